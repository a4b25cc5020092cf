"""Export placement: where each model is loaded (GPU, CPU, split) from its size and the free memory, and the
real export on CPU when RAM is short: no model is moved after loading, every parity comparison runs on one
device in one dtype, and a merge the box cannot hold is refused before anything is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TINY_DATA = REPO / "recipes" / "data" / "tiny-chat.jsonl"
GB = 1e9


def _stub_cuda(monkeypatch, free: list[float]):
    """torch.cuda as a box with these GPUs (free bytes each) would answer; [] is a box without CUDA."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(free))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(free))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (int(free[i]), int(max(free) * 1.1)))


# ---------------------------------------------------------------------------------------------
# The choice, with the device queries stubbed


def test_gpu_box_compares_in_float32_on_one_gpu_and_merges_there(monkeypatch):
    import torch

    from launcher.deliver.placement import free_gpu_memory, merge_placement, parity_placement

    _stub_cuda(monkeypatch, [20 * GB, 80 * GB])
    gpus = free_gpu_memory()
    assert gpus == [20e9, 80e9]
    # 8B: float32 (32 GB) fits the second card; every parity model, the GGUF read-back included, goes there
    p = parity_placement(8_000_000_000, torch.bfloat16, gpus, ram=64 * GB)
    assert p.device_map == {"": "cuda:1"} and p.dtype == "float32" and p.max_memory is None
    assert p.load_kwargs() == {"dtype": torch.float32, "device_map": {"": "cuda:1"}}
    m = merge_placement(8_000_000_000, torch.bfloat16, gpus, ram=64 * GB)
    assert m.device_map == {"": "cuda:1"} and m.dtype == "bfloat16"


def test_small_gpu_compares_on_the_cpu_in_float32_not_across_devices(monkeypatch):
    """Item 16: a CUDA bf16 forward against a CPU read-back is never the comparison; float32 on the CPU is."""
    import torch

    from launcher.deliver.placement import free_gpu_memory, merge_placement, parity_placement

    _stub_cuda(monkeypatch, [24 * GB])
    p = parity_placement(8_000_000_000, torch.bfloat16, free_gpu_memory(), ram=64 * GB)
    assert p.device_map == {"": "cpu"} and p.dtype == "float32" and "not one GPU" in p.reason
    m = merge_placement(8_000_000_000, torch.bfloat16, free_gpu_memory(), ram=64 * GB)
    assert m.device_map == {"": "cuda:0"} and m.dtype == "bfloat16"  # 16 GB fits the card


def test_70b_on_two_24gb_cards_splits_over_gpus_and_ram_and_refuses_a_merge_it_cannot_hold(monkeypatch):
    import torch

    from launcher.errors import FtrunError
    from launcher.deliver.placement import (
        GPU_RESERVE,
        HEADROOM,
        RAM_RESERVE,
        free_gpu_memory,
        merge_placement,
        parity_placement,
    )

    _stub_cuda(monkeypatch, [24 * GB, 24 * GB])
    n = 70_000_000_000
    p = parity_placement(n, torch.bfloat16, free_gpu_memory(), ram=128 * GB)
    assert p.device_map == "auto" and p.dtype == "bfloat16"
    assert p.max_memory == {
        0: int((24 * GB - GPU_RESERVE) / HEADROOM),
        1: int((24 * GB - GPU_RESERVE) / HEADROOM),
        "cpu": int((128 * GB - RAM_RESERVE) / HEADROOM),
    }
    assert "disk" not in p.max_memory  # parity never offloads to disk (see the sources in placement.py)
    with pytest.raises(FtrunError, match="about 163.0 GB of RAM, and this box has 128.0 GB") as err:
        merge_placement(n, torch.bfloat16, free_gpu_memory(), ram=128 * GB)
    assert "export: [adapter]" in err.value.fix
    m = merge_placement(n, torch.bfloat16, free_gpu_memory(), ram=256 * GB)
    assert m.device_map == {"": "cpu"} and m.dtype == "bfloat16" and "merged on the CPU" in m.reason
    # too little memory in all for the 16-bit base: no logit comparison at all (the adapter is checked as a file)
    assert parity_placement(n, torch.bfloat16, free_gpu_memory(), ram=64 * GB).device_map is None


def test_cpu_box_without_room_for_float32_compares_in_16_bit_on_the_cpu_and_merges_float32_bases_in_float32():
    import torch

    from launcher.deliver.placement import merge_placement, parity_placement

    p = parity_placement(8_000_000_000, torch.bfloat16, [], ram=24 * GB)
    assert p.device_map == {"": "cpu"} and p.dtype == "bfloat16" and p.max_memory is None
    assert merge_placement(1_000_000_000, torch.bfloat16, [], 24 * GB, stored_float32=True).dtype == "float32"
    assert merge_placement(8_000_000_000, torch.bfloat16, [], 24 * GB, stored_float32=True).dtype == "bfloat16"


# ---------------------------------------------------------------------------------------------
# Real loads and exports on CPU


@pytest.fixture(scope="module")
def finished_run(tiny_model, tmp_path_factory) -> Path:
    """A LoRA run as training leaves it (recipe.yaml, final/adapter with tokenizer), with a seeded non-zero adapter
    instead of a training run: seconds instead of a minute."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path_factory.mktemp("placement") / "run"
    (run / "final").mkdir(parents=True)
    (run / "recipe.yaml").write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_model),
                "method": "lora",
                "data": str(TINY_DATA),
                "max_length": 256,
                "output_dir": str(run),
                "export": ["adapter"],
            }
        )
    )
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    torch.manual_seed(0)
    peft_model = get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.005)
    peft_model.save_pretrained(str(run / "final" / "adapter"))
    AutoTokenizer.from_pretrained(str(tiny_model)).save_pretrained(str(run / "final" / "adapter"))
    return run


def test_a_model_split_onto_disk_is_used_where_it_was_loaded(tiny_model, tmp_path, monkeypatch):
    """The old export's `.to(dtype)` after a split load raises in accelerate; loading in the compute dtype and
    feeding the inputs to the compute device gives the unsplit model's logits exactly."""
    import torch

    import launcher.deliver.parity as parity
    from launcher.deliver.parity import model_outputs
    from launcher.deliver.placement import Loads, Placement, load_model

    monkeypatch.setattr(parity, "GREEDY_NEW_TOKENS", 4)  # each step reads the disk part again
    prompts = [{"ids": list(range(5, 60)), "prompt_ids": list(range(5, 20))}]
    loads = Loads()
    whole = load_model(str(tiny_model), Placement({"": "cpu"}, "bfloat16", "test"), loads)
    split = load_model(
        str(tiny_model),
        Placement("auto", "bfloat16", "test", max_memory={"cpu": 250_000}),
        loads,
        offload_folder=str(tmp_path / "offload"),
    )
    assert [entry["offloaded_to"] for entry in loads.log] == [[], ["disk"]]
    with pytest.raises(RuntimeError, match="offloaded to cpu or disk"):
        split.to(torch.float32)  # what `load_16bit(...).to(cdtype)` did
    a, b = model_outputs(whole, prompts)[0], model_outputs(split, prompts)[0]
    assert torch.equal(a["logits"], b["logits"]) and a["greedy"] == b["greedy"]


def _copy_run(run: Path, tmp: Path) -> Path:
    import shutil

    dst = tmp / "run"
    shutil.copytree(run, dst)
    recipe = yaml.safe_load((dst / "recipe.yaml").read_text())
    recipe["output_dir"] = str(dst)
    (dst / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return dst


def test_adapter_export_when_the_base_fits_nowhere_checks_the_file_and_refuses_the_merge(
    finished_run, tmp_path, monkeypatch
):
    """The 70B recipes' `export: [adapter]` loaded the 16-bit base for its parity check, wherever it landed."""
    import launcher.deliver.export as ex
    import launcher.deliver.placement as placement

    run = _copy_run(finished_run, tmp_path)
    monkeypatch.setattr(ex, "free_gpu_memory", lambda: [])
    monkeypatch.setattr(ex, "available_ram", lambda: int(placement.RAM_RESERVE + 100_000))  # less than the bf16 model
    rep = ex.export_run(run, ["adapter"])
    adapter = rep["outputs"]["adapter"]
    assert rep["ok"] and adapter["changes_base_logits"] is None and adapter["file_check"]["lora_B_nonzero"] == "14/14"
    assert rep["placement"]["parity"]["device"] is None and rep["placement"]["loads"] == []
    assert (run / "final" / "SERVING.md").is_file()
    assert "export_dtype" not in rep  # no 16-bit weights written: the adapter keeps the dtype training saved it in
    with pytest.raises(ex.ExportError, match="merging needs the whole bfloat16 model"):
        ex.export_run(run, ["adapter", "merged"])
    rep = json.loads((run / "final" / "export.json").read_text())  # refused before any model was loaded
    assert "merge" not in rep["placement"] and "loads" not in rep["placement"]
    assert not (run / "final" / "merged").exists()


@pytest.mark.slow
def test_export_in_16_bit_when_float32_fits_nowhere_compares_like_with_like(finished_run, tmp_path, monkeypatch):
    """RAM for the 16-bit model but not for float32: merge and every parity load in bf16 on the CPU, one model at
    a time, the merged model compared with base + adapter in the same dtype. (The GGUF is read back in llama.cpp,
    which places nothing through this: tests/deliver/test_gguf.py, the gguf tier.)"""
    import launcher.deliver.export as ex
    import launcher.deliver.placement as placement

    run = _copy_run(finished_run, tmp_path)
    n = placement.parameter_count(yaml.safe_load((run / "recipe.yaml").read_text())["model"])
    monkeypatch.setattr(ex, "free_gpu_memory", lambda: [])
    monkeypatch.setattr(ex, "available_ram", lambda: int(placement.RAM_RESERVE + placement.HEADROOM * 3 * n))
    rep = ex.export_run(run, ["adapter", "merged"])
    assert rep["ok"], rep.get("error")
    place = rep["placement"]
    assert place["parity"]["dtype"] == "bfloat16" and place["merge"]["dtype"] == "bfloat16"
    loads = place["loads"]
    assert loads and {e["dtype"] for e in loads} == {"bfloat16"} and {e["device"] for e in loads} == {"cpu"}
    assert loads[-1]["model"].endswith("merged")  # the written folder, reloaded last for its check
    merged = rep["outputs"]["merged"]["parity_vs_base_plus_adapter"]
    assert merged["ok"] and merged["compute_dtype"] == "bfloat16"
