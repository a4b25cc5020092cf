"""Out of memory in the smoke test (a real allocator failure under --memory-limit): re-plan, keep the effective batch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import REPO, _load_script, recipe_file
from helpers import ftrun, metrics


@pytest.fixture(scope="module")
def big_vocab_model() -> Path:
    """The tiny model with its embedding padded to 32k rows: the logits of a long batch dominate memory."""
    out = REPO / ".cache" / "tiny-model-bigvocab"
    _load_script("make_tiny_model").build_tiny_model(out, model_vocab=32768)
    return out


FIELDS = dict(max_length=512, micro_batch_size=8, gradient_accumulation_steps=1, max_steps=4, smoke={"min_steps": 2})


def test_nothing_fits_stops_with_the_attempts_and_starts_nothing(tmp_path, big_vocab_model):
    recipe = recipe_file(tmp_path / "r.yaml", big_vocab_model, output_dir=tmp_path / "run",
                         auto_adjust=["batch"], **{**FIELDS, "micro_batch_size": 2})
    res = ftrun(recipe, "--memory-limit", "150MB", cwd=tmp_path)
    assert res.returncode == 4, res.stdout + res.stderr
    err = res.stderr
    assert "nothing the recipe allows (auto_adjust: ['batch']) is left to try" in err
    assert "- micro_batch_size=2 gradient_accumulation_steps=1" in err and "- micro_batch_size=1 gradient_accumulation_steps=2" in err
    assert "out of memory (peak" in err and "Fix: lower max_length (now 512)" in err
    assert "Traceback" not in err
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert state["state"] == "failed-smoke" and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_auto_adjust_empty_is_respected(tmp_path, big_vocab_model):
    recipe = recipe_file(tmp_path / "r.yaml", big_vocab_model, output_dir=tmp_path / "run", auto_adjust=[], **FIELDS)
    res = ftrun("smoke", recipe, "--memory-limit", "150MB", cwd=tmp_path)
    assert res.returncode == 4 and "auto_adjust: []" in res.stderr
    assert "re-planning" not in res.stdout


@pytest.mark.slow
def test_oom_replans_to_smaller_micro_batch_and_trains_like_that_from_the_start(tmp_path, big_vocab_model):
    recipe = recipe_file(tmp_path / "r.yaml", big_vocab_model, output_dir=tmp_path / "run", **FIELDS)
    res = ftrun(recipe, "--foreground", "--memory-limit", "1.2GB", cwd=tmp_path, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "re-planning: micro_batch_size 8 -> 4, gradient_accumulation_steps 1 -> 2" in res.stdout
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    final = {}
    for adj in plan["adjustments"]:
        assert "out of memory at peak" in adj["reason"]
        final.update(adj["set"])
    m, g = final["micro_batch_size"], final["gradient_accumulation_steps"]
    assert m < 8 and m * g == 8  # the effective batch is kept

    ref = recipe_file(tmp_path / "ref.yaml", big_vocab_model, output_dir=tmp_path / "ref",
                      **{**FIELDS, "micro_batch_size": m, "gradient_accumulation_steps": g})
    res = ftrun(ref, "--foreground", "smoke.enabled=false", cwd=tmp_path, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    assert [r["loss"] for r in metrics(tmp_path / "run")] == [r["loss"] for r in metrics(tmp_path / "ref")]
    # the same command again resumes/finishes with the adjusted recipe, not a trajectory mismatch
    again = ftrun(recipe, cwd=tmp_path)
    assert again.returncode == 0 and "finished" in again.stdout
