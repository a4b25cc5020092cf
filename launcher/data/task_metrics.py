"""The task evaluation's metrics as a table: exact (short labels), json (structured answers), text (free text, chrF),
the choice among them from the references with its reason, the scores, and the reference article's verdict rule.

Pure (no torch). chrF comes from sacrebleu (2.6.0 `sacrebleu.metrics.CHRF`, corpus level, scaled to a fraction).

    metric, reason = choose(references)       # ('exact', '4 distinct short labels ...')
    score(metric, answers, references)        # {'score': 0.75, 'details': {...}, 'per_example': [...]}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

# The reference article: "still wrong in one case out of five" (with examples in the prompt): a fine-tune pays
PAYS_BELOW = 0.8
# Labels: at most this many words each, and few distinct ones (a class, a category, a yes/no).
LABEL_MAX_WORDS = 4
LABEL_MAX_DISTINCT = 20


@dataclass(frozen=True)
class Metric:
    name: str
    primary: str  # what the score in [0, 1] measures
    when: str  # when `choose` picks it, for the recipe's help
    word: str  # how its score is named beside the percentage (the verdict, the summary)
    scorer: Callable[[list[str], list[str], list[float]], dict[str, Any]]  # (answers, references, exact) -> score


def _exact_score(answers: list[str], references: list[str], exact: list[float]) -> dict[str, Any]:
    n = len(references)
    return {"score": sum(exact) / n, "details": {"exact": sum(exact) / n}, "per_example": exact}


def _json_score(answers: list[str], references: list[str], exact: list[float]) -> dict[str, Any]:
    n = len(references)
    parsed = [_json_object(a) for a in answers]
    keys, fields = [], []
    for got, ref_text in zip(parsed, references):
        ref = _json_object(ref_text) or {}
        keys.append(float(got is not None and set(ref) <= set(got)))
        matched = sum(1.0 for k, v in ref.items() if got is not None and k in got and got[k] == v)
        fields.append(matched / len(ref) if ref else float(got == ref))
    details = {
        "parses": sum(p is not None for p in parsed) / n,
        "has_keys": sum(keys) / n,
        "field_match": sum(fields) / n,
        "exact": sum(exact) / n,
    }
    return {"score": details["field_match"], "details": details, "per_example": fields}


def _chrf_score(answers: list[str], references: list[str], exact: list[float]) -> dict[str, Any]:
    from sacrebleu.metrics import CHRF

    chrf = CHRF()
    corpus = chrf.corpus_score(list(answers), [list(references)]).score / 100.0
    per = [chrf.sentence_score(a, [r]).score / 100.0 for a, r in zip(answers, references)]
    return {"score": corpus, "details": {"chrf": corpus, "exact": sum(exact) / len(references)}, "per_example": per}


METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric(
            "exact",
            "accuracy after whitespace and case normalisation",
            "the references are a few short labels",
            "exact",
            _exact_score,
        ),
        Metric(
            "json",
            "field-level exact match against the reference object",
            "every reference parses as a JSON object",
            "field match",
            _json_score,
        ),
        Metric("text", "chrF (sacrebleu), as a fraction", "anything else", "chrF", _chrf_score),
    )
}
AUTO = "auto"  # the recipe's default: chosen from the references


def word(metric: Optional[str]) -> Optional[str]:
    """How the metric's score is named beside its percentage ("field match 40%")."""
    return METRICS[metric].word if metric in METRICS else metric


def described() -> str:
    """Every metric with when it is chosen, for the recipe's help."""
    return "; ".join(f"{m.name}: {m.primary} (chosen when {m.when})" for m in METRICS.values())


def normalise(text: str) -> str:
    return " ".join(str(text).split()).casefold()


def _json_object(text: str) -> Optional[dict]:
    """The JSON object a text holds: the whole text, or inside a ```json fence a chat model may add."""
    body = str(text).strip()
    if body.startswith("```"):
        body = body.strip("`").strip()
        body = body[4:].lstrip() if body.lower().startswith("json") else body
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def choose(references: list[str]) -> tuple[str, str]:
    """(metric, why) from the references alone."""
    n = len(references)
    if n and all(_json_object(r) is not None for r in references):
        return "json", f"all {n} references parse as JSON objects: parse rate, keys and field-level exact match"
    labels = {normalise(r) for r in references}
    longest = max((len(r.split()) for r in references), default=0)
    words = f"{longest} word{'' if longest == 1 else 's'}"
    if n and longest <= LABEL_MAX_WORDS and len(labels) <= min(LABEL_MAX_DISTINCT, max(2, n // 2)):
        return "exact", (
            f"the {n} references are {len(labels)} distinct short labels (at most {words}): "
            "accuracy after whitespace and case normalisation"
        )
    if n and single_tokens(references):
        # a number or a one-word label is right or wrong: chrF would credit shared characters (docs/task_eval.md)
        numbers = all(_is_number(r) for r in references)
        return "exact", (
            f"the {n} references are single {'numbers' if numbers else 'words'} ({len(labels)} distinct): "
            "right or wrong, accuracy after whitespace and case normalisation (chrF would credit shared characters)"
        )
    return "text", f"the {n} references are free text ({len(labels)} distinct, up to {words}): chrF, plus exact match"


def _is_number(text: str) -> bool:
    try:
        float(str(text).strip().rstrip(".").replace(",", ""))
    except ValueError:
        return False
    return True


def single_tokens(references: list[str]) -> bool:
    """Every reference one word or number: where exact match tells right from wrong (shown beside another metric)."""
    return bool(references) and all(len(str(r).split()) == 1 for r in references)


def score(metric: str, answers: list[str], references: list[str]) -> dict[str, Any]:
    """{"score": the primary metric in [0, 1], "details": sub-metrics, "per_example": each example's score}."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; one of {', '.join(METRICS)}")
    if len(answers) != len(references):
        raise ValueError(f"{len(answers)} answers for {len(references)} references")
    n = len(references)
    if n == 0:
        return {"score": 0.0, "details": {}, "per_example": []}
    exact = [float(normalise(a) == normalise(r)) for a, r in zip(answers, references)]
    return METRICS[metric].scorer(answers, references, exact)


def fine_tune_pays(few_shot: float) -> bool:
    """The article's rule on the base model's few-shot score: wrong in one case out of five or more."""
    return few_shot < PAYS_BELOW
