"""Which attention kernel a padding-free row runs on, per device, torch and flash-attn (launcher/plan/attention.py),
and what the plan counts where it is SDPA's dense L x L mask: its memory (sizing.dense_mask_bytes), its FLOPs
(throughput.flops_per_token), and no micro-batch raised into it (speed.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from launcher.plan import attention, sizing, throughput
from launcher.plan.hardware import catalog_box, from_spec
from launcher.plan.models import from_catalog
from launcher.plan.plan import make_plan
from launcher.recipe_loading import validate_recipe

QWEN3_8B = from_catalog("Qwen/Qwen3-8B")


@pytest.mark.parametrize(
    "device,bf16,flash,varlen,expected",
    [
        ("cuda", True, True, True, attention.FLASH),  # flash-attn where installed
        ("cuda", True, True, False, attention.FLASH),
        ("cuda", True, False, True, attention.VARLEN),  # else torch's own varlen kernel
        ("cuda", True, False, False, "sdpa"),  # neither: SDPA with the dense mask
        ("cuda", False, True, True, "sdpa"),  # an fp16 card (compute capability < 8.0): no FlashAttention-2
        ("cpu", False, True, True, "sdpa"),
    ],
)
def test_the_kernel_per_device_flash_attn_and_torch(device, bf16, flash, varlen, expected):
    assert attention.implementation(device, bf16, flash, varlen) == expected


@pytest.mark.parametrize(
    "release,has",
    [("2.9.1", False), ("2.10.0+cu128", False), ("2.11.0", True), ("2.13.0+cu130", True), ("3.0", True), (None, True)],
)
def test_torch_releases_with_the_varlen_kernel(release, has):
    # 2.10's varlen_attn has is_causal and no scale; None: no torch where the plan runs, the image's is assumed
    assert attention.torch_has_varlen(release) is has


def test_only_sdpa_over_rows_of_several_examples_carries_the_dense_mask():
    assert attention.dense_mask("sdpa", "trl", True)
    assert not attention.dense_mask(attention.VARLEN, "trl", True)
    assert not attention.dense_mask(attention.FLASH, "trl", True)
    assert not attention.dense_mask("sdpa", "unsloth", True)  # Unsloth's own attention
    assert not attention.dense_mask("sdpa", "trl", False)


def _workload(**keys):
    base = dict(method="lora", seq_len=500, micro_batch=8, gradient_checkpointing=False, device="cuda")
    return sizing.Workload(**{**base, **keys})


def test_the_dense_mask_is_counted_in_memory():
    plain = sizing.memory(QWEN3_8B, _workload())
    dense = sizing.memory(QWEN3_8B, _workload(dense_mask=True))
    row = 8 * 500
    # the boolean mask once, the bf16 bias saved by every one of the 36 layers without checkpointing
    assert sizing.dense_mask_bytes(QWEN3_8B, _workload(dense_mask=True)) == row**2 * (1 + 2 * 36)
    assert dense.breakdown_gb["attention mask"] == pytest.approx(row**2 * 73 / sizing.GB)
    assert "attention mask" not in plain.breakdown_gb
    assert dense.per_gpu_gb > plain.per_gpu_gb + dense.breakdown_gb["attention mask"]  # and its allocator slack
    # the figure: micro-batch 32 of 500-token examples, checkpointing off: ~18 GB of saved masks
    big = _workload(dense_mask=True, micro_batch=32)
    assert 2 * (32 * 500) ** 2 * 36 / 1e9 == pytest.approx(18.4, abs=0.1)
    assert sizing.memory(QWEN3_8B, big).breakdown_gb["attention mask"] > 17
    # with checkpointing only the recomputed layer keeps its bias
    on = _workload(dense_mask=True, gradient_checkpointing=True)
    assert sizing.dense_mask_bytes(QWEN3_8B, on) == row**2 * 3


def test_the_dense_mask_is_counted_in_flops_and_tokens_per_second():
    causal = throughput.flops_per_token(QWEN3_8B, "lora", 500, False)
    dense = throughput.flops_per_token(QWEN3_8B, "lora", 500, False, dense_row=8 * 500)
    matmul = QWEN3_8B.active_params - QWEN3_8B.embedding_params
    forward_extra = (4 * 8 * 500 - 2 * 500) * QWEN3_8B.layers * QWEN3_8B.q_dim
    assert dense - causal == pytest.approx(2 * forward_extra)  # LoRA: forward + backward of the same
    # the figure: micro-batch 8 of 500-token examples adds ~15% to the forward
    assert 0.12 < 4 * 8 * 500 * QWEN3_8B.layers * QWEN3_8B.q_dim / (2 * matmul) < 0.18
    tps = throughput.tokens_per_second(QWEN3_8B, _workload(), 989.0, mean_seq_len=500)
    tps_dense = throughput.tokens_per_second(QWEN3_8B, _workload(dense_mask=True), 989.0, mean_seq_len=500)
    assert tps_dense < tps and throughput.dense_row(_workload(dense_mask=True), 500) == 4000


def _recipe(tmp_path, **keys):
    base = {
        "model": "Qwen/Qwen3-8B",
        "method": "lora",
        "data": "train.jsonl",
        "tokens": 15_000_000,
        "output_dir": str(tmp_path / "run"),
    }
    return validate_recipe({**base, **keys}, tmp_path, "r", source="test")


@pytest.fixture
def this_h200(monkeypatch):
    """An H200 detected as this machine (its software counts), without flash-attn, with the given torch."""

    def box(release):
        monkeypatch.setattr(attention, "torch_version", lambda: release)
        monkeypatch.setattr(attention, "flash_attn_installed", lambda: False)
        return replace(catalog_box("H200", 1), source="detected")

    return box


def _line(plan):
    return next(r for r in plan.reasons if r.startswith("attention:"))


def test_an_old_torch_prices_the_dense_mask_and_keeps_the_micro_batch(tmp_path, this_h200):
    old = make_plan(_recipe(tmp_path), this_h200("2.10.0"), tokens=15_000_000)
    new = make_plan(_recipe(tmp_path), this_h200("2.11.0"), tokens=15_000_000)
    # torch 2.11: the varlen kernel, the plan grows the micro-batch as before
    assert attention.VARLEN in _line(new) and "varlen_attn" in _line(new) and "torch 2.11.0" in _line(new)
    assert new.micro_batch_size > 2 and "attention mask" not in new.memory["breakdown_gb"]
    # torch 2.10: SDPA's dense mask, said with why; the micro-batch stays the recipe's, and the reason says so
    line = _line(old)
    assert "dense L x L mask" in line and "torch 2.10.0 has no varlen_attn" in line and "flash-attn" in line
    assert old.micro_batch_size == 2 and old.gradient_accumulation_steps == 4
    assert any(r.startswith("micro-batch kept at 2") and "square" in r for r in old.reasons)
    assert old.memory["breakdown_gb"]["attention mask"] > 0
    assert old.tokens["estimated_tokens_per_second"] < new.tokens["estimated_tokens_per_second"]


def test_a_rented_box_is_planned_with_the_images_torch(tmp_path, monkeypatch):
    monkeypatch.setattr(attention, "torch_version", lambda: "2.10.0")  # this machine's: not the box's
    p = make_plan(_recipe(tmp_path), catalog_box("H100-80GB", 1), tokens=15_000_000)
    assert attention.VARLEN in _line(p) and "the torch of ftrun's image" in _line(p)


def test_a_micro_batch_of_one_example_carries_no_mask(tmp_path, this_h200):
    p = make_plan(
        _recipe(tmp_path, micro_batch_size=1, gradient_accumulation_steps=8), this_h200("2.10.0"), tokens=15_000_000
    )
    assert "attention mask" not in p.memory["breakdown_gb"] and "dense" not in _line(p)
    packed = make_plan(
        _recipe(tmp_path, micro_batch_size=1, gradient_accumulation_steps=8, packing=True, max_length=2048),
        this_h200("2.10.0"),
        tokens=15_000_000,
    )
    assert packed.memory["breakdown_gb"]["attention mask"] > 0  # a packed row holds several examples


def test_the_cpu_plan_counts_the_dense_mask_of_a_padding_free_row(tmp_path):
    p = make_plan(_recipe(tmp_path, model="Qwen/Qwen3-0.6B", micro_batch_size=4), from_spec("cpu"), tokens=100_000)
    assert p.memory["breakdown_gb"]["attention mask"] > 0
    assert _line(p).startswith("attention: SDPA on the CPU") and "dense L x L mask" in _line(p)
    padded = make_plan(
        _recipe(tmp_path, model="Qwen/Qwen3-0.6B", micro_batch_size=4, padding_free=False),
        from_spec("cpu"),
        tokens=100_000,
    )
    assert "attention mask" not in padded.memory["breakdown_gb"]
    assert padded.memory["estimated_per_gpu_gb"] < p.memory["estimated_per_gpu_gb"]
    assert padded.tokens["estimated_tokens_per_second"] > p.tokens["estimated_tokens_per_second"]  # the L^2 FLOPs


def test_flash_attn_where_installed_comes_first(tmp_path, this_h200, monkeypatch):
    box = this_h200("2.10.0")
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: True)
    p = make_plan(_recipe(tmp_path), box, tokens=15_000_000)
    assert _line(p).startswith(f"attention: {attention.FLASH}") and "attention mask" not in p.memory["breakdown_gb"]
    assert p.micro_batch_size > 2  # nothing quadratic to keep it from growing


def test_each_box_has_its_own_kernel(this_h200, monkeypatch):
    """This machine's software where the box is this machine, ftrun's image for a rented one (the alternatives the
    plan lists are each priced with their own)."""
    assert attention.box_kernels(this_h200("2.10.0"))["implementation"] == "sdpa"
    assert attention.box_kernels(this_h200("2.11.0"))["implementation"] == attention.VARLEN
    monkeypatch.setattr(attention, "torch_version", lambda: "2.10.0")
    rented = attention.box_kernels(catalog_box("H200", 1))
    assert rented["implementation"] == attention.VARLEN and rented["torch"] == "the torch of ftrun's image"
    assert attention.box_kernels(catalog_box("T4", 1))["implementation"] == "sdpa"  # fp16: no FlashAttention-2
    assert attention.box_kernels(from_spec("cpu"))["implementation"] == "sdpa"
