#!/usr/bin/env python3
"""Smoke-test ETA accuracy: the predicted full-run wall time (smoke.json estimated_seconds) against the actual run.

For each case (LoRA and QLoRA, two max_length values), one `ftrun RECIPE --foreground`, as a user runs it:
plan, smoke test (which prints the ETA and writes smoke.json), then the full run to its end (supervisor,
worker start, model load, training, checkpoints, final save, export). Predicted = smoke.json
estimated_seconds; actual = from smoke.json being written to the command's end. Error = predicted /
actual - 1; the target is within +-10%. The actual time is split into its parts so a miss says where it
comes from: the training steps alone (metrics.jsonl, first to last logged step), the export
(final/export.json), and the rest. --rounds N repeats every case and reports medians.

    .venv/bin/python scripts/bench_eta.py            # 4 cases, model m, 1000 examples (long on 2 busy cores)
    .venv/bin/python scripts/bench_eta.py --quick    # 2 cases, model s, 300 examples (~5 min)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

CASES = {
    "lora-512": dict(method="lora", max_length=512),
    "lora-256": dict(method="lora", max_length=256),
    "qlora-512": dict(method="qlora", max_length=512),
    "qlora-256": dict(method="qlora", max_length=256),
}
QUICK_CASES = ["lora-512", "qlora-256"]


def run_case(name: str, model: Path, data: Path, work: Path, epochs: float, extra: list[str]) -> dict:
    out = bc.fresh_dir(work / name)
    recipe = bc.write_recipe(
        work / f"{name}.yaml",
        model=str(model),
        data=str(data),
        output_dir=str(out),
        micro_batch_size=8,
        gradient_accumulation_steps=2,
        epochs=epochs,
        learning_rate=2e-4,
        logging_steps=5,
        checkpoint_every_minutes=0.5,
        keep_checkpoints=2,
        **CASES[name],
    )
    rc, wall = bc.ftrun([str(recipe), "--foreground", *extra], log=work / f"{name}.log")
    end = time.time()
    if rc != 0:
        raise SystemExit(f"{name}: the run failed (exit {rc}); see {work / (name + '.log')}")
    smoke = json.loads((out / "smoke.json").read_text())
    full_wall = end - (out / "smoke.json").stat().st_mtime  # the ETA is printed as smoke.json is written
    rows = bc.read_rows(out / "metrics.jsonl")
    # Training steps only: from the first logged step back to step 0 at the measured rate, to the last.
    steps = rows[-1]["time"] - rows[0]["time"]
    steps_total = steps * rows[-1]["step"] / max(rows[-1]["step"] - rows[0]["step"], 1)
    export_path = out / "final" / "export.json"
    export = json.loads(export_path.read_text()).get("seconds", 0.0) if export_path.is_file() else 0.0
    est = smoke["estimated_seconds"]
    return {
        "case": name,
        "predicted_seconds": est,
        "actual_seconds": round(full_wall, 1),
        "error": est / full_wall - 1,
        "training_steps_seconds": round(steps_total, 1),
        "export_seconds": export,
        "other_seconds": round(full_wall - steps_total - export, 1),
        "smoke_wall_seconds": round(wall - full_wall, 1),
        "smoke_tokens_per_second": smoke["tokens_per_second"],
        "run_tokens_per_second": round(bc.tokens_per_second(rows) or 0, 1),
        "steps": rows[-1]["step"],
        "smoke": {
            k: smoke.get(k)
            for k in (
                "measured_steps",
                "warmup_seconds",
                "training_tokens",
                "startup_seconds",
                "saves_seconds",
                "export_seconds",
                "wall_seconds",
            )
        },
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 cases, model s, 300 examples (a few minutes)")
    p.add_argument("--cases", help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--examples", type=int, help="examples in the data (default 1000, --quick 300)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--size", choices=sorted(bc.MODEL_SIZES), help="default m (~10M), --quick s (~1.8M)")
    p.add_argument("--rounds", type=int, default=1, help="repeat every case, report medians (default 1)")
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args(argv)
    cases = a.cases.split(",") if a.cases else (QUICK_CASES if a.quick else list(CASES))
    examples = a.examples or (300 if a.quick else 1000)
    size = a.size or ("s" if a.quick else "m")
    model, data = bc.bench_model(size), bc.bench_data(examples)
    work = bc.CACHE / "eta"
    print(f"bench_eta: {bc.machine()}; model {model.name}, {examples} examples, {a.epochs:g} epoch(s)", flush=True)
    results = []
    for rnd in range(a.rounds):
        for name in cases:
            r = run_case(name, model, data, work, a.epochs, [])
            r["round"] = rnd + 1
            results.append(r)
            print(
                f"  {name:10s} round {rnd + 1}: predicted {r['predicted_seconds']:7.1f} s  actual "
                f"{r['actual_seconds']:7.1f} s  error {r['error']:+6.1%}  (training steps "
                f"{r['training_steps_seconds']:.1f} s, export {r['export_seconds']:.1f} s (predicted "
                f"{r['smoke']['export_seconds']}), other {r['other_seconds']:.1f} s; tokens/s smoke "
                f"{r['smoke_tokens_per_second']:.0f}, run {r['run_tokens_per_second']:.0f})",
                flush=True,
            )
    for name in cases:
        errs = [r["error"] for r in results if r["case"] == name]
        print(f"  {name:10s} median error {bc.median(errs):+6.1%} over {len(errs)} round(s)")
    errors = [abs(bc.median([r["error"] for r in results if r["case"] == n])) for n in cases]
    print(
        f"ETA error: median |error| {bc.median(errors):.1%}, worst case median {max(errors):.1%}; "
        f"{sum(e <= 0.10 for e in errors)}/{len(errors)} cases within +-10%"
    )
    if a.json:
        a.json.write_text(json.dumps({"machine": bc.machine(), "examples": examples, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
