"""The end-of-run summary: the lines a run's end prints, headed by how it ended (from facts.py `end_summary`)."""

from __future__ import annotations

from typing import Any

from launcher.run.task_eval_view import format_task_eval
from launcher.run.views import _mean_spread, _summary_says_reason, format_duration, preference_accuracy, reward_warnings


# How the end of a run is headed, for every state that ends one (store/state.py ENDED; tests/test_tables.py).
ENDING = {
    "succeeded": "finished",
    "trained-not-exported": "finished (its export failed)",
    "stopped": "stopped",
    "preempted": "preempted",
    "failed": "FAILED",
    "failed-smoke": "smoke test FAILED",
}


def exporting(s: dict[str, Any]) -> bool:
    """The training finished and a live supervisor is still exporting."""
    return (s.get("export") or {}).get("state") == "running" and bool(s.get("pid_alive", True))


def format_end_summary(e: dict[str, Any]) -> str:
    """The lines a run's end prints (the foreground run, `ftrun status --watch`, `ftrun status` of a finished run)."""
    head = ENDING.get(e["state"], e["state"])
    if e["state"] == "trained-not-exported" and (e.get("export") or {}).get("state") == "stopped":
        head = "finished (its export stopped by `ftrun stop`)"
    if e["state"] == "succeeded" and exporting(e):
        head = "trained (its export is still running)"  # not "finished" beside an export line that says running
    step = f"step {e['step']}/{e['total_steps']}" if e.get("total_steps") else f"step {e.get('step') or 0}"
    lines = [f"== run {head} at {step}: {e['run_dir']}"]
    if _summary_says_reason(e) and e.get("reason"):
        lines.append(f"  {e['reason']}")
    if e.get("loss_first") is not None:
        lines.append(
            f"  loss      {e['loss_first']:.4f} (step {e['loss_first_step']}) -> {e['loss_last']:.4f} "
            f"(step {e['loss_last_step']})"
        )
    if e.get("eval_loss_first") is not None:
        lines.append(f"  eval loss {e['eval_loss_first']:.4f} -> {e['eval_loss_last']:.4f}")
    sampled = e.get("rewards")
    if sampled:
        lines.append(
            f"  reward    {sampled['first']:.3f} +- {sampled['first_std'] or 0:.3f} (step {sampled['step_first']}) -> "
            f"{sampled['last']:.3f} +- {sampled['last_std'] or 0:.3f} (step {sampled['step_last']}): the sampled "
            "answers' mean and spread" + (", the weighted sum of:" if len(sampled.get("parts") or []) > 1 else "")
        )
        parts = sampled.get("parts") or []
        if len(parts) > 1:
            width = max(len(p["name"]) for p in parts)
            lines.extend(
                f"            {p['name']:<{width}}  {_mean_spread(p['first'], p['first_std'])} -> "
                f"{_mean_spread(p['last'], p['last_std'])}"
                for p in parts
            )
        lines.extend(reward_warnings(sampled.get("flat") or [], sampled.get("no_variance")))
    pref = e.get("preference")
    if pref:
        # KTO logs no accuracy (its answers are unpaired): the margin is desirable minus undesirable answers' reward
        paired = pref["accuracy_first"] is not None or pref["accuracy_last"] is not None
        chosen, rejected = ("chosen", "rejected") if paired else ("desirable", "undesirable")
        lines.append(
            f"  rewards   held-out margin {pref['margin_first']:.3f} (step {pref['step_first']}) -> "
            f"{pref['margin_last']:.3f} (step {pref['step_last']})"
            + (
                f"; preference accuracy {preference_accuracy(pref['accuracy_first'], pref['margin_first'])} -> "
                f"{preference_accuracy(pref['accuracy_last'], pref['margin_last'])}"
                if paired
                else " (desirable minus undesirable answers)"
            )
        )
        if pref.get("chosen_first") is not None and pref.get("chosen_last") is not None:
            fell = pref["chosen_last"] < pref["chosen_first"]
            lines.append(
                f"            {chosen} answers' reward {pref['chosen_first']:.3f} -> {pref['chosen_last']:.3f}, "
                f"{rejected} {pref['rejected_first'] or 0:.3f} -> {pref['rejected_last'] or 0:.3f}"
                + (
                    f"; the {chosen} answers fell too: less likely than under the reference (lower "
                    "preference.beta or the learning rate if the task score fell)"
                    if fell
                    else ""
                )
            )
    if e.get("tokens"):
        # the count logged with the last loss: short of the run's own where the last step logged none (logging_steps)
        logged = e.get("loss_last_step")
        lines.append(
            f"  tokens    {e['tokens']:,}"
            + (f" (by step {logged}, the last logged one)" if logged and logged < (e.get("step") or 0) else "")
        )
    if e.get("wall_seconds"):
        fc, what = e.get("forecast_seconds"), ""
        step, total = e.get("step") or 0, e.get("total_steps") or 0
        if fc and total and step < total:
            # a run that ended early is compared with the forecast for the steps it ran, not the whole run's
            fc, what = (fc * step / total if step else None), f" for {step} of {total} steps"
        # the smoke test's forecast counts the export, which runs after `running`: its seconds are added
        export = (e.get("export") or {}).get("seconds") if e.get("forecast_source") == "smoke test" else None
        actual = e["wall_seconds"] + (export or 0.0)
        lines.append(
            f"  time      {format_duration(e['wall_seconds'])} running"
            + (f" + {format_duration(export)} export" if export else "")
            + (
                f" (the {e['forecast_source']} forecast{what} {format_duration(fc)}, {(actual - fc) / fc:+.0%})"
                if fc
                else ""
            )
            + (
                f"; {format_duration(e['box_seconds'])} on the box with the smoke test"
                if (e.get("box_seconds") or 0) > e["wall_seconds"] + 1
                else ""
            )
        )
    if e.get("price_per_hour_eur") is not None and e.get("cost_eur") is not None:
        lines.append(f"  cost      {e['cost_eur']:.2f} EUR at {e['price_per_hour_eur']:.2f} EUR/h (the box time above)")
    if e.get("result"):
        lines.append(f"  result    {e['result']}")
    if e.get("samples"):
        lines.append(f"  samples   {e['samples']} (answers before and after the training)")
    if e.get("task_eval"):
        lines.append(format_task_eval(e["task_eval"]))
    ex = e.get("export") or {}
    if ex.get("state") == "succeeded" and ex.get("serving"):
        lines.append(f"  serving   {ex['serving']}")
    elif ex.get("state") == "failed":
        lines.append(f"  export    failed: {ex.get('reason')}")
    if e.get("serve"):
        lines.append(f"  serve it  {e['serve']}")
    return "\n".join(lines)
