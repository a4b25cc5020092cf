"""Issue 24, the lean engines: TRL's activation offloading as the plan's choice where one card does not hold the job
otherwise, with its host-link time and RAM; the loss the plan names; what the worker passes to SFTConfig."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from launcher.errors import PlanError
from launcher.plan import sizing, sizing_constants
from launcher.plan import throughput
from launcher.plan.hardware import from_spec
from launcher.plan.plan import make_plan
from launcher.plan.text import format_plan
from launcher.recipe_loading import validate_recipe
from launcher.worker.engines import trainer_fields

DATA = SimpleNamespace(
    examples=2_000,
    total_tokens=8_000_000,
    mean_tokens=4000.0,
    max_tokens=4096,
    over_max_length=0,
    tokens_source="tokenizer",
)


def _recipe(tmp_path, **fields):
    base = {"model": "Qwen/Qwen3-32B", "method": "qlora", "data": "d.jsonl", "max_length": 4096, "micro_batch_size": 1}
    return validate_recipe({**base, **fields}, tmp_path, "r")


def _here(spec: str):
    """The box in hand, without Unsloth (its own software counts)."""
    return replace(from_spec(spec), source="detected")


def test_offloading_chosen_only_where_one_card_needs_it(tmp_path):
    """Qwen3-32B QLoRA at 4k tokens on the RTX 4090 in hand, Unsloth absent: 25 GB with the layer inputs on the card,
    23 GB of 24 with them in RAM. The plan trains with TRL's activation offloading, slower by the host-link time."""
    r = _recipe(tmp_path)
    plan = make_plan(r, _here("1xRTX4090"), DATA, unsloth_available=False)
    assert plan.engine == "trl" and plan.offload_activations and plan.to_dict()["offload_activations"] is True
    assert plan.memory["per_gpu_gb"] <= 24 * sizing_constants.USABLE_FRACTION
    text = "\n".join(plan.reasons)
    assert "activation offloading" in text and "saved layer inputs" in text and "of the speed without it" in text
    assert "activation offloading" in format_plan(plan)
    # slower than the same job would run without it, by the transfer the sizer counts
    job_w = sizing.Workload("qlora", 4096, 1, True, 16, "all-linear", "trl")
    from launcher.plan.models import from_catalog

    arch = from_catalog("Qwen/Qwen3-32B")
    g = from_spec("1xRTX4090").gpu
    off = throughput.tokens_per_second(
        arch, replace(job_w, offload_activations=True), g.tflops_bf16, compute_capability=g.compute_capability
    )
    plain = throughput.tokens_per_second(arch, job_w, g.tflops_bf16, compute_capability=g.compute_capability)
    assert off < plain
    assert throughput.activation_offload_seconds(arch, replace(job_w, offload_activations=True), 31.5) == pytest.approx(
        2 * (arch.layers * 4096 * arch.hidden * 2 + 4096 * arch.hidden * 4) / 31.5e9
    )  # + the final norm's fp32 input
    # the card that holds it without: no offloading
    big = make_plan(r, _here("1xH100-80GB"), DATA, unsloth_available=False)
    assert big.engine == "trl" and not big.offload_activations
    # nor without gradient checkpointing (nothing saved per layer to offload: the plan's advice turns it on first)
    with pytest.raises(PlanError):
        make_plan(_recipe(tmp_path, gradient_checkpointing=False), _here("1xRTX4090"), DATA, unsloth_available=False)


def test_offloaded_activations_need_the_boxes_ram(tmp_path):
    """The 2.5 GB of saved layer inputs wait in pinned RAM, beside the worker's 1 GB: a box whose usable RAM (80%)
    holds less is not offered offloading."""
    r = _recipe(tmp_path)
    assert make_plan(r, replace(_here("1xRTX4090"), ram_gb=8.0), DATA, unsloth_available=False).offload_activations
    with pytest.raises(PlanError):
        make_plan(r, replace(_here("1xRTX4090"), ram_gb=4.0), DATA, unsloth_available=False)


def test_the_plan_names_its_loss(tmp_path):
    plan = make_plan(
        _recipe(tmp_path, max_length=2048, model="meta-llama/Llama-3.1-8B"),
        _here("1xH100-80GB"),
        DATA,
        unsloth_available=False,
    )
    loss = [r for r in plan.reasons if r.startswith("loss:")]
    assert len(loss) == 1 and "TRL's fused LM head" in loss[0] and "never" in loss[0]
    assert "token accuracy and entropy are still logged" in loss[0]


def test_worker_fields_follow_the_plan():
    assert trainer_fields({"engine": "trl", "device": "cuda", "offload_activations": True}, None) == {
        "activation_offloading": True
    }
    assert trainer_fields({"engine": "trl", "device": "cpu", "offload_activations": True}, None) == {}
    assert trainer_fields({"engine": "trl", "device": "cuda"}, None) == {}


def test_the_recipes_own_activation_offloading_is_sized(tmp_path):
    """trainer: activation_offloading: true (passed through to SFTConfig) moves the layer inputs off the card in the
    plan too."""
    base = make_plan(
        _recipe(tmp_path, model="meta-llama/Llama-3.1-8B"), _here("1xH100-80GB"), DATA, unsloth_available=False
    )
    forced = make_plan(
        _recipe(tmp_path, model="meta-llama/Llama-3.1-8B", trainer={"activation_offloading": True}),
        _here("1xH100-80GB"),
        DATA,
        unsloth_available=False,
    )
    assert forced.offload_activations and not base.offload_activations
    assert forced.memory["per_gpu_gb"] < base.memory["per_gpu_gb"]
    assert forced.estimate["hours"] > base.estimate["hours"]
