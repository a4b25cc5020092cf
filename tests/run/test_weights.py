"""The model is on this box before any GPU time (launcher/run/weights.py): found in the cache, downloaded with its
size, progress and speed, or refused with the reason before the run directory is touched. The Hub is a local
stand-in (tests/hub_standin.py) answered through huggingface_hub's own client; no network here."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, ftrun
from hub_standin import HubStandIn
from launcher.run import weights
from launcher.errors import ModelError


@pytest.fixture
def hub(tiny_model, tmp_path, monkeypatch):
    """The stand-in with org/tiny (the tiny model) and a gated org/gated; online, with an empty cache."""
    import huggingface_hub.constants as hf_constants

    standin = HubStandIn({"org/tiny": tiny_model}, gated=("org/gated",), slow=0.002)
    monkeypatch.setenv("HF_ENDPOINT", standin.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    yield standin
    standin.close()


def test_download_shows_size_progress_and_speed_then_the_cache_answers(hub, tiny_model):
    found = weights.check("org/tiny")
    files = {p.name: p.stat().st_size for p in tiny_model.iterdir() if p.is_file()}
    assert found["source"] == "hub" and found["bytes"] == sum(files.values()) and found["files"] == len(files)

    lines: list[str] = []
    got = weights.fetch("org/tiny", found, lines.append, every=0.0)
    assert got["model_source"] == "hub" and got["download_bytes"] == found["bytes"] and got["download_seconds"] > 0
    assert (
        lines[0] == f"downloading org/tiny: {len(files)} files, {weights.format_bytes(found['bytes'])} into the "
        "Hugging Face cache"
    )
    progress = [line for line in lines if " of " in line]
    assert progress and all("/s" in line and "%" in line for line in progress)
    assert (
        progress[-1].startswith(f"downloading org/tiny: {weights.format_bytes(found['bytes'])} of")
        and "(100%)" in progress[-1]
    )
    assert lines[-1].startswith(f"downloaded org/tiny: {weights.format_bytes(found['bytes'])} in ")

    again = weights.check("org/tiny")  # a complete snapshot: no download, the worker reads it offline
    assert again["source"] == "cache"
    snapshot = Path(again["path"])
    assert {p.name: p.stat().st_size for p in snapshot.iterdir()} == files


def test_missing_gated_offline_or_unreachable_models_are_clear_errors(hub, monkeypatch):
    with pytest.raises(ModelError, match="the Hub has no such model"):
        weights.check("org/tpyo")
    with pytest.raises(ModelError, match="it is gated") as gated:
        weights.check("org/gated")
    assert "HF_TOKEN" in gated.value.fix
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(ModelError, match="the Hub could not be reached"):
        weights.check("org/tiny")
    monkeypatch.setenv("FTRUN_OFFLINE", "1")
    with pytest.raises(ModelError, match="not in the Hugging Face cache and the network is off"):
        weights.check("org/tiny")


def test_a_model_that_cannot_be_had_stops_before_the_smoke_test_and_again_the_same_way(write_recipe, tmp_path):
    recipe = write_recipe(model="org/not-cached")
    for _ in range(2):
        res = ftrun("smoke", recipe, cwd=tmp_path, env={"HF_HOME": str(tmp_path / "hf")})
        assert res.returncode == 2, res.stdout + res.stderr
        assert "the model 'org/not-cached' is not on this box and cannot be downloaded" in res.stderr
        assert "network is off" in res.stderr and "Traceback" not in res.stderr
        assert "nothing that fits" not in res.stdout + res.stderr
        assert not (tmp_path / "run").exists()  # nothing was written: the next try starts clean


@pytest.mark.slow
def test_a_run_from_the_hub_downloads_before_the_smoke_test_and_records_the_time(hub, write_recipe, tmp_path):
    recipe = write_recipe(model="org/tiny", max_steps=4)
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        HF_ENDPOINT=hub.url,
        HF_HUB_OFFLINE="0",
        HF_HUB_CACHE=str(tmp_path / "hf-cache"),
    )

    def ftrun_online(*args):
        return subprocess.run(
            [sys.executable, "-m", "launcher.cli", *map(str, args)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    res = ftrun_online("smoke", recipe)
    assert res.returncode == 0, res.stdout + res.stderr
    smoke = json.loads((tmp_path / "run" / "smoke.json").read_text())
    assert smoke["model_source"] == "hub" and smoke["download_bytes"] > 0 and smoke["download_seconds"] > 0
    assert "the model's download took" in res.stdout
    log = (tmp_path / "run" / "train.log").read_text()
    assert "downloading org/tiny:" in log and "downloaded org/tiny:" in log
    again = ftrun_online("smoke", recipe)  # from the cache now
    assert again.returncode == 0 and "downloading" not in again.stdout


def test_unsloth_qlora_checks_and_downloads_the_prequantized_repo_it_trains(hub, tiny_model, tmp_path):
    """Unsloth trains QLoRA on its pre-quantized 4-bit copy (engines/unsloth.py): that repository is the one
    checked and downloaded before the smoke test, not the 16-bit one of the recipe (about four times the size)."""
    from launcher.run import prepare
    from launcher.recipe_loading import validate_recipe
    from launcher.store.rundir import RunDir

    hub.repos["unsloth/Qwen3-8B-bnb-4bit"] = tiny_model  # the stand-in serves it; Qwen/Qwen3-8B it does not
    recipe = validate_recipe({"model": "Qwen/Qwen3-8B", "method": "qlora", "data": "d.jsonl"}, tmp_path, "r")
    assert prepare.worker_model(recipe, {"engine": "unsloth"}) == "unsloth/Qwen3-8B-bnb-4bit"
    assert prepare.worker_model(recipe, {"engine": "trl"}) == "Qwen/Qwen3-8B"  # trl quantizes the recipe's model
    lora = validate_recipe({"model": "Qwen/Qwen3-8B", "method": "lora", "data": "d.jsonl"}, tmp_path, "r")
    assert prepare.worker_model(lora, {"engine": "unsloth"}) == "Qwen/Qwen3-8B"  # LoRA trains the 16-bit weights

    plan = {
        "engine": "unsloth",
        "weights": {"model": "unsloth/Qwen3-8B-bnb-4bit", **weights.check("unsloth/Qwen3-8B-bnb-4bit")},
    }
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    got = prepare._download(run, recipe, {"source": "hub", "files": 99, "bytes": 10**10, "allow": ["*"]}, plan)
    assert got["model_source"] == "hub" and got["download_bytes"] == plan["weights"]["bytes"]
    assert (
        "downloading unsloth/Qwen3-8B-bnb-4bit" in run.log.read_text() and "Qwen/Qwen3-8B:" not in run.log.read_text()
    )
    assert weights.check("unsloth/Qwen3-8B-bnb-4bit")["source"] == "cache"  # the worker reads it offline


def test_the_tokenizer_comes_before_the_data_check_on_a_models_first_run(hub, tiny_model):
    """A Hub model not yet cached: its tokenizer and chat template are fetched first (small files), so the data
    check counts tokens and checks tool calls/reasoning with the real template instead of a character estimate."""
    from launcher.data.dataset import token_counter

    found = weights.check("org/tiny")
    assert token_counter("org/tiny")[0] is None  # nothing cached yet: the data check could only estimate
    assert "tokenizer.json" in found["tokenizer_files"]
    weights.fetch_tokenizer("org/tiny", found)
    count, source = token_counter("org/tiny")
    assert count is not None and "tokenizer and chat template" in source
    assert weights.check("org/tiny")["source"] == "hub"  # the weights are still to come (before the smoke test)
