"""The statistics of the recipe's data that the plan and the run use: what trains, the eval split's examples left out."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from launcher.data import loss_view
from launcher.data import split
from launcher.data.dataset import compute_stats, example_lengths, load_data
from launcher.data.dataset import identity as data_identity


def data_stats(recipe: Any):
    data = load_data(recipe.data, recipe.seed)
    examples = data.examples
    lengths, source = example_lengths(examples, recipe.model, data.where)
    # the statistics (plan, ETA) count what trains: the eval split's held-out examples do not (launcher/data/split.py)
    parts = split.for_recipe(examples, recipe)
    train = parts.train
    stats = compute_stats([examples[i] for i in train], [lengths[i] for i in train], source, recipe.max_length, data)
    # what the loss sees, every training example marked as TRL masks it; a DataError refuses data that would train
    # nothing, never teach the model to stop, or lose its answers to max_length (launcher/data/loss_view.py)
    seen = loss_view.check(recipe.model, loss_view.Settings.of(recipe), [examples[i] for i in train],
                           [data.where[i] for i in train], [data.origin[i] for i in train] if data.origin else None,
                           [str(s.get("source")) for s in data.sources])
    stats = replace(stats, loss_view=seen, held_out=len(parts.held_out), held_out_lines=len(examples) - len(train))
    if recipe.eval.data:
        split.load_eval_data(recipe)  # a missing or broken eval file stops here, before the smoke test
        # a resume on changed eval data is refused like one on changed training data
        stats = replace(stats, sha256=data_identity(stats.sha256, load_data(recipe.eval.data, recipe.seed).sha256))
    return examples, lengths, stats


def data_record(stats) -> dict[str, Any]:
    """data.json in the run: the resolved data (sources with their sha256 or revision, format, count, tokens)."""
    return {"description": stats.description, "sha256": stats.sha256, "sources": list(stats.sources),
            "examples": stats.examples, "total_tokens": stats.total_tokens, "mean_tokens": stats.mean_tokens,
            "max_tokens": stats.max_tokens, "tokens_source": stats.tokens_source,
            **({"loss_view": stats.loss_view} if stats.loss_view else {})}
