"""One module per training engine; this file maps a plan's engine to the command that starts the worker."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..errors import PlanError

SINGLE_PROCESS = ("trl", "unsloth")


def launch_command(plan: dict[str, Any], run_dir: Path, mode: str) -> list[str]:
    """The worker's argv for this plan: an argument list, never a shell string built from recipe values."""
    engine = plan.get("engine", "trl")
    n = int(plan.get("num_processes", 1))
    worker = ["-m", "launcher.train", "--run-dir", str(run_dir), "--mode", mode]
    if engine in SINGLE_PROCESS:
        return [sys.executable, *worker]
    if engine == "ddp":
        # torchrun starts exactly n processes (accelerate's `--cpu --num_processes n` silently
        # starts one); each worker checks WORLD_SIZE against the plan.
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", *worker]
    raise PlanError(
        f"engine '{engine}' cannot be launched by this version of ftrun yet",
        fix="set engine: auto (or trl / ddp) in the recipe.",
    )
