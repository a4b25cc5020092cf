#!/usr/bin/env python3
"""Launcher overhead: plan + smoke test against a 30-minute run, resume cost after kill -9, sizing calibration.

1. plan + smoke: wall time of `ftrun smoke RECIPE`, split into a fixed part (process start, imports, model
   load, data preparation) and the smoke test's training, then extrapolated to a 30-minute run: the fixed
   part stays, the training part becomes max(smoke.fraction x 30 min, min_steps x seconds per step).
2. resume: `ftrun RECIPE` (detached) runs until it has written a checkpoint and trained past it; supervisor
   and worker are killed with SIGKILL (the machine died); then the time from `ftrun RECIPE` to the first new
   training step (metrics.jsonl), against the same measure for a cold start (new run, smoke test off).
   Work lost: the steps trained after the last checkpoint, against the checkpoint interval.
3. sizing: the plan's predicted memory (device cpu) against the smoke test's measured peak RSS, both above
   the worker's post-import baseline (a process importing what the worker imports), at 3 model sizes.

    .venv/bin/python scripts/bench_overhead.py            # model m, sizing at s/m/l, 2 resume rounds
    .venv/bin/python scripts/bench_overhead.py --quick    # model s, sizing at s/m, 1 resume round (~4 min)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

BASE = dict(
    method="lora",
    micro_batch_size=8,
    gradient_accumulation_steps=1,
    learning_rate=2e-4,
    max_length=512,
    logging_steps=1,
)


def recipe(work: Path, name: str, model: Path, data: Path, **fields) -> Path:
    return bc.write_recipe(
        work / f"{name}.yaml",
        **{**BASE, "model": str(model), "data": str(data), "output_dir": str(bc.fresh_dir(work / name)), **fields},
    )


def plan_and_smoke(work: Path, model: Path, data: Path) -> dict:
    r = recipe(work, "smoke", model, data, epochs=1)
    rc, wall = bc.ftrun(["smoke", str(r)], log=work / "smoke.log")
    if rc != 0:
        raise SystemExit(f"ftrun smoke failed (exit {rc}); see {work / 'smoke.log'}")
    smoke = json.loads((work / "smoke" / "smoke.json").read_text())
    train_s = smoke["seconds"]  # the smoke test's training loop, first step included
    fixed = wall - train_s
    per_step = smoke["seconds_per_step"]
    run = 1800.0
    smoke_cfg = dict(fraction=0.01, min_steps=8)  # the recipe defaults
    extrapolated_train = max(smoke_cfg["fraction"] * run, smoke_cfg["min_steps"] * per_step)
    total = fixed + extrapolated_train
    return {
        "wall_seconds": round(wall, 1),
        "smoke_training_seconds": train_s,
        "fixed_seconds": round(fixed, 1),
        "seconds_per_step": per_step,
        "for_30_min_run_seconds": round(total, 1),
        "fraction_of_30_min": total / run,
    }


def _pids(run_dir: Path) -> list[int]:
    pids = []
    for name in ("state.json", "worker.json"):
        p = run_dir / name
        if p.is_file():
            data = json.loads(p.read_text())
            pids += [data.get(k) for k in ("supervisor_pid", "worker_pid", "pid") if data.get(k)]
    return sorted(set(int(p) for p in pids))


def _wait(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {what}")


def _first_new_step(metrics: Path, after_wall: float, timeout: float) -> dict:
    def new_row():
        if not metrics.is_file():
            return None
        rows = [r for r in bc.read_rows(metrics) if r["time"] >= after_wall]
        return rows[0] if rows else None

    return _wait(new_row, timeout, f"a new step in {metrics}")


def _start(r: Path, out: Path) -> float:
    """`ftrun RECIPE` (detached); returns the wall clock at the command, after the launcher returned."""
    t0 = time.time()
    rc, _ = bc.ftrun([str(r)], log=out.with_suffix(".launch.log"))
    if rc != 0:
        raise SystemExit(f"ftrun {r} failed (exit {rc})")
    return t0


def _kill_run(out: Path) -> None:
    for pid in _pids(out):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def resume_cost(work: Path, model: Path, data: Path, i: int) -> dict:
    interval_min = 0.25
    r = recipe(
        work, f"resume-{i}", model, data, epochs=3, checkpoint_every_minutes=interval_min, smoke={"enabled": False}
    )
    out = work / f"resume-{i}"
    t_cold = _start(r, out)
    cold = _first_new_step(out / "metrics.jsonl", t_cold, 600)
    cold_s = cold["time"] - t_cold
    # Train past a checkpoint, then kill everything at a moment that is not a checkpoint.
    ckpt_dir = out / "checkpoints"
    _wait(lambda: any((p / "manifest.json").is_file() for p in ckpt_dir.glob("step-*")), 600, "a checkpoint")
    time.sleep(interval_min * 60 * 0.6)
    rows = bc.read_rows(out / "metrics.jsonl")
    _kill_run(out)
    time.sleep(1)
    last_step = rows[-1]["step"]
    ckpt_steps = sorted(int(p.name.split("-")[1]) for p in ckpt_dir.glob("step-*") if (p / "manifest.json").is_file())
    saved = ckpt_steps[-1]
    sec_per_step = (rows[-1]["time"] - rows[0]["time"]) / max(rows[-1]["step"] - rows[0]["step"], 1)
    t_resume = _start(r, out)
    first = _first_new_step(out / "metrics.jsonl", t_resume, 600)
    resume_s = first["time"] - t_resume
    _kill_run(out)  # the measurement is done; the rest of the run is not needed
    return {
        "cold_start_to_first_step_seconds": round(cold_s, 1),
        "resume_to_first_new_step_seconds": round(resume_s, 1),
        "resume_vs_cold": resume_s / cold_s,
        "killed_at_step": last_step,
        "resumed_from_step": saved,
        "first_new_step": first["step"],
        "steps_lost": last_step - saved,
        "work_lost_seconds": round((last_step - saved) * sec_per_step, 1),
        "checkpoint_interval_seconds": interval_min * 60,
        "seconds_per_step": round(sec_per_step, 2),
    }


BASELINE = """
import resource, torch, transformers, peft, datasets, trl
from trl import SFTTrainer
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9)
"""


def sizing(work: Path, sizes: list[str], data: Path) -> list[dict]:
    base = float(
        subprocess.run([bc.PYTHON, "-c", BASELINE], env=bc.ENV, capture_output=True, text=True, check=True)
        .stdout.strip()
        .splitlines()[-1]
    )
    rows = []
    for size in sizes:
        model = bc.bench_model(size)
        r = recipe(work, f"sizing-{size}", model, data, epochs=1, smoke={"min_steps": 2, "fraction": 0.01})
        rc, _ = bc.ftrun(["smoke", str(r)], log=work / f"sizing-{size}.log")
        if rc != 0:
            raise SystemExit(f"sizing smoke for model {size} failed (exit {rc})")
        plan = json.loads((work / f"sizing-{size}" / "plan.json").read_text())
        smoke = json.loads((work / f"sizing-{size}" / "smoke.json").read_text())
        mem = plan["memory"]
        predicted = mem.get("estimated_per_gpu_gb") or mem["per_gpu_gb"]
        runtime = mem["breakdown_gb"].get("runtime", 0.0)
        measured = smoke["peak_memory_gb"]
        rows.append(
            {
                "size": size,
                "params": plan["model"]["params"],
                "predicted_gb": predicted,
                "predicted_runtime_gb": runtime,
                "measured_peak_gb": measured,
                "import_baseline_gb": round(base, 3),
                "predicted_above_runtime_gb": round(predicted - runtime, 3),
                "measured_above_baseline_gb": round(measured - base, 3),
                "ratio_total": predicted / measured,
                "ratio_above_baseline": (predicted - runtime) / max(measured - base, 1e-3),
            }
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="model s, sizing at s and m, 1 resume round")
    p.add_argument("--rounds", type=int, help="resume rounds (default 2, --quick 1)")
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args(argv)
    size = "s" if a.quick else "m"
    rounds = a.rounds or (1 if a.quick else 2)
    model, data = bc.bench_model(size), bc.bench_data(300 if a.quick else 1000)
    work = bc.CACHE / "overhead"
    work.mkdir(parents=True, exist_ok=True)
    print(f"bench_overhead: {bc.machine()}; model {model.name}", flush=True)
    ps = plan_and_smoke(work, model, data)
    print(
        f"plan + smoke: {ps['wall_seconds']:.1f} s here ({ps['fixed_seconds']:.1f} s fixed: start, imports, load, "
        f"data; {ps['smoke_training_seconds']:.1f} s training); for a 30-min run about "
        f"{ps['for_30_min_run_seconds']:.0f} s = {ps['fraction_of_30_min']:.1%} (target <= 3%)",
        flush=True,
    )
    resumes = []
    for i in range(rounds):
        r = resume_cost(work, model, data, i)
        resumes.append(r)
        print(
            f"resume {i}: first new step {r['resume_to_first_new_step_seconds']:.1f} s after `ftrun RECIPE` "
            f"(cold start {r['cold_start_to_first_step_seconds']:.1f} s, {r['resume_vs_cold']:.2f}x); killed at "
            f"step {r['killed_at_step']}, resumed from {r['resumed_from_step']}: {r['steps_lost']} steps = "
            f"{r['work_lost_seconds']:.0f} s lost, interval {r['checkpoint_interval_seconds']:.0f} s",
            flush=True,
        )
    sz = sizing(work, ["s", "m"] if a.quick else ["s", "m", "l"], data)
    for r in sz:
        print(
            f"sizing {r['size']} ({r['params'] / 1e6:.1f}M): predicted {r['predicted_gb']:.2f} GB, measured peak RSS "
            f"{r['measured_peak_gb']:.2f} GB (ratio {r['ratio_total']:.2f}); above the imports: predicted "
            f"{r['predicted_above_runtime_gb']:.3f} GB, measured {r['measured_above_baseline_gb']:.3f} GB "
            f"(ratio {r['ratio_above_baseline']:.2f})",
            flush=True,
        )
    if a.json:
        a.json.write_text(
            json.dumps({"machine": bc.machine(), "plan_and_smoke": ps, "resume": resumes, "sizing": sz}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
