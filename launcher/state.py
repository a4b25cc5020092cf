"""The run's state machine, written atomically to state.json, and the lock that makes one writer per run.

    planned -> smoking -> running -> succeeded
                  |          |  \\-> stopped      (`ftrun stop`: checkpoint saved and copied off the box)
                  |          |  \\-> preempted    (SIGTERM from the provider: the same, within grace_seconds)
                  |          |  \\-> recovering -> running   (worker crashed, restarted from its checkpoint)
                  v          v
           failed-smoke   failed               (crash limit reached, NaN, OOM, bad world size)

A run whose state says smoking/running/recovering but whose supervisor is gone reads as
`interrupted` (machine crash, kill -9): `ftrun RECIPE` resumes it.

Liveness never rests on a pid alone: after a reboot (a stopped and restarted rental keeps its volume)
or in a container the pid in state.json belongs to someone else. A run is live when its lock is held
(the flock dies with its last holder) and the process recorded as holding it is the same process: same
pid, same start time (clock ticks since boot, /proc/<pid>/stat field 22), same boot. Nothing is
signalled before that check.
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


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_identity(pid: Optional[int]) -> Optional[dict[str, Any]]:
    """What tells this process apart from a later one given the same pid: its start time and the boot, plus its
    process group and session; None when no such process runs (a zombie counts as gone: it holds no lock)."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return None
    except OSError:
        return _identity_psutil(pid)
    # field 2 (comm) may hold spaces and parentheses: the fields after it start at the last ')'
    fields = stat.rsplit(")", 1)[1].split()  # fields[0] is field 3 (state)
    if fields[0] in ("Z", "X", "x"):
        return None
    return {"pid": int(pid), "start": int(fields[19]), "boot": _boot_id(), "pgid": int(fields[2]),
            "sid": int(fields[3]), "ppid": int(fields[1])}


def _identity_psutil(pid: int) -> Optional[dict[str, Any]]:
    """Without /proc (macOS): psutil's creation time stands for the start time."""
    import psutil

    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return {"pid": int(pid), "start": round(p.create_time() * 100), "boot": "", "pgid": os.getpgid(pid),
                "sid": os.getsid(pid), "ppid": p.ppid()}
    except (psutil.Error, OSError):
        return None


def same_process(record: Optional[dict[str, Any]]) -> bool:
    """True when the recorded process (process_identity) still runs: same pid, start time and boot."""
    if not record or not record.get("pid") or record.get("start") is None:
        return False  # a bare pid proves nothing
    now = process_identity(record["pid"])
    return bool(now) and now["start"] == record["start"] and now["boot"] == record.get("boot", "")


def run_holder(run: RunDir, data: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
    """The live process that drives the run: its supervisor (or the launcher while it plans and smoke-tests),
    with "role"; None when no verified process holds the run's lock.

    The lock says someone holds the run; the recorded identity says who. A supervisor found by its command
    line (`launcher.supervisor --run-dir <this run>`) counts too: state.json may not name it yet.
    """
    if not is_locked(run):
        return None
    data = read_state(run) if data is None else data
    for role in ("supervisor", "launcher"):
        rec = data.get(f"{role}_proc")
        if same_process(rec):
            return {"role": role, **rec}
    for proc in run_processes(run, ("supervisor",)):
        return {"role": "supervisor", **proc}
    return None


def run_processes(run: RunDir, roles: tuple[str, ...] = ("train",)) -> list[dict[str, Any]]:
    """Processes on this box whose command line runs `launcher.<role> --run-dir <this run>` (a worker, a
    launcher of ranks, a supervisor), each with its identity and argv. Processes in another pid namespace
    (another container on the same volume) are not visible: the lock still covers them."""
    root = os.path.realpath(run.root)
    modules = {f"launcher.{r}" for r in roles}
    found = []
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return []
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
        except OSError:
            continue
        if not modules.intersection(argv) or "--run-dir" not in argv[:-1]:
            continue
        where = argv[argv.index("--run-dir") + 1]
        if not os.path.isabs(where):
            try:
                where = os.path.join(os.readlink(f"/proc/{pid}/cwd"), where)
            except OSError:
                continue
        if os.path.realpath(where) != root:
            continue
        ident = process_identity(pid)
        if ident:
            found.append({**ident, "argv": argv})
    return found


def effective_state(run: RunDir) -> str:
    data = read_state(run)
    state = data.get("state", "none")
    if state in ACTIVE and run_holder(run, data) is None:
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
            raise busy_error(self.run) from None
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def busy_error(run: RunDir) -> BusyError:
    """The run's lock is held: by its verified supervisor or launcher, or by a process ftrun cannot vouch for."""
    data = read_state(run)
    holder = run_holder(run, data)
    if holder:
        return BusyError(
            f"another ftrun ({holder['role']}, pid {holder['pid']}) is working on {run.root} "
            f"(state: {data.get('state', 'starting')})",
            fix=f"watch it with `ftrun status {run.root}` or `ftrun logs -f {run.root}`; "
            f"stop it with `ftrun stop {run.root}`.")
    workers = [p["pid"] for p in run_processes(run)]
    return BusyError(
        f"the lock of {run.root} is held, but not by a live ftrun supervisor"
        + (f": worker process(es) {', '.join(map(str, workers))} still train into it" if workers else
           ": by a process this box cannot see (another container or machine using the same directory?) "
           "or by an ftrun that is just starting"),
        fix=(f"`ftrun stop {run.root}` ends them (after a checkpoint); then run the same command to resume."
             if workers else "end the other ftrun first (in its container or on its machine), or wait a few "
             "seconds and retry; ftrun never trains twice into the same directory."))


def is_locked(run: RunDir) -> bool:
    """Someone holds the run's lock. Probed with a shared, non-blocking flock on a read-only descriptor: it
    fails only against the holders' exclusive lock, two probes never collide, and it is released at once."""
    try:
        fd = os.open(run.lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
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
    holder = run_holder(run, data)
    # workers still training into the run with no supervisor over them (it was killed hard)
    orphans = [] if holder else [p["pid"] for p in run_processes(run)]
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
    state = data.get("state", "none")
    if state in ACTIVE and holder is None:
        state = "interrupted"  # effective_state, from the same reading
    if total and step and state == "running":
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
        "state": state,
        "step": step,
        "total_steps": total,
        "loss": last.get("loss"),
        "tokens_per_second": tps,
        "eta_seconds": eta,
        "pid": data.get("supervisor_pid"),
        # alive: the run's lock is held and this pid is the process recorded with it (start time, boot)
        "pid_alive": bool(holder) and holder["role"] == "supervisor",
        "launcher_pid": holder["pid"] if holder and holder["role"] == "launcher" else None,
        "worker_pid": data.get("worker_pid"),
        # the worker holds the run's lock too (inherited): the same test as the supervisor's
        "worker_alive": same_process(data.get("worker_proc")) and is_locked(run),
        "orphan_worker_pids": orphans,
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
