#!/usr/bin/env python3
"""Predicted against measured peak memory and tokens/s, per method and model size: `ftrun plan` then `ftrun smoke`.

On a GPU box the smoke worker measures torch.cuda.max_memory_reserved (launcher/worker/callbacks.py peak_memory_gb) and
real tokens/s; the plan gives the sizer's prediction for the detected GPU. Models are Qwen3-shaped with random
weights, built on the box (scripts/make_tiny_model.py; no download). One compact line per (size, method); a
failed case is a row with its reason, never the end of the report. With --json the file is rewritten after every
row, so a run cut short keeps what it measured; --deadline-seconds gives each smoke test only the time left and
records the rows it cannot start as skipped.

    python scripts/gpu_bench.py                 # GPU: sizes 0.5b and 1.5b, methods qlora, lora, full-8bit
    python scripts/gpu_bench.py --dry-run       # the same flow on CPU with a ~1.8M model (a couple of minutes)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

GPU_SIZES = {
    "0.5b": dict(hidden=1024, layers=24, heads=16, kv_heads=8, intermediate=3072, model_vocab=151936),
    "1.5b": dict(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, model_vocab=151936),
}


def build(size: str, dry_run: bool) -> Path:
    if dry_run:
        return bc.bench_model("s")
    out = bc.CACHE / f"gpu-model-{size}"
    bc._script("make_tiny_model").build_tiny_model(out, data=bc.bench_data(2000), **GPU_SIZES[size])
    return out


def case(work: Path, model: Path, data: Path, size: str, method: str, dry_run: bool, timeout: float = 600) -> dict:
    name = f"{size}-{method}"
    out = bc.fresh_dir(work / name)
    recipe = bc.write_recipe(
        work / f"{name}.yaml",
        model=str(model),
        data=str(data),
        output_dir=str(out),
        method=method,
        max_length=256 if dry_run else 2048,
        micro_batch_size=4 if dry_run else 8,
        gradient_accumulation_steps=1,
        gradient_checkpointing=True,
        smoke={"min_steps": 4, "fraction": 0.01, "max_minutes": 2},
    )
    row = {"size": size, "method": method}
    rc, plan_wall = bc.ftrun(["plan", str(recipe)], log=work / f"{name}.plan.log")
    t0 = time.monotonic()
    try:
        rc, smoke_wall = bc.ftrun(["smoke", str(recipe)], log=work / f"{name}.smoke.log", timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"smoke test timed out after {timeout:.0f} s"}
    row["smoke_wall_seconds"] = round(smoke_wall, 1)
    if rc != 0 or not (out / "smoke.json").is_file():
        tail = (work / f"{name}.smoke.log").read_text(errors="replace").strip().splitlines()[-1:] or [""]
        return {**row, "error": f"exit {rc}: {tail[0][:160]}"}
    plan = json.loads((out / "plan.json").read_text())
    smoke = json.loads((out / "smoke.json").read_text())
    mem = plan["memory"]
    predicted_gb = mem.get("estimated_per_gpu_gb") or mem["per_gpu_gb"]
    predicted_tps = plan["tokens"].get("estimated_tokens_per_second")
    return {
        **row,
        "params": plan["model"]["params"],
        "device": smoke["device"],
        "predicted_gb": predicted_gb,
        "measured_gb": smoke["peak_memory_gb"],
        "memory_ratio": predicted_gb / smoke["peak_memory_gb"] if smoke["peak_memory_gb"] else None,
        "predicted_tokens_per_second": predicted_tps,
        "measured_tokens_per_second": smoke["tokens_per_second"],
        "tps_ratio": (predicted_tps / smoke["tokens_per_second"]) if predicted_tps else None,
        "elapsed": round(time.monotonic() - t0, 1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="run on CPU with a ~1.8M model (checks the flow)")
    p.add_argument("--sizes", help=f"comma-separated subset of {','.join(GPU_SIZES)} (default all)")
    p.add_argument("--methods", default="qlora,lora,full-8bit")
    p.add_argument("--json", type=Path, help="also write the results here (rewritten after every row)")
    p.add_argument("--deadline-seconds", type=float, help="stop starting rows once this much time has passed")
    a = p.parse_args(argv)
    start = time.monotonic()
    sizes = ["cpu-s"] if a.dry_run else (a.sizes.split(",") if a.sizes else list(GPU_SIZES))
    data = bc.bench_data(2000)
    work = bc.CACHE / "gpu"
    work.mkdir(parents=True, exist_ok=True)
    print(f"gpu_bench{' --dry-run' if a.dry_run else ''}: {bc.machine()}", flush=True)
    rows = []

    def left() -> float:
        return (a.deadline_seconds - (time.monotonic() - start)) if a.deadline_seconds else 600.0

    def save() -> None:
        if a.json:
            tmp = a.json.with_name(a.json.name + ".tmp")
            tmp.write_text(json.dumps({"machine": bc.machine(), "rows": rows}, indent=2))
            tmp.replace(a.json)

    for size in sizes:
        model = build(size, a.dry_run) if left() > 30 else None
        for method in a.methods.split(","):
            if model is None or left() < 30:
                rows.append({"size": size, "method": method, "error": "skipped: out of time"})
                save()
                continue
            r = case(work, model, data, size, method, a.dry_run, timeout=min(600.0, left()))
            rows.append(r)
            save()
            if "error" in r:
                print(f"  {size:6s} {method:9s} FAILED {r['error']}", flush=True)
            else:
                print(
                    f"  {size:6s} {method:9s} memory predicted {r['predicted_gb']:.2f} GB measured "
                    f"{r['measured_gb']:.2f} GB ({r['memory_ratio']:.2f}x); tokens/s predicted "
                    f"{r['predicted_tokens_per_second'] or 0:.0f} measured {r['measured_tokens_per_second']:.0f} "
                    f"({r['device']}, smoke {r['smoke_wall_seconds']:.0f} s)",
                    flush=True,
                )
    save()
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
