"""Logged values after a resume from a checkpoint inside a logging window equal an uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from helpers import (
    adapter_tensors,
    freeze_worker,
    ftrun,
    metrics,
    polled_status,
    read_state,
    wait_for,
    wait_until_ended,
)

LOG_EVERY = 5
# A checkpoint after every step (the cadence is wall-clock): a 0.6 s cadence on a busy box saved only at logged steps
# (the logging step is the slow one), so no checkpoint fell inside a window; with one per step, 4 of 5 do.
FIELDS = dict(max_steps=30, logging_steps=LOG_EVERY, checkpoint_every_minutes=0.0001, learning_rate=5e-3)
QUICK = ("smoke.enabled=false", "export=[]")
# Wall-clock values differ between any two runs; every other logged value is a function of the trajectory.
WALL_CLOCK = (
    "time",
    "tokens_per_second",
    "peak_memory_gb",
    "train_runtime",
    "train_tokens_per_second",
    "train_samples_per_second",
    "train_steps_per_second",
)


def _complete_steps(run: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*/manifest.json"))


def _inside_a_window(run: Path) -> bool:
    """The newest complete checkpoint falls between two logged steps, after the first log (the rows before it are
    kept, the window's sums and the step of its last log both matter)."""
    steps = _complete_steps(run)
    return bool(steps) and steps[-1] > LOG_EVERY and steps[-1] % LOG_EVERY != 0


def _trajectory(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in rows]


def _log_history(run: Path, step: int) -> list[dict]:
    """Everything the Trainer logged up to `step` (TensorBoard gets the same values), TRL's entropy,
    mean_token_accuracy and num_tokens included: metrics.jsonl holds only some of them."""
    state = json.loads((run / "checkpoints" / f"step-{step:06d}" / "trainer_state.json").read_text())
    return _trajectory(state["log_history"])


def _reference(write_recipe, tmp_path: Path, name: str, *overrides: str) -> Path:
    recipe = write_recipe(f"{name}.yaml", output_dir=str(tmp_path / name), **FIELDS)
    res = ftrun(recipe, "--foreground", *QUICK, *overrides, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    return tmp_path / name


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model) -> Path:
    """The uninterrupted single-process run both single-process tests compare with (built once)."""
    from conftest import uninterrupted_run

    return uninterrupted_run(tmp_path_factory, tiny_model, "metrics-reference", FIELDS, *QUICK)


def _interrupted(write_recipe, tmp_path: Path, *overrides: str, kill_group: bool = False) -> tuple[Path, int, Path]:
    """A detached run, killed with SIGKILL (machine loss) while its newest checkpoint lies inside a logging
    window. Returns the run, the step it will resume from, and its recipe."""
    recipe = write_recipe(max_restarts=0, **FIELDS)
    assert ftrun(recipe, *QUICK, *overrides, cwd=tmp_path).returncode == 0
    run = tmp_path / "run"
    if kill_group:  # torchrun and every rank

        def frozen(r: Path) -> bool:
            st = read_state(r) if (r / "state.json").is_file() else {}
            if not st.get("supervisor_pid"):
                return False
            pgid = os.getpgid(st["supervisor_pid"])
            os.killpg(pgid, signal.SIGSTOP)
            if _inside_a_window(r):
                return True
            os.killpg(pgid, signal.SIGCONT)
            return False

        wait_for(lambda: frozen(run), 240, "a checkpoint inside a logging window", 0.05)
        os.killpg(os.getpgid(read_state(run)["supervisor_pid"]), signal.SIGKILL)
    else:
        st = freeze_worker(run, _inside_a_window, timeout=240)
        os.kill(st["supervisor_pid"], signal.SIGKILL)
        os.kill(st["worker_pid"], signal.SIGKILL)
    assert not (run / "final").exists(), "the run finished before it could be interrupted"
    resume_at = _complete_steps(run)[-1]
    wait_for(lambda: polled_status(run)["state"] == "interrupted", 30, "state interrupted")
    return run, resume_at, recipe


def _resume(run: Path, recipe: Path, tmp_path: Path, resume_at: int, *overrides: str) -> str:
    res = ftrun(recipe, *QUICK, *overrides, cwd=tmp_path)
    assert res.returncode == 0 and "continuing" in res.stdout, res.stdout + res.stderr
    wait_until_ended(run, tmp_path)
    log = (run / "train.log").read_text()
    assert f"resuming from step-{resume_at:06d}" in log
    return log


def _assert_same_logs(ref: Path, run: Path) -> None:
    a, b = _trajectory(metrics(ref)), _trajectory(metrics(run))
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(LOG_EVERY, 31, LOG_EVERY))
    assert a == b  # loss, grad_norm, learning_rate, epoch, tokens_seen: exact on CPU
    ha, hb = _log_history(ref, 30), _log_history(run, 30)
    assert {"loss", "grad_norm", "learning_rate", "entropy", "mean_token_accuracy", "num_tokens"} <= set(ha[-1])
    assert ha == hb


def _assert_same_adapter(ref: Path, run: Path) -> None:
    import torch

    ta, tb = adapter_tensors(ref), adapter_tensors(run)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.slow
def test_kill9_inside_a_logging_window_then_every_logged_value_matches(write_recipe, tmp_path, reference):
    ref = reference
    run, resume_at, recipe = _interrupted(write_recipe, tmp_path)
    folder = run / "checkpoints" / f"step-{resume_at:06d}"
    hashed = json.loads((folder / "manifest.json").read_text())["files"]
    _resume(run, recipe, tmp_path, resume_at)
    _assert_same_logs(ref, run)
    _assert_same_adapter(ref, run)
    assert "ftrun_window.json" in hashed  # in the checkpoint, hashed with the rest


@pytest.mark.slow
def test_ddp_kill9_inside_a_logging_window_then_every_logged_value_matches(write_recipe, tmp_path):
    """Each rank's own share of the window's loss is carried: the gathered mean at the next log is the same."""
    ddp = ("engine=ddp", "num_processes=2")
    ref = _reference(write_recipe, tmp_path, "ref", *ddp)
    run, resume_at, recipe = _interrupted(write_recipe, tmp_path, *ddp, kill_group=True)
    window = run / "checkpoints" / f"step-{resume_at:06d}" / "ftrun_window.json"
    saved = json.loads(window.read_text()) if window.is_file() else {}
    _resume(run, recipe, tmp_path, resume_at, *ddp)
    _assert_same_logs(ref, run)
    _assert_same_adapter(ref, run)
    assert len(saved["loss_sums"]) == 2


@pytest.mark.slow
def test_checkpoint_without_window_state_still_resumes_with_a_note(write_recipe, tmp_path, reference):
    """A checkpoint written before the window's sums were saved: the same weights, the old metrics, a note."""
    from launcher.store import checkpoint as ckpt

    ref = reference
    run, resume_at, recipe = _interrupted(write_recipe, tmp_path)
    folder = run / "checkpoints" / f"step-{resume_at:06d}"
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "ftrun_window.json").unlink()
    (folder / "manifest.json").unlink()
    meta = {k: v for k, v in manifest.items() if k not in ("step", "files", "ftrun_version")}
    ckpt.write_manifest(folder, resume_at, meta)  # as an older ftrun wrote it
    log = _resume(run, recipe, tmp_path, resume_at)
    assert "carries no logging-window state" in log
    _assert_same_adapter(ref, run)
    a, b = metrics(ref), metrics(run)
    assert [r["loss"] for r in a if r["step"] < resume_at] == [r["loss"] for r in b if r["step"] < resume_at]


def _trainer_after_zeroing(step: int, world_size: int, rank: int):
    """The attributes restore() reads and sets, as transformers' _inner_training_loop leaves them before
    on_train_begin."""
    from collections import defaultdict
    from types import SimpleNamespace

    import torch

    return SimpleNamespace(
        _tr_loss=torch.tensor(0.0),
        _globalstep_last_logged=step,
        _total_loss_scalar=0.0,
        state=SimpleNamespace(global_step=step),
        args=SimpleNamespace(world_size=world_size, process_index=rank),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
    )


def test_restore_puts_each_ranks_sum_back_or_says_why_not(tmp_path):
    from launcher.worker import window

    saved = {
        "step": 7,
        "last_logged_step": 5,
        "loss_sums": [12.5, 11.25],
        "loss_dtype": "float32",
        "trl_metrics": {"entropy": [1.5, 1.25], "num_tokens": [900]},
        "trl_total_train_tokens": 900,
    }
    (tmp_path / window.WINDOW_FILE).write_text(json.dumps(saved))

    t = _trainer_after_zeroing(7, world_size=2, rank=1)
    assert window.restore(t, tmp_path) is None
    assert t._tr_loss.item() == 11.25 and t._globalstep_last_logged == 5
    assert t._metrics["train"] == {"entropy": [1.5, 1.25], "num_tokens": [900]} and t._total_train_tokens == 900
    assert t._total_loss_scalar == -11.875  # the launch's train_loss counts only its own steps

    one = _trainer_after_zeroing(7, world_size=1, rank=0)  # a 2-process checkpoint resumed on one process
    assert "each carries their mean" in window.restore(one, tmp_path)
    assert one._tr_loss.item() == 11.875

    other = _trainer_after_zeroing(9, world_size=2, rank=0)  # a state for another step: nothing is put back
    assert "is for step 7" in window.restore(other, tmp_path) and other._tr_loss.item() == 0.0

    (tmp_path / window.WINDOW_FILE).unlink()
    old = _trainer_after_zeroing(7, world_size=2, rank=0)
    assert "carries no logging-window state" in window.restore(old, tmp_path)
    assert old._tr_loss.item() == 0.0 and old._globalstep_last_logged == 7
