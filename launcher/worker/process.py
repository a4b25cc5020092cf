"""What every part of the worker asks about its own process: rank, world size, a requested stop, the log line,
how a rank leaves."""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn


class _Stop:
    """Set by SIGTERM/SIGINT: a checkpoint at the next step, then stop. After training (`trained`): the result first,
    then a stop before the samples or between the task evaluation's batches (answers kept)."""

    requested = False
    signal_name = ""
    trained = False


class StopRequested(Exception):
    """Raised between the task evaluation's batches once a stop is requested after training."""


def _on_signal(signum, _frame):
    _Stop.requested = True
    _Stop.signal_name = signal.Signals(signum).name
    then = (
        "training is complete: saving the final result and its checkpoint if not yet saved, then stopping "
        "before the rest of the samples and the task evaluation (kept answers stay)"
        if _Stop.trained
        else "saving a checkpoint at the end of this step, then stopping"
    )
    print(f"[ftrun worker] {_Stop.signal_name} received: {then}", flush=True)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _say(line: str) -> None:
    print(f"[ftrun worker] {line}", flush=True)


def leave_rank(code: int) -> NoReturn:
    """End this rank of a torchrun launch with `code`, without the interpreter's teardown, once its work is written
    and its group destroyed: the distributed stack's C++ destructors abort a rank now and then ("terminate called
    without an active exception", about one in four 2-process runs; pytorch/pytorch#179291, gloo's threads), which
    torchrun reports as a failure. atexit handlers do not run: logging and the streams are flushed here."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
