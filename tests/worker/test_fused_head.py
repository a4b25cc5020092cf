"""launcher/worker/fused_head.py: TRL's fused LM head runs outside TRL's activation offloading, so what a step offloads
is what the plan counts (launcher/plan/sizing.py offloaded_activation_bytes; issue 32 item 6).

TRL's OffloadActivations needs an accelerator (it reads torch.accelerator.current_accelerator().type). On the CPU the
same step runs under a saved-tensors hook that applies its rules (trl 1.16 trl/models/activation_offloading.py
pack_tensor): a tensor is offloaded once per storage, if it has at least min_offload_size bytes (1024, the default
SFTTrainer keeps) and is not a parameter's storage. Only the most recently registered hook pair runs, as for trl's.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from launcher.plan import models, sizing
from launcher.worker import fused_head, loading

MIN_OFFLOAD_SIZE = 1024  # trl's get_act_offloading_ctx_manager default, as SFTTrainer calls it (sft_trainer.py)


@pytest.fixture
def trl_kernel(monkeypatch):
    """TRL's module as shipped, restored after the test (install() replaces its kernel reference)."""
    from trl.trainer import utils

    monkeypatch.setattr(utils, "_ChunkedLogProbFunction", utils._ChunkedLogProbFunction)
    return utils


def _offloaded(model, ids) -> list[int]:
    """The bytes of each tensor trl's pack_tensor would offload in one training step of `model`."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, sizes = set(), []

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.dtype)
        size = t.numel() * t.element_size()
        if key not in seen and size >= MIN_OFFLOAD_SIZE and key[0] not in params:
            sizes.append(size)
        seen.add(key)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
    out.loss.backward()
    return sizes


def test_the_fused_heads_input_is_not_offloaded_and_the_rest_is_the_plans_count(tiny_model, trl_kernel):
    from trl.trainer.utils import add_fused_lm_head

    lora = SimpleNamespace(r=4, alpha=8, dropout=0.0, target_modules="all-linear")
    recipe = SimpleNamespace(model=str(tiny_model), method="lora", gradient_checkpointing=True, lora=lora)
    model, _ = loading.load_model_and_tokenizer(recipe, "cpu", torch.bfloat16, {"engine": "trl"})  # a GPU's dtype
    base = model.get_base_model()
    add_fused_lm_head(base)  # as SFTTrainer does
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    arch = models.from_config(json.loads((tiny_model / "config.json").read_text()), "tiny", "test")
    ids = torch.randint(0, arch.vocab, (2, 64))
    plan = sizing.offloaded_activation_bytes(arch, ids.numel())

    before = _offloaded(base, ids)  # TRL's kernel as trl calls it: inside the offloaded region
    # no offloading asked (DDP, FSDP, ZeRO-3): the call is left as it is, the head's saved tensor (here the CPU
    # kernel's fp32 gradient) in whatever hooks are active
    assert fused_head.install() and sum(_offloaded(base, ids)) > plan
    assert fused_head.install(activation_offloading=True)
    after = _offloaded(base, ids)
    assert sum(after) == plan, (after, plan)
    head_input = (ids.numel() - 2) * arch.hidden  # the shifted tokens' hidden states, saved by the head's function
    assert sum(before) - sum(after) >= head_input * 2, (before, after)
    print(
        f"offloaded per micro-batch: {sum(after):,} B with ftrun's dispatcher = the plan's {plan:,} B; "
        f"{sum(before):,} B with the fused head inside the offloaded region"
    )
