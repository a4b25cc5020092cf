"""A full fine-tune's final/model is written in the base model's dtype (launcher/worker/saving.py), whatever dtype
training kept: the real save paths on CPU (trl/ddp's cast-while-saving, DeepSpeed's file-by-file recast), and a
whole run end to end (slow). The FSDP gather is checked by test_engines.py's fully_shard exercise ([full])."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from helpers import REPO, read_state

from launcher.store import final
from launcher.worker import saving


def _header_dtypes(folder) -> set[str]:
    return saving.tensor_dtypes(folder)


def _trained_fp32(tiny_model_bf16):
    """The bf16 base loaded in fp32 (what trl/ddp train: fp32 master weights) and moved off bf16's grid, as
    training moves it: the save must round, not just copy."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_bf16), dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-4)
    return model


# --- the base model's dtype ------------------------------------------------------------------------------


def _folder(tmp_path, config: dict | None, tensor_dtype=None):
    import torch
    from safetensors.torch import save_file

    tmp_path.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    if tensor_dtype is not None:
        save_file(
            {"a.weight": torch.zeros(2, 2, dtype=tensor_dtype), "b.ids": torch.zeros(2, dtype=torch.int64)},
            str(tmp_path / "model.safetensors"),
        )
    return str(tmp_path)


def test_base_dtype_is_read_from_config_then_weights(tmp_path):
    import torch

    assert saving.base_dtype_name(_folder(tmp_path / "a", {"dtype": "bfloat16"}, torch.float32)) == (
        "bfloat16",
        "the base model's config.json",
    )  # the config wins, as transformers' dtype="auto"
    assert saving.base_dtype_name(_folder(tmp_path / "b", {"torch_dtype": "float16"}))[0] == "float16"  # before v5
    assert saving.base_dtype_name(_folder(tmp_path / "c", {"text_config": {"dtype": "float32"}}))[0] == "float32"
    assert saving.base_dtype_name(_folder(tmp_path / "d", {"model_type": "x"}, torch.float32)) == (
        "float32",
        "the base model's weights",
    )  # a config without a dtype: the first floating tensor's
    name, source = saving.base_dtype_name(_folder(tmp_path / "e", {"model_type": "x"}))
    assert name == "bfloat16" and source.startswith("assumed")
    assert saving.base_dtype_name("no-such-org/no-such-model")[0] == "bfloat16"  # not cached: no network


def test_final_dtype_is_for_whole_models_only(tiny_model_bf16, tiny_model):
    import torch
    from types import SimpleNamespace

    assert saving.final_dtype(SimpleNamespace(method="full", model=str(tiny_model_bf16)))[0] == torch.bfloat16
    assert saving.final_dtype(SimpleNamespace(method="full-8bit", model=str(tiny_model)))[0] == torch.float32
    assert saving.final_dtype(SimpleNamespace(method="lora", model=str(tiny_model_bf16)))[0] is None


# --- the trl/ddp path: cast while saving ---------------------------------------------------------------


def test_cast_state_dict_copies_each_tensor_once_onto_the_cpu(tmp_path):
    import torch

    emb = torch.randn(4, 3)
    state = {"embed.weight": emb, "head.weight": emb, "ids": torch.arange(3), "n.weight": torch.ones(3)}
    out = saving.cast_state_dict(state, torch.bfloat16)
    assert out is state and out["embed.weight"].dtype == torch.bfloat16 and out["embed.weight"].device.type == "cpu"
    assert out["head.weight"] is out["embed.weight"]  # tied: one copy, which save_pretrained writes once
    assert out["ids"].dtype == torch.int64  # integers are not weights
    assert torch.equal(out["embed.weight"], emb.to(torch.bfloat16))


def test_trl_full_save_writes_the_base_dtype_and_reloads(tmp_path, tiny_model_bf16):
    import torch
    from transformers import AutoModelForCausalLM

    model = _trained_fp32(tiny_model_bf16)
    out = tmp_path / "model"
    saving.save_model(model, out, torch.bfloat16)
    assert _header_dtypes(out) == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert model.dtype == torch.float32  # the training model itself is not cast
    # the same tensors as the base (tied head written once), every value the trained one rounded to bf16
    assert sorted(final.read_header(out / final.MODEL_WEIGHTS)) == sorted(
        final.read_header(tiny_model_bf16 / final.MODEL_WEIGHTS)
    )
    assert final.verify_model(out, final.base_weights(str(tiny_model_bf16))).ok
    loaded = AutoModelForCausalLM.from_pretrained(str(out))  # dtype "auto": what config.json says
    assert loaded.dtype == torch.bfloat16
    mine = dict(loaded.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(mine[name], p.detach().to(torch.bfloat16)), name


# --- the DeepSpeed path: its 16-bit gather writes the training dtype; recast file by file ----------------


@pytest.mark.parametrize("sharded", [False, True])
def test_recast_folder_rewrites_other_dtypes_file_by_file(tmp_path, tiny_model_bf16, sharded):
    import torch
    from transformers import AutoModelForCausalLM

    model = _trained_fp32(tiny_model_bf16)
    out = tmp_path / "model"
    # as ZeRO-3 on the CPU writes it: fp32 weights, config.json saying float32
    model.save_pretrained(str(out), **({"max_shard_size": "200KB"} if sharded else {}))
    assert _header_dtypes(out) == {"F32"} and len(saving.weight_files(out)) == (3 if sharded else 1)
    assert saving.recast_folder(out, torch.bfloat16)
    assert _header_dtypes(out) == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert not list(out.glob("*.tmp"))
    if sharded:  # the index's byte count follows the files
        index = json.loads((out / final.MODEL_INDEX).read_text())
        assert index["metadata"]["total_size"] == sum(
            t["data_offsets"][1] - t["data_offsets"][0]
            for f in saving.weight_files(out)
            for t in final.read_header(f).values()
        )
    assert final.verify_model(out, final.base_weights(str(tiny_model_bf16))).ok
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    assert loaded.dtype == torch.bfloat16
    mine = dict(loaded.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(mine[name], p.detach().to(torch.bfloat16)), name
    assert not saving.recast_folder(out, torch.bfloat16)  # already in the dtype: nothing rewritten


# --- end to end: a full fine-tune of a bf16 base ends with final/model in bf16 ----------------------------


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_full_finetune_of_a_bf16_base_ends_with_a_bf16_final_model(tmp_path, tiny_model_bf16, processes):
    """The worker trains fp32 weights on the CPU (as trl/ddp keep fp32 masters on a GPU) and _save_final writes
    them in the base's bf16: one process (trl) and two gloo processes (ddp, rank 0 writes)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from conftest import recipe_file

    recipe = recipe_file(
        tmp_path / "r.yaml", tiny_model_bf16, tmp_path / "run", method="full", max_steps=4, learning_rate=1e-3
    )
    engine = ["engine=ddp", "num_processes=2"] if processes == 2 else []
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "launcher.cli", str(recipe), "--foreground", "smoke.enabled=false", *engine],
        cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=400,
    )
    run = tmp_path / "run"
    log = ((run / "train.log").read_text() if (run / "train.log").is_file() else "") + res.stdout + res.stderr
    st = read_state(run)
    assert res.returncode == 0 and st["state"] == "succeeded", (st.get("reason"), log[-3000:], res.stderr[-2000:])
    out = run / "final" / "model"
    assert _header_dtypes(out) == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert "in bfloat16 (from the base model's config.json)" in log
    # the newest checkpoint holds the trained fp32 weights (the Trainer's own save): final/model is them in bf16
    ckpt = sorted((run / "checkpoints").glob("step-*/model.safetensors"))[-1]
    trained = load_file(str(ckpt))
    assert {t.dtype for t in trained.values()} == {torch.float32}
    written = load_file(str(out / final.MODEL_WEIGHTS))
    assert set(written) <= set(trained)
    assert all(torch.equal(written[k], trained[k].to(torch.bfloat16)) for k in written)
    base = load_file(str(tiny_model_bf16 / final.MODEL_WEIGHTS))
    assert any(not torch.equal(written[k], base[k]) for k in written)  # trained, not the base copied
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    assert loaded.dtype == torch.bfloat16
    print(
        f"full fine-tune, {processes} process(es): final/model in bf16, equal to the last checkpoint's fp32 "
        f"weights rounded; {time.monotonic() - t0:.0f}s"
    )
