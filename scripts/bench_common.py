"""What the bench_*.py scripts share: the bench model and data, recipes, running ftrun, reading its metrics."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import yaml

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "bench"
PYTHON = sys.executable
FTRUN = [PYTHON, "-m", "launcher.cli"]

# Qwen3-shaped, random weights, built locally. "m" (~10M parameters) is the default: large enough that
# compute, not Python overhead, dominates a step on 2 cores, small enough for a bench in minutes.
MODEL_SIZES = {
    "xs": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128),  # the tests' tiny model's shape
    "s": dict(hidden=192, layers=4, heads=6, kv_heads=2, intermediate=512),  # ~1.8M
    "m": dict(hidden=384, layers=6, heads=6, kv_heads=2, intermediate=1024),  # ~9.8M
    "l": dict(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1408),  # ~22M
}

ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_data(examples: int) -> Path:
    """Synthetic chat data with a long tail (scripts/make_tiny_data.py), deterministic for a given size."""
    path = CACHE / f"data-{examples}.jsonl"
    if not path.is_file():
        mod = _script("make_tiny_data")
        mod.write_jsonl(path, mod.make_examples(examples, seed=0))
    return path


def bench_model(size: str = "m") -> Path:
    """The bench model of this size, built once into .cache/bench/ (the tokenizer learns from 2000 examples)."""
    out = CACHE / f"model-{size}"
    _script("make_tiny_model").build_tiny_model(out, data=bench_data(2000), **MODEL_SIZES[size])
    return out


def write_recipe(path: Path, **fields: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(fields, sort_keys=False))
    return path


def ftrun(args: list[str], *, log: Optional[Path] = None, timeout: float = 3600) -> tuple[int, float]:
    """Run the ftrun CLI; (exit code, wall seconds). Output goes to `log` (or is discarded)."""
    t0 = time.monotonic()
    out = log.open("w") if log else subprocess.DEVNULL
    try:
        rc = subprocess.run(
            FTRUN + args, cwd=REPO, env=ENV, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
        ).returncode
    finally:
        if log:
            out.close()
    return rc, time.monotonic() - t0


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    return path


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def tokens_per_second(rows: list[dict[str, Any]]) -> Optional[float]:
    """Real (non-padding) training tokens/s from the first logged step to the last.

    Rows carry `time` (wall clock) and `tokens_seen` (the trainer's non-padding count) at each logged step.
    Starting at the first logged step leaves the warm-up steps (allocator, lazy init) out, on both sides.
    """
    if len(rows) < 2:
        return None
    first, last = rows[0], rows[-1]
    seconds = last["time"] - first["time"]
    return (last["tokens_seen"] - first["tokens_seen"]) / seconds if seconds > 0 else None


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def machine() -> str:
    import platform

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{os.cpu_count()} cores ({cpu or platform.processor()}), no GPU, load average {load:.1f} at start"
