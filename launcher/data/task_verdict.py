"""The reference article's verdict on the task evaluation's scores: does a fine-tune pay? A base model still wrong in
one case out of five with examples in its prompt pays for one (task_metrics.PAYS_BELOW); one right more often may
need only a prompt. final/task_eval.json stores the sentence (worker/task_eval.py record); the views add the
fine-tune's forecast cost where they show it (run/task_eval_view.py task_verdict)."""

from __future__ import annotations

from typing import Any, Optional

from launcher.data.task_metrics import PAYS_BELOW, fine_tune_pays, word as metric_word

# The score names of task_eval.json (each export adds its own: merged, gguf-q4_k_m)
BASE_ZERO_SHOT, BASE_FEW_SHOT, FINE_TUNED = "base_zero_shot", "base_few_shot", "fine_tuned"
# A run from a parent adapter (init_from) scores the parent where another scores the base; this row scores the base
# model without any adapter, so a chain (SFT, then DPO or GRPO) reads against the bare base too
BARE_BASE = "bare_base_zero_shot"
BARE_BASE_LABEL = "base model without the adapter, zero-shot"
# ... and the parent's rows (files written before 2026-12-06 call them base_* beside a starting_point: start_keys)
PARENT_ZERO_SHOT, PARENT_FEW_SHOT = "parent_zero_shot", "parent_few_shot"
_AS_PARENT = {BASE_ZERO_SHOT: PARENT_ZERO_SHOT, BASE_FEW_SHOT: PARENT_FEW_SHOT}


def stored_name(t: dict[str, Any], name: str) -> str:
    """The name task_eval.json keeps a score under (a run from a parent adapter names the parent's rows so)."""
    return _AS_PARENT.get(name, name) if t.get("starting_point") else name


def start_keys(t: dict[str, Any]) -> tuple[str, str]:
    """The names of the starting point's zero-shot and few-shot scores in `t`: the parent's (init_from), under their
    old base_ names in a file written before they had their own, else the base model's."""
    scores = (t.get("scores") or {}).keys()
    old = not scores & {PARENT_ZERO_SHOT, PARENT_FEW_SHOT} and scores & {BASE_ZERO_SHOT, BASE_FEW_SHOT}
    if t.get("starting_point") and not old:
        return PARENT_ZERO_SHOT, PARENT_FEW_SHOT
    return BASE_ZERO_SHOT, BASE_FEW_SHOT


def pct(value: float) -> str:
    return f"{value:.0%}"


def start_name(t: dict[str, Any]) -> str:
    """What the "base" scores scored: the base model, or the parent adapter a run from init_from starts from."""
    return "parent adapter" if t.get("starting_point") else "base model"


def base_score(t: dict[str, Any]) -> tuple[Optional[float], str]:
    """The score the verdict reads, and how to name it: the base model's better prompt of the two tried (base_key),
    with examples (the article's "good prompt with a few examples") or without."""
    key, start, shots = base_key(t), start_name(t), t.get("shots")
    score = (t.get("scores") or {}).get(key) if key else None
    if key is not None and key == start_keys(t)[1]:
        return score, f"{start} with {shots} examples" if shots else f"{start} with examples"
    return score, f"{start} zero-shot"


def base_key(t: dict[str, Any]) -> Optional[str]:
    """The score name base_score reads: few-shot where it scores at least the zero-shot one; None if neither is."""
    scores, shots = t.get("scores") or {}, t.get("shots")
    zero_key, few_key = start_keys(t)
    few = scores.get(few_key) if shots != 0 else None
    zero = scores.get(zero_key)
    if few is not None and (zero is None or few >= zero):
        return few_key
    return zero_key if zero is not None else None


def difference(t: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The fine-tuned score against the verdict's: {"gain" (points, as shown), "noise" (two standard errors of the
    per-example differences), "within" (|gain| inside the noise), "n", ...}; None until both are scored."""
    scores, key = t.get("scores") or {}, base_key(t)
    if key is None or scores.get(FINE_TUNED) is None:
        return None
    gain = int(pct(scores[FINE_TUNED]).rstrip("%")) - int(pct(scores[key]).rstrip("%"))
    mine, theirs = ((t.get("per_example") or {}).get(k) for k in (FINE_TUNED, key))
    n = int(t.get("examples") or len(mine or []) or 0)
    noise, unchanged = None, False
    if mine and theirs and len(mine) == len(theirs) and len(mine) > 1:
        d = [a - b for a, b in zip(mine, theirs)]
        unchanged = all(abs(x) < 1e-9 for x in d)
        mean = sum(d) / len(d)
        spread = (sum((x - mean) ** 2 for x in d) / (len(d) - 1)) ** 0.5
        noise = 100 * 2 * spread / len(d) ** 0.5
    elif n:
        noise = 100 / n  # without the per-example scores: one example's worth, the least a difference can be
    return {
        "gain": gain,
        "noise": noise,
        "within": noise is not None and abs(gain) <= noise,
        "n": n,
        "paired": bool(mine and theirs),
        "unchanged": unchanged,  # every example scored as before: no noise to speak of
    }


def exact_pair(t: dict[str, Any]) -> Optional[tuple[float, float]]:
    """(the base score's exact match, the fine-tuned one's) where task_eval.json shows exact beside another metric."""
    beside, key = t.get("exact_beside") or {}, base_key(t)
    if key is None or beside.get(key) is None or beside.get(FINE_TUNED) is None:
        return None
    return beside[key], beside[FINE_TUNED]


def _judged(t: dict[str, Any], diff: dict[str, Any], word: str) -> tuple[str, str]:
    """(the change in words, what follows the scores): better, worse or no measurable change; "no better" where the
    exact match beside it stayed (a chrF gain of shared characters)."""
    change = "no measurable change" if diff["within"] else "better" if diff["gain"] > 0 else "worse"
    pair = exact_pair(t)
    if pair is None:
        return change, ""
    said = f"; exact {pct(pair[0])} -> {pct(pair[1])}"
    if change == "better" and pair[1] <= pair[0]:
        return "no better", said + f": the {word} gain is credit for shared characters, not right answers"
    return change, said


def noise_words(diff: dict[str, Any]) -> str:
    """ "-1 point, within the ±6-point noise of 20 examples" (or beyond it, or what one example is worth)."""
    said = f"{diff['gain']:+d} point{'' if abs(diff['gain']) == 1 else 's'}"
    if diff.get("noise") is None:
        return said
    if not diff.get("paired"):
        return said + f", one example of {diff['n']} being worth {diff['noise']:.0f}"
    if diff.get("unchanged"):
        return said + f": each of the {diff['n']} examples scored as before"
    where = "within" if diff["within"] else "beyond"
    # a noise under half a point is said with its decimal: "±0-point noise" reads as none
    noise = f"{diff['noise']:.0f}" if diff["noise"] >= 0.5 else f"{diff['noise']:.1f}"
    return said + f", {where} the ±{noise}-point noise of {diff['n']} examples"


def verdict(t: dict[str, Any], price: str = "") -> str:
    """The verdict from task_eval.json's fields `t`; `price`: the fine-tune's cost, said where a prompt may do."""
    if t.get("not_applicable"):
        return f"the task evaluation does not apply to this data: {t['not_applicable']}"
    if t.get("too_few") is not None:
        return f"too few examples to score the task: {t.get('why') or str(t['too_few']) + ' held-out example(s)'}" + (
            f"; fix: {t['fix']}" if t.get("fix") else ""
        )
    score, who = base_score(t)
    if score is None:
        if (t.get("scores") or {}).get(FINE_TUNED) is not None:  # after training, and nothing to compare with
            cannot = " (an adapter from init_from cannot be switched off to score it after)"
            return (
                f"the {start_name(t)} was not scored, so there is no comparison: set eval.task.baseline: run to "
                f"score it before training{cannot if t.get('starting_point') else ''}"
            )
        return f"the {start_name(t)} has not been scored yet"
    diff, metric = difference(t), t.get("metric")
    word = metric_word(metric) or "score"
    change, exact = _judged(t, diff, word) if diff is not None else ("", "")
    versus = (
        f"{change} on the task ({pct(t['scores'][FINE_TUNED])} against {pct(score)} {word}, {noise_words(diff)}{exact})"
        if diff is not None
        else ""
    )
    if diff is not None and t.get("starting_point"):  # a step from a parent adapter is judged against where it started
        return f"this run against the {who}: {versus}"
    pays = t["fine_tune_pays"] if t.get("fine_tune_pays") is not None else fine_tune_pays(score)
    if pays:
        fifths = max(1, round(5 * (1 - score)))
        if metric == "exact":
            said = f"{who}: wrong in {fifths} of 5 ({pct(score)} exact)"
        elif metric == "json":
            said = f"{who}: fields wrong in {fifths} of 5 ({pct(score)} field match)"
        else:
            said = f"{who}: {pct(score)} {word}, below the {pct(PAYS_BELOW)} a prompt would need"
        onward = "training on from it" if t.get("starting_point") else "fine-tuning"
        if diff is not None and change != "better":  # after training: the run did not deliver it
            return f"{said}, so {onward} should pay; this run did not: {versus}"
        return f"{said}: {onward} pays"
    said = f"right in {pct(score)}" if metric == "exact" else f"{pct(score)} {word}"
    prompt = "a prompt with examples" if not who.endswith("zero-shot") else "a prompt"
    return f"{who}: {said}: {prompt} may be enough" + (f"; fine-tuning would {price}" if price else "")
