"""The run's state machine, written atomically to state.json, and the lock that makes one writer per run.

    planned -> smoking -> running -> succeeded
                  |          |  \\-> stopped      (`ftrun stop`: checkpoint saved and copied off the box)
                  |          |  \\-> preempted    (SIGTERM from the provider: the same, within grace_seconds)
                  |          |  \\-> recovering -> running   (worker crashed, restarted from its checkpoint)
                  v          v
           failed-smoke   failed               (crash limit reached, NaN, OOM, bad world size)

A run whose state says smoking/running/recovering but whose supervisor is gone reads as
`interrupted` (machine crash, kill -9): `ftrun RECIPE` resumes it.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

from .checkpoint import atomic_write_json
from .errors import BusyError
from .rundir import RunDir

STATES = ("planned", "smoking", "running", "recovering", "succeeded", "stopped", "preempted", "failed", "failed-smoke")
ACTIVE = ("smoking", "running", "recovering")


def format_duration(seconds: Optional[float]) -> str:
    """12 s, 4.5 min, 2.1 h; '-' when unknown (status lines, the smoke test's forecast)."""
    if seconds is None:
        return "-"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def read_state(run: RunDir) -> dict[str, Any]:
    if not run.state.is_file():
        return {}
    return json.loads(run.state.read_text())


def set_state(run: RunDir, state: str, **fields: Any) -> dict[str, Any]:
    assert state in STATES, state
    data = read_state(run)
    now = time.time()
    history = data.get("history", [])
    if data.get("state") != state:
        history.append({"state": state, "at": now, **({"reason": fields["reason"]} if "reason" in fields else {})})
    data.update(fields)
    data.update(state=state, updated_at=now, history=history[-50:])
    atomic_write_json(run.state, data)
    return data


def pid_alive(pid: Optional[int]) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes (an exited child not yet reaped).
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return True


def effective_state(run: RunDir) -> str:
    data = read_state(run)
    state = data.get("state", "none")
    if state in ACTIVE and not pid_alive(data.get("supervisor_pid")):
        return "interrupted"
    return state


class RunLock:
    """An exclusive flock on the run directory. Inherited by the detached supervisor (same open file)."""

    def __init__(self, run: RunDir):
        self.run = run
        self.fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        self.run.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.run.lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            data = read_state(self.run)
            pid = data.get("supervisor_pid") or data.get("launcher_pid")
            raise BusyError(
                f"another ftrun (pid {pid or 'unknown'}) is working on {self.run.root} (state: {data.get('state', 'starting')})",
                fix=f"watch it with `ftrun status {self.run.root}` or `ftrun logs -f {self.run.root}`; "
                f"stop it with `ftrun stop {self.run.root}`.",
            ) from None
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def is_locked(run: RunDir) -> bool:
    if not run.lock.exists():
        return False
    fd = os.open(run.lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def status_summary(run: RunDir) -> dict[str, Any]:
    """What `ftrun status --json` prints, derived from the run's files (no torch)."""
    from .checkpoint import newest_step_unverified
    from .sync import status_fields as sync_status_fields

    data = read_state(run)
    worker = json.loads(run.worker.read_text()) if run.worker.is_file() else {}
    plan = json.loads(run.plan.read_text()) if run.plan.is_file() else {}
    smoke = json.loads(run.smoke.read_text()) if run.smoke.is_file() else {}
    last = _last_metrics(run.metrics)
    ckpt_step = newest_step_unverified(run.checkpoints)
    # a checkpoint is progress too (a run shorter than logging_steps logs no step)
    step = max(last.get("step", worker.get("start_step", 0)), ckpt_step or 0)
    total = worker.get("total_steps") or plan.get("total_steps")
    ckpt_age = None
    if ckpt_step is not None:
        from .checkpoint import step_dir_name

        ckpt_age = round(time.time() - (run.checkpoints / step_dir_name(ckpt_step) / "manifest.json").stat().st_mtime, 1)
    eta = None
    tps = last.get("tokens_per_second")
    if total and step and effective_state(run) == "running":
        started = worker.get("started")
        done_since = step - worker.get("start_step", 0)
        if started and done_since > 0:
            eta = round((time.time() - started) / done_since * (total - step), 1)
    final = None
    for name in ("adapter", "model"):
        if (run.final / name).is_dir():
            final = str(run.final / name)
    return {
        "run_dir": str(run.root),
        "state": effective_state(run),
        "step": step,
        "total_steps": total,
        "loss": last.get("loss"),
        "tokens_per_second": tps,
        "eta_seconds": eta,
        "pid": data.get("supervisor_pid"),
        "pid_alive": pid_alive(data.get("supervisor_pid")),
        "worker_pid": data.get("worker_pid"),
        "worker_alive": pid_alive(data.get("worker_pid")),
        "restarts": data.get("restarts", 0),
        "last_checkpoint": f"step-{ckpt_step:06d}" if ckpt_step is not None else None,
        "last_checkpoint_age_seconds": ckpt_age,
        "smoke_estimated_seconds": smoke.get("estimated_seconds"),
        "reason": data.get("reason"),
        "final": final,
        "log": str(run.log),
        # the engine as planned, how it was launched, and what the worker verified (launcher/backends)
        "engine": plan.get("engine"),
        "num_processes": plan.get("num_processes"),
        "launch_argv": data.get("launch_argv"),
        "world_size": (worker.get("verification") or {}).get("world_size", worker.get("world_size")),
        "verification": worker.get("verification") or data.get("verification"),
        **sync_status_fields(run),
    }


def _last_metrics(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - 4096))
        lines = fh.read().decode(errors="replace").splitlines()
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return {}
