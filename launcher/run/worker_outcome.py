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
    """Before each attempt: the last attempt's outcome must not speak for a worker that dies before writing its own."""
    if not run.worker.is_file():
        return
    from launcher.store.checkpoint import atomic_write_json

    info, keys = json.loads(run.worker.read_text()), ("exit_code", "error", "stopped_after_training", "out_of_memory")
    if set(keys) & set(info):
        atomic_write_json(run.worker, {k: v for k, v in info.items() if k not in keys})


def _worker_exit_code(run: RunDir) -> Optional[int]:
    """The exit code a rank recorded in worker.json with its error (exits._record_error), if any."""
    return _worker_fact(run, "exit_code")


def _worker_error(run: RunDir) -> Optional[str]:
    return _worker_fact(run, "error")
