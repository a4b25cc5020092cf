"""How long each phase of a rank may stay silent: the watchdog's deadlines (launcher/run/watchdog.py) and the process
group's backstop timeout above them (launcher/worker/trainer_config.py), from the plan and smoke.json. Owns the
ranks' heartbeat interval (HEARTBEAT_SECONDS, launcher/worker/heartbeat.py).
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Optional

# A rank is silent too long after WATCHDOG_FACTOR x its phase's expected time and the floor (docs/engines.md).
WATCHDOG_FACTOR = 10.0
WATCHDOG_FLOOR_S = 300.0
FLOOR_ENV = "FTRUN_WATCHDOG_FLOOR_S"
# The process group's timeout: this many times the longest deadline of a phase in which ranks wait for each other.
BACKSTOP_FACTOR = 2.0
# The worker's heartbeat write interval: a live rank's file may be this old, so every deadline adds it.
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
    """Each phase's expected seconds from the smoke test's measurements, else the plan's; None where neither says.
    start adds one checkpoint's verification, export (the final save and the samples) one save."""

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
    """Seconds a rank's heartbeat may be old before the watchdog acts."""
    return max(WATCHDOG_FACTOR * (expected or 0.0), floor) + HEARTBEAT_SECONDS


def phase_deadline(phase: str, expected: Mapping[str, Optional[float]], floor: float) -> float:
    """deadline() for one phase; a start-up nothing measured or planned gets UNKNOWN_START_FACTOR floors (a false
    alarm there would restart the same slow load until the budget is spent)."""
    value = expected.get(phase)
    return deadline(value, floor * (UNKNOWN_START_FACTOR if phase == "start" and value is None else 1.0))


def process_group_timeout(plan: Mapping[str, Any], smoke: Mapping[str, Any], floor: Optional[float] = None) -> int:
    """The process group's timeout in whole seconds, above every collective phase's deadline so the watchdog (which
    says which rank and why) acts first."""
    floor = floor_seconds() if floor is None else floor
    expected = expected_seconds(plan, smoke)
    return math.ceil(BACKSTOP_FACTOR * max(deadline(expected[p], floor) for p in COLLECTIVE_PHASES))
