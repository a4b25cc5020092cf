"""What the worker of this attempt recorded in worker.json, as the supervisor reads it: its exit code, error, facts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from launcher.store.rundir import RunDir


def _json_or_empty(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def _worker_fact(run: RunDir, key: str) -> Any:
    """A fact the worker of this attempt recorded in worker.json (forgotten before each attempt)."""
    return _json_or_empty(run.worker).get(key)


def _forget_worker_outcome(run: RunDir) -> None:
    """Before each attempt: the last attempt's error and exit code must not speak for a worker that dies before
    it writes its own worker.json (a crash would otherwise be read as the previous out of memory, not restarted)."""
    if not run.worker.is_file():
        return
    from launcher.store.checkpoint import atomic_write_json

    info = json.loads(run.worker.read_text())
    if {"exit_code", "error", "stopped_after_training", "out_of_memory"} & set(info):
        for key in ("exit_code", "error", "stopped_after_training", "out_of_memory"):
            info.pop(key, None)
        atomic_write_json(run.worker, info)


def _worker_exit_code(run: RunDir) -> Optional[int]:
    """The exit code a rank recorded in worker.json with its error (exits._record_error), if any."""
    if not run.worker.is_file():
        return None
    return json.loads(run.worker.read_text()).get("exit_code")


def _worker_error(run: RunDir) -> Optional[str]:
    if not run.worker.is_file():
        return None
    return json.loads(run.worker.read_text()).get("error")
