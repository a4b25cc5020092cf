"""The validation split: which examples are held out (seeded, the same at every resume), and the eval pass's cost.

How the eval settings hold out and evaluate: docs/evaluation.md, "The validation split".
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from launcher.data import formats


@dataclass(frozen=True)
class Split:
    train: list[int]  # indices into the data, in file order
    held_out: list[int]  # indices into the data (fraction), else empty


def split(n: int, fraction: Optional[float], seed: int) -> Split:
    """A seeded split, the same at every start and resume; at least one example held out, at least one trains."""
    if not fraction or n < 2:
        return Split(list(range(n)), [])
    k = min(n - 1, max(1, round(fraction * n)))
    held = set(random.Random(f"ftrun-eval-{seed}").sample(range(n), k))
    return Split([i for i in range(n) if i not in held], sorted(held))


def for_recipe(examples: list, recipe) -> Split:
    """The recipe's split: identical examples held out or trained together, the draw over the distinct ones (with no
    duplicates, exactly `split(len(examples), ...)`); the eval pass uses one copy of each held-out example."""
    if not recipe.eval.fraction:
        return Split(list(range(len(examples))), [])
    first: dict[str, int] = {}  # example -> its number among the distinct examples
    # the same example with other columns beside it (an id) is still a copy
    keys = [json.dumps(formats.canonical(e), sort_keys=True, ensure_ascii=False) for e in examples]
    group = [first.setdefault(key, len(first)) for key in keys]
    parts = split(len(first), recipe.eval.fraction, recipe.seed)
    held = set(parts.held_out)
    first_copy = {g: i for i, g in reversed(list(enumerate(group)))}  # each distinct example's first index
    return Split([i for i, g in enumerate(group) if g not in held], sorted(first_copy[g] for g in held))


def source_name(data: Any) -> str:
    """How samples.md names the file (or dataset) its examples are numbered in."""
    if isinstance(data, list):
        return " + ".join(source_name(d) for d in data)
    path = data if isinstance(data, str) else getattr(data, "path", None) or str(data)
    return Path(path).name if Path(path).exists() else path


def load_eval_data(recipe) -> list:
    """The examples of eval.data, checked like data's (every bad line named) before any GPU time is spent."""
    from launcher.data.dataset import load_data
    from launcher.errors import DataError

    try:
        return load_data(recipe.eval.data, recipe.seed).examples
    except DataError as exc:  # the same checks as data's, named as eval.data's
        raise DataError(f"eval.data: {exc.message}", fix=exc.fix) from None


def smoke_subset(held_out: list[int], recipe, processes: int) -> list[int]:
    """The held-out examples the smoke test evaluates (its fraction, at least two eval batches), a seeded draw."""
    want = max(2 * recipe.micro_batch_size * processes, math.ceil(recipe.smoke.fraction * len(held_out)))
    if want >= len(held_out):
        return list(held_out)
    return sorted(random.Random(f"ftrun-smoke-eval-{recipe.seed}").sample(list(held_out), want))


def passes(train_seconds: float, recipe) -> int:
    """Eval passes of the full run: one at the start, one every eval.every_minutes of training, one at the end."""
    return 2 + math.floor(train_seconds / (recipe.eval.every_minutes * 60.0))


def eval_seconds(measured: dict[str, Any], train_seconds: float, recipe) -> float:
    """The full run's evaluation time, scaled from the smoke's pass by eval_full_tokens / eval_tokens."""
    seconds, tokens, full = (measured.get(k) for k in ("eval_seconds", "eval_tokens", "eval_full_tokens"))
    if not seconds or not tokens or not full:
        return 0.0
    return float(seconds) * float(full) / float(tokens) * passes(train_seconds, recipe)


def trainer_fields(recipe, evaluates: bool, first_start: bool) -> dict[str, Any]:
    """SFTConfig fields for the evaluation: ftrun asks for each pass itself (worker/callbacks.py), the eval batch is
    the training micro-batch, and the full run's first start evaluates the base model (eval_on_start)."""
    if not evaluates:
        return {}
    return {"eval_strategy": "no", "per_device_eval_batch_size": recipe.micro_batch_size, "eval_on_start": first_start}
