"""The task evaluation's wording: its scores as one table with the metric, the gain, the reference article's verdict."""

from __future__ import annotations

from typing import Any, Optional

from launcher.data import task_metrics
from launcher.data.task_verdict import (
    BARE_BASE,
    BARE_BASE_LABEL,
    BASE_FEW_SHOT,
    BASE_ZERO_SHOT,
    FINE_TUNED,
    PARENT_FEW_SHOT,
    PARENT_ZERO_SHOT,
    base_score,
    difference,
    exact_pair,
    noise_words,
    pct,
    start_name,
    verdict,
)
from launcher.run.views import format_duration
from launcher.worker.task_eval import PREFIX as TASK_EVAL_PREFIX

BASE_SCORES = (BASE_ZERO_SHOT, BASE_FEW_SHOT, PARENT_ZERO_SHOT, PARENT_FEW_SHOT)


def task_label(name: str, shots: Optional[int], start: str = "base model") -> str:
    """A row of the scores table; `start`: what the "base" rows scored ("parent adapter" for a run with init_from)."""
    if name in (BASE_ZERO_SHOT, PARENT_ZERO_SHOT):
        return f"{start}, zero-shot"
    if name in (BASE_FEW_SHOT, PARENT_FEW_SHOT):
        return f"{start}, {shots} examples" if shots else f"{start}, with examples"
    if name == BARE_BASE:
        return BARE_BASE_LABEL
    return "fine-tuned" if name == FINE_TUNED else name


def task_verdict(t: dict[str, Any]) -> str:
    """The verdict (launcher/data/task_verdict.py) with the fine-tune's forecast cost, else its time, where a prompt
    may be enough (facts.task_eval adds both)."""
    cost, hours = t.get("fine_tune_cost_eur"), t.get("fine_tune_hours")
    price = f"cost ~{cost:.2f} EUR" if cost else f"take ~{format_duration(hours * 3600)}" if hours else ""
    return verdict(t, price)


def task_rows(t: dict[str, Any]) -> list[tuple[str, float, Optional[float]]]:
    """(label, score, generation tokens/s) for each score stored: the base model's two, fine-tuned, each export."""
    scores, speed = t.get("scores") or {}, t.get("generation") or {}
    order = [n for n in (BARE_BASE, *BASE_SCORES, FINE_TUNED) if n in scores] + [
        n for n in scores if n not in (BARE_BASE, *BASE_SCORES, FINE_TUNED)
    ]
    start = start_name(t)  # init_from: the parent adapter, where the run starts
    return [
        (task_label(n, t.get("shots"), start), scores[n], (speed.get(n) or {}).get("tokens_per_s"))
        for n in order
        if scores[n] is not None
    ]


def format_task_eval(t: dict[str, Any]) -> str:
    """The scores as one table with the metric and the verdict (the end summary, `ftrun status` of a finished run,
    `ftrun baseline`, the launch before its smoke test)."""
    verdict = task_verdict(t)
    if t.get("not_applicable") or t.get("too_few") is not None:
        return f"  task      {verdict}"
    metric = t.get("metric")
    word = task_metrics.word(metric)
    lines = [
        f"  task      {t.get('examples')} held-out examples, scored by {metric}"
        + (f" ({word})" if word != metric else "")
        + (f": {t['metric_reason']}" if t.get("metric_reason") else "")
    ]
    if t.get("starting_point"):
        lines.append(f"            (the parent adapter rows: {t['starting_point']}, where this run starts)")
    cap = t.get("capped")
    if cap:  # the answers are cut by a setting before they can be as long as the references
        lines.append(
            f"            answers cut at {cap['max_new_tokens']} new tokens ({cap['key']}) while the longest "
            f"reference runs to about {cap['reference_tokens']} tokens: the scores are capped by that "
            f"setting; eval.task.max_new_tokens: {cap['reference_tokens']} lets the answers finish"
        )
    rows = task_rows(t)
    width = max([len(label) for label, _, _ in rows] + [10])
    beside = t.get("exact_beside") or {}  # single-word or numeric references: exact match beside the metric
    labels = {task_label(n, t.get("shots"), start_name(t)): n for n in (t.get("scores") or {})}
    for label, score, tps in rows:
        exact = beside.get(labels.get(label, ""))
        lines.append(
            f"            {label:<{width}}  {pct(score):>5}"
            + (f"  exact {pct(exact):>4}" if exact is not None else "")
            + (f"   ({tps:,.0f} tokens/s generated)" if tps else "")
        )
    scores = t.get("scores") or {}
    base, who = base_score(t)
    diff = difference(t)
    if diff is not None:
        # the difference of the two percents shown, and whether the n examples can tell it apart
        pair = exact_pair(t)
        lines.append(
            f"  gain      fine-tuned {pct(scores[FINE_TUNED])} against {pct(base)} for the {who} ({noise_words(diff)})"
            + (f"; exact {pct(pair[1])} against {pct(pair[0])}" if pair else "")
        )
    lines.append(f"  verdict   {verdict}")
    return "\n".join(lines)


def worker_line(line: str) -> str:
    return line.strip().removeprefix(TASK_EVAL_PREFIX).strip()


def baseline_failed(code: Optional[int], last: str, launching: bool) -> str:
    """One line: the base model could not be scored (the worker's exit code and last line); the launch goes on."""
    how = f"its worker exited with code {code}" if code is not None else "it could not run"
    said = worker_line(last)
    return (
        f"task evaluation: the base model was not scored ({how}"
        + (f": {said}" if said else "")
        + ")"
        + ("; the launch goes on without the verdict (`ftrun baseline RECIPE` tries again)" if launching else "")
    )
