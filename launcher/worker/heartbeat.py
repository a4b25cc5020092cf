"""This rank's heartbeat: its step and phase into the run directory, cheaply, for the supervisor's watchdog.

One small file per rank (launcher/store/heartbeat_files.py), replaced at most every HEARTBEAT_SECONDS
(launcher/plan/deadlines.py) within a phase and at once when the phase changes, so the watchdog can tell where a
silent rank stopped (launcher/run/watchdog.py). Writing never fails the training.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from launcher.plan.deadlines import HEARTBEAT_SECONDS
from launcher.store import heartbeat_files
from launcher.store.rundir import RunDir


class Heartbeat:
    def __init__(self) -> None:
        self.run: Optional[RunDir] = None
        self.rank = 0
        self.step = 0
        self.phase = ""
        self.phase_started = 0.0
        self.written = 0.0

    def start(self, run_dir: Path, rank: int) -> None:
        """From here on this process reports (the full run only: the smoke test runs in the foreground)."""
        self.run, self.rank = RunDir(Path(run_dir)), int(rank)
        self.beat("start", 0)

    def beat(self, phase: str, step: Optional[int] = None) -> None:
        """Note the phase and step; write when the phase changed or the last write is HEARTBEAT_SECONDS old."""
        if self.run is None:
            return
        now = time.time()
        changed = phase != self.phase
        if step is not None:
            self.step = int(step)
        if changed:
            self.phase, self.phase_started = phase, now
        elif now - self.written < HEARTBEAT_SECONDS:
            return
        try:
            beat = {"pid": os.getpid(), "step": self.step, "phase": self.phase, "phase_started": self.phase_started}
            heartbeat_files.write(self.run, self.rank, {**beat, "time": now})
            self.written = now
        except OSError:  # a full disk says so elsewhere; the watchdog's floor covers a rank that cannot write
            pass


BEAT = Heartbeat()
