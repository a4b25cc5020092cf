"""The plan-time probe of one GRPO reward (rewards.py `refusals`): called as TRL's GRPOTrainer calls it on a few
prompts of the data, each answered right, wrong in the same form (`_wrong`) and empty, in each of DRESSINGS; its
refusals and its line for the plan. A reward that scores the right answers no higher than the wrong ones is refused
unless the recipe says it scores the form (`scores: form`); a form reward must still vary. Sparse rewards are normal:
whether the base model's own samples score above 0 is not probed. Pure (no torch).
"""

from __future__ import annotations

import math
import numbers
import random
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

from launcher.data import task_metrics
from launcher.errors import RecipeError

# The prompts a function is probed on (the first ones with different right answers)
PROBE_PROMPTS = 4
# Each answer as it is and as reward functions expect it (trl.rewards, Unsloth's GRPO notebooks)
DRESSINGS = (
    "{}",
    "The answer is {}.",
    "The answer is $\\boxed{{{}}}$.",
    "<think>\nLet me work it out.\n</think>\n{}",
    "<reasoning>\nLet me work it out.\n</reasoning>\n<answer>\n{}\n</answer>\n",
)


@dataclass
class Probe:
    """One reward on the first prompts of the data; the column `right` holds the right answer (None: not known)."""

    fn: Callable
    label: str
    right: Optional[str]
    rows: list[dict[str, Any]]
    where: list[str]
    model: str

    def __post_init__(self) -> None:
        known = [k for k, r in enumerate(self.rows) if self.right and r.get(self.right) is not None]
        first: dict[str, int] = {}  # each distinct right answer's first row: these first, a wrong answer is easy then
        for k in known:
            first.setdefault(str(self.rows[k][self.right]), k)
        picked = list(first.values()) + [k for k in known if k not in first.values()]
        self.picked = (picked or list(range(len(self.rows))))[:PROBE_PROMPTS]
        self.rights = {k: str(self.rows[k][self.right]) for k in self.picked if k in known}
        others = list(first)
        self.answers: list[tuple[int, str, str]] = []  # (row, what it is, text)
        self.wrong = {k: _wrong(right, others) for k, right in self.rights.items()}
        for k in self.picked:
            right = self.rights.get(k)
            if right is None:
                self.answers += [(k, "an answer", d.format("4")) for d in DRESSINGS]
            else:
                self.answers += [(k, "right", d.format(right)) for d in DRESSINGS]
                self.answers += [(k, "wrong", d.format(self.wrong[k])) for d in DRESSINGS]
            self.answers.append((k, "empty", ""))

    def call(self, subset: Optional[list[int]] = None) -> list[Any]:
        """The reward's values for the answers (their indices in `subset`), as TRL's GRPOTrainer asks them."""
        chosen = [self.answers[j] for j in (subset if subset is not None else range(len(self.answers)))]
        prompts = [self.rows[k]["prompt"] for k, _, _ in chosen]
        conversational = isinstance(prompts[0], list)
        completions = [[{"role": "assistant", "content": t}] if conversational else t for _, _, t in chosen]
        columns = {c: [self.rows[k][c] for k, _, _ in chosen] for c in self.rows[0] if c != "prompt"}
        with _seeded():  # a reward that draws random numbers probes the same way at every plan
            return self._trl_call(prompts, completions, [_token_ids(self.model, t) for _, _, t in chosen], columns)

    def _trl_call(self, prompts: list, completions: list, ids: list, columns: dict[str, list]) -> Any:
        return self.fn(
            prompts=prompts,
            completions=completions,
            completion_ids=ids,
            trainer_state=None,
            log_extra=lambda *a, **k: None,
            log_metric=lambda *a, **k: None,
            **columns,
        )

    def values(self) -> list[Optional[float]]:
        """Each answer's value; a RecipeError where the reward raises or returns what TRL cannot use."""
        n = len(self.answers)
        asked = f"{len(self.picked)} prompt{'s' if len(self.picked) > 1 else ''} of the data with {n} answers"
        try:
            values = self.call()
        except Exception as exc:  # the user's code: whatever it raises is refused with its words
            raise self._raised(exc, asked) from None
        if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # a numpy array (TRL takes it too)
            values = values.tolist()
        bad = None
        if not isinstance(values, (list, tuple)):
            bad = f"returned {type(values).__name__} {str(values)[:60]}, not a list"
        elif len(values) != n:
            bad = f"returned {len(values)} values for {n} completions"
        else:
            wrong = [v for v in values if not _is_number(v)]
            if wrong:
                bad = f"returned {wrong[0]!r} ({type(wrong[0]).__name__}), not a number"
        if bad:
            raise RecipeError(
                f"{self.label} {bad} (called on {asked}, as TRL's GRPOTrainer calls it)",
                fix="return a list with one float per completion (None for one that cannot be scored)",
            )
        values = [None if v is None else float(v) for v in values]
        for (k, what, text), v in zip(self.answers, values):
            if v is not None and not math.isfinite(v):
                raise RecipeError(
                    f"{self.label} returned {v} for {_answer_words(what, text)} to the prompt of {self.where[k]}: "
                    "TRL's GRPOTrainer subtracts each group's mean reward, and one infinite or NaN reward makes every "
                    "advantage of its group NaN",
                    fix="return a finite number for every answer (clamp it, or return 0.0 for an empty answer; None "
                    "for one that cannot be scored)",
                )
        return values

    def _raised(self, exc: Exception, asked: str) -> RecipeError:
        """The refusal for a reward that raised, naming the answer that makes it raise where one alone does."""
        culprit = None
        for j in range(len(self.answers)):
            try:
                self.call([j])
            except Exception:  # this answer alone makes it raise
                culprit = j
                break
        k, what, text = self.answers[culprit] if culprit is not None else self.answers[0]
        on = f"when called on {asked}"
        if culprit is not None:
            on = f"for {_answer_words(what, text)} to the prompt of {self.where[k]}"
        message = f"{self.label} raised {type(exc).__name__}: {exc} {on}, as TRL's GRPOTrainer calls it"
        if isinstance(exc, ImportError):
            return RecipeError(
                message,
                fix="install what it names into ftrun's environment, here and on the box that trains (TRL's "
                "accuracy_reward: pip install math-verify)",
            )
        if not isinstance(self.rows[k]["prompt"], list):
            as_chat = [[{"role": "assistant", "content": t}] for _, _, t in self.answers[:1]]
            try:
                columns = {c: [self.rows[k][c]] for c in self.rows[0] if c != "prompt"}
                self._trl_call([[{"role": "user", "content": "?"}]], as_chat, [[]], columns)
            except Exception:  # it fails on message lists too: the generic fix below
                pass
            else:
                return RecipeError(
                    message + '; it reads each completion as a list of messages (completion[0]["content"]), which '
                    "TRL passes only for prompts that are message lists, and this data's prompts are plain text",
                    fix='give the prompts as message lists ({"prompt": [{"role": "user", "content": "..."}]}), or '
                    "a reward that reads plain-text completions",
                )
        return RecipeError(
            message, fix="fix the function so that it returns a number (or None) for every answer, an empty one too"
        )

    def _scores(self, values: list[Optional[float]]) -> dict[int, dict[str, list[Optional[float]]]]:
        out: dict[int, dict[str, list[Optional[float]]]] = {}
        for (k, what, _), v in zip(self.answers, values):
            out.setdefault(k, {}).setdefault(what, []).append(v)
        return out

    def _duel(self, values: list[Optional[float]]) -> tuple[int, int]:
        """(wins, losses): right-and-wrong pairs (same prompt and dressing) where the right one scored higher, lower."""
        pairs = [
            (r, w)
            for s in self._scores(values).values()
            for r, w in zip(s.get("right", []), s.get("wrong", []))
            if r is not None and w is not None
        ]
        return sum(r > w for r, w in pairs), sum(r < w for r, w in pairs)

    def _what(self) -> str:
        n, places = len(self.picked), _places([self.where[k] for k in self.picked])
        return (
            f"{n} prompt{'s' if n > 1 else ''} of the data ({places}), each with "
            + (
                "its right answer, a wrong one of the same form and an empty one"
                if self.rights
                else "an answer and an empty one"
            )
            + ", plain, boxed, after a <think> block and in <answer> tags"
        )

    def _shown(self, values: list[Optional[float]]) -> str:
        """Each probe prompt's right and wrong answer with its mean score: "line 1: '5' 0.2 and '6' 0.2"."""
        scores = self._scores(values)
        parts = []
        for k in self.picked:
            right = self.rights.get(k)
            if right is None:
                continue
            means = [_mean(scores[k].get(what, [])) for what in ("right", "wrong")]
            parts.append(
                f"{_short(self.where[k])}: {right!r} {_number(means[0])} and {self.wrong[k]!r} {_number(means[1])}"
            )
        return "; ".join(parts)

    def check(self, form: bool, fix: str, alike_fix: str) -> str:
        """The plan's line for this reward, or a RecipeError (module docstring; `form`: the recipe's `scores: form`),
        with `fix` where it cannot tell right from wrong and `alike_fix` where it scores every answer alike."""
        values = self.values()
        numbers_ = {v for v in values if v is not None}
        if len(numbers_) <= 1:
            said = f"{next(iter(numbers_))}" if numbers_ else "None (TRL leaves the answer out)"
            shown = f" ({self._shown(values)}: each the mean over its {len(DRESSINGS)} forms)" if self.rights else ""
            raise RecipeError(
                f"{self.label} returned {said} for every answer on {self._what()}{shown}: a reward that scores every "
                "answer alike gives GRPO nothing to learn from (its advantages are all 0)",
                fix=alike_fix,
            )
        said_form = "it scores the answers' form (scores: form)"
        if not self.rights:
            return f"{self.label}: runs and returns finite numbers that vary on {self._what()}" + (
                f"; {said_form}"
                if form
                else "; whether it tells a right answer from a wrong one was not probed: the data has no reference "
                "and it reads no column of it"
            )
        source = "reference" if self.right == "reference" else f"column {self.right!r}"
        wins, losses = self._duel(values)
        pairs = sum(len(s.get("right", [])) for s in self._scores(values).values())
        if wins > losses:
            return (
                f"{self.label}: tells the right answer (the {source}) from a wrong one (on {self._what()}; right "
                f"above wrong in {wins} of {pairs} pairs"
                + (f", below in {losses}" if losses else "")
                + ")"
                + (f"; {said_form}" if form else "")
            )
        if form:
            return (
                f"{self.label}: {said_form}: a right answer (the {source}) and a wrong one of the same form score "
                f"alike, answers of other forms differ (on {self._what()})"
            )
        if losses > wins:
            what = (
                f"scores the wrong answers above the right ones (the {source}): below in {losses} of {pairs} pairs of "
                f"a right answer and a wrong one of the same form, above in {wins}"
            )
            why = "GRPO makes the higher-scored answers more likely, so it would teach wrong answers"
            fix = "return a higher value for a better answer (negate a penalty or a distance)"
        else:
            what = f"scores the right answer (the {source}) like a wrong one of the same form" + (
                f" (above in {wins} of {pairs} pairs, below in as many)" if wins else ""
            )
            why = (
                "it has no signal: in a group whose answers differ only in being right or wrong, every answer would "
                "score alike, and GRPO learns nothing from it about the answer"
            )
        raise RecipeError(
            f"{self.label} {what}, on {self._what()} ({self._shown(values)}: each the mean over its "
            f"{len(DRESSINGS)} forms): {why}",
            fix=fix,
        )


def _wrong(right: str, others: list[str]) -> str:
    """A wrong answer of the same form as `right`: each letter and digit moved one on (Paris -> Qbsjt, 19 -> 20),
    so a reward that reads only the form scores both alike; else another prompt's different right answer."""
    moved = "".join(_next_char(c) for c in right)
    if task_metrics.normalise(moved) != task_metrics.normalise(right):
        return moved
    different = [o for o in others if task_metrics.normalise(o) != task_metrics.normalise(right)]
    return different[0] if different else "I do not know."


def _next_char(c: str) -> str:
    """The letter or digit after `c` in its own range (z -> a, Z -> A, 9 -> 0); anything else as it is."""
    for first, last in (("a", "z"), ("A", "Z"), ("0", "9")):
        if first <= c <= last:
            return first if c == last else chr(ord(c) + 1)
    return c


def _mean(values: list[Optional[float]]) -> Optional[float]:
    scored = [v for v in values if v is not None]
    return sum(scored) / len(scored) if scored else None


def _number(value: Optional[float]) -> str:
    return "None" if value is None else f"{value:.3g}"


def _short(where: str) -> str:
    """ "line 3" for "data/math.jsonl line 3" (the probe's places are named in full once, before)."""
    return "line " + where.rpartition(" line ")[2] if " line " in where else where


class _seeded:
    """Python's and numpy's random generators seeded for one call of the reward, and put back after it."""

    def __enter__(self) -> None:
        self.state = random.getstate()
        random.seed(0)
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None
        if numpy is not None:
            numpy.random.seed(0)

    def __exit__(self, *exc: Any) -> None:
        random.setstate(self.state)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)


def _places(where: list[str]) -> str:
    """ "d.jsonl lines 1, 2, 3" for ["d.jsonl line 1", "d.jsonl line 2", "d.jsonl line 3"]; otherwise each in full."""
    heads = {w.rpartition(" line ")[0] for w in where}
    if len(heads) == 1 and all(" line " in w for w in where) and len(where) > 1:
        return f"{heads.pop()} lines " + ", ".join(w.rpartition(" line ")[2] for w in where)
    return ", ".join(where)


def _answer_words(what: str, text: str) -> str:
    shown = repr(text[:60]) + ("..." if len(text) > 60 else "")
    if what == "empty":
        return "the empty answer ''"
    return f"the {what} answer {shown}" if what in ("right", "wrong") else f"the answer {shown}"


_ENCODERS: dict[str, Any] = {}


def _token_ids(model: str, text: str) -> list[int]:
    """The answer's completion_ids: the model's own tokenizer where this machine has it, else one id per character."""
    if model not in _ENCODERS:
        from launcher.data.tokenizer import read_tokenizer, tokenizer_dir

        folder, _ = tokenizer_dir(model)
        read = read_tokenizer(folder) if folder is not None else None
        _ENCODERS[model] = read.tokenizer if read is not None else None
    encoder = _ENCODERS[model]
    return [ord(c) for c in text] if encoder is None else list(encoder.encode(text, add_special_tokens=False).ids)


def _is_number(value: Any) -> bool:
    """A float TRL can put in its reward tensor: a real number (numpy's too) or None, not a bool or a string."""
    return value is None or (isinstance(value, numbers.Real) and not isinstance(value, bool))
