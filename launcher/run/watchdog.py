"""The supervisor's progress watchdog: which rank has been silent past its phase's deadline, from the heartbeats.

Every rank replaces its heartbeat file as it works (launcher/worker/heartbeat.py); a rank that stops making progress
(a hung GPU, a stuck collective, a stopped process) goes silent, and its peers go silent with it at their next
collective. The deadlines are launcher/plan/deadlines.py's.
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
    """The facts of the rank to blame when any rank is silent past its deadline, else None.

    A rank without a heartbeat yet counts as starting since the launch. When one rank is overdue, every rank
    silent for over half its own deadline is a suspect (a peer waiting in a collective goes silent too); the one
    blamed is a stopped or stuck process first, then the one at the lowest step, then the longest silent.
    "behind" lists the ranks that explain it: the stuck ones, else those at the lowest step. During an NCCL or GPU
    hang every rank blocks at the next collective at the same step, and the heartbeats (at most every
    HEARTBEAT_SECONDS) cannot tell who blocked first: "all_silent" says so, rather than naming one rank at random."""
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
