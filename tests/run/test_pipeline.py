"""End to end on CPU with the tiny model: foreground, detached + status, kill -9 and resume, bad input."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from conftest import RESUME_FIELDS
from helpers import (
    assert_same_run,
    freeze_worker,
    ftrun,
    has_checkpoint,
    logged_steps,
    metrics,
    polled_status,
    status,
    wait_for,
    wait_until_ended,
)


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
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))  # what people already watch
    s = status(run, tmp_path)
    assert s["state"] == "succeeded" and s["step"] == 12 and s["total_steps"] == 12
    assert s["last_checkpoint"] == "step-000012"
    _the_outputs_agree(res.stdout, ftrun("status", run, cwd=tmp_path).stdout, smoke)
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


def test_detached_kill9_after_checkpoint_then_same_command_resumes_exactly(write_recipe, tmp_path, reference_run):
    fields, ref = RESUME_FIELDS, reference_run

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
    st = freeze_worker(run, has_checkpoint)
    os.kill(st["supervisor_pid"], signal.SIGKILL)
    os.kill(st["worker_pid"], signal.SIGKILL)
    wait_for(lambda: polled_status(run)["state"] == "interrupted", 20, "state interrupted")

    res = ftrun(recipe, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "continuing" in res.stdout and "smoke test" not in res.stdout
    wait_until_ended(run, tmp_path)
    assert "resuming from step-" in (run / "train.log").read_text()
    assert_same_run(ref, run)


@pytest.mark.slow  # a long end-to-end run: the default tier stays under 6 minutes
def test_worker_crash_is_restarted_by_the_supervisor(write_recipe, tmp_path, reference_run):
    fields, ref = RESUME_FIELDS, reference_run
    recipe = write_recipe(**fields)
    assert ftrun(recipe, "smoke.enabled=false", cwd=tmp_path).returncode == 0
    run = tmp_path / "run"
    st = freeze_worker(run, has_checkpoint)
    os.kill(st["worker_pid"], signal.SIGKILL)
    s = wait_until_ended(run, tmp_path)
    assert s["restarts"] == 1
    assert_same_run(ref, run)


@pytest.mark.slow  # a long end-to-end run: the default tier stays under 6 minutes
def test_stop_saves_a_checkpoint_and_resume_continues(write_recipe, tmp_path):
    recipe = write_recipe(max_steps=200, checkpoint_every_minutes=10)
    assert ftrun(recipe, "smoke.enabled=false", cwd=tmp_path).returncode == 0
    run = tmp_path / "run"
    first_estimate = json.loads((run / "plan.json").read_text())["estimate"]
    st = freeze_worker(run, logged_steps(3))
    os.kill(st["worker_pid"], signal.SIGCONT)
    res = ftrun("stop", run, cwd=tmp_path)
    assert res.returncode == 0 and "stopped" in res.stdout
    s = status(run, tmp_path)
    assert s["state"] == "stopped" and s["last_checkpoint"]  # saved on SIGTERM, not by the 10-minute cadence
    stopped_at = int(s["last_checkpoint"].split("-")[1])
    assert stopped_at >= 3
    # stop reports the step of the checkpoint it wrote, in its own output and in the state's reason
    assert f"at step {stopped_at} after a checkpoint (step-{stopped_at:06d})" in s["reason"]
    assert f"== run stopped at step {stopped_at}/" in res.stdout
    # a changed training setting is refused with the difference named, or accepted on request
    changed = ftrun(recipe, "learning_rate=1e-2", "max_steps=" + str(stopped_at + 3), cwd=tmp_path)
    assert changed.returncode == 2
    assert (
        "- learning_rate: run has 0.005, recipe now says 0.01" in changed.stderr and "--allow-changes" in changed.stderr
    )
    res = ftrun(recipe, "learning_rate=1e-2", f"max_steps={stopped_at + 3}", "--allow-changes", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "continuing from the existing checkpoints with a changed recipe" in res.stdout
    wait_until_ended(run, tmp_path)
    assert f"resuming from step-{stopped_at:06d}" in (run / "train.log").read_text()
    assert metrics(run)[-1]["step"] == stopped_at + 3
    # the forecast shown first stays the plan's; the resume's new plan (fewer steps here) is labelled as such
    plan = json.loads((run / "plan.json").read_text())
    assert plan["estimate_as_planned"] == first_estimate and plan["estimate_at_resume"] == plan["estimate"]
    text = ftrun("status", run, cwd=tmp_path).stdout
    assert "plan forecast " in text and "resume re-plan forecast " in text, text


@pytest.mark.parametrize(
    "fields, overrides, needle",
    [
        ({"lerning_rate": 1e-3}, [], "unknown key 'lerning_rate' (did you mean 'learning_rate'?)"),
        ({"micro_batch_size": "two"}, [], "'micro_batch_size' = 'two'"),
        ({"method": "dora"}, [], "'method' = 'dora'"),
        (
            {"data": "/nonexistent/train.jsonl"},
            [],
            "data '/nonexistent/train.jsonl' (recipe key 'data') does not exist",
        ),
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
    data.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{"messages": 5}\n'
    )
    res = ftrun(write_recipe(data=str(data)), cwd=tmp_path)
    assert res.returncode == 2 and "line 2: 'messages' must be a non-empty list" in res.stderr
    assert not (tmp_path / "run").exists()


def test_output_dir_that_is_not_a_run_is_never_written(write_recipe, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "precious.txt").write_text("mine")
    res = ftrun(write_recipe(), cwd=tmp_path)
    assert res.returncode == 2 and "not an ftrun run" in res.stderr
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["precious.txt"]


@pytest.mark.parametrize(
    "method, built, optimizer",
    [
        ("qlora", "Linear4bit", "torch.optim.adamw.AdamW"),  # fused, as TRL's default
        pytest.param("full", "Linear", "torch.optim.adamw.AdamW", marks=pytest.mark.slow),
        # bitsandbytes, with 8-bit states
        pytest.param("full-8bit", "Linear", "bitsandbytes.optim.adamw.AdamW", marks=pytest.mark.slow),
    ],
)
def test_each_method_trains_what_it_says(write_recipe, tmp_path, method, built, optimizer):
    recipe = write_recipe(method=method, max_steps=3, learning_rate=1e-3)
    res = ftrun(recipe, "--foreground", "smoke.enabled=false", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    log = (tmp_path / "run" / "train.log").read_text() if (tmp_path / "run" / "train.log").is_file() else res.stdout
    assert f"optimizer: {optimizer}" in log
    line = next(l for l in log.splitlines() if "linear layers:" in l)
    assert built in line and (
        method != "qlora" or "Linear " not in line.split("linear layers:")[1].replace("Linear4bit", "")
    )
    final = tmp_path / "run" / "final" / ("adapter" if method == "qlora" else "model")
    assert final.is_dir() and any(final.glob("*.safetensors"))
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3]


def _minutes(text: str) -> float:
    number, unit = text.split()[:2]
    return float(number) * {"s": 1 / 60, "min": 1.0, "h": 60.0}[unit]


def _the_outputs_agree(launch: str, status_text: str, smoke: dict) -> None:
    """One number, one value: the launch's printed plan and smoke test against `ftrun status` and smoke.json."""
    import re

    speed = re.search(r"^Speed:\s+([\d,]+) tokens/s", launch, re.M).group(1)
    assert re.search(rf"training tokens / {speed} tokens/s", launch), "the time line's rate is the Speed: line's"
    planned = re.search(r"^Time:\s+(\d+(?:\.\d+)? (?:s|min|h)) training", launch, re.M).group(1)
    forecast = re.search(r"plan forecast (\d+(?:\.\d+)? (?:s|min|h))", status_text).group(1)
    assert abs(_minutes(planned) - _minutes(forecast)) <= 0.5, (planned, forecast)  # the printed plan, rounded
    smoke_said = re.search(r"full run: [\d,]+ tokens -> about (\d+(?:\.\d+)? (?:s|min|h))", launch).group(1)
    assert f"smoke test forecast {smoke_said}" in status_text
    assert f"{smoke['tokens_per_second']:,.0f} tokens/s" in launch  # the smoke line says smoke.json's figure
