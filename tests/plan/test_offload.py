"""DeepSpeed ZeRO-3 CPU offload in the plan: the memory it moves into RAM, its time, when the plan chooses it, and the
refusals when even offload does not fit (one layout's figures, one fix that plans). docs/sizing.md, "CPU offload"."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from launcher.errors import PlanError
from launcher.plan import engine_software, links, sizing, sizing_constants
from launcher.plan import throughput
from launcher.plan.hardware import catalog_box, from_spec
from launcher.plan.models import from_catalog
from launcher.plan.plan import make_plan
from launcher.plan.sizing import Workload
from launcher.plan.sizing_constants import GB
from launcher.recipe_loading import load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
LLAMA_8BIT = RECIPES / "llama-3.1-70b-full-8bit-8xh100.yaml"
QWEN_8BIT = RECIPES / "qwen3-32b-full-8bit-4xh100.yaml"
ARCH = from_catalog("meta-llama/Llama-3.1-70B")


def ds(method="full-8bit", n=8, optimizer=True, params=False, seq=2048, acc=8) -> Workload:
    return Workload(method, seq, 1, True, 16, "all-linear", "deepspeed", n, "cuda", params, optimizer, acc)


def test_optimizer_offload_moves_gradients_and_states_into_ram():
    plain, off = sizing.memory(ARCH, ds(optimizer=False)), sizing.memory(ARCH, ds())
    assert {"gradients", "optimizer", "gradient churn"} <= plain.breakdown_gb.keys()
    assert not {"gradients", "optimizer", "gradient churn"} & off.breakdown_gb.keys()
    assert off.breakdown_gb["weights"] == pytest.approx(plain.breakdown_gb["weights"])  # 16-bit partitions stay
    assert plain.per_gpu_gb > 97 and off.per_gpu_gb < 35  # 8 x 80 GB: does not fit without, fits with
    # fp32 master 4 + fp32 gradient 4 + Adam m, v 8 + 16-bit gradient partition 2, whatever the recipe's optimizer
    assert off.offloaded_params_gb == pytest.approx(ARCH.params * 18 / GB)
    assert off.train_ram_gb == pytest.approx(off.offloaded_params_gb + 8 * sizing_constants.CPU_RUNTIME_GB)
    assert off.host_ram_gb == off.train_ram_gb > off.load_ram_gb and off.ram_explanation == off.offload_explanation
    # the job in all: the cards' partitions and one card's step tensors, plus what lives in RAM
    static = off.breakdown_gb["weights"]
    assert off.total_gb == pytest.approx(
        static * 8 + off.per_gpu_gb - static - off.breakdown_gb["gathered shards"] + off.offloaded_params_gb
    )
    assert "18 B/param" in off.offload_explanation and "RAM while training" in off.offload_explanation


def test_parameter_offload_moves_the_16bit_partitions_too():
    opt, both = sizing.memory(ARCH, ds(n=2)), sizing.memory(ARCH, ds(n=2, params=True))
    assert (
        opt.per_gpu_gb > 79.65 * sizing_constants.USABLE_FRACTION
        and "weights" not in both.breakdown_gb
        and both.per_gpu_gb < 20
    )
    assert both.offloaded_params_gb == pytest.approx(ARCH.params * 20 / GB)
    assert "16-bit parameter partitions" in both.offload_explanation


def test_offload_time_adds_the_host_link_and_the_cpu_step():
    w = ds()
    est = sizing.memory(ARCH, w)
    move, step = throughput.deepspeed_offload_seconds(ARCH, est, w, 63.0, 64)
    p = ARCH.params
    assert move == pytest.approx((4 * p / 8 + (4 + 4) * p / 8 / 8) / 63e9)  # per micro-batch; the step's over 8
    assert step == pytest.approx(p / (throughput.CPU_ADAM_PARAMS_PER_CORE_S * 64) / 8)
    plain = throughput.tokens_per_second(ARCH, ds(optimizer=False), 989, "nvlink", 64, 500, (9, 0))
    slow = throughput.tokens_per_second(ARCH, w, 989, "nvlink", 64, 500, (9, 0))
    compute = 500 * throughput.flops_per_token(ARCH, "full-8bit", 500, True) / (989e12 * throughput.MFU["full-8bit"])
    one = 500 / (compute + throughput.GPU_SECONDS_PER_MICRO_BATCH + move + step)
    assert slow == pytest.approx(one * links.scaling(8, "nvlink") * links.sharding_efficiency("nvlink"))
    assert slow < plain
    # more accumulation spreads the step's transfer and the CPU step over more micro-batches
    assert sum(throughput.deepspeed_offload_seconds(ARCH, est, ds(acc=32), 63.0, 64)) < move + step
    # parameter offload: every unit's partition goes up in forward and backward, nothing comes back after the step
    w2 = ds(n=2, params=True)
    move2, _ = throughput.deepspeed_offload_seconds(ARCH, sizing.memory(ARCH, w2), w2, 63.0, 64)
    assert move2 == pytest.approx((4 * p / 2 + 2 * 2 * p / 2 + 4 * p / 2 / 8) / 63e9)
    # never on a CPU, never without offload, never for FSDP
    assert throughput.deepspeed_offload_seconds(ARCH, est, ds(optimizer=False), 63.0, 64) == (0.0, 0.0)


@pytest.mark.parametrize("path, gpus", [(LLAMA_8BIT, 8), (QWEN_8BIT, 4)])
def test_the_shipped_8bit_recipes_plan_with_optimizer_offload_and_say_why(path, gpus):
    p = make_plan(load_recipe(path), from_spec(f"{gpus}xH100-80GB"), tokens=15e6)
    assert p.fits and p.engine == "deepspeed" and p.offload_optimizer and not p.offload_params
    text = " ".join(p.reasons)
    assert "DeepSpeed ZeRO-3, not FSDP" in text and "nothing else fits" in text
    assert "8-bit AdamW is not used" in text and "DeepSpeedCPUAdam" in text
    assert re.search(r"\+\d\.\d\d s transfer and \+\d\.\d\d s CPU step per micro-batch", text)
    assert "rent" in text and "GB of RAM" in text  # the catalog box's assumed RAM is short: the RAM to rent with
    assert p.to_dict()["offload_optimizer"] is True and p.memory["train_ram_gb"] > 500


def test_offload_only_when_nothing_else_fits():
    # 8 x B200 holds 70B full-8bit on ZeRO-3 without offload: no offload there
    p = make_plan(load_recipe(LLAMA_8BIT), from_spec("8xB200"), tokens=15e6)
    assert p.fits and p.engine == "deepspeed" and not p.offload_optimizer
    # method full (AdamW): FSDP where it fits, DeepSpeed offload where it does not
    full = load_recipe(RECIPES / "llama-3.1-70b-full-8xb200.yaml", ["engine=auto"])
    assert make_plan(full, from_spec("8xB200"), tokens=15e6).engine == "fsdp"
    on_h100 = make_plan(full, from_spec("8xH100-80GB"), tokens=15e6)
    assert on_h100.engine == "deepspeed" and on_h100.offload_optimizer
    assert not any("8-bit AdamW" in r for r in on_h100.reasons)
    # LoRA that fits is never offloaded, and offload: none refuses instead
    with pytest.raises(PlanError):
        make_plan(load_recipe(LLAMA_8BIT, ["offload=none"]), from_spec("8xH100-80GB"), tokens=15e6)


def test_forced_offload_is_honoured_or_refused():
    p = make_plan(load_recipe(QWEN_8BIT, ["offload=optimizer+params"]), from_spec("4xH100-80GB"), tokens=15e6)
    assert p.offload_optimizer and p.offload_params and "weights" not in p.memory["breakdown_gb"]
    assert any("forced by the recipe (offload: optimizer+params)" in r for r in p.reasons)
    with pytest.raises(PlanError, match="offload: optimizer is DeepSpeed ZeRO-3's CPU offload"):
        make_plan(load_recipe(QWEN_8BIT, ["offload=optimizer", "engine=fsdp"]), from_spec("4xH100-80GB"), tokens=15e6)


def _fix_plans(recipe_path: Path, overrides: list[str], hw, fix: str) -> None:
    """The fix a refusal names, applied as written, plans."""
    m = re.match(r"set ((?:\w+=[\w+]+(?: and )?)+): ", fix)
    if m:
        changes = m.group(1).split(" and ")
        assert make_plan(load_recipe(recipe_path, overrides + changes), hw, tokens=15e6).fits
        return
    m = re.match(r"rent (\S+) .*plan for it with --gpus (\S+)", fix)
    assert m, fix
    assert make_plan(load_recipe(recipe_path, overrides), from_spec(m.group(2)), tokens=15e6).fits


def test_fsdp_refusal_names_one_fix_that_plans_no_circle():
    """The circle of issue 23: FSDP said engine: deepspeed, deepspeed said engine: auto, auto gave FSDP's refusal."""
    hw = from_spec("8xH100-80GB")
    for overrides in (["engine=fsdp"], ["engine=deepspeed", "offload=none"]):
        with pytest.raises(PlanError) as err:
            make_plan(load_recipe(LLAMA_8BIT, overrides), hw, tokens=15e6)
        options = err.value.plan.refusal["options"]
        assert len(options) == 1, options
        _fix_plans(LLAMA_8BIT, overrides, hw, options[0])
    assert make_plan(load_recipe(LLAMA_8BIT, ["engine=deepspeed"]), hw, tokens=15e6).fits
    assert make_plan(load_recipe(LLAMA_8BIT, ["engine=auto"]), hw, tokens=15e6).fits


def test_a_box_that_cannot_hold_it_even_with_offload_gets_one_layouts_figures_and_a_fix_that_plans(monkeypatch):
    monkeypatch.setattr(engine_software, "_deepspeed_installed", lambda: True)
    # the box in hand, whose RAM is read: the cards hold it with offload, the RAM does not
    small = replace(from_spec("8xH100-80GB"), ram_gb=512.0, source="detected")
    with pytest.raises(PlanError) as err:
        make_plan(load_recipe(LLAMA_8BIT), small, tokens=15e6, unsloth_available=False)
    msg, options = err.value.message, err.value.plan.refusal["options"]
    assert "the cards hold it with CPU offload of the optimizer" in msg and "training does not fit the box's RAM" in msg
    assert "this box has 512 GB" in msg and "18 B/param" in msg
    assert any(o.startswith("rent ") for o in options) and "set engine=auto" not in " ".join(options)
    _fix_plans(LLAMA_8BIT, [], small, next(o for o in options if o.startswith("rent ")))
    # cards too small even with the optimizer and the parameters offloaded: the "in all" and the per-card figure are
    # the same layout's (before: 468 GB of another layout beside 104.1 GB per card of this one)
    hw = from_spec("8xT4")
    with pytest.raises(PlanError) as err:
        make_plan(load_recipe(LLAMA_8BIT, ["max_length=8192", "micro_batch_size=2"]), hw, tokens=15e6)
    p = err.value.plan
    assert "with DeepSpeed ZeRO-3 and CPU offload of the optimizer and the parameters" in err.value.message
    assert f"needs {p.memory['total_gb']:.0f} GB in all" in err.value.message
    assert f"still needs {p.memory['peak_gb']:.1f} GB per card" in err.value.message
    assert p.offload_optimizer and p.offload_params
    for fix in p.refusal["options"]:
        if fix.startswith("rent "):
            _fix_plans(LLAMA_8BIT, ["max_length=8192", "micro_batch_size=2"], hw, fix)


def test_alternatives_only_offer_boxes_whose_assumed_ram_holds_the_offload(monkeypatch):
    # the rented box has the image's software; the check is about RAM, not about what this machine has installed
    monkeypatch.setattr(engine_software, "_deepspeed_installed", lambda: True)
    p = make_plan(load_recipe(LLAMA_8BIT), from_spec("8xH100-80GB"), tokens=15e6)
    for a in p.alternatives:
        box = catalog_box(a["gpus"].split("x", 1)[1], int(a["gpus"].split("x", 1)[0]))
        assert (
            make_plan(
                load_recipe(LLAMA_8BIT), replace(box, source="detected"), tokens=15e6, unsloth_available=False
            ).fits
            or a["engine"] != "deepspeed"
        )
