"""How long each phase of a rank may stay silent: the watchdog's deadlines and the process group's backstop.

Pure arithmetic from the plan and the smoke test's measurements (smoke.json). The supervisor's watchdog ends a run
whose rank is silent past its phase's deadline (launcher/run/watchdog.py); the worker sets the process group's own
timeout (SFTConfig ddp_timeout, launcher/worker/trainer_config.py) above every deadline, as a backstop that acts
only when the watchdog cannot (the supervisor is gone). Owns the ranks' heartbeat interval (HEARTBEAT_SECONDS),
which the worker writes at (launcher/worker/heartbeat.py) and every deadline adds.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Optional

# A rank is silent too long after WATCHDOG_FACTOR x its phase's expected time, and never before the floor: a step
# measured at 0.4 s by the smoke test may take far longer on a loaded box, a save on slow storage, a first step that
# compiles kernels. The floor is lowered by FLOOR_ENV (seconds; the tests of a hung rank set it), documented in
# docs/engines.md, "One rank down".
WATCHDOG_FACTOR = 10.0
WATCHDOG_FLOOR_S = 300.0
FLOOR_ENV = "FTRUN_WATCHDOG_FLOOR_S"
# The process group's timeout: this many times the longest deadline of a phase in which ranks wait for each other.
BACKSTOP_FACTOR = 2.0
# The longest a live rank leaves its heartbeat file unchanged within one phase (launcher/worker/heartbeat.py writes
# at this interval), so a live rank's file may be this old: every deadline adds it.
HEARTBEAT_SECONDS = 2.0
COLLECTIVE_PHASES = ("step", "hash", "save", "eval", "export")
UNKNOWN_START_FACTOR = 3.0


def floor_seconds(env: Optional[Mapping[str, str]] = None) -> float:
    """WATCHDOG_FLOOR_S, or FLOOR_ENV where set to a positive number of seconds."""
    raw = (os.environ if env is None else env).get(FLOOR_ENV)
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        value = 0.0
    return value if value > 0 else WATCHDOG_FLOOR_S


def expected_seconds(plan: Mapping[str, Any], smoke: Mapping[str, Any]) -> dict[str, Optional[float]]:
    """Each phase's expected duration in seconds, None where nothing measured or planned says.

    step: the smoke test's seconds_per_step, else the plan's training hours over its steps; save and hash: the smoke
    test's timed checkpoint (its save and hashing); eval: the smoke's forecast of the run's eval passes (an upper
    bound for one); export (the final save and the sample answers): one save plus the samples; start: the smoke's
    start-up (imports, load; else the plan's set-up hours) plus one checkpoint's verification."""

    def num(value: Any) -> Optional[float]:
        try:
            v = float(value)
        except (TypeError, ValueError):
            return None
        return v if v > 0 and math.isfinite(v) else None

    step = num(smoke.get("seconds_per_step"))
    if step is None:
        hours, steps = num((plan.get("estimate") or {}).get("hours")), num(plan.get("total_steps"))
        step = hours * 3600.0 / steps if hours and steps else None
    save = num(smoke.get("checkpoint_seconds"))
    samples = num(smoke.get("samples_seconds")) or 0.0
    startup = num(smoke.get("startup_seconds"))
    if startup is None:  # the plan's start-up (loading the model on the box), where it counts one
        setup = num((plan.get("estimate") or {}).get("setup_hours"))
        startup = setup * 3600.0 if setup else None
    return {
        "start": startup + (save or 0.0) if startup else None,
        "step": step,
        "hash": save,
        "save": save,
        "eval": num(smoke.get("eval_seconds")),
        "export": save + samples if save else None,
    }


def deadline(expected: Optional[float], floor: float) -> float:
    """Seconds a rank's heartbeat may be old before the watchdog acts: max(factor x expected, floor), plus the
    heartbeat's own write interval."""
    return max(WATCHDOG_FACTOR * (expected or 0.0), floor) + HEARTBEAT_SECONDS


def phase_deadline(phase: str, expected: Mapping[str, Optional[float]], floor: float) -> float:
    """deadline() for one phase; a start-up that nothing measured or planned (no smoke test, no set-up estimate) gets
    UNKNOWN_START_FACTOR floors: loading a large model from a slow disk takes minutes, and a false alarm there would
    restart the same slow load until the budget is spent."""
    value = expected.get(phase)
    return deadline(value, floor * (UNKNOWN_START_FACTOR if phase == "start" and value is None else 1.0))


def process_group_timeout(plan: Mapping[str, Any], smoke: Mapping[str, Any], floor: Optional[float] = None) -> int:
    """The process group's timeout in whole seconds: BACKSTOP_FACTOR x the longest deadline of a phase in which
    the ranks wait for each other, so the watchdog, which says which rank and why, always acts first."""
    floor = floor_seconds() if floor is None else floor
    expected = expected_seconds(plan, smoke)
    return math.ceil(BACKSTOP_FACTOR * max(deadline(expected[p], floor) for p in COLLECTIVE_PHASES))
