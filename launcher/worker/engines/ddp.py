"""TRL single process and DDP: the checks that the running processes are the planned ones."""

from __future__ import annotations

from typing import Any


def _backend_ok(plan: dict[str, Any]) -> tuple[bool, str]:
    import torch.distributed as dist

    backend = dist.get_backend()
    want = "nccl" if plan.get("device") == "cuda" else "gloo"
    return backend == want, f"{backend} (expected {want} on {plan.get('device', 'cpu')})"


def checks(plan: dict[str, Any], trainer: Any) -> list[dict[str, Any]]:
    """DDP: a process group of the planned backend, and the model wrapped in DistributedDataParallel."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not (dist.is_available() and dist.is_initialized()):
        return [{"check": "process group", "ok": False, "seen": "none: the trainer runs a single process"}]
    ok, seen = _backend_ok(plan)
    wrapped = trainer.model_wrapped
    return [
        {"check": "process group backend", "ok": ok, "seen": seen},
        {"check": "model wrapped in DistributedDataParallel", "ok": isinstance(wrapped, DistributedDataParallel),
         "seen": type(wrapped).__name__},
    ]


def single_checks(plan: dict[str, Any], trainer: Any) -> list[dict[str, Any]]:
    """One process: no process group, the model not wrapped for data parallelism."""
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized()
    return [{"check": "single process", "ok": not grouped,
             "seen": f"process group of {dist.get_world_size()}" if grouped else "no process group"}]
