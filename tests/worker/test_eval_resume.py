"""Eval values and samples across a resume and under DDP: after a kill -9 and a resume every eval loss equals an
uninterrupted run's, the base model's answers are not generated again, and the answers after training are the
same; 2 DDP processes evaluate the same held-out examples (the base model's eval loss as one process measures it)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from helpers import freeze_worker, ftrun, metrics, polled_status, wait_for, wait_until_ended

pytestmark = pytest.mark.slow

FIELDS = dict(
    max_steps=12,
    logging_steps=2,
    checkpoint_every_minutes=0.01,
    learning_rate=5e-3,
    # an eval pass after every step: the steps of the passes do not depend on the machine's speed
    eval={"fraction": 0.05, "every_minutes": 0.0001, "samples": 2, "max_new_tokens": 6},
)
QUICK = ("smoke.enabled=false",)  # the base model's answers then come from the full run's first start
WALL_CLOCK = ("time", "tokens_per_second", "peak_memory_gb", "eval_seconds")


def _values(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in rows]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model) -> Path:
    from conftest import uninterrupted_run

    return uninterrupted_run(tmp_path_factory, tiny_model, "eval-ref", FIELDS, *QUICK)


def _samples(run: Path) -> list[dict]:
    return json.loads((run / "final" / "samples.json").read_text())["samples"]


def test_kill9_and_resume_then_every_eval_value_and_the_samples_match(reference, write_recipe, tmp_path):
    evals = [r for r in metrics(reference) if "eval_loss" in r]
    assert [r["step"] for r in evals] == list(range(0, 13))  # the start, then every step

    recipe = write_recipe(max_restarts=0, **FIELDS)
    assert ftrun(recipe, *QUICK, cwd=tmp_path).returncode == 0
    run = tmp_path / "run"

    def resumable(r: Path) -> bool:
        done = sorted(int(p.parent.name.split("-")[1]) for p in (r / "checkpoints").glob("step-*/manifest.json"))
        return bool(done) and 3 <= done[-1] < 12

    st = freeze_worker(run, resumable, timeout=240)
    before = (run / "samples-before.json").read_text()  # written before step 1
    os.kill(st["supervisor_pid"], signal.SIGKILL)
    os.kill(st["worker_pid"], signal.SIGKILL)
    wait_for(lambda: polled_status(run)["state"] == "interrupted", 30, "state interrupted")
    assert not (run / "final").exists()

    res = ftrun(recipe, *QUICK, cwd=tmp_path)
    assert res.returncode == 0 and "continuing" in res.stdout, res.stdout + res.stderr
    wait_until_ended(run, tmp_path)
    log = (run / "train.log").read_text()
    assert "resuming from step-" in log
    assert log.count("the base model answered") == 1  # the first start only
    assert (run / "samples-before.json").read_text() == before

    assert _values(metrics(run)) == _values(metrics(reference))  # eval rows and training rows, exact on CPU
    got, want = _samples(run), _samples(reference)
    assert [(r["index"], r["before"], r["after"]) for r in got] == [(r["index"], r["before"], r["after"]) for r in want]


def test_ddp_evaluates_every_held_out_example_once(reference, write_recipe, tmp_path):
    # one example per eval batch: the Trainer's eval loss is the mean over examples of each batch's mean
    # (transformers trainer.py evaluation_loop, losses.repeat(batch_size)), so only with batches of one does it
    # not depend on how the examples are split into batches, over one process or two
    fields = {
        **FIELDS,
        "max_steps": 4,
        "eval": {**FIELDS["eval"], "every_minutes": 30},
        "trainer": {"per_device_eval_batch_size": 1},
    }
    one = write_recipe("one.yaml", **{**fields, "output_dir": str(tmp_path / "one")})
    assert ftrun(one, "--foreground", *QUICK, cwd=tmp_path).returncode == 0
    recipe = write_recipe(**fields)
    res = ftrun(recipe, "--foreground", *QUICK, "engine=ddp", "num_processes=2", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    run = tmp_path / "run"
    evals = [r for r in metrics(run) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 4]
    # the base model on the same 20 examples, split over 2 processes and gathered without the padding repeats
    first = next(r for r in metrics(tmp_path / "one") if "eval_loss" in r)
    assert evals[0]["eval_loss"] == pytest.approx(first["eval_loss"], rel=1e-5)
    assert [(r["index"], r["before"]) for r in _samples(run)] == [
        (r["index"], r["before"]) for r in _samples(reference)
    ]
