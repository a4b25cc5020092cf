"""Each rank's heartbeat in the run directory: its step and phase, one small file per rank, replaced atomically.

The worker writes it (worker/heartbeat.py), the watchdog and `ftrun status` read it. `heartbeats/rank-<RANK>.json`:
{"rank", "pid", "step" (optimizer steps done), "phase" (a PHASES key), "phase_started", "time"}.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from launcher.store.rundir import RunDir

# What a rank is doing, in the words `ftrun status` uses ("rank 1 silent for 5 min at step 35 (in a step; ...)").
PHASES = {
    "start": "starting (imports, model load, resume check)",
    "step": "in a step",
    "hash": "waiting for a checkpoint's manifest",
    "save": "saving a checkpoint",
    "eval": "evaluating",
    "export": "saving the final result",
    "error": "raised an error",
}


def path(run: RunDir, rank: int) -> Path:
    return run.heartbeats / f"rank-{int(rank)}.json"


def write(run: RunDir, rank: int, fields: dict[str, Any]) -> None:
    """Write-then-rename, not fsynced (the supervisor clears the folder before each launch)."""
    target = path(run, rank)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps({"rank": int(rank), **fields}))
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_all(run: RunDir) -> dict[int, dict[str, Any]]:
    """Every rank's last heartbeat, by rank; a file being replaced or unreadable is skipped (read again next time)."""
    beats: dict[int, dict[str, Any]] = {}
    if not run.heartbeats.is_dir():
        return beats
    for p in run.heartbeats.glob("rank-*.json"):
        try:
            data = json.loads(p.read_text())
            beats[int(data["rank"])] = data
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return dict(sorted(beats.items()))


def clear(run: RunDir) -> None:
    """Before a launch: the last attempt's heartbeats must not speak for the new processes."""
    shutil.rmtree(run.heartbeats, ignore_errors=True)
