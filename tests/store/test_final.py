"""The final result's verification (launcher/store/final.py): good, missing, empty, truncated and wrong artifacts, and,
end to end, a run whose final save writes nothing ends `failed` with the reason, never `succeeded`."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import REPO, read_state

from launcher.store import final

LAYERS = 2
TARGETS = ["q_proj", "v_proj"]
HIDDEN, R = 8, 4


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """The safetensors layout written by hand (8-byte header length, JSON header, data), so that any dtype
    (bf16 included, which numpy lacks) and any damage can be made."""
    header, offset, blobs = {}, 0, []
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def f32(shape, value=0.5):
    return ("F32", list(shape), np.full(shape, value, dtype="<f4").tobytes())


def base_model(folder: Path) -> Path:
    """A base checkpoint folder with the weight names of a 2-layer decoder."""
    folder.mkdir(parents=True, exist_ok=True)
    t = {"model.embed_tokens.weight": f32((16, HIDDEN))}
    for i in range(LAYERS):
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[f"model.layers.{i}.self_attn.{m}.weight"] = f32((HIDDEN, HIDDEN))
        t[f"model.layers.{i}.mlp.experts.0.q_proj.weight"] = f32((HIDDEN, HIDDEN))  # fused experts: not adapted
    write_safetensors(folder / final.MODEL_WEIGHTS, t)
    (folder / final.MODEL_CONFIG).write_text(json.dumps({"model_type": "qwen3", "tie_word_embeddings": True}))
    return folder


def adapter(folder: Path, layers=range(LAYERS), targets=TARGETS, b_value=0.01, dtype="F32", **damage) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / final.ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": R, "target_modules": TARGETS}))
    (folder / "tokenizer.json").write_text("{}")
    t = {}
    for i in layers:
        for m in targets:
            key = f"base_model.model.model.layers.{i}.self_attn.{m}"
            t[f"{key}.lora_A.weight"] = f32((R, HIDDEN), 0.1)
            if dtype == "BF16":  # 0x3C00 is bf16 0.0078125; 0x7FC0 its NaN
                word = 0x7FC0 if damage.get("nan") else (0x3C00 if b_value else 0)
                t[f"{key}.lora_B.weight"] = ("BF16", [HIDDEN, R], np.full((HIDDEN, R), word, "<u2").tobytes())
            else:
                t[f"{key}.lora_B.weight"] = f32((HIDDEN, R), float("nan") if damage.get("nan") else b_value)
    write_safetensors(folder / final.ADAPTER_WEIGHTS, t)
    return folder


def test_a_complete_adapter_is_verified_against_the_recipe_and_the_base(tmp_path):
    base = final.base_weights(str(base_model(tmp_path / "base")))
    v = final.verify_adapter(adapter(tmp_path / "adapter"), TARGETS, base)
    assert v.ok, v.reason
    assert v.details["lora_modules"] == LAYERS * len(TARGETS) and v.details["rank"] == R
    assert "all 4 targeted modules of the base model adapted" in v.reason  # the experts' q_proj left out
    # "all-linear": the targets are the ones PEFT resolved and recorded in adapter_config.json
    assert final.verify_adapter(tmp_path / "adapter", "all-linear", base).ok
    # a bf16 adapter is read from its bits (numpy has no bf16)
    assert final.verify_adapter(adapter(tmp_path / "bf16", dtype="BF16"), TARGETS, base).ok
    # the file is a real safetensors file: the library reads what the test helper writes
    from safetensors.numpy import load_file

    assert len(load_file(str(tmp_path / "adapter" / final.ADAPTER_WEIGHTS))) == 2 * LAYERS * len(TARGETS)


def test_an_adapter_folder_with_only_tokenizer_files_names_the_missing_file(tmp_path):
    folder = tmp_path / "final" / "adapter"
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")
    v = final.verify(tmp_path / "final", "lora", TARGETS, str(tmp_path / "no-such-base"))
    assert not v.ok
    assert v.reason == (
        "final/adapter/adapter_config.json is missing (final/adapter holds only tokenizer.json, tokenizer_config.json)"
    )
    assert "does not exist" in final.verify(tmp_path / "nothing", "qlora", TARGETS, "x").reason
    (folder / final.ADAPTER_CONFIG).write_text(json.dumps({"r": R}))
    assert final.verify_adapter(folder, TARGETS).reason == "final/adapter/adapter_model.safetensors is missing"


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda p: p.write_bytes(b""), "adapter_model.safetensors is empty (0 bytes)"),
        (lambda p: p.write_bytes(p.read_bytes()[:-10]), "adapter_model.safetensors is truncated"),
        (lambda p: p.write_bytes(p.read_bytes()[:5]), "shorter than a safetensors header"),
        (lambda p: p.write_bytes(p.read_bytes()[:40]), "its header says"),
        (lambda p: p.write_bytes(p.read_bytes() + b"\0" * 4), "bytes after its last tensor"),
        (lambda p: p.write_bytes(struct.pack("<Q", 4) + b"nope"), "its header is not JSON"),
        (lambda p: write_safetensors(p, {}), "holds no tensors"),
        (lambda p: write_safetensors(p, {"w": ("F32", [0, 4], b"")}), "1 empty tensor(s), e.g. w"),
        (lambda p: write_safetensors(p, {"model.w": f32((2, 2))}), "holds no LoRA tensors"),
        (lambda p: write_safetensors(p, {"x.q_proj.lora_A.weight": f32((R, HIDDEN))}), "has lora_A without its pair"),
        (
            lambda p: write_safetensors(
                p, {"x.lora_A.weight": f32((R, HIDDEN)), "x.lora_B.weight": f32((HIDDEN, R + 1))}
            ),
            "do not share a rank",
        ),
        (lambda p: write_safetensors(p, {"x.lora_A.weight": ("F32", [R, HIDDEN], b"\0" * 4)}), "should take 128 bytes"),
    ],
)
def test_damaged_adapter_files_fail_with_the_file_and_what_is_wrong(tmp_path, damage, reason):
    folder = adapter(tmp_path / "adapter")
    damage(folder / final.ADAPTER_WEIGHTS)
    v = final.verify_adapter(folder, TARGETS)
    assert not v.ok and reason in v.reason, v.reason
    assert v.reason.startswith("final/adapter/")


def test_adapter_contents_are_checked_against_targets_base_and_values(tmp_path):
    base = final.base_weights(str(base_model(tmp_path / "base")))
    v = final.verify_adapter(adapter(tmp_path / "a1", targets=["q_proj"]), TARGETS, base)
    assert not v.ok and "no LoRA tensors for target module(s) v_proj" in v.reason
    v = final.verify_adapter(adapter(tmp_path / "a2", layers=[0]), TARGETS, base)  # a save that lost a layer
    assert not v.ok and "adapts 2 of the base model's 4 target modules; missing e.g. model.layers.1" in v.reason
    assert final.verify_adapter(tmp_path / "a2", TARGETS).ok  # without the base, the layer count is unknown
    v = final.verify_adapter(adapter(tmp_path / "a3", layers=[0, 1, 7]), TARGETS, base)
    assert not v.ok and "does not have, e.g. model.layers.7.self_attn.q_proj" in v.reason
    for dtype in ("F32", "BF16"):
        v = final.verify_adapter(adapter(tmp_path / f"nan-{dtype}", dtype=dtype, nan=True), TARGETS, base)
        assert not v.ok and "4 tensor(s) hold inf/NaN" in v.reason, (dtype, v.reason)
        v = final.verify_adapter(adapter(tmp_path / f"zero-{dtype}", dtype=dtype, b_value=0.0), TARGETS, base)
        assert not v.ok and "every lora_B is zero, the untrained initialisation" in v.reason, (dtype, v.reason)
    (tmp_path / "a1" / final.ADAPTER_CONFIG).write_text("{")
    assert "adapter_config.json is not valid JSON" in final.verify_adapter(tmp_path / "a1", TARGETS).reason


def _model(folder: Path, names=None, sharded=False, tie=True) -> Path:
    base_model(folder)
    if names is not None:
        write_safetensors(folder / final.MODEL_WEIGHTS, {n: f32((HIDDEN, HIDDEN)) for n in names})
    if sharded:  # an index and two shards, as save_pretrained writes a large model
        header = final.read_header(folder / final.MODEL_WEIGHTS)
        names = sorted(header)
        halves = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
        for shard, keys in halves.items():
            write_safetensors(folder / shard, {k: f32(header[k]["shape"]) for k in keys})
        (folder / final.MODEL_INDEX).write_text(
            json.dumps({"weight_map": {k: shard for shard, keys in halves.items() for k in keys}})
        )
        (folder / final.MODEL_WEIGHTS).unlink()
    (folder / final.MODEL_CONFIG).write_text(json.dumps({"tie_word_embeddings": tie}))
    return folder


def test_a_full_model_is_checked_against_the_base_weights(tmp_path):
    base_dir = base_model(tmp_path / "base")
    base = dict(final.base_weights(str(base_dir)), **{"lm_head.weight": [16, HIDDEN]})  # tied: saved once
    assert final.verify_model(_model(tmp_path / "model"), base).ok
    v = final.verify_model(_model(tmp_path / "sharded", sharded=True), base)
    assert v.ok and v.details["files"] == 2, v.reason
    assert not final.verify_model(_model(tmp_path / "untied", tie=False), base).ok  # then lm_head must be there
    v = final.verify_model(_model(tmp_path / "few", names=["model.layers.0.self_attn.q_proj.weight"]), base)
    assert not v.ok and "lacks 10 of the base model's 11 weights" in v.reason
    v = final.verify_model(_model(tmp_path / "shape", names=list(base)), base)
    assert not v.ok and "another shape than in the base model, e.g. model.embed_tokens.weight [8, 8]" in v.reason

    shard = tmp_path / "sharded" / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-3])
    v = final.verify_model(tmp_path / "sharded", base)
    assert not v.ok and v.reason.startswith("final/sharded/model-00002-of-00002.safetensors is truncated")
    index = json.loads((tmp_path / "sharded" / final.MODEL_INDEX).read_text())
    index["weight_map"]["model.extra.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / "sharded" / final.MODEL_INDEX).write_text(json.dumps(index))
    shard.unlink()
    assert "model-00002-of-00002.safetensors is missing" in final.verify_model(tmp_path / "sharded", base).reason

    only_config = tmp_path / "cfg"
    only_config.mkdir()
    (only_config / final.MODEL_CONFIG).write_text("{}")
    assert final.verify_model(only_config).reason == (
        "final/cfg has no weights: neither model.safetensors nor model.safetensors.index.json"
    )
    (only_config / final.MODEL_CONFIG).unlink()
    (only_config / "tokenizer.json").write_text("{}")
    assert "config.json is missing (final/cfg holds only tokenizer.json)" in final.verify_model(only_config).reason


def test_index_listing_a_tensor_its_shard_lacks_fails(tmp_path):
    folder = _model(tmp_path / "m", sharded=True)
    index = json.loads((folder / final.MODEL_INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"
    (folder / final.MODEL_INDEX).write_text(json.dumps(index))
    v = final.verify_model(folder)
    assert not v.ok and "lists 1 tensor(s) its shards lack, e.g. model.norm.weight" in v.reason


def test_base_weights_come_from_a_local_folder_with_an_index_or_not_at_all(tmp_path):
    assert final.base_weights(str(tmp_path / "missing")) is None
    assert final.base_weights("no-such-org/no-such-model") is None  # not in the Hub cache: no network
    folder = _model(tmp_path / "m", sharded=True)
    assert len(final.base_weights(str(folder))) == 11


# --- end to end: the final save writes nothing, the run must not succeed --------------------------------

# Loaded by every Python process of the run through PYTHONPATH; without the variable it does nothing. It
# turns the FINAL save (Trainer.save_model called by the worker, not the checkpoints' internal calls) into a
# no-op, the way Trainer.save_model behaves under FSDP with SHARDED_STATE_DICT.
SITECUSTOMIZE = """
import os
import sys

if os.environ.get("FTRUN_TEST_FINAL_SAVE_WRITES_NOTHING") == "1":
    import importlib.abc

    class _PatchTrainer(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "transformers.trainer":
                return None
            for finder in sys.meta_path:
                if finder is not self and hasattr(finder, "find_spec"):
                    spec = finder.find_spec(name, path, target)
                    if spec is not None:
                        break
            else:
                return None
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                original = module.Trainer.save_model

                def save_model(self, output_dir=None, _internal_call=False):
                    if _internal_call:  # checkpoints
                        return original(self, output_dir, _internal_call)
                    print("[test] final Trainer.save_model made a no-op", flush=True)

                module.Trainer.save_model = save_model

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _PatchTrainer())
"""


@pytest.mark.slow
def test_a_run_whose_final_save_writes_nothing_fails_with_the_reason_and_resumes_to_success(write_recipe, tmp_path):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
    recipe = write_recipe(max_steps=4, export=["adapter"])
    run = tmp_path / "run"
    env = dict(
        os.environ,
        PYTHONPATH=f"{inject}{os.pathsep}{REPO}",
        HF_HUB_OFFLINE="1",
        FTRUN_TEST_FINAL_SAVE_WRITES_NOTHING="1",
    )
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "launcher.cli", str(recipe), "--foreground", "smoke.enabled=false"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    t_fail = time.monotonic() - t0
    log = (run / "train.log").read_text() if (run / "train.log").is_file() else res.stdout + res.stderr
    assert "[test] final Trainer.save_model made a no-op" in log, log[-3000:]
    st = read_state(run)
    assert res.returncode != 0 and st["state"] == "failed", (st.get("reason"), log[-3000:])
    assert "succeeded" not in [h["state"] for h in st["history"]]
    assert st["reason"].startswith(
        "training finished but the final result is not usable: "
        "final/adapter/adapter_config.json is missing (final/adapter holds only "
    ), st
    assert st["final_check"]["ok"] is False
    assert "export" not in st and not (run / "final" / "export.json").exists()  # nothing was exported
    assert not (run / "final" / "adapter" / final.ADAPTER_WEIGHTS).exists()
    assert list((run / "checkpoints").glob("step-*/manifest.json"))  # the checkpoints are intact

    # what the reason says to do: the same command resumes from the newest checkpoint and saves again
    del env["FTRUN_TEST_FINAL_SAVE_WRITES_NOTHING"]
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "launcher.cli", str(recipe), "--foreground", "smoke.enabled=false"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    st = read_state(run)
    assert res.returncode == 0 and st["state"] == "succeeded", (st.get("reason"), res.stdout[-3000:])
    assert st["final_check"]["ok"] and st["final_check"]["lora_modules"] > 0
    assert st["export"]["state"] == "succeeded"
    print(
        f"final save writing nothing: failed in {t_fail:.0f}s; resumed to a verified adapter in "
        f"{time.monotonic() - t0:.0f}s ({st['final_check']['reason']})"
    )
