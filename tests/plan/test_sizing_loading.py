"""The box's RAM while FSDP and DeepSpeed load 16-bit weights (LoRA, full fine-tuning): counted by the plan
(loading_memory._loading_16bit) and refused with the reason and the RAM a box would need when the box cannot hold it.
QLoRA on FSDP: one 4-bit copy per box (loading_memory._loading; measured in tests/worker/test_fsdp_qlora.py).

The rule rests on what transformers and accelerate do on the CPU, measured here with the real libraries: a
16-bit checkpoint loaded in its own dtype is the memory-mapped file (page cache, shared by the processes of a
box), while accelerate's fp32 upcast of the trainable weights (fsdp2_prepare_model, on every rank's CPU
before sharding) is new memory in each process.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from launcher.plan import loading_memory, sizing, sizing_constants
from launcher.plan import throughput
from launcher.errors import PlanError
from launcher.plan.hardware import from_spec
from launcher.plan.models import from_catalog, from_config
from launcher.plan.plan import make_plan
from launcher.recipe_loading import load_recipe
from launcher.plan.sizing import Workload
from launcher.plan.sizing_constants import GB

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
LLAMA70 = "meta-llama/Llama-3.1-70B-Instruct"
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 48,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}


def est(arch, method: str, engine: str, n: int):
    return sizing.memory(arch, Workload(method, 2048, 2, True, 16, "all-linear", engine, n, "cuda"))


def test_fsdp_full_holds_an_fp32_copy_per_process_while_loading():
    arch = from_catalog(LLAMA70)
    e = est(arch, "full", "fsdp", 8)
    # accelerate upcasts every trainable weight to fp32 on each rank's CPU before sharding: 4 B/param per process
    assert e.load_ram_gb == pytest.approx(8 * (arch.params * 4 / GB + sizing_constants.CPU_RUNTIME_GB))
    assert 2050 < e.load_ram_gb < 2150  # 70.6B x 4 B = 263 GB per process, + 1 GB of runtime
    assert "each of the 8 processes loads the whole model" in e.load_explanation
    assert "upcast to fp32 (263 GB" in e.load_explanation
    assert "engine: deepspeed loads partitioned" in e.load_explanation
    assert e.load_peak_gb == 0.0  # the cards: accelerate shards on the meta device and broadcasts unit by unit


def test_fsdp_lora_shares_the_mapped_16bit_weights_and_holds_its_fp32_adapters():
    arch = from_catalog(LLAMA70)
    e = est(arch, "lora", "fsdp", 4)
    lora_gb = e.trainable_params * 4 / GB
    assert e.load_ram_gb == pytest.approx(4 * (lora_gb + sizing_constants.CPU_RUNTIME_GB))
    assert e.load_ram_gb < 10  # not 4 x 131 GB: the 16-bit weights are the files' pages, shared by the processes
    assert "the 131 GB of 16-bit weights stay in the page cache, shared" in e.load_explanation


def test_moe_experts_fused_while_loading_are_per_process():
    arch = from_config(QWEN3_30B_A3B, "qwen3-30b-a3b", "test")
    fused = loading_memory.fused_expert_params(arch)
    assert fused == 3 * 2048 * 768 * 128 * 48  # 29B of the 30.5B parameters
    e = est(arch, "lora", "fsdp", 4)
    assert e.load_ram_gb == pytest.approx(
        4 * (e.trainable_params * 4 / GB + fused * 2 / GB + sizing_constants.CPU_RUNTIME_GB)
    )
    assert "MoE experts fused while loading" in e.load_explanation
    assert loading_memory.fused_expert_params(from_catalog(LLAMA70)) == 0  # dense: nothing fused


def test_deepspeed_zero3_loads_partitioned_without_a_copy_per_process():
    arch = from_catalog(LLAMA70)
    full = est(arch, "full", "deepspeed", 8)
    assert full.load_ram_gb == pytest.approx(8 * sizing_constants.CPU_RUNTIME_GB)  # rank 0 reads the mapped checkpoint
    assert "zero.Init" in full.load_explanation and "rank 0 alone reads the checkpoint" in full.load_explanation
    moe = from_config(QWEN3_30B_A3B, "qwen3-30b-a3b", "test")
    assert est(moe, "full", "deepspeed", 8).load_ram_gb == pytest.approx(
        8 * sizing_constants.CPU_RUNTIME_GB + loading_memory.fused_expert_params(moe) * 2 / GB
    )  # rank 0 fuses them once


def test_single_card_and_cpu_plans_count_no_loading():
    arch = from_catalog(LLAMA70)
    assert est(arch, "full", "trl", 1).load_ram_gb == 0.0
    assert sizing.memory(arch, Workload("full", 512, 1, device="cpu", engine="ddp", num_gpus=2)).load_ram_gb == 0.0


def test_full_finetune_on_fsdp_is_refused_where_the_box_ram_cannot_hold_the_load(monkeypatch):
    """32B full fine-tuning over 8 x H100 plans on the catalog box (2 x the cards' memory in RAM, 1274 GB) and is
    refused on a box with 1 TB, with the reason, the RAM it needs, and DeepSpeed (partitioned loading) fitting."""
    recipe = load_recipe(RECIPES / "qwen3-32b-full-8xh100.yaml")
    hw = from_spec("8xH100-80GB")
    p = make_plan(recipe, hw, tokens=15e6)
    assert p.fits and p.engine == "fsdp" and 900 < p.memory["load_ram_gb"] < hw.ram_gb * 0.8
    assert any(r.startswith("loading: each of the 8 processes loads the whole model") for r in p.reasons)

    # a box to rent: its RAM is an assumption, so the plan names the RAM it needs instead of refusing
    rented = make_plan(recipe, replace(hw, ram_gb=1024.0), tokens=15e6)
    need = p.memory["load_ram_gb"] / sizing_constants.USABLE_RAM_FRACTION
    assert rented.fits and any(f"with at least {need:.0f} GB of RAM" in r for r in rented.reasons)
    # the box in hand: its RAM is read, and too little is refused with the figure
    small = replace(hw, ram_gb=1024.0, source="detected")
    from launcher.plan import engine_software

    monkeypatch.setattr(
        engine_software, "_deepspeed_installed", lambda: True
    )  # the box in hand has the image's software
    with pytest.raises(PlanError) as err:
        make_plan(recipe, small, tokens=15e6, unsloth_available=False)
    msg = err.value.message
    assert "loading does not fit the box's RAM" in msg and "this box has 1024 GB" in msg
    assert "each of the 8 processes loads the whole model onto its CPU" in msg
    assert f"A box with {need:.0f} GB of RAM or more" in msg

    ds = make_plan(load_recipe(RECIPES / "qwen3-32b-full-8xh100.yaml", ["engine=deepspeed"]), small, tokens=15e6)
    assert ds.fits and ds.engine == "deepspeed" and ds.memory["load_ram_gb"] < 20


def test_70b_lora_on_4xh100_plans_and_says_what_loading_holds():
    p = make_plan(load_recipe(RECIPES / "llama-3.1-70b-lora-4xh100.yaml"), from_spec("4xH100-80GB"), tokens=15e6)
    assert p.fits and p.engine == "fsdp" and p.memory["load_ram_gb"] < 10
    assert any(r.startswith("loading:") and "shared" in r for r in p.reasons)


# --- QLoRA + FSDP: one 4-bit copy per box (issue 21 item 7) ---------------------------------------------


def qlora_fsdp(n: int, offload: bool = False):
    arch = from_catalog(LLAMA70)
    return arch, sizing.memory(arch, Workload("qlora", 512, 1, True, 16, "all-linear", "fsdp", n, "cuda", offload))


def test_qlora_fsdp_ram_is_one_4bit_copy_per_box_whatever_the_process_count():
    """launcher/worker/loading.py quantizes once per box and every rank maps the saved file: more processes add
    their runtime and fp32 LoRA, never another 4-bit copy."""
    arch, two = qlora_fsdp(2)
    _, eight = qlora_fsdp(8)
    model_gb = loading_memory.nf4_model_bytes(arch) / GB
    temp_gb = loading_memory.quantize_temporary_bytes(arch) / GB
    assert two.load_ram_gb == pytest.approx(model_gb + temp_gb + 2 * sizing_constants.CPU_RUNTIME_GB)
    assert eight.load_ram_gb - two.load_ram_gb == pytest.approx(6 * sizing_constants.CPU_RUNTIME_GB)
    assert eight.load_ram_gb < 1.5 * model_gb  # it was 8 x (model + LoRA + runtime) = 310 GB
    text = two.load_explanation
    assert "one process quantizes the model once for the box on its CPU (36.8 GB in 4-bit" in text
    assert "while the other waits" in text and "while the other 7 wait" in eight.load_explanation
    assert "maps that file (one copy in the page cache, shared)" in text
    need = two.load_ram_gb / sizing_constants.USABLE_RAM_FRACTION
    assert (
        f"{two.load_ram_gb:.0f} GB of RAM at the peak (quantizing; a box with {need:.0f} GB or more holds it)" in text
    )


def test_qlora_fsdp_with_offload_counts_the_pinned_shards_once():
    arch, on_card = qlora_fsdp(2)
    _, off = qlora_fsdp(2, offload=True)
    lora_gb = off.trainable_params * 4 / GB
    sharding = off.offloaded_params_gb + 2 * (lora_gb + sizing_constants.CPU_RUNTIME_GB)
    assert off.load_ram_gb == pytest.approx(max(on_card.load_ram_gb, sharding))
    assert "(sharding; a box with" in off.load_explanation and "pinned RAM (39.9 GB)" in off.load_explanation
    # the pinned shards of all ranks together are one copy (+ LoRA gradients and AdamW states), not one per rank
    assert off.offloaded_params_gb < 1.1 * loading_memory.nf4_model_bytes(arch) / GB


def test_qlora_fsdp_quantizes_once_with_every_core():
    arch = from_catalog(LLAMA70)
    for n in (2, 4, 8):
        w = Workload("qlora", 512, 1, True, 16, "all-linear", "fsdp", n, "cuda")
        assert throughput.load_seconds(arch, w, 16) == pytest.approx(arch.linear_params / (5e6 * 16))  # 14 min
    # other paths do not quantize on the CPU
    assert throughput.load_seconds(arch, Workload("qlora", 512, 1, engine="deepspeed", num_gpus=2), 16) == 0.0
    assert throughput.load_seconds(arch, Workload("lora", 512, 1, engine="fsdp", num_gpus=2), 16) == 0.0


def test_the_70b_qlora_row_plans_on_2x4090_and_names_the_ram():
    p = make_plan(load_recipe(RECIPES / "llama-3.1-70b-qlora-fsdp-2xrtx4090.yaml"), from_spec("2xRTX4090"), tokens=15e6)
    assert p.fits and p.engine == "fsdp" and p.offload_params
    need = p.memory["load_ram_gb"] / sizing_constants.USABLE_RAM_FRACTION
    assert need < 96  # the catalog box's assumed RAM
    assert any(
        r.startswith("loading: one process quantizes") and f"a box with {need:.0f} GB or more" in r for r in p.reasons
    )


# --- the premise, measured: mapped 16-bit weights, private fp32 upcast -----------------------------------

MEASURE = """
import json, sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM

def rss():
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "RssFile:")):
            key, value = line.split(":")
            out[key] = int(value.split()[0]) / 1024
    return out

# a first load pays the one-time costs (lazy imports, kernels' registries), which are not per-model memory
import gc
warm = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, device_map=None)
del warm
gc.collect()
before = rss()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, device_map=None)
touched = sum(float(p.detach().float().sum()) for p in model.parameters())  # every page read
loaded = rss()
# accelerate 1.15 fsdp2_prepare_model under mixed precision ("Upcast to fp32 master weights")
for p in model.parameters():
    if p.requires_grad and p.dtype != torch.float32:
        p.data = p.data.to(torch.float32)
upcast = rss()
print(json.dumps({"anon": loaded["RssAnon"] - before["RssAnon"], "mapped": loaded["RssFile"] - before["RssFile"],
                  "upcast": upcast["RssAnon"] - loaded["RssAnon"],
                  "dtypes": sorted({str(p.dtype) for p in model.parameters()})}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_16bit_checkpoint_loads_mapped_and_the_fp32_upcast_is_private(tmp_path):
    """What loading_memory._loading_16bit relies on (transformers 5.24, on the CPU as FSDP's ranks load):
    from_pretrained in the checkpoint's own dtype with device_map=None maps the safetensors file (file-backed pages,
    which the processes of a box share), and the upcast accelerate's fsdp2_prepare_model applies to trainable weights
    allocates 4 B/param in each process. Measured in a fresh process, so no earlier allocation blurs it."""
    import json
    import os
    import subprocess

    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        shape = Qwen3ForCausalLM(config)
    n = sum(p.numel() for p in shape.parameters())
    gen = torch.Generator().manual_seed(0)
    folder = tmp_path / "m"
    folder.mkdir()
    save_file(
        {k: (torch.rand(v.shape, generator=gen) - 0.5).to(torch.bfloat16) for k, v in shape.state_dict().items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config.dtype = "bfloat16"
    config.save_pretrained(folder)
    model_mb = n * 2 / 2**20

    res = subprocess.run(
        [sys.executable, "-c", MEASURE, str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    m = json.loads(res.stdout.strip().splitlines()[-1])
    assert m["mapped"] > 0.8 * model_mb, (m, model_mb)  # the file's pages
    assert m["anon"] < 0.25 * model_mb, (m, model_mb)  # no private copy
    assert m["upcast"] > 0.9 * 2 * model_mb and m["dtypes"] == ["torch.float32"], (m, model_mb)  # 4 B/param, private
    print(
        f"{n / 1e6:.0f}M params ({model_mb:.0f} MB in bf16): loaded +{m['mapped']:.0f} MB file-backed, "
        f"+{m['anon']:.0f} MB anonymous; fp32 upcast +{m['upcast']:.0f} MB anonymous"
    )
