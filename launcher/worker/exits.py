"""The worker's failure exits: the exit codes the supervisor reads, with the errors that lead to them.

Out of memory and a full disk are told apart from a crash (which the supervisor restarts); the code and the reason
go into worker.json, since torchrun reports any rank's exit as 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

# the codes' one definition, with their wording and whether the supervisor restarts: launcher/errors.py WORKER_EXITS
from launcher.errors import EXIT_BAD_WORLD, EXIT_DISK_FULL, EXIT_NAN, EXIT_OOM, EXIT_STOPPED  # noqa: F401
from launcher.store import checkpoint as ckpt
from launcher.store.rundir import RunDir
from launcher.worker import memory
from launcher.worker.process import _rank


def _out_of_memory(run: RunDir, mode: str, device: str, text: str, step: int) -> int:
    peak = memory.out_of_memory_peak_gb(device)  # this rank's: the others may be gone or stuck in a collective
    first = text.strip().splitlines()[0] if text.strip() else "out of memory"
    measured = f"peak {peak:.2f} GB" if peak is not None else "peak unknown"
    message = f"out of {'GPU ' if device == 'cuda' else ''}memory at step {step + 1} ({measured}): {first[:300]}"
    print(f"[ftrun worker] {message}", file=sys.stderr, flush=True)
    # any rank: under ZeRO-3 or FSDP one rank may run out before the others
    oom = {"step": step + 1, "peak_memory_gb": None if peak is None else round(peak, 3), "rank": _rank()}
    if mode == "smoke":
        ckpt.atomic_write_json(run.smoke_work / "oom.json", {**oom, "error": first[:500]})
    else:  # the step as a fact too: the restart says where (launcher/run/oom_restart.py)
        _record_error(run, message, EXIT_OOM, out_of_memory=oom)
    return EXIT_OOM


def _says_disk_full(exc: BaseException) -> bool:
    import errno

    seen: Optional[BaseException] = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _is_disk_full(exc: BaseException, where: Path) -> bool:
    import shutil

    if _says_disk_full(exc):
        return True
    # torch.save's full disk is one of several RuntimeErrors: ask the disk whether a checkpoint still fits
    kept = [p for p in ckpt.candidates(where / "checkpoints") if (p / ckpt.MANIFEST).is_file()]
    last = ckpt.tree_bytes(kept[0]) if kept else 0
    return shutil.disk_usage(where).free < max(64 * 1024 * 1024, 2 * last)


def _record(run: RunDir, facts: dict) -> None:
    info = json.loads(run.worker.read_text()) if run.worker.is_file() else {}
    info.update(facts)
    try:
        ckpt.atomic_write_json(run.worker, info)
    except OSError:  # the disk may be too full even for this; the log line already says it
        pass


def _record_error(run: RunDir, message: str, exit_code: Optional[int] = None, **facts) -> None:
    # torchrun reports any rank's exit as 1: the supervisor reads the real one here
    _record(run, {"error": message, **facts, **({"exit_code": exit_code} if exit_code is not None else {})})


def _record_stop_after_training(run: RunDir, step: int) -> None:
    """worker.json's fact for the supervisor: this stop came after training ended at `step` (result and last
    checkpoint saved)."""
    _record(run, {"stopped_after_training": {"step": step}})
