"""Cards without bf16 (compute capability < 8.0: T4, V100) train in fp16: the rule, the catalog's fp16
rates, and the plan's speed and time saying so."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from launcher.plan import throughput
from launcher.plan.hardware import Gpu, Hardware, catalog, from_spec
from launcher.plan.plan import make_plan
from launcher.plan.text import format_plan
from launcher.recipe_loading import validate_recipe

DATA = SimpleNamespace(
    examples=10_000,
    total_tokens=5_000_000,
    mean_tokens=500.0,
    max_tokens=2048,
    over_max_length=0,
    tokens_source="tokenizer",
)


def plan(tmp_path, hw):
    recipe = validate_recipe(
        {"model": "meta-llama/Llama-3.1-8B", "method": "qlora", "data": "d.jsonl", "max_length": 1024}, tmp_path, "r"
    )
    return make_plan(recipe, hw, DATA, unsloth_available=False)


@pytest.mark.parametrize(
    "device,cc,want",
    [
        ("cuda", (7, 0), "fp16"),
        ("cuda", (7, 5), "fp16"),
        ("cuda", [7, 5], "fp16"),
        ("cuda", (8, 0), "bf16"),
        ("cuda", (8, 9), "bf16"),
        ("cuda", (12, 0), "bf16"),
        ("cuda", None, "bf16"),
        ("cpu", None, "fp32"),
        ("cpu", (7, 5), "fp32"),
    ],
)
def test_precision_rule(device, cc, want):
    assert throughput.training_precision(device, cc) == want


def test_catalog_cards_before_ampere_carry_fp16_rates():
    """T4 65 and V100 125 TFLOP/s are their dense fp16 tensor rates (their bf16 is emulated, far slower)."""
    old = {name: e for name, e in catalog().items() if e.compute_capability < (8, 0)}
    assert set(old) == {"T4", "V100-16GB", "V100-32GB"}
    assert (old["T4"].tflops_bf16, old["V100-16GB"].tflops_bf16, old["V100-32GB"].tflops_bf16) == (65, 125, 125)


@pytest.mark.parametrize("spec", ["T4", "V100-16GB"])
def test_plan_on_t4_v100_says_fp16(tmp_path, spec):
    p = plan(tmp_path, from_spec(spec))
    assert p.tokens["precision"] == "fp16"
    [why] = [r for r in p.reasons if r.startswith("precision fp16")]
    tflops = catalog()[spec].tflops_bf16
    assert f"{tflops:g} TFLOP/s, its fp16 tensor rate" in why
    assert any(r.startswith("time:") and "(estimated, fp16)" in r for r in p.reasons)
    speed = next(line for line in format_plan(p).splitlines() if line.startswith("Speed:"))
    assert "fp16 with loss scaling" in speed


def test_t4_v100_speed_follows_their_fp16_rates(tmp_path):
    """Not the A100-class guess for unknown cards: a V100's estimate is about 125/65 of a T4's."""
    t4, v100 = (plan(tmp_path, from_spec(s)).tokens["tokens_per_second"] for s in ("T4", "V100-16GB"))
    assert v100 / t4 == pytest.approx(125 / 65, rel=0.05)


def test_plan_on_ampere_and_newer_stays_bf16(tmp_path):
    p = plan(tmp_path, from_spec("RTX4090"))
    assert p.tokens["precision"] == "bf16"
    assert not any("fp16" in r for r in p.reasons) and "fp16" not in format_plan(p)


def test_unknown_pre_ampere_card_says_its_speed_is_a_guess(tmp_path):
    card = Gpu("Quadro RTX 8000", 51.0, (7, 5), None, None)
    p = plan(tmp_path, Hardware((card,), "none", 8, 64.0, "detected"))
    [why] = [r for r in p.reasons if r.startswith("precision fp16")]
    assert "not in the catalog" in why and f"{throughput.UNKNOWN_GPU_TFLOPS:g} TFLOP/s" in why
