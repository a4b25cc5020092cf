"""Where TRL's fused LM head is called (trl 1.16 trl/trainer/utils.py add_fused_lm_head:
`_ChunkedLogProbFunction.apply`, read at call time). The worker puts a dispatcher there (install):
- on the CPU, a frozen, not soft-capped head's call goes to launcher/worker/cpu_logprob.py, else TRL's own kernel;
- where the trainer offloads activations, the call runs under its own innermost saved_tensors_hooks pair that keeps
  tensors where they are, as TRL keeps lm_head out of offloading (trl/models/activation_offloading.py: a NoOpManager
  in lm_head's forward pre-hook, which the fused head never calls); the plan does not count that round trip
  (launcher/plan/sizing.py offloaded_activation_bytes). Only there: ZeRO-3's backward hooks need the parameter
  itself ("'Tensor' object has no attribute 'ds_status'").
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
    keep the head's call out of it."""
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
