"""Where TRL's fused LM head is called: the step that turns the last hidden states into per-token log-probabilities.

trl 1.16's SFTTrainer patches the model with add_fused_lm_head (trl/trainer/utils.py), whose forward calls
`_ChunkedLogProbFunction.apply`, read from trl's module at call time. The worker puts a dispatcher there (install):
- on the CPU, a frozen head's call goes to launcher/worker/cpu_logprob.py, TRL's own kernel otherwise (a GPU tensor,
  a trainable or soft-capped head);
- where the trainer offloads activations (`trainer: activation_offloading`, the plan's choice for one card:
  launcher/worker/engines/__init__.py trainer_fields), the call runs outside that offloading. TRL keeps the output head
  out of it (trl/models/activation_offloading.py, get_act_offloading_ctx_manager: a NoOpManager entered in lm_head's
  forward pre-hook): offloading the head's input only to fetch it back at the very start of backward costs a round
  trip over PCIe for nothing. The fused head never calls lm_head.forward (it reads lm_head.weight), so those hooks
  never fire and the head's input (tokens x hidden) went to pinned RAM and back each micro-batch, beyond the plan's
  count (launcher/plan/sizing.py offloaded_activation_bytes). Here the call runs under its own innermost
  saved_tensors_hooks pair that keeps tensors where they are, as TRL's NoOpManager does: only the most recently
  registered pair runs (torch.autograd.graph.saved_tensors_hooks). Only there: a saved tensor then reaches
  backward as a plain alias, and DeepSpeed ZeRO-3's own backward hooks need the parameter itself (a trainable
  head under ZeRO-3 failed with "'Tensor' object has no attribute 'ds_status'").
"""

from __future__ import annotations

from typing import Any

from launcher.worker import cpu_logprob


def _keep(tensor: Any) -> Any:
    return tensor


class _Dispatch:
    """What `trl.trainer.utils._ChunkedLogProbFunction` becomes (module docstring)."""

    def __init__(self, trl_function: Any) -> None:
        self.trl_function = trl_function
        self.outside_offloading = False

    def apply(
        self,
        hidden,
        weight,
        bias,
        targets,
        temperature,
        chunk_size,
        final_logit_softcapping=None,
        logit_scale=1.0,
        outputs=("log_probs",),
    ):
        import torch

        trainable = weight.requires_grad or (bias is not None and bias.requires_grad)
        on_cpu = hidden.device.type == "cpu" and not trainable and final_logit_softcapping is None
        chosen = cpu_logprob.function() if on_cpu else self.trl_function
        if not self.outside_offloading:
            return chosen.apply(
                hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs
            )
        with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):  # out of activation offloading
            return chosen.apply(
                hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs
            )


def install(activation_offloading: bool = False) -> bool:
    """Put the dispatcher in TRL's place (once); True where TRL has a fused head to route. `activation_offloading`:
    this process's trainer offloads activations, so the head's call is kept out of it."""
    try:
        from trl.trainer import utils
    except ImportError:
        return False
    current = getattr(utils, "_ChunkedLogProbFunction", None)
    if current is None:  # a trl without the fused head: the model's own loss, nothing to route
        return False
    if not isinstance(current, _Dispatch):
        current = utils._ChunkedLogProbFunction = _Dispatch(current)
    current.outside_offloading = activation_offloading
    return True
