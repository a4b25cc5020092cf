"""TRL single process and DDP: the checks that the running processes are the planned ones."""

from __future__ import annotations

from typing import Any


def checks(plan: dict[str, Any], trainer: Any) -> list[dict[str, Any]]:
    """DDP: a process group of the planned backend, and the model wrapped in DistributedDataParallel."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not (dist.is_available() and dist.is_initialized()):
        return [{"check": "process group", "ok": False, "seen": "none: the trainer runs a single process"}]
    backend, want = dist.get_backend(), "nccl" if plan.get("device") == "cuda" else "gloo"
    seen = f"{backend} (expected {want} on {plan.get('device', 'cpu')})"
    wrapped = trainer.model_wrapped
    return [
        {"check": "process group backend", "ok": backend == want, "seen": seen},
        {
            "check": "model wrapped in DistributedDataParallel",
            "ok": isinstance(wrapped, DistributedDataParallel),
            "seen": type(wrapped).__name__,
        },
    ]


def single_checks(plan: dict[str, Any], trainer: Any) -> list[dict[str, Any]]:
    """One process: no process group, and n_gpu 1 on a GPU (no nn.DataParallel: transformers trainer.py)."""
    import os

    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized()
    n_gpu = int(trainer.args.n_gpu)
    want = 1 if plan.get("device") == "cuda" else 0
    return [
        {
            "check": "single process",
            "ok": not grouped,
            "seen": f"process group of {dist.get_world_size()}" if grouped else "no process group",
        },
        {
            "check": "one device (no nn.DataParallel)",
            "ok": n_gpu == want,
            "seen": f"n_gpu {n_gpu} (expected {want}; CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}), batch per step "
            f"{trainer.args.train_batch_size}",
        },
    ]
