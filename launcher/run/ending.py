"""A run's one door out: every ending leaves through `leave`, which writes the state and reason (the move `end`,
launcher/store/state.py MOVES), makes the last copy off the box, logs the reason, notifies, and runs on_finish last,
once a trained result is safe off the box (it may stop the box; `ftrun export` leaves it out).

The trackers are closed by the worker that holds them, not here: a worker killed by -9 leaves its tracked run open for
the next worker to reopen (launcher/worker/trackers.py).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from launcher import notify
from launcher.run.facts import end_summary
from launcher.run.summary_view import ENDING, format_end_summary
from launcher.run.supervisor_log import _log
from launcher.store.rundir import RunDir
from launcher.store.state import TRAINED, RunSnapshot, move


@dataclass
class Ending:
    """How a run ended: its state, why (None where the state holds it), the exit code, more facts for state.json."""

    state: str
    reason: Optional[str]
    code: int
    fields: dict[str, Any] = field(default_factory=dict)


def _record(run: RunDir, name: str, to: Optional[str] = None, log: Callable[[str], None] = _log, **fields) -> None:
    """A move of the run's state, but a full disk must not kill the supervisor: it says so in the log."""
    try:
        move(run, name, to, **fields)
    except OSError as exc:
        log(f"could not write state.json ({exc.strerror}); the run's state is {to or name}: {fields.get('reason', '')}")


def leave(
    run: RunDir, recipe, ending: Ending, syncer=None, log: Callable[[str], None] = _log, on_finish: bool = True
) -> int:
    """The end of a run, however it came: returns the command's exit code."""
    safe = True  # the result is where on_finish may rely on it
    if ending.state in TRAINED:
        if syncer:
            # the export's reason stays (trained, not exported: why); the copy's progress is added to it
            kept = ending.reason or RunSnapshot(run).state.get("reason") or "training finished"
            _record(run, "end", ending.state, log, reason=f"{kept}; copying the result to {recipe.sync.to}")
            safe = syncer.finish(final=True)
            if safe:
                _record(run, "end", ending.state, log, reason=f"{kept}; result verified at {recipe.sync.to}")
                syncer.sync_once()  # the state file itself, saying so
            else:
                why = f"{kept}, but the copy off the box failed: see sync.json; `ftrun push` retries"
                _record(run, "end", ending.state, log, reason=why)
    else:
        if syncer:
            syncer.finish(final=False)  # what exists goes off the box first, then the state says why
        _record(run, "end", ending.state, log, worker_pid=None, reason=ending.reason, **ending.fields)
        log(ending.reason)
    summary = end_summary(run)
    notify.send(recipe.notify, f"ftrun: run {ENDING[ending.state]}: {run.root.name}", format_end_summary(summary), log)
    if ending.state in TRAINED and safe and on_finish:
        _on_finish(recipe, log)
    return ending.code


def _on_finish(recipe, log: Callable[[str], None]) -> None:
    """The recipe's on_finish commands (argument lists, no shell), after the result is safe off the box."""
    for argv in recipe.on_finish:
        log(recipe.redact("on_finish: " + " ".join(argv)))
        try:
            res = subprocess.run(argv, stdin=subprocess.DEVNULL, timeout=600)
            if res.returncode != 0:
                log(f"on_finish command exited with {res.returncode}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            log(recipe.redact(f"on_finish command failed: {exc}"))
