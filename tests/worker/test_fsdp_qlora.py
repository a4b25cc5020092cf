"""QLoRA on FSDP (issue 12, item 3) and full-8bit on FSDP (item 8).

Item 3: the worker loads and quantizes QLoRA on each rank's CPU under FSDP (loading.fsdp_qlora_kwargs); the
plan counts what that load costs (each card's transient, the box's RAM, CPU quantization time) and chooses
parameter offload when the shards do not fit the cards, with the host-link transfers in its tokens/s.
Item 8: bitsandbytes' 8-bit AdamW cannot run on FSDP's DTensors: the plan refuses it, and the out-of-memory
re-plan never moves a full-8bit job onto FSDP.

The load path runs for real on CPU (two gloo processes, fully_shard as accelerate wraps); what only CUDA shows
(the card's transient while sharding, PCIe time, bitsandbytes' CUDA kernels on the sharded weights) is left to
the GPU check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from launcher.plan import sizing
from launcher.errors import PlanError
from launcher.plan.hardware import from_spec
from launcher.plan.models import from_catalog
from launcher.plan.plan import make_plan
from launcher.plan.text import format_plan
from launcher.recipe import load_recipe, validate_recipe
from launcher.plan.sizing import GB, Workload

REPO = Path(__file__).resolve().parents[2]
LLAMA70 = "meta-llama/Llama-3.1-70B-Instruct"
RECIPE_70B = REPO / "recipes" / "llama-3.1-70b-qlora-fsdp-2xrtx4090.yaml"


def qlora70(offload: bool, n: int = 2) -> tuple:
    arch = from_catalog(LLAMA70)
    w = Workload("qlora", 512, 1, True, 16, "all-linear", "fsdp", n, "cuda", offload)
    return arch, w, sizing.memory(arch, w)


# --- item 3: the load, counted ----------------------------------------------------------------

def test_load_peak_and_ram_of_qlora_fsdp_follow_the_cpu_load_path():
    arch, w, est = qlora70(False)
    model_gb = sizing.nf4_model_bytes(arch) / GB
    # 68.45B linear weights in NF4 + 2.1B embedding/head params in bf16: 39.5e9 bytes, 36.8 GB (GB = 2**30)
    assert 36.5 < model_gb < 37
    lora_gb = est.trainable_params * 4 / GB
    # each rank holds the whole 4-bit model (+ its fp32 LoRA) in RAM until it is sharded
    assert est.load_ram_gb == pytest.approx(2 * (model_gb + lora_gb + sizing.CPU_RUNTIME_GB))
    # on the card: its weight and LoRA shards + the largest unit whole (the 16-bit embedding), never the whole model
    unit = max(sizing.layer_unit_bytes(arch, w), sizing.embedding_unit_bytes(arch, w)) / GB
    shards = est.breakdown_gb["weights"] + est.breakdown_gb["adapters"] * 4 / 16
    assert est.load_peak_gb == pytest.approx(sizing.CUDA_CONTEXT_GB + shards + unit)
    assert est.load_peak_gb < model_gb / 2 + 4 < model_gb  # half the model + one unit, not all of it
    assert est.peak_gb == est.per_gpu_gb  # training, not the load, decides here


def test_parameter_offload_moves_the_shards_to_ram_and_costs_pcie_time():
    arch, w, on_card = qlora70(False)
    _, wo, est = qlora70(True)
    static = sum(on_card.breakdown_gb[k] for k in sizing.STATIC_TERMS if k in on_card.breakdown_gb)
    assert est.offloaded_params_gb == pytest.approx(2 * static)
    assert not set(sizing.STATIC_TERMS) & set(est.breakdown_gb)
    assert est.per_gpu_gb == pytest.approx(on_card.per_gpu_gb - static)
    # RAM while loading: both ranks' CPU copies and the pinned shards exist together
    assert est.load_ram_gb == pytest.approx(on_card.load_ram_gb + est.offloaded_params_gb - est.trainable_params * 12 / GB, rel=0.01)
    assert est.load_peak_gb < 3  # one unit whole while sharding, nothing resident
    # host-link time: the card's weight shard up twice (forward, backward), the LoRA gradient shard down once
    link = sizing.pcie_gb_s((8, 9))
    assert link == 31.5
    up = on_card.breakdown_gb["weights"] + est.trainable_params * 4 / 2 / GB
    expected = (2 * up + est.trainable_params * 4 / 2 / GB) / (link * 1e9 / GB)  # a link's rate is in 1e9 bytes/s
    assert sizing.offload_seconds_per_micro_batch(est, wo, link) == pytest.approx(expected)
    slow = sizing.tokens_per_second(arch, wo, 165, "pcie", 16, 500, (8, 9))
    fast = sizing.tokens_per_second(arch, w, 165, "pcie", 16, 500, (8, 9))
    assert slow < fast


def test_pcie_generation_from_compute_capability():
    assert [sizing.pcie_gb_s(cc) for cc in ((7, 5), (8, 0), (8, 9), (9, 0), (10, 0), (12, 0), None)] == \
        [15.75, 31.5, 31.5, 63.0, 63.0, 63.0, 31.5]


def test_deepspeed_qlora_counts_the_whole_4bit_model_on_every_card_at_load():
    arch = from_catalog(LLAMA70)
    est = sizing.memory(arch, Workload("qlora", 512, 1, True, 16, "all-linear", "deepspeed", 2, "cuda"))
    assert est.load_peak_gb > sizing.nf4_model_bytes(arch) / GB
    assert est.peak_gb == est.load_peak_gb  # the load, not the step, is the peak there


def test_70b_qlora_on_2x4090_is_refused_for_ram_and_plans_with_offload_where_ram_suffices():
    recipe = load_recipe(RECIPE_70B)
    hw = from_spec("2xRTX4090")  # a catalog box: 2 x VRAM in RAM per card, 96 GB
    with pytest.raises(PlanError) as err:
        make_plan(recipe, hw, tokens=15e6)
    msg = err.value.message
    assert "with parameter offload" in msg and "loading does not fit the box's RAM" in msg
    assert "each of the 2 processes loads and quantizes the whole model on its CPU" in msg
    assert "this box has 96 GB" in msg

    big = replace(hw, ram_gb=256.0)
    p = make_plan(recipe, big, tokens=15e6)
    assert p.fits and p.engine == "fsdp" and p.num_processes == 2 and p.offload_params
    assert p.memory["per_gpu_gb"] < 8 and p.memory["offloaded_params_gb"] > 36
    assert p.memory["load_ram_gb"] > 110 and p.memory["load_peak_gb"] < 3
    assert any("parameter offload" in r and "PCIe" in r for r in p.reasons)
    assert any(r.startswith("loading:") and "quantizing on 16 CPU cores" in r for r in p.reasons)
    assert "offloaded to CPU RAM (FSDP parameter offload)" in format_plan(p)
    # the estimate includes the transfers and the CPU quantization
    _, w, est = qlora70(True)
    assert p.tokens["tokens_per_second"] == pytest.approx(
        sizing.tokens_per_second(from_catalog(LLAMA70), w, 165, "pcie", 16, 500, (8, 9)), rel=0.01)
    load_h = sizing.load_seconds(from_catalog(LLAMA70), w, 16) / 3600
    assert p.estimate["hours"] == pytest.approx(15e6 / p.tokens["tokens_per_second"] / 3600 + load_h, rel=0.01)
    assert p.to_dict()["offload_params"] is True


def test_offload_reaches_the_accelerate_config():
    from launcher.worker.engines.fsdp import accelerate_config

    on = accelerate_config({"num_processes": 2, "device": "cuda", "offload_params": True}, True)["fsdp_config"]
    off = accelerate_config({"num_processes": 2, "device": "cuda"}, True)["fsdp_config"]
    assert on["fsdp_offload_params"] is True and off["fsdp_offload_params"] is False
    assert on["fsdp_cpu_ram_efficient_loading"] is True


def test_fsdp_qlora_loads_on_the_cpu_and_other_paths_are_unchanged(tmp_path):
    import torch

    from launcher.worker import loading

    r = validate_recipe({"model": "m", "method": "qlora", "data": "d.jsonl"}, tmp_path, "r")
    assert loading.load_kwargs(r, "cuda", torch.bfloat16, "fsdp")["device_map"] == {"": "cpu"}
    assert loading.fsdp_qlora_kwargs("qlora", "fsdp") == {"device_map": {"": "cpu"}}
    for method, engine in (("qlora", "deepspeed"), ("qlora", "trl"), ("lora", "fsdp"), ("full", "fsdp")):
        assert loading.fsdp_qlora_kwargs(method, engine) == {}
    quant = loading.load_kwargs(r, "cuda", torch.bfloat16, "fsdp")["quantization_config"]
    assert quant.bnb_4bit_quant_storage == "bfloat16" or quant.bnb_4bit_quant_storage == torch.bfloat16


@pytest.mark.slow
def test_qlora_loaded_on_cpu_shards_with_fully_shard_and_matches_the_unsharded_model(tmp_path, tiny_model):
    """Two gloo processes load the tiny model through the worker's FSDP path (4-bit, bf16 quant storage, on the
    CPU), shard it as accelerate does, and compute the same loss and LoRA gradients as the unsharded copy."""
    from conftest import recipe_file

    run = tmp_path / "run"
    run.mkdir()
    recipe_file(run / "recipe.yaml", tiny_model, run, method="qlora")
    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{REPO / 'tests'}", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          "29561", str(REPO / "tests" / "fsdp_qlora_worker.py"), str(run), "bfloat16", str(out)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["load_kwargs"]["device_map"] == "{'': 'cpu'}"
    assert r["params4bit"] > 0 and r["quantized"] and r["devices"] == ["cpu"]
    assert r["storage_dtypes"] == ["torch.bfloat16"]  # a float storage: FSDP2 can shard it
    # the 4-bit weights as the sizer counts them (4 bits per value; the constants are in their quant states)
    assert r["bytes_4bit"] == r["values_4bit"] // 2
    assert r["sharded_4bit"] == r["params4bit"]  # every 4-bit weight became a DTensor shard
    assert r["local_bytes_4bit"] <= r["bytes_4bit"] / 2 + 64 * r["params4bit"]  # each rank holds half (+ padding)
    assert r["loss_sharded"] == pytest.approx(r["loss_unsharded"], abs=1e-3)
    assert r["lora_grads"] > 0 and r["max_grad_diff"] <= 1e-2 * max(r["max_ref_grad"], 1e-6)


# --- item 8: full-8bit never runs on FSDP -----------------------------------------------------

def _recipe(tmp_path, **fields):
    base = {"model": LLAMA70, "method": "full-8bit", "data": "d.jsonl", "max_length": 2048,
            "micro_batch_size": 1, "gradient_accumulation_steps": 8}
    base.update(fields)
    return validate_recipe(base, tmp_path, "r")


@pytest.mark.parametrize("engine", ["fsdp", "auto"])
def test_full_8bit_on_fsdp_is_refused_with_the_reason_and_the_fix(tmp_path, engine):
    with pytest.raises(PlanError) as err:
        make_plan(_recipe(tmp_path, engine=engine), from_spec("8xH100-80GB"), tokens=15e6)
    msg = err.value.message
    assert "full-8bit cannot run on FSDP" in msg and "DTensor" in msg
    assert "method: full" in msg and "engine: deepspeed" in msg


def test_full_8bit_on_one_card_still_plans(tmp_path):
    p = make_plan(_recipe(tmp_path, model="meta-llama/Llama-3.1-8B"), from_spec("H100-80GB"), tokens=15e6)
    assert p.engine == "trl"


def test_deepspeed_counts_its_fp32_master_copy_for_full_8bit():
    arch = from_catalog(LLAMA70)
    fsdp = sizing.memory(arch, Workload("full-8bit", 2048, 1, True, 16, "all-linear", "fsdp", 8, "cuda"))
    ds = sizing.memory(arch, Workload("full-8bit", 2048, 1, True, 16, "all-linear", "deepspeed", 8, "cuda"))
    extra = (ds.breakdown_gb["optimizer"] - fsdp.breakdown_gb["optimizer"]) * GB * 8 / arch.params
    assert extra == pytest.approx(4)


def test_the_oom_shard_step_never_moves_full_8bit_onto_fsdp(tmp_path):
    from launcher.run.adjustments import next_adjustment, shard_blocker

    r = validate_recipe({"model": "meta-llama/Llama-3.1-8B", "method": "full", "data": "d.jsonl",
                         "micro_batch_size": 1, "gradient_accumulation_steps": 8,
                         "auto_adjust": ["optimizer", "shard"]}, tmp_path, "r")
    plan = {"engine": "trl", "num_processes": 1, "device": "cuda", "hardware": {"count": 4}}
    update, _ = next_adjustment(r, plan)
    assert update == {"method": "full-8bit"}  # the optimizer step first
    eight = r.model_copy(update=update)
    assert next_adjustment(eight, plan) is None  # then nothing: shard would put 8-bit AdamW on FSDP
    assert "full-8bit cannot run on FSDP" in shard_blocker(eight, plan)
    update, _ = next_adjustment(r.model_copy(update={"auto_adjust": ["shard"]}), plan)
    assert update["engine"] == "fsdp"  # method full still shards
