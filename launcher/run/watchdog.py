"""The supervisor's progress watchdog: which rank has been silent past its deadline (launcher/plan/deadlines.py),
from the heartbeats (launcher/worker/heartbeat.py); a stuck rank's peers go silent with it at their next collective.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional

from launcher.plan.deadlines import phase_deadline

# A process the kernel shows stopped or in uninterruptible sleep is the one to blame among the silent ranks.
STUCK_STATES = ("stopped", "tracing-stop", "disk-sleep")


def local_ranks(plan: Mapping[str, Any]) -> list[int]:
    """The global ranks this node's launcher starts (one node: 0..n-1)."""
    n = int(plan.get("num_processes") or 1)
    node = int((plan.get("nodes") or {}).get("node_rank", 0))
    return list(range(node * n, node * n + n))


def silent_rank(
    beats: Mapping[int, Mapping[str, Any]],
    ranks: Iterable[int],
    launched_at: float,
    now: float,
    expected: Mapping[str, Optional[float]],
    floor: float,
    process_state: Callable[[int], Optional[str]] = lambda pid: None,
) -> Optional[dict[str, Any]]:
    """The facts of the rank to blame when any rank is silent past its deadline, else None. Once one is overdue,
    every rank silent over half its deadline is a suspect; blamed: a stuck process first, then the lowest step, then
    the longest silent. "behind": the stuck ones, else those at the lowest step; "all_silent": every rank blocked at
    the same step (an NCCL or GPU hang), where the heartbeats cannot tell who blocked first."""
    suspects, overdue, watched = [], False, 0
    for rank in ranks:
        beat = beats.get(rank) or {}
        phase = beat.get("phase") or "start"
        if phase == "error":  # it raised and is ending: torchrun reports it
            continue
        watched += 1
        since = float(beat.get("time") or launched_at)
        silent, limit = now - since, phase_deadline(phase, expected, floor)
        if silent > limit / 2:
            state = process_state(int(beat["pid"])) if beat.get("pid") else None
            suspects.append(
                {
                    "rank": rank,
                    "silent_seconds": round(silent, 1),
                    "step": int(beat.get("step") or 0),
                    "phase": phase,
                    "expected_seconds": expected.get(phase),
                    "deadline_seconds": round(limit, 1),
                    **({"process_state": state} if state else {}),
                }
            )
            overdue = overdue or silent > limit
    if not overdue:
        return None
    blamed = min(suspects, key=lambda s: (s.get("process_state") not in STUCK_STATES, s["step"], -s["silent_seconds"]))
    stuck = [s["rank"] for s in suspects if s.get("process_state") in STUCK_STATES]
    behind = stuck or [s["rank"] for s in suspects if s["step"] == blamed["step"]]
    return {
        **blamed,
        "silent_ranks": [s["rank"] for s in suspects],
        "behind": behind,
        "all_silent": not stuck and watched > 1 and len(behind) == watched,
    }


def heartbeat_rows(beats: Mapping[int, Mapping[str, Any]], now: float) -> list[dict[str, Any]]:
    """Each rank's last heartbeat for `ftrun status`: rank, step, phase, seconds since."""
    return [
        {
            "rank": rank,
            "step": int(b.get("step") or 0),
            "phase": b.get("phase"),
            "seconds_ago": round(max(0.0, now - float(b.get("time") or now)), 1),
        }
        for rank, b in sorted(beats.items())
    ]
