"""What every part of the worker asks about its own process: rank, world size, a requested stop, the log line."""

from __future__ import annotations

import os
import signal


class _Stop:
    """Set by SIGTERM/SIGINT; the trainer callback saves a checkpoint and stops at the next step."""

    requested = False
    signal_name = ""


def _on_signal(signum, _frame):
    _Stop.requested = True
    _Stop.signal_name = signal.Signals(signum).name
    print(f"[ftrun worker] {_Stop.signal_name} received: saving a checkpoint at the end of this step, then stopping",
          flush=True)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _say(line: str) -> None:
    print(f"[ftrun worker] {line}", flush=True)
