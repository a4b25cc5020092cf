"""What every check shares: the step's context, its JSON files, and a child process's command line and environment."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

from launcher.plan.sizing_constants import GB  # 2**30 bytes: what launcher/worker/memory.py reports in

# the repository root (this file is gpu_check/common.py): scripts/, and the children's PYTHONPATH
REPO = Path(__file__).resolve().parents[1]
# The fused LM head's outputs as trl 1.16's SFTTrainer asks for them (the loss, its entropy and token accuracy
# metrics): what the benches and the loss-head check run it with.
FUSED_OUTPUTS = ("log_probs", "entropy", "is_top1")


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


class Context(SimpleNamespace):
    out: Path  # results (JSON, logs): what comes back from the box
    work: Path  # what the steps build (the tiny model, the FSDP final save): stays on the box
    dry_run: bool
    device: str  # "cuda" or "cpu": what this run expects to use
    shape: str
    progress: Callable[..., None]


def in_gb(n: float) -> float:
    return round(n / GB, 3)


def has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def worker_recipe(model: Path, method: str = "lora") -> SimpleNamespace:
    # the recipe fields loading reads (launcher.recipe needs pydantic, which a bare GPU box may lack)
    lora = SimpleNamespace(r=16, alpha=16, dropout=0.0, target_modules="all-linear")
    return SimpleNamespace(model=str(model), method=method, gradient_checkpointing=True, lora=lora, seed=0)


def module_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpu_check", *args]


def last_line(proc) -> str:
    """A finished child's last line of output, or its exit code: why it left no result."""
    lines = [x for x in ((proc.stdout or "") + (proc.stderr or "")).splitlines() if x.strip()]
    return lines[-1][:300] if lines else f"exit {proc.returncode}"


def child_env(**extra: str) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": str(REPO) + (os.pathsep + path if path else ""), **extra}


def record_skip(out: Path, name: str, why: str, **extra: Any) -> None:
    """A step left out before it started because this box cannot run it (the preflight: its memory, its imports)."""
    write_json(
        out / f"{name}.json",
        {"step": name, "status": "skipped", "ok": None, "skipped": why, "line": f"skipped: {why}", **extra},
    )
