"""loss.png redrawn in a child process, so that drawing it never holds up training."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# a drawing costs about a second of a core (matplotlib's import: 0.9 s on the 2-core CI box, 2026-12-05)
REDRAW_EVERY_SECONDS = 60.0

_PLOT: dict[str, Any] = {"child": None, "pending": False, "started": None}


def _redraw_loss_plot(run_root: Path, final: bool = False) -> None:
    """Skipped while a drawing runs or within REDRAW_EVERY_SECONDS of its start; at the end (`final`) the last one is
    waited for, and made if a checkpoint came since, so the finished run's plot is complete."""
    child, started = _PLOT["child"], _PLOT["started"]
    recent = started is not None and time.monotonic() - started < REDRAW_EVERY_SECONDS
    if not final and ((child is not None and child.poll() is None) or recent):
        _PLOT["pending"] = True
        return
    if child is not None:
        _reap(child)
        _PLOT["child"] = None
        if final and not _PLOT["pending"]:
            return
    _PLOT["pending"] = False
    _PLOT["started"] = time.monotonic()
    _PLOT["child"] = subprocess.Popen(
        [sys.executable, "-m", "launcher.deliver.plots", str(run_root)],
        stdin=subprocess.DEVNULL,
        cwd=str(Path(__file__).resolve().parents[2]),
    )
    if final:
        _reap(_PLOT["child"])
        _PLOT["child"] = None


def _reap(child: subprocess.Popen, timeout: float = 60.0) -> None:
    """Wait for a drawing; one that hangs is killed (a plot is not worth a run that never ends)."""
    try:
        child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        print(f"[ftrun worker] loss.png not updated: the drawing took more than {timeout:.0f} s", flush=True)
