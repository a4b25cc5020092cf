"""Talks to a running supervisor from outside it: `ftrun stop` signals it, and workers left without one are ended."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any, Optional

from launcher.run.facts import end_summary
from launcher.run.summary_view import format_end_summary
from launcher.run.views import STOPPED_PREFIXES, stop_outcome, stop_waits_for
from launcher.store.rundir import RunDir
from launcher.store.state import ENDED, RunSnapshot, move, process_identity, run_holder, run_processes, same_process


def stop_command(run: RunDir) -> int:
    """`ftrun stop`: say what the stop waits for, stop the run, say how it ended (as `ftrun status` does) and sum up."""
    outcome = stop(run, say=lambda line: print(f"{run.root}: {line}", flush=True))
    print(f"{run.root}: {outcome}")
    if outcome == "stopped" or outcome.startswith(STOPPED_PREFIXES):
        print(format_end_summary(end_summary(run)))
    return 0


def stop(run: RunDir, timeout: float = 120.0, say=lambda line: None) -> str:
    """SIGTERM the run's verified supervisor (not its group: it forwards to the worker or the ranks) and wait until it
    exits; workers left without a supervisor are ended (end_orphans). A pid alone is never signalled (store/state.py).
    """
    snap = RunSnapshot(run)
    data = snap.state
    holder = run_holder(run, data)
    if holder is None:
        ended = end_orphans(run, _grace_seconds(run) + 15, log=print, data=data)
        if ended:
            return f"the supervisor was gone; ended its orphaned worker process(es) {', '.join(map(str, ended))}"
        state = data.get("state")
        if state in ENDED:
            return f"nothing to stop: the run already ended ({state}); no process was signalled"
        return "not running (no live supervisor holds the run; no process was signalled)"
    if holder["role"] != "supervisor":
        return (
            f"not stopped: pid {holder['pid']} is still planning or smoke-testing this run (state "
            f"{data.get('state', 'planned')}); interrupt it with Ctrl-C where it runs, or wait and stop the run"
        )
    move(run, "note", stop_requested=True)  # `stopped`, not `preempted`
    say(stop_waits_for(_phase(snap), _grace_seconds(run)))
    _signal_verified(holder, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while same_process(holder) and time.monotonic() < deadline:
        time.sleep(0.2)
    if same_process(holder):
        return "still stopping"
    return stop_outcome(RunSnapshot(run).state)  # what the supervisor wrote as it ended: read again


def _phase(snap: RunSnapshot) -> dict[str, Any]:
    """What the run does as the stop comes: export, after training (rank 0's heartbeat phase), or training."""
    beat = snap.heartbeats.get(0) or {}
    if (snap.state.get("export") or {}).get("state") == "running":
        return {"phase": "export", "step": beat.get("step")}
    return {"phase": "after training" if beat.get("phase") == "export" else "training", "step": beat.get("step")}


def _grace_seconds(run: RunDir) -> float:
    try:
        from launcher.recipe_loading import load_recipe

        return float(load_recipe(run.recipe).grace_seconds)
    except Exception:  # a recipe that no longer loads must not keep a stop from ending workers
        return 60.0


def _signal_verified(proc: dict[str, Any], sig: int) -> bool:
    """Send `sig` to the recorded process only if it is still that process (pid, start time, boot)."""
    if not same_process(proc):
        return False
    try:
        os.kill(proc["pid"], sig)
        return True
    except ProcessLookupError:
        return False


def end_orphans(run: RunDir, wait_seconds: float, log=print, data: Optional[dict[str, Any]] = None) -> list[int]:
    """Workers still training into the run without a supervisor: SIGTERM (they save and exit), SIGKILL what is left
    after wait_seconds; returns their pids. Found by their command line, each checked again (start time) before each
    signal; SIGKILL also goes to the dead supervisor's own session's group while a worker sits in it (a group id is
    not reused while a member lives). Only when run_holder is None; `data`: the state as the caller read it."""
    procs = run_processes(run)
    if not procs:
        return []
    pids = [p["pid"] for p in procs]
    # launchers carry the worker's arguments too: told apart by their command (a worker may fork a helper), not asked
    launchers = {
        p["pid"] for p in procs if any(a in ("torch.distributed.run", "accelerate.commands.launch") for a in p["argv"])
    }
    log(
        f"{run.root}: worker process(es) {', '.join(map(str, pids))} still train into this run without a supervisor; "
        f"asking them to save a checkpoint and exit (up to {wait_seconds:g} s)"
    )

    def asked(p: dict) -> bool:
        if p["pid"] in launchers:  # a launcher only while it has no ranks yet
            return not any(q["ppid"] == p["pid"] for q in procs)
        return p["ppid"] in launchers or p["ppid"] not in pids  # a rank, or a worker of its own (not a fork of one)

    for p in procs:
        if asked(p):
            _signal_verified(p, signal.SIGTERM)
    deadline = time.monotonic() + wait_seconds
    while any(same_process(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in procs if same_process(p)]
    if left:
        log(
            f"{run.root}: killing worker process(es) {', '.join(str(p['pid']) for p in left)} (no exit after "
            f"{wait_seconds:g} s)"
        )
        sup = (RunSnapshot(run).state if data is None else data).get("supervisor_proc") or {}
        same_boot = sup.get("boot") == (process_identity(os.getpid()) or {}).get("boot")
        group = sup.get("pgid") if same_boot and sup.get("pgid") == sup.get("pid") else None
        for p in left:
            if group and p["pgid"] == group and p["sid"] == group and same_process(p) and group != os.getpgrp():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)
            _signal_verified(p, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(same_process(p) for p in left) and time.monotonic() < deadline:
            time.sleep(0.1)
    return pids
