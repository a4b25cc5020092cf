"""The smoke test's forecast of a GRPO run against the run's time, side by side (the demo's third step by default).

    .venv/bin/python scripts/grpo_eta.py --repeat 3 [--seeds 1,2,3] [--busy 1]   # runs recipes/tiny-cpu-grpo.yaml
    .venv/bin/python scripts/grpo_eta.py runs/tiny-cpu-grpo ...                    # reads finished runs

The runs are launched as the README launches them (`ftrun RECIPE`: a detached run, followed here until it ends);
`--busy N` keeps N CPU-bound processes running in this script's session from each launch to its run's end, as a build
or a test suite started from the same shell would: the detached run has a session of its own, and so has the smoke
worker (launcher/run/smoke.py start_worker); before 2026-12-06 the smoke worker shared this session's CPU share.

Per run: the box's 1-minute load average at the start and the end (os.getloadavg; only for the runs it started),
the forecast and the time it is compared with in the end summary (running + export), their ratio; then the parts:
the smoke test's measured step (the median its forecast uses) and the mean of its measured steps against the full
run's mean step (its logged rows' times, step 1's warm-up left out); the longest answer of the smoke's generate calls
against the full run's sampled answers' mean length and cut share; the export's forecast and its time. The runs
list is the figure of record; a single line says nothing on a box others load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-cpu-grpo.yaml"


def _rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return [r for r in rows if "loss" in r and "time" in r]


def measure(run: Path) -> dict:
    """The figures of one finished run, from its files."""
    from launcher.run.facts import end_summary
    from launcher.store.rundir import RunDir

    smoke = json.loads((run / "smoke.json").read_text())
    e = end_summary(RunDir(run))
    export = (e.get("export") or {}).get("seconds") or 0.0
    actual = (e.get("wall_seconds") or 0.0) + export
    forecast = e.get("forecast_seconds") or smoke.get("estimated_seconds")
    costs = [c[1] for c in smoke.get("step_costs") or []]
    rows = _rows(run)
    full_step = (rows[-1]["time"] - rows[0]["time"]) / (rows[-1]["step"] - rows[0]["step"]) if len(rows) > 1 else None
    lengths = [r.get("completions/mean_length") for r in rows if r.get("completions/mean_length") is not None]
    cut = [r.get("completions/clipped_ratio") for r in rows if r.get("completions/clipped_ratio") is not None]
    longest = smoke.get("sampling_longest") or []
    return {
        "forecast": forecast,
        "actual": actual,
        "error": (actual - forecast) / forecast if forecast else None,
        "smoke_median_step": statistics.median(costs) if costs else None,
        "smoke_mean_step": statistics.fmean(costs) if costs else None,
        "forecast_step": (smoke.get("train_seconds") or 0.0) / max(1, e.get("total_steps") or 1),
        "full_step": full_step,
        "smoke_longest": statistics.fmean(longest) if longest else None,
        "full_mean_length": statistics.fmean(lengths) if lengths else None,
        "full_cut": statistics.fmean(cut) if cut else None,
        "export_forecast": smoke.get("export_seconds"),
        "export": export,
        "startup_forecast": smoke.get("startup_seconds"),
    }


BUSY = "while True: pass"  # one core's worth of work, until killed


def _until_ended(run: Path) -> None:
    """Wait until the detached run has ended, its export included (as `ftrun status --watch` waits)."""
    from launcher.run import progress
    from launcher.store.rundir import RunDir

    progress.watch(RunDir(run), out=open(os.devnull, "w"), live=False)


def _f(v, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(runs: list[tuple[Path, tuple | None]]) -> str:
    head = (
        f"{'run':<28} {'load':>11} {'forecast':>9} {'actual':>7} {'error':>6}   "
        f"{'step: fc':>8} {'smoke md':>8} {'smoke mn':>8} {'full':>6} {'full/fc':>7}   "
        f"{'longest':>7} {'len':>5} {'cut':>5}   {'export fc':>9} {'export':>6}"
    )
    lines = [head]
    for run, load in runs:
        m = measure(run)
        ratio = m["full_step"] / m["forecast_step"] if m["full_step"] and m["forecast_step"] else None
        loads = f"{load[0]:.1f}->{load[1]:.1f}" if load else "-"
        lines.append(
            f"{run.name:<28} {loads:>11} {_f(m['forecast'], '{:.0f} s'):>9} {_f(m['actual'], '{:.0f} s'):>7} "
            f"{_f(m['error'], '{:+.0%}'):>6}   {_f(m['forecast_step']):>8} {_f(m['smoke_median_step']):>8} "
            f"{_f(m['smoke_mean_step']):>8} {_f(m['full_step']):>6} {_f(ratio):>7}   "
            f"{_f(m['smoke_longest'], '{:.1f}'):>7} "
            f"{_f(m['full_mean_length'], '{:.1f}'):>5} {_f(m['full_cut'], '{:.0%}'):>5}   "
            f"{_f(m['export_forecast'], '{:.0f} s'):>9} {_f(m['export'], '{:.0f} s'):>6}"
        )
    lines.append(
        "step: fc = the forecast's training seconds per step; smoke md/mn = the median/mean of the smoke's measured "
        "steps; full = the full run's mean step (logged rows); longest = the smoke's longest answers (mean of its "
        "generate calls); len, cut = the full run's sampled answers' mean length and share cut at the cap"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*", type=Path, help="finished run directories to read")
    ap.add_argument("--repeat", type=int, default=0, help="run the recipe this many times first")
    ap.add_argument("--seeds", default="", help="comma-separated seeds, one per repeat (the recipe's own if empty)")
    ap.add_argument("--recipe", type=Path, default=RECIPE)
    ap.add_argument("--busy", type=int, default=0, help="CPU-bound processes in this session during each run")
    args = ap.parse_args(argv)
    seeds = [s for s in args.seeds.split(",") if s]
    done: list[tuple[Path, tuple | None]] = [(r.resolve(), None) for r in args.runs]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for i in range(args.repeat):
        out = ROOT / "runs" / f"grpo-eta-{time.strftime('%H%M%S')}-{i}"
        cmd = [sys.executable, "-m", "launcher.cli", str(args.recipe), f"output_dir={out}"]
        if i < len(seeds):
            cmd.append(f"seed={seeds[i]}")
        start = os.getloadavg()[0]
        busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.busy)]
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
            if rc == 0:
                _until_ended(out)
        finally:
            for p in busy:
                p.kill()
                p.wait()
        if rc != 0:
            print(f"{out}: ftrun exited {rc} (see {out}/train.log)", file=sys.stderr)
            continue
        done.append((out, (start, os.getloadavg()[0])))
    if not done:
        ap.error("give run directories or --repeat N")
    print(table(done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
