"""One attempt of the worker watched until it exits: its ranks' heartbeats, its launcher's report, its end."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Optional

from launcher.plan import deadlines
from launcher.plan.cgroup import memory_limit_bytes, oom_kills
from launcher.run import rank_ends, views, watchdog
from launcher.run.rank_processes import _end_attempt, _process_state, _rank_handles
from launcher.run.supervisor_log import _log
from launcher.run.worker_outcome import _json_or_empty
from launcher.store import heartbeat_files
from launcher.store.rundir import RunDir


WATCH_INTERVAL_S = 2.0  # how often the supervisor reads the heartbeats while the worker runs
WATCHDOG_GRACE_S = 30.0  # a silent attempt gets at most this long (or grace_seconds) between SIGTERM and SIGKILL
TAIL_BYTES = 256 * 1024  # torchrun's stderr kept for its report of how each rank ended


class _Tail:
    """A launcher's stderr copied through to the supervisor's, its last TAIL_BYTES kept (torchrun's report of each
    rank's end is the last thing it prints)."""

    def __init__(self, stream) -> None:
        self.kept = bytearray()
        self.thread = threading.Thread(target=self._copy, args=(stream,), daemon=True)
        self.thread.start()

    def _copy(self, stream) -> None:
        fd = stream.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            try:
                os.write(2, chunk)
            except OSError:  # a full disk must not block the ranks behind a full pipe: keep reading
                pass
            self.kept += chunk
            del self.kept[:-TAIL_BYTES]
        stream.close()

    def join(self) -> None:
        self.thread.join(timeout=10)  # a rank that outlives its launcher keeps the pipe open: not forever

    def text(self) -> str:
        return bytes(self.kept).decode(errors="replace")


def _rank_ends(run: RunDir, rc: int, tail: Optional[_Tail], error_file: Path, multi: bool) -> list:
    """How each rank ended (launcher/run/rank_ends.py), each with its last heartbeat's step and phase."""
    if rc == 0:
        return []
    if multi:
        ends = rank_ends.parse_report(tail.text() if tail else "") or [
            rank_ends.RankEnd(rank=None, exit_code=rc, signal=rank_ends.signal_name(rc))
        ]
    else:
        ends = rank_ends.single(rc, error_file)
    beats = heartbeat_files.read_all(run)
    for e in ends:
        beat = beats.get(e.rank) if e.rank is not None else None
        if beat:
            e.step, e.phase = int(beat.get("step") or 0), beat.get("phase")
    return ends


def _wait_watching(
    proc: subprocess.Popen,
    run: RunDir,
    plan: dict[str, Any],
    launched_at: float,
    stopping: dict[str, Any],
    multi: bool,
    grace_seconds: float,
) -> tuple[int, Optional[dict], list]:
    """Wait for the worker (or launcher) to exit; a rank silent past its phase's deadline (launcher/plan/deadlines.py)
    ends the attempt (_end_attempt). Returns the exit code, the silent rank's facts (or None) and psutil handles of the
    launcher's ranks, taken while it lived."""
    smoke = _json_or_empty(run.smoke)
    expected, floor = deadlines.expected_seconds(plan, smoke), deadlines.floor_seconds()
    ranks = watchdog.local_ranks(plan) if multi else [0]
    seen: set = set()  # a reused pid is another entry: psutil/__init__.py Process.__hash__ takes pid and start time
    hang = None
    while True:
        try:
            return proc.wait(timeout=WATCH_INTERVAL_S), hang, list(seen)
        except subprocess.TimeoutExpired:
            pass
        if multi:
            seen.update(_rank_handles(proc))
        if hang is not None or stopping["signal"]:
            continue  # already ending it, or a stop has its own grace
        hang = watchdog.silent_rank(
            heartbeat_files.read_all(run), ranks, launched_at, time.time(), expected, floor, _process_state
        )
        if hang is not None:
            _log(
                f"{views.rank_end_text({'kind': 'hang', 'world': len(ranks) if multi else 1, **hang})}: ending the "
                "attempt (SIGTERM, then SIGKILL) to restart it from the newest verified checkpoint"
            )
            seen.update(_end_attempt(proc, multi, min(grace_seconds, WATCHDOG_GRACE_S)))


def _host_oom(kills_before: Optional[int]) -> Optional[dict[str, Any]]:
    """The cgroup's OOM kills since the worker started (the supervisor's cgroup holds its ranks too); None when none
    or the kernel does not say."""
    after = oom_kills()
    if kills_before is None or after is None or after <= kills_before:
        return None
    limit = memory_limit_bytes()
    return {"oom_kills": after - kills_before, "limit_gb": round(limit / 2**30, 1) if limit else None}
