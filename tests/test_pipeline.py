"""End to end on CPU with the tiny model: foreground, detached + status, kill -9 and resume, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def ftrun(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "launcher.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def status(run_dir: Path, cwd: Path) -> dict:
    res = ftrun("status", run_dir, "--json", cwd=cwd)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


def adapter_tensors(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "adapter" / "adapter_model.safetensors"))


def test_foreground_run_end_to_end(write_recipe, tmp_path):
    recipe = write_recipe(max_steps=12)
    res = ftrun(recipe, "--foreground", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    run = tmp_path / "run"
    smoke = json.loads((run / "smoke.json").read_text())
    for key in ("tokens_per_second", "peak_memory_gb", "seconds", "steps", "estimated_seconds", "estimated_cost"):
        assert key in smoke, key
    assert smoke["tokens_per_second"] > 0 and smoke["peak_memory_gb"] > 0.1 and smoke["steps"] >= 3
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert all(r["loss"] > 0 for r in rows)
    assert (run / "final" / "adapter" / "adapter_model.safetensors").is_file()
    assert (run / "final" / "adapter" / "tokenizer.json").is_file()
    s = status(run, tmp_path)
    assert s["state"] == "succeeded" and s["step"] == 12 and s["total_steps"] == 12
    assert s["last_checkpoint"] == "step-000012"
    manifest = json.loads((run / "checkpoints" / "step-000012" / "manifest.json").read_text())
    assert manifest["step"] == 12 and "adapter_model.safetensors" in manifest["files"]
    # the same command again on a finished run says so and changes nothing; nor does bad input
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    again = ftrun(recipe, cwd=tmp_path)
    assert again.returncode == 0 and "finished" in again.stdout
    bad = ftrun(recipe, "lerning_rate=1", cwd=tmp_path)
    assert bad.returncode == 2 and "did you mean 'learning_rate'" in bad.stderr
    changed = ftrun(recipe, "learning_rate=1e-2", "--fresh", "max_steps=0", cwd=tmp_path)
    assert changed.returncode == 2 and "'max_steps' = 0" in changed.stderr
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before


def _reference(write_recipe, tmp_path, **fields):
    ref = write_recipe("ref.yaml", output_dir=str(tmp_path / "ref"), **fields)
    res = ftrun(ref, "--foreground", "smoke.enabled=false", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    return tmp_path / "ref"


def _assert_same_run(a: Path, b: Path) -> None:
    import torch

    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in ma] == [r["step"] for r in mb]
    assert [r["loss"] for r in ma] == [r["loss"] for r in mb]  # exactly equal on CPU
    ta, tb = adapter_tensors(a), adapter_tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


def test_detached_kill9_after_checkpoint_then_same_command_resumes_exactly(write_recipe, tmp_path):
    fields = dict(max_steps=30, checkpoint_every_minutes=0.02)
    ref = _reference(write_recipe, tmp_path, **fields)

    recipe = write_recipe(max_restarts=0, **fields)
    t0 = time.monotonic()
    res = ftrun(recipe, "smoke.enabled=false", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ftrun status" in res.stdout and "ftrun logs -f" in res.stdout
    run = tmp_path / "run"
    s = status(run, tmp_path)
    assert s["state"] in ("running", "succeeded") and s["pid"]
    assert time.monotonic() - t0 < 60

    # running the same command while it runs shows its status and starts nothing
    again = ftrun(recipe, cwd=tmp_path)
    assert again.returncode == 0 and "already active" in again.stdout

    # machine loss: the supervisor and the worker die without a word, after a checkpoint
    def checkpoint_and_steps():
        st = json.loads((run / "state.json").read_text())
        ck = sorted((run / "checkpoints").glob("step-*/manifest.json"))
        return st if ck and st.get("worker_pid") else None

    st = wait_for(checkpoint_and_steps, 120, "a first checkpoint")
    os.kill(st["supervisor_pid"], signal.SIGKILL)
    os.kill(st["worker_pid"], signal.SIGKILL)
    wait_for(lambda: status(run, tmp_path)["state"] == "interrupted", 20, "state interrupted")

    res = ftrun(recipe, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "continuing" in res.stdout and "smoke test" not in res.stdout
    wait_for(lambda: status(run, tmp_path)["state"] in ("succeeded", "failed"), 180, "the resumed run to end", 0.5)
    s = status(run, tmp_path)
    assert s["state"] == "succeeded", (run / "train.log").read_text()[-3000:]
    assert "resuming from step-" in (run / "train.log").read_text()
    _assert_same_run(ref, run)


def test_worker_crash_is_restarted_by_the_supervisor(write_recipe, tmp_path):
    fields = dict(max_steps=30, checkpoint_every_minutes=0.02)
    ref = _reference(write_recipe, tmp_path, **fields)
    recipe = write_recipe(**fields)
    assert ftrun(recipe, "smoke.enabled=false", cwd=tmp_path).returncode == 0
    run = tmp_path / "run"
    st = wait_for(lambda: (lambda s: s if list((run / "checkpoints").glob("step-*/manifest.json")) and s.get("worker_pid")
                           else None)(json.loads((run / "state.json").read_text())), 120, "a checkpoint")
    os.kill(st["worker_pid"], signal.SIGKILL)
    wait_for(lambda: status(run, tmp_path)["state"] in ("succeeded", "failed"), 180, "the run to end", 0.5)
    s = status(run, tmp_path)
    assert s["state"] == "succeeded" and s["restarts"] == 1, (run / "train.log").read_text()[-3000:]
    _assert_same_run(ref, run)


def test_stop_saves_a_checkpoint_and_resume_continues(write_recipe, tmp_path):
    recipe = write_recipe(max_steps=200, checkpoint_every_minutes=10)
    assert ftrun(recipe, "smoke.enabled=false", cwd=tmp_path).returncode == 0
    run = tmp_path / "run"
    wait_for(lambda: (run / "metrics.jsonl").is_file() and len(metrics(run)) >= 3, 120, "three steps")
    res = ftrun("stop", run, cwd=tmp_path)
    assert res.returncode == 0 and "stopped" in res.stdout
    s = status(run, tmp_path)
    assert s["state"] == "stopped" and s["last_checkpoint"]  # saved on SIGTERM, not by the 10-minute cadence
    stopped_at = int(s["last_checkpoint"].split("-")[1])
    assert stopped_at >= 3


@pytest.mark.parametrize(
    "fields, overrides, needle",
    [
        ({"lerning_rate": 1e-3}, [], "unknown key 'lerning_rate' (did you mean 'learning_rate'?)"),
        ({"micro_batch_size": "two"}, [], "'micro_batch_size' = 'two'"),
        ({"method": "dora"}, [], "'method' = 'dora'"),
        ({"data": "/nonexistent/train.jsonl"}, [], "data file '/nonexistent/train.jsonl' (recipe key 'data') does not exist"),
        ({}, ["max_steps=-1"], "'max_steps' = -1"),
        ({"trainer": {"warmup_ratioo": 0.1}}, [], "trainer.warmup_ratioo is not a field of TRL's SFTConfig"),
    ],
)
def test_bad_input_is_one_paragraph_and_touches_nothing(write_recipe, tmp_path, fields, overrides, needle):
    recipe = write_recipe(**fields)
    res = ftrun(recipe, *overrides, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert needle in res.stderr
    assert "Traceback" not in res.stderr and "Fix:" in res.stderr
    assert not (tmp_path / "run").exists()  # checked before anything is written


def test_bad_data_line_is_named(write_recipe, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{"messages": 5}\n')
    res = ftrun(write_recipe(data=str(data)), cwd=tmp_path)
    assert res.returncode == 2 and "line 2: 'messages' must be a non-empty list" in res.stderr
    assert not (tmp_path / "run").exists()


def test_output_dir_that_is_not_a_run_is_never_written(write_recipe, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "precious.txt").write_text("mine")
    res = ftrun(write_recipe(), cwd=tmp_path)
    assert res.returncode == 2 and "not an ftrun run" in res.stderr
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["precious.txt"]
