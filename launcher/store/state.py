"""The run's state machine, written atomically to state.json, and the lock that makes one writer per run.

STATES is the one table of a run's states and what each allows next; MOVES names every write the product makes and
who makes it. `move` makes a MOVES row through `set_state`, the one writer (tests/test_layout.py), which refuses a
transition STATES does not hold; docs/architecture.md shows both tables (tests/store/test_state_table.py).

An active run whose supervisor is gone reads as `interrupted`: `ftrun RECIPE` resumes it. Liveness never rests on a
pid alone: the lock is held and the recorded holder is the same process (pid, start time, boot).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

from launcher.store import heartbeat_files
from launcher.store.checkpoint import atomic_write_json
from launcher.errors import BusyError, FtrunError
from launcher.store.rundir import RunDir


@dataclass(frozen=True)
class State:
    next: tuple[str, ...]  # the states it allows next (and itself: a write of new facts that keeps the state)
    active: bool = False  # a process of the run is working (a run whose holder is gone reads as interrupted)
    ended: bool = False  # nothing more happens until the user acts
    trained: bool = False  # the training finished with a verified result


# The launch writes `planned` first, for a new run and a resume (an interrupted run, or an ended one that did not
# train to the end); a state.json written by hand may start in any state. The table governs every change after.
_RESUMED = "planned"

# The run states: the one table; ACTIVE, ENDED and TRAINED derive from it; what a user reads about each is composed
# in launcher/run/views.py and summary_view.py (tests/test_tables.py walks every state through them).
STATES: dict[str, State] = {
    "planned": State(("smoking", "running")),
    "smoking": State(("running", "failed-smoke", _RESUMED), active=True),  # planned: `ftrun smoke` once it passed
    "running": State(("recovering", "succeeded", "failed", "stopped", "preempted", _RESUMED), active=True),
    "recovering": State(("running", "failed", "stopped", _RESUMED), active=True),
    # a resume: an export killed with its supervisor is made again
    "succeeded": State(("trained-not-exported", _RESUMED), ended=True, trained=True),
    "stopped": State((_RESUMED,), ended=True),
    "preempted": State((_RESUMED,), ended=True),
    "failed": State((_RESUMED,), ended=True),
    "failed-smoke": State((_RESUMED,), ended=True),
    # `ftrun export` (or the same command, after a stopped export) made it
    "trained-not-exported": State(("succeeded",), ended=True, trained=True),
}
ACTIVE = tuple(k for k, s in STATES.items() if s.active)
ENDED = tuple(k for k, s in STATES.items() if s.ended)
TRAINED = tuple(k for k, s in STATES.items() if s.trained)


@dataclass(frozen=True)
class Move:
    to: tuple[str, ...]  # the states it may write; none: it keeps the state and records new facts
    by: str  # the command or process that makes it, and its module


# Every write of state.json the product makes, by name: `move(run, NAME, ...)`.
MOVES: dict[str, Move] = {
    "plan": Move(
        ("planned",),
        "`ftrun RECIPE` (a new run or a resume), `ftrun smoke` and `ftrun baseline` once the plan is written, and the "
        "last two as they end (run/pipeline.py, run/baseline_command.py)",
    ),
    "smoke": Move(("smoking",), "the launch, as its smoke test starts (run/smoke_replan.py)"),
    "run": Move(
        ("running",),
        "the launch, handing over to the supervisor (run/pipeline.py); the supervisor at each attempt "
        "(run/supervisor.py)",
    ),
    "recover": Move(
        ("recovering",), "the supervisor, after a crash or an out of memory that a restart from the checkpoint may fix"
    ),
    "trained": Move(("succeeded",), "the supervisor, once the final result passed its check (its export follows)"),
    "export": Move(
        ("succeeded", "trained-not-exported"),
        "the supervisor's export and `ftrun export` (both run/after_training.py): its record as it starts, then its "
        "outcome (an export that failed its check or that `ftrun stop` ended leaves the run trained-not-exported)",
    ),
    "end": Move(
        ENDED,
        "every ending, through the one door (run/ending.py `leave`): the supervisor's (stopped after `ftrun stop`, "
        "also while recovering; preempted after a SIGTERM from outside; failed: a crash repeated or over "
        "max_restarts, out of memory, NaN, an unusable result; a trained run once its export ended), the launch's "
        "failed or interrupted smoke test (run/smoke_replan.py), `ftrun export`'s outcome",
    ),
    "note": Move(
        (),
        "facts that keep the state: `ftrun stop`'s request (run/control.py), the publish record (deliver/publish.py), "
        "a fetched run's cleared pids (run/sync_commands.py), an accepted recipe change (run/pipeline.py), the "
        "worker's verification (run/supervisor.py)",
    ),
}


def read_state(run: RunDir) -> dict[str, Any]:
    return json.loads(run.state.read_text()) if run.state.is_file() else {}


class TransitionError(FtrunError):
    """A write of state.json that the tables (STATES, MOVES) do not allow: a bug in ftrun, never the user's input."""

    def __init__(self, what: str):
        super().__init__(
            f"internal error: {what} (launcher/store/state.py); state.json is left as it was",
            fix="report this as a bug with the run's state.json (its history) and train.log.",
        )


def set_state(run: RunDir, state: str, **fields: Any) -> dict[str, Any]:
    """The only writer of a run's state: the transition checked against STATES, then state.json written whole. The
    product calls it through `move`; a test's fixture may call it to put a run in any state."""
    data = read_state(run)
    was = data.get("state")
    if was in STATES and state != was and state not in STATES[was].next:
        raise TransitionError(f"{run.root}'s state cannot go from {was} to {state}: STATES holds no such transition")
    now = time.time()
    history = data.get("history", [])
    if data.get("state") != state:
        history.append({"state": state, "at": now, **({"reason": fields["reason"]} if "reason" in fields else {})})
    data.update(fields)
    data.update(state=state, updated_at=now, history=history[-50:])
    atomic_write_json(run.state, data)
    return data


def move(run: RunDir, name: str, to: Optional[str] = None, **fields: Any) -> dict[str, Any]:
    """The row `name` of MOVES made: `to` one of the states it may write (needed where it may write more than one);
    a move that keeps the state writes its facts into the run's current state."""
    row = MOVES[name]
    allowed = row.to or (read_state(run).get("state", _RESUMED),)  # a note keeps the state it finds
    to = to or (allowed[0] if len(allowed) == 1 else None)
    if to not in allowed:
        raise TransitionError(
            f"the run-state move {name} cannot write {to}: its row in MOVES writes {', '.join(allowed)}"
        )
    return set_state(run, to, **fields)


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
    """What tells this process apart from a later one with the same pid (start time, boot), plus its process group
    and session; None when no such process runs (a zombie counts as gone)."""
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
    start = int(fields[19])  # clock ticks since boot (field 22)
    return dict(
        pid=int(pid), start=start, boot=_boot_id(), pgid=int(fields[2]), sid=int(fields[3]), ppid=int(fields[1])
    )


def _identity_psutil(pid: int) -> Optional[dict[str, Any]]:
    """Without /proc (macOS): psutil's creation time stands for the start time."""
    import psutil

    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        start = round(p.create_time() * 100)
        return dict(pid=int(pid), start=start, boot="", pgid=os.getpgid(pid), sid=os.getsid(pid), ppid=p.ppid())
    except (psutil.Error, OSError):
        return None


def same_process(record: Optional[dict[str, Any]]) -> bool:
    """True when the recorded process (process_identity) still runs: same pid, start time and boot."""
    if not record or not record.get("pid") or record.get("start") is None:
        return False  # a bare pid proves nothing
    now = process_identity(record["pid"])
    return bool(now) and now["start"] == record["start"] and now["boot"] == record.get("boot", "")


def run_holder(run: RunDir, data: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
    """The live process that drives the run (supervisor, or launcher while it plans), with "role"; None when no
    verified process holds the lock. A supervisor found by its command line counts too (state.json may lag)."""
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


# The module each role runs as (`python -m MODULE --run-dir RUN`), and its name before 2026-12-02 (an upgrade's)
ROLE_MODULES = {
    "train": ("launcher.worker.train", "launcher.train"),
    "supervisor": ("launcher.run.supervisor", "launcher.supervisor"),
}


def run_processes(run: RunDir, roles: tuple[str, ...] = ("train",)) -> list[dict[str, Any]]:
    """The processes on this box running a role's module with `--run-dir <this run>`, with identity and argv."""
    root = os.path.realpath(run.root)
    modules = {m for r in roles for m in ROLE_MODULES[r]}
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
    if state == "succeeded" and (data.get("export") or {}).get("state") == "running" and run_holder(run, data) is None:
        # trained, then killed while exporting: the same command resumes, trains nothing more, and exports
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
            f"stop it with `ftrun stop {run.root}`.",
        )
    workers = [p["pid"] for p in run_processes(run)]
    return BusyError(
        f"the lock of {run.root} is held, but not by a live ftrun supervisor"
        + (
            f": worker process(es) {', '.join(map(str, workers))} still train into it"
            if workers
            else ": by a process this box cannot see (another container or machine using the same directory?) "
            "or by an ftrun that is just starting"
        ),
        fix=(
            f"`ftrun stop {run.root}` ends them (after a checkpoint); then run the same command to resume."
            if workers
            else "end the other ftrun first (in its container or on its machine), or wait a few "
            "seconds and retry; ftrun never trains twice into the same directory."
        ),
    )


def is_locked(run: RunDir) -> bool:
    """Someone holds the run's lock (probed with a shared, non-blocking flock: two probes never collide)."""
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


def last_metrics(path: Path, key: Optional[str] = None) -> dict[str, Any]:
    """The newest row of metrics.jsonl (with `key`, the newest that has it), read from the end in growing blocks."""
    if not path.is_file():
        return {}
    with path.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        block = 4096
        while True:
            fh.seek(max(0, size - block))
            lines = fh.read().decode(errors="replace").splitlines()
            if size > block:
                lines = lines[1:]  # the first line of a block may be cut
            for line in reversed(lines):
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict) and (key is None or row.get(key) is not None):
                    return row
            if block >= size:
                return {}
            block *= 8


class RunSnapshot:
    """A run as one command reads it: state.json at its start, each other file once where first asked."""

    def __init__(self, run: RunDir):
        self.run = run
        self.state: dict[str, Any] = read_state(run)

    @cached_property
    def plan(self) -> dict[str, Any]:
        return read_json(self.run.plan)

    @cached_property
    def smoke(self) -> dict[str, Any]:
        return read_json(self.run.smoke)

    @cached_property
    def heartbeats(self) -> dict[int, dict[str, Any]]:
        return heartbeat_files.read_all(self.run)

    @cached_property
    def last(self) -> dict[str, Any]:
        return last_metrics(self.run.metrics, "loss")  # the training rows; eval passes have rows of their own

    @cached_property
    def last_eval(self) -> dict[str, Any]:
        return last_metrics(self.run.metrics, "eval_loss")


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):  # a file being replaced right now reads as absent; the next refresh has it
        return {}
