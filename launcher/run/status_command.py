"""`ftrun status`: one run (text or JSON, once or until it ends), or without a target the runs listing: every run
under ./runs, a line each."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

from launcher.run.facts import end_summary, find_runs, run_row, run_status
from launcher.run.run_dirs import resolve_run
from launcher.run.progress import watch
from launcher.run.summary_view import format_end_summary
from launcher.run.views import format_runs, format_status
from launcher.store.rundir import RUNS
from launcher.store.state import ACTIVE, ENDED, RunSnapshot


def status_command(
    target: Optional[str], as_json: bool = False, watching: bool = False, sleep: Callable[[float], None] = time.sleep
) -> int:
    """Several runs under ./runs (no target): one line each. One run: its status and, once it ended, its summary;
    `watching`: the live bar until it ends, or with `as_json` the JSON again every 2 s."""
    if target is None:
        runs = find_runs(Path.cwd() / RUNS)
        if len(runs) > 1 or (not runs and as_json):  # several runs: one line each
            rows = [run_row(r) for r in runs]
            print(json.dumps(rows, indent=2) if as_json else format_runs(rows))
            return 0
        if not runs:  # nothing to show is not an error
            print(
                f"no runs under ./{RUNS}: start one with `ftrun RECIPE`, or name a recipe or run directory "
                "(`ftrun status RECIPE|RUN_DIR`)"
            )
            return 0
    run = resolve_run(target)
    if watching and not as_json:
        watch(run)
        return 0
    while True:  # each pass reads the run once: the state, files and rows it shows, and then its summary
        snap = RunSnapshot(run)
        s = run_status(run, snap)
        if as_json:
            print(json.dumps(s, indent=2), flush=True)
        else:
            print(format_status(s, ending_follows=s["state"] in ENDED), flush=True)
            if s["state"] in ENDED:
                print(format_end_summary(end_summary(run, snap)), flush=True)
        if not watching or s["state"] not in ACTIVE:
            return 0
        sleep(2)
