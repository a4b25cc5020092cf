"""What every part of the worker asks about its own process: rank, world size, a requested stop, the log line,
how a rank leaves."""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn


class _Stop:
    """Set by SIGTERM/SIGINT; the trainer callback saves a checkpoint and stops at the next step. After training
    (`trained`), the final result and the last checkpoint are saved first, and the worker stops before the samples
    and between the task evaluation's batches: the answers so far are kept, the same command answers the rest."""

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
    """End this rank of a torchrun launch with `code`, without the interpreter's teardown.

    Call it once the rank's work is written and its process group destroyed. At the interpreter's teardown the C++
    destructors of the distributed stack abort a rank now and then: "terminate called without an active
    exception", SIGABRT (seen about once in four 2-process runs of the worker here; once in a fresh-clone
    slow tier, 2026-12-03, in tests/fsdp_qlora_worker.py after its report was written and its group destroyed).
    pytorch/pytorch#179291 (closed unmerged) describes one road to it: gloo's C++ worker threads still hold work
    objects whose tensors are released during the interpreter's finalization. torchrun reports such a rank as a
    failed worker, and the supervisor would restart a finished run. atexit handlers do not run: logging and the
    standard streams are flushed here; anything else the rank must flush, it flushes before.
    """
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
