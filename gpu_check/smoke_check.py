"""The smoke-bench step: scripts/gpu_bench.py (plan and smoke test through the real worker) where trl is there."""

from __future__ import annotations

import os
import sys
from typing import Any

from gpu_check.common import REPO, Context, child_env, read_json


def step_smoke_bench(ctx: Context) -> dict[str, Any]:
    """scripts/gpu_bench.py (ftrun plan + smoke through the real worker): only where trl and datasets are
    installed; in --dry-run only with GPU_CHECK_SMOKE_BENCH=1 (it takes minutes on 2 cores)."""
    import importlib.util

    missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
    if missing:
        return {
            "ok": None,
            "skipped": f"{', '.join(missing)} not installed",
            "line": f"skipped: {', '.join(missing)} not installed (the smoke test needs them)",
        }
    if ctx.dry_run and os.environ.get("GPU_CHECK_SMOKE_BENCH") != "1":
        return {
            "ok": None,
            "skipped": "dry run (GPU_CHECK_SMOKE_BENCH=1 runs it)",
            "line": "skipped in --dry-run (GPU_CHECK_SMOKE_BENCH=1 runs it)",
        }
    import subprocess

    budget = float(os.environ.get("GPU_CHECK_STEP_BUDGET", "300"))
    args = [
        sys.executable,
        str(REPO / "scripts" / "gpu_bench.py"),
        "--json",
        str(ctx.out / "gpu_bench.json"),
        "--deadline-seconds",
        str(max(30, int(budget) - 15)),
    ]
    if ctx.dry_run:
        args += ["--dry-run", "--methods", "lora"]
    proc = subprocess.run(args, env=child_env(), capture_output=True, text=True, timeout=budget)
    (ctx.out / "smoke-bench.log").write_text(proc.stdout + proc.stderr)
    rows = (read_json(ctx.out / "gpu_bench.json") or {}).get("rows", [])
    line = (
        "; ".join(
            f"{r['size']} {r['method']}: "
            + (
                f"failed ({r['error'][:60]})"
                if "error" in r
                else f"{r['measured_gb']:.1f} GB, {r['measured_tokens_per_second']:.0f} tok/s"
            )
            for r in rows
        )
        or "no rows"
    )
    return {"ok": proc.returncode == 0, "rows": rows, "line": line}
