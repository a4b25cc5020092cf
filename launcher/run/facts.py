"""Reads a run's facts from its run directory: its status (`run_status`), the list of runs, the end summary's numbers.

Never imports torch (`ftrun status` must answer fast on a busy box); one reading, so text, JSON and summary agree.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

from launcher import methods
from launcher.plan.mfu import model_flops_utilization
from launcher.run.commands import serve_command
from launcher.run.views import rank_end_text
from launcher.run.watchdog import heartbeat_rows
from launcher.store import final as final_result
from launcher.store.checkpoint import newest_step_unverified, step_dir_name
from launcher.store.rundir import RunDir
from launcher.store.state import (
    ACTIVE,
    ENDED,
    RunSnapshot,
    is_locked,
    last_metrics,
    read_json,
    run_holder,
    run_processes,
    same_process,
)


def metrics_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of metrics.jsonl (a half-written last line is skipped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


# A reward whose spread was 0 in this many logged rows in a row, up to the last, has stopped varying (fewer rows: all)
FLAT_WINDOW = 5
_ZERO = 1e-9


def _trailing(rows: list[dict[str, Any]], holds) -> Optional[int]:
    """The index where the stretch of rows for which `holds` is true up to the last row begins; None if the last
    row breaks it, or the stretch is shorter than FLAT_WINDOW while more rows were logged."""
    start = len(rows)
    while start > 0 and holds(rows[start - 1]):
        start -= 1
    if start == len(rows) or len(rows) - start < min(FLAT_WINDOW, len(rows)):
        return None
    return start


def _part(row: dict[str, Any], name: str, which: str, apart: bool) -> Optional[float]:
    """One reward's mean or std in a row (`apart`), else the weighted sum's (reward, reward_std)."""
    if apart:
        return (methods.reward_parts(row).get(name) or {}).get(which)
    return row.get("reward" if which == "mean" else "reward_std")


def _flat(spread: Optional[float]) -> bool:
    return spread is not None and abs(spread) < _ZERO


def reward_facts(train: list[dict[str, Any]]) -> dict[str, Any]:
    """GRPO's rewards in the training rows: each reward's mean and spread in the last row ("parts"), those that
    stopped varying ("flat"), and whether no prompt's answers differed in reward ("no_variance"). Rows without the
    rewards apart have only the weighted sum: it stands for them."""
    rows = [r for r in train if r.get("reward") is not None]
    if not rows:
        return {}
    last = rows[-1]
    parts = methods.reward_parts(last)
    flat = []
    for name in parts or ["reward"]:
        start = _trailing(rows, lambda r, name=name: _flat(_part(r, name, "std", bool(parts))))
        if start is not None:
            flat.append(
                {
                    "name": name,
                    "value": _part(last, name, "mean", bool(parts)),
                    "since_step": rows[start]["step"],
                    "rows": len(rows) - start,
                    "whole_run": start == 0,
                }
            )
    start = _trailing(
        rows, lambda r: r.get("frac_reward_zero_std") is not None and r["frac_reward_zero_std"] >= 1 - _ZERO
    )
    return {
        "parts": [{"name": n, **p} for n, p in parts.items()],
        "flat": flat,
        "no_variance": (
            {"since_step": rows[start]["step"], "rows": len(rows) - start, "whole_run": start == 0}
            if start is not None
            else None
        ),
    }


def _box_seconds(
    history: list[dict[str, Any]], live: bool, states: tuple[str, ...] = ACTIVE, until: Optional[float] = None
) -> float:
    """Box time the run has used: the intervals spent smoking, running or recovering (resumes included);
    with `states`, only those (the full run's own time: running, recovering); `until`: none after that moment."""
    used = 0.0
    for i, h in enumerate(history):
        if h.get("state") in states:
            end = history[i + 1]["at"] if i + 1 < len(history) else (time.time() if live else h["at"])
            end = min(end, until) if until is not None else end
            used += max(end - h["at"], 0.0)
    return used


def _phases(history: list[dict[str, Any]], export: Optional[dict[str, Any]]) -> dict[str, float]:
    """An ended run's time by phase (what `ftrun status`'s "in all" covers), by the states each spent."""
    out = {
        "plan and baseline": _box_seconds(history, False, ("planned",)),
        "smoke test": _box_seconds(history, False, ("smoking",)),
        "training and evaluation": _box_seconds(history, False, ("running", "recovering")),
        "export": float((export or {}).get("seconds") or 0.0),
    }
    return {k: round(v, 1) for k, v in out.items() if v > 0}


def task_eval(run: RunDir, base_only: bool = False, snap: Optional[RunSnapshot] = None) -> dict[str, Any] | None:
    """The task evaluation's facts (launcher/worker/task_eval.py): final/task_eval.json after training, else (or with
    `base_only`) the base model's RUN/task_eval.json, with what the verdict weighs against it: the fine-tune's
    forecast time and cost (the smoke test's, else the plan's). None when neither file exists."""
    paths = [run.task_eval] if base_only else [run.final / run.task_eval.name, run.task_eval]
    found = next((p for p in paths if p.is_file()), None)
    record = read_json(found) if found else {}
    if not record:
        return None
    snap = snap or RunSnapshot(run)
    plan, smoke = snap.plan, snap.smoke
    estimate = plan.get("estimate") or {}
    hours = smoke.get("estimated_hours") if smoke.get("estimated_hours") is not None else estimate.get("hours")
    cost = smoke.get("estimated_cost") if smoke.get("price_per_hour_eur") else estimate.get("cost_eur")
    return {**record, "file": str(found), "fine_tune_hours": hours, "fine_tune_cost_eur": cost}


def run_status(run: RunDir, snap: Optional[RunSnapshot] = None) -> dict[str, Any]:
    """What `ftrun status --json` prints: one reading of the run's files (no torch), the command's `snap` if given."""
    from launcher.store.sync import status_fields as sync_status_fields

    snap = snap or RunSnapshot(run)
    data, plan, smoke, last, last_eval = snap.state, snap.plan, snap.smoke, snap.last, snap.last_eval
    holder = run_holder(run, data)
    # workers still training into the run with no supervisor over them (it was killed hard)
    orphans = [] if holder else [p["pid"] for p in run_processes(run)]
    worker = read_json(run.worker)
    ckpt_step = newest_step_unverified(run.checkpoints)
    state = data.get("state", "none")
    if state in ACTIVE and holder is None:
        state = "interrupted"  # state.effective_state, from the same reading
    # a worker.json of another mode, or older than the full run's launch, says nothing of its steps: the plan's counts
    full_worker = worker.get("mode") == "full" and (worker.get("started") or 0) >= _last_moved_to_running(data)
    start_step = worker.get("start_step", 0) if full_worker else 0
    # a checkpoint is progress too (a run shorter than logging_steps logs no step)
    step = max(last.get("step", start_step), ckpt_step or 0)
    total = (worker.get("total_steps") if full_worker else None) or plan.get("total_steps")
    ckpt_age = None
    if ckpt_step is not None:
        manifest = run.checkpoints / step_dir_name(ckpt_step) / "manifest.json"
        ckpt_age = round(time.time() - manifest.stat().st_mtime, 1) if manifest.is_file() else None
    eta = None
    if total and step and state == "running" and full_worker:
        started, done_since = worker.get("started"), step - start_step
        if started and done_since > 0:
            eta = round((time.time() - started) / done_since * (total - step), 1)
    final = next(
        (str(run.final / n) for n in (final_result.MODEL, final_result.ADAPTER) if (run.final / n).is_dir()), None
    )
    memory = plan.get("memory") or {}
    s = {
        "run_dir": str(run.root),
        "state": state,
        "step": step,
        "total_steps": total,
        "loss": last.get("loss"),
        "loss_step": last.get("step"),  # the logged row the loss and tokens/s come from (logging_steps)
        "eval_loss": last_eval.get("eval_loss"),
        "eval_step": last_eval.get("step"),
        # a preference objective's rewards (methods.py logged), the last training row's and eval pass's
        "margin": last.get("rewards/margins"),
        "accuracy": last.get("rewards/accuracies"),
        "eval_margin": last_eval.get("eval_rewards/margins"),
        "eval_accuracy": last_eval.get("eval_rewards/accuracies"),
        # KTO's (unpaired answers: no accuracy): its KL estimate against the reference, the last training row's
        "kl": last.get("kl"),
        # GRPO's sampled answers' reward, mean and spread in the last row; then each apart, and those gone flat
        "reward": last.get("reward"),
        "reward_std": last.get("reward_std"),
        **(_reward_status(run) if last.get("reward") is not None else {}),
        "tokens_per_second": last.get("tokens_per_second"),
        "mfu": (model_flops_utilization(plan, last.get("tokens_per_second")) if plan.get("device") == "cuda" else None),
        "tokens_seen": last.get("tokens_seen"),
        "eta_seconds": eta,
        "updated_at": data.get("updated_at"),
        "pid": data.get("supervisor_pid"),
        "pid_alive": bool(holder) and holder["role"] == "supervisor",
        "launcher_pid": holder["pid"] if holder and holder["role"] == "launcher" else None,
        "worker_pid": data.get("worker_pid"),
        "worker_alive": same_process(data.get("worker_proc")) and is_locked(run),
        "orphan_worker_pids": orphans,
        "restarts": data.get("restarts", 0),
        "last_checkpoint": f"step-{ckpt_step:06d}" if ckpt_step is not None else None,
        "last_checkpoint_age_seconds": ckpt_age,
        "smoke_estimated_seconds": smoke.get("estimated_seconds"),
        "reason": data.get("reason"),
        "resume_command": data.get("resume_command"),
        "final": final,
        "log": str(run.log),
        "engine": plan.get("engine"),
        "num_processes": plan.get("num_processes"),
        "launch_argv": data.get("launch_argv"),
        "world_size": (worker.get("verification") or {}).get("world_size", worker.get("world_size")),
        "verification": worker.get("verification") or data.get("verification"),
        "export": data.get("export"),
        "loss_plot": str(run.root / "loss.png") if (run.root / "loss.png").is_file() else None,
        # the plan's memory, calibrated by the smoke test's measured peak once it passed
        "device": plan.get("device"),
        "memory_gb": memory.get("per_gpu_gb"),
        "memory_source": memory.get("source"),
        "estimated_memory_gb": memory.get("estimated_per_gpu_gb"),
        "adjustments": [a.get("reason") for a in plan.get("adjustments", []) if not a.get("mid_run")],
        # an out of memory mid-run that undid the plan's faster setting (launcher/run/oom_restart.py)
        "oom_restarts": [a["mid_run"] for a in plan.get("adjustments", []) if a.get("mid_run")],
        # each rank's last heartbeat while a multi-process run trains (watchdog.py)
        "heartbeats": (
            heartbeat_rows(snap.heartbeats, time.time())
            if state in ("running", "recovering") and (plan.get("num_processes") or 1) > 1
            else []
        ),
        "last_restart": rank_end_text(data["last_end"]) if data.get("last_end") else None,
        "task_eval": task_eval(run, snap=snap),
        **sync_status_fields(run),
    }
    s.update(time_and_money(s, data.get("history", []), plan, smoke, _last_sign_of_life(run, data, last, holder)))
    if state in ENDED:
        s["phase_seconds"] = _phases(data.get("history", []), data.get("export"))
        trained = [r for r in metrics_rows(run.metrics) if "loss" in r and r.get("time")]
        # a finished run's speed: tokens over the time spent training (loads, evaluations, checkpoints included)
        wall = (
            _box_seconds(data.get("history", []), False, ("running", "recovering"), until=trained[-1]["time"])
            if trained
            else 0.0
        )
        if trained and trained[-1].get("tokens_seen") and wall > 0:
            s["average_tokens_per_second"] = round(trained[-1]["tokens_seen"] / wall, 1)
    return s


def _reward_status(run: RunDir) -> dict[str, Any]:
    facts = reward_facts([r for r in metrics_rows(run.metrics) if r.get("loss") is not None])
    return {
        "reward_parts": facts.get("parts") or [],
        "flat_rewards": facts.get("flat") or [],
        "no_reward_variance": facts.get("no_variance"),
    }


def _last_sign_of_life(run: RunDir, data: dict[str, Any], last: dict[str, Any], holder: Any) -> Optional[float]:
    """When an interrupted run (its processes gone) last did something: the newest of its state's update, its last
    logged row, its files' writes. None for any other state."""
    if data.get("state") not in ACTIVE or holder is not None:
        return None
    seen = [data.get("updated_at"), last.get("time")]
    for path in (run.log, run.metrics, run.worker):
        try:
            seen.append(path.stat().st_mtime)
        except OSError:
            pass
    return max((float(t) for t in seen if t), default=None)


def time_and_money(
    s: dict[str, Any],
    history: list[dict[str, Any]],
    plan: dict[str, Any],
    smoke: dict[str, Any],
    died_at: Optional[float] = None,
) -> dict[str, Any]:
    """Box time and euros so far and to go, beside what the smoke test and the plan forecast. `died_at`: an
    interrupted run counts its last interval up to then."""
    live = s["state"] in ACTIVE or died_at is not None
    used = _box_seconds(history, live, until=died_at)
    price = plan.get("price_per_hour_eur")
    eta = s.get("eta_seconds")
    estimate = plan.get("estimate_as_planned") or plan.get("estimate") or {}  # what the printed plan said
    at_resume = plan.get("estimate_at_resume") or {}  # the plan made again at the newest resume (prepare.py)
    return {
        "elapsed_seconds": round(used, 1),
        # what the forecasts are for: the full run after the smoke test (its restarts included)
        "run_seconds": round(_box_seconds(history, live, ("running", "recovering"), until=died_at), 1),
        "price_per_hour_eur": price,
        "cost_so_far_eur": round(used / 3600 * price, 2) if price is not None else None,
        "cost_to_go_eur": round(eta / 3600 * price, 2) if price is not None and eta is not None else None,
        "plan_estimated_seconds": round(estimate["hours"] * 3600, 1) if estimate.get("hours") is not None else None,
        "plan_estimated_cost_eur": estimate.get("cost_eur"),
        "resume_estimated_seconds": round(at_resume["hours"] * 3600, 1) if at_resume.get("hours") is not None else None,
        "resume_estimated_cost_eur": at_resume.get("cost_eur"),
        "smoke_estimated_cost_eur": smoke.get("estimated_cost"),
    }


def _last_moved_to_running(data: dict[str, Any]) -> float:
    """When the newest launch of the full run began (its last move into `running` from another state)."""
    history = data.get("history", [])
    for h in reversed(history):
        if h.get("state") == "running":
            return float(h.get("at") or 0.0)
    return 0.0


def find_runs(root: Path) -> list[RunDir]:
    """The run directories directly under `root` (./runs), by name."""
    if not root.is_dir():
        return []
    return [RunDir(p) for p in sorted(root.iterdir()) if p.is_dir() and (p / "recipe.yaml").is_file()]


def run_row(run: RunDir) -> dict[str, Any]:
    """One line's worth of a run: name, state, step/total, loss, age (since its state or its last logged step)."""
    s = run_status(run)
    times = [t for t in (s.get("updated_at"), last_metrics(run.metrics).get("time")) if t]
    return {
        "run_dir": s["run_dir"],
        "name": run.root.name,
        "state": s["state"],
        "step": s["step"],
        "total_steps": s["total_steps"],
        "loss": s["loss"],
        # what tells the run's progress: GRPO's reward, a preference objective's margin, else the loss
        "figure": next(
            (
                (name, s[key])
                for name, key in (("reward", "reward"), ("margin", "margin"), ("loss", "loss"))
                if s.get(key) is not None
            ),
            None,
        ),
        "age_seconds": round(time.time() - max(times), 1) if times else None,
    }


def _preference_first_last(evals: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    rows = [r for r in evals if r.get("eval_rewards/margins") is not None]
    if not rows:
        return None
    # chosen and rejected apart: a margin that rises while the chosen answers' reward falls lowers their likelihood
    keys = {"margin": "margins", "accuracy": "accuracies", "step": None, "chosen": "chosen", "rejected": "rejected"}
    return {
        f"{name}_{end}": row["step"] if key is None else row.get(f"eval_rewards/{key}")
        for name, key in keys.items()
        for end, row in (("first", rows[0]), ("last", rows[-1]))
    }


def _rewards_first_last(train: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """GRPO's sampled answers' reward, mean and spread, at the first and the last logged step."""
    rows = [r for r in train if r.get("reward") is not None]
    if not rows:
        return None
    first_parts, facts = methods.reward_parts(rows[0]), reward_facts(rows)
    return {
        "first": rows[0]["reward"],
        "first_std": rows[0].get("reward_std"),
        "step_first": rows[0]["step"],
        "last": rows[-1]["reward"],
        "last_std": rows[-1].get("reward_std"),
        "step_last": rows[-1]["step"],
        # each reward apart, first -> last logged row
        "parts": [
            {
                "name": p["name"],
                "first": (first_parts.get(p["name"]) or {}).get("mean"),
                "first_std": (first_parts.get(p["name"]) or {}).get("std"),
                "last": p["mean"],
                "last_std": p["std"],
            }
            for p in facts["parts"]
        ],
        "flat": facts["flat"],
        "no_variance": facts["no_variance"],
    }


def end_summary(run: RunDir, snap: Optional[RunSnapshot] = None) -> dict[str, Any]:
    """The finished run in numbers: loss first -> last (eval loss too when logged), tokens, wall time against
    the forecasts, cost at the box's price, the result and how to serve it."""
    s = run_status(run, snap)
    rows = metrics_rows(run.metrics)
    train = [r for r in rows if r.get("loss") is not None]
    evals = [r for r in rows if r.get("eval_loss") is not None]
    tokens = max((int(r.get("tokens_seen") or 0) for r in rows), default=0) or None
    forecast = s.get("smoke_estimated_seconds") or s.get("plan_estimated_seconds")
    samples = run.final / "samples.md"
    return {
        "run_dir": s["run_dir"],
        "state": s["state"],
        "reason": s.get("reason"),
        "step": s["step"],
        "total_steps": s["total_steps"],
        "loss_first": train[0]["loss"] if train else None,
        "loss_last": train[-1]["loss"] if train else None,
        "loss_first_step": train[0]["step"] if train else None,
        "loss_last_step": train[-1]["step"] if train else None,
        "eval_loss_first": evals[0]["eval_loss"] if evals else None,
        "eval_loss_last": evals[-1]["eval_loss"] if evals else None,
        "preference": _preference_first_last(evals),
        "rewards": _rewards_first_last(train),
        "tokens": tokens,
        "wall_seconds": s.get("run_seconds"),
        "box_seconds": s.get("elapsed_seconds"),
        "forecast_seconds": forecast,
        "forecast_source": "smoke test" if s.get("smoke_estimated_seconds") else "plan" if forecast else None,
        "price_per_hour_eur": s.get("price_per_hour_eur"),
        "cost_eur": s.get("cost_so_far_eur"),
        "result": s.get("final"),
        "samples": str(samples) if samples.is_file() else None,
        "serve": serve_command(run, s.get("final")),
        "export": s.get("export"),
        "pid_alive": s.get("pid_alive"),
        "task_eval": s.get("task_eval"),
    }
