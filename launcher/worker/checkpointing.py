"""How the processes of one launch share the run's checkpoints on disk: who verifies the resume choice and who writes
on each disk, the step every rank resumes from, the background manifest every rank awaits, a disk that fills up.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

from launcher.store import checkpoint as ckpt
from launcher.store.rundir import RunDir
from launcher.worker.exits import EXIT_DISK_FULL, _is_disk_full, _record_error, _says_disk_full
from launcher.worker.process import _rank


METRICS_IN_CHECKPOINT = "ftrun_metrics.jsonl"


def _restore_metrics(path: Path, checkpoint: Path, last_step: int) -> None:
    """On resume, metrics.jsonl = the checkpoint's rows up to its step; later rows will be logged again."""
    source = checkpoint / METRICS_IN_CHECKPOINT
    source = source if source.is_file() else path
    if not source.is_file():
        return
    keep = [
        line
        for line in source.read_text().splitlines()
        if line.strip() and json.loads(line).get("step", 0) <= last_step
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def _launch_identity() -> dict[str, str]:
    """What the processes of one launch share (torchrun sets it); under a static rendezvous _launcher_started tells
    launches apart."""
    return {
        k: os.environ.get(k, "")
        for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")
    }


def _resume_steps_differ(resume_from, device: str) -> Optional[str]:
    """The message when the nodes (each verifying its own disk) would resume from different steps, else None."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    step = resume_from.step if resume_from is not None else -1
    t = torch.tensor([float(step), float(-step)], device="cuda" if device == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    newest, oldest = int(t[0].item()), int(-t[1].item())
    if newest == oldest:
        return None

    def name(s: int) -> str:
        return ckpt.step_dir_name(s) if s >= 0 else "none"

    keep = f"keep {name(oldest)} and older" if oldest >= 0 else "keep none"
    return (
        f"the nodes would resume from different checkpoints (oldest {name(oldest)}, newest {name(newest)}, this "
        f"node {name(step)}): a node was stopped before its copy of the newest checkpoint was complete. On every "
        f"node remove the newer step-* folders under checkpoints/ ({keep}), then run the same command."
    )


def _launcher_started() -> float:
    """When this process's launcher started: a resume choice written earlier belongs to an earlier launch."""
    import psutil

    try:
        return psutil.Process(os.getppid()).create_time()
    except psutil.Error:
        return psutil.Process().create_time() - 1.0  # the verifier writes after its imports, seconds later


def _verifies_resume(plan: dict[str, Any], rank: int, local_rank: int) -> bool:
    """Whether this process verifies the checkpoints at resume and hands its choice to the others: rank 0, or each
    node's local rank 0 over several nodes whatever the engine (DeepSpeed never sets save_on_each_node)."""
    from launcher.worker.engines import world_size

    several_nodes = world_size(plan) > int(plan.get("num_processes", 1))
    return (local_rank if several_nodes else rank) == 0


def _writes_checkpoints(save_on_each_node: bool, rank: int, local_rank: int) -> bool:
    """Whether this process moves, hashes and removes checkpoint folders on its disk (Cadence.on_save's rule, the
    Trainer's should_save); no other process deletes a step folder without manifest (its hash may be running)."""
    return (local_rank if save_on_each_node else rank) == 0


def _writes_this_disk(plan: dict[str, Any], recipe, run: RunDir) -> bool:
    from launcher.worker.engines import trainer_fields
    from launcher.worker.loading import local_rank

    fields = {**trainer_fields(plan, run.root), **dict(getattr(recipe, "trainer", None) or {})}
    return _writes_checkpoints(bool(fields.get("save_on_each_node")), _rank(), local_rank())


_MANIFEST = ckpt.BackgroundManifest(log=lambda line: print(f"[ftrun worker] {line}", flush=True))


_MANIFEST_POLL_S = 5.0  # one round of _await_manifest: far below any process group timeout


def _await_manifest(device: str) -> None:
    """Every rank waits, in short collectives (no barrier timeout), until the writer's background manifest is on disk:
    a rank that exited first would have torchrun cut the hashing. Then every rank raises ManifestFailed when a
    writer's manifest failed (with ENOSPC among its causes when the disk was full)."""
    import errno

    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        _MANIFEST.wait()
        _MANIFEST.check()
        return
    while True:
        done = _MANIFEST.wait(timeout=_MANIFEST_POLL_S)
        failed = _MANIFEST.exception if done else None
        state = torch.tensor(
            [0.0 if done else 1.0, 0.0 if failed is None else 2.0 if _says_disk_full(failed) else 1.0],
            device="cuda" if device == "cuda" else "cpu",
        )
        dist.all_reduce(state, op=dist.ReduceOp.MAX)
        if not state[0].item():
            break
    _MANIFEST.check()  # the writer whose manifest failed: its own error
    if state[1].item():
        full = state[1].item() == 2.0
        raise ckpt.ManifestFailed(
            "the checkpoint's manifest could not be written by the process that writes "
            "checkpoints on a disk of this run (its log says why)"
        ) from (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if full else None)


def _disk_full_message(run: RunDir, step: int, writer: bool = True) -> str:
    """Remove the half-written save (the disk's writer only); name the sizes so the user knows how much to free."""
    import shutil

    partial = [p for p in run.checkpoints.glob("checkpoint-*") if p.is_dir()]
    partial_bytes = sum(ckpt.tree_bytes(p) for p in partial)
    if writer:
        # only this disk's writer, after its own manifest (_writes_checkpoints)
        _MANIFEST.wait()
        ckpt.remove_incomplete(run.checkpoints)
    kept = [p for p in ckpt.candidates(run.checkpoints) if (p / ckpt.MANIFEST).is_file()]
    last_size = ckpt.tree_bytes(kept[0]) if kept else 0
    free = shutil.disk_usage(run.root).free
    removed = (
        "the partial save was removed"
        if writer
        else "the partial save is removed by the process that writes this disk's checkpoints (or at the next start)"
    )
    return (
        f"disk full while saving the checkpoint of step {step}: {free / 1e6:.1f} MB free on {run.root}, "
        f"a checkpoint takes about {max(last_size, partial_bytes) / 1e6:.1f} MB; {removed}, "
        f"{kept[0].name if kept else 'no earlier checkpoint'} is intact. Free space (or lower keep_checkpoints), "
        "then run the same command to resume."
    )


def _disk_full(run: RunDir, step: int, writer: bool) -> int:
    """The disk-full exit: the reason in the log and in worker.json, the partial save removed by the disk's writer."""
    message = _disk_full_message(run, step, writer)
    print(f"[ftrun worker] {message}", file=sys.stderr, flush=True)
    _record_error(run, message, EXIT_DISK_FULL)  # under torchrun the supervisor sees 1: it reads this one
    return EXIT_DISK_FULL


def _finish(run: RunDir, device: str, step: int, writer: bool) -> int:
    """0 once the last manifest is on disk (every rank waits); a failed one takes the disk-full exit or is raised."""
    try:
        _await_manifest(device)
    except ckpt.ManifestFailed as exc:
        if not _is_disk_full(exc, run.root):
            raise
        return _disk_full(run, step, writer)
    return 0
