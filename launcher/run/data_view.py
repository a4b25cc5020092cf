"""How the training data reads to a user: its one-line description and what the loss sees of each example."""

from __future__ import annotations

import os
import sys
from typing import Any, Optional, TextIO


def data_label(stats) -> str:
    return ", ".join(str(s.get("source")) for s in stats.sources) or "data"


def data_line(stats) -> str:
    """'Alpaca (instruction/input/output) format, 10,000 examples, converted to chat; 1,234,567 tokens (tokenizer)';
    with an eval split, how many of the examples train (the tokens are theirs) and how many are held out."""
    held, lines = getattr(stats, "held_out", 0), getattr(stats, "held_out_lines", 0)
    copies = lines - held
    trains = (
        f"; {stats.examples:,} train, {held:,} are held out for evaluation (a seeded draw)"
        + (
            (
                ", and 1 copy of a held-out example leaves training with it"
                if copies == 1
                else f", and {copies:,} copies of held-out examples leave training with them"
            )
            if copies > 0
            else ""
        )
        if held
        else ""
    )
    labels = getattr(stats, "labels", None)  # KTO's unpaired answers: the training split's classes
    classes = f"; {labels['desirable']:,} desirable and {labels['undesirable']:,} undesirable answers" if labels else ""
    return (
        f"{stats.description}{trains}{classes}; {stats.total_tokens:,} tokens per epoch ({stats.tokens_source}"
        + (_over(stats) if stats.over_max_length else "")
        + ")"
    )


def _over(stats) -> str:
    """What happens to the examples longer than max_length, with the tokens kept of all."""
    all_tokens = getattr(stats, "all_tokens", 0)
    if getattr(stats, "splits", False):
        return (
            f", {stats.over_max_length:,} over max_length {stats.max_length}: packing splits them into pieces, "
            f"all {all_tokens:,} tokens kept"
        )
    kept = f", {stats.total_tokens:,} of {all_tokens:,} tokens kept" if all_tokens else ""
    return f", {stats.over_max_length:,} over max_length {stats.max_length}: truncated{kept}"


def wants_color(stream: Optional[TextIO] = None) -> bool:
    """Highlighting on a terminal, plain text on a pipe or a file, none where NO_COLOR is set (no-color.org)."""
    stream = stream or sys.stdout
    return bool(getattr(stream, "isatty", lambda: False)()) and not os.environ.get("NO_COLOR")


def format_loss_view(
    record: Optional[dict[str, Any]], color: bool = False, statistics: bool = False, sampled: bool = False
) -> str:
    """What the loss sees (data.json "loss_view"): one example per source, trained tokens marked; `statistics`: the
    dataset's figures; `sampled`: the objective trains on answers it samples (GRPO)."""
    from launcher.data.loss_view import CLOSE, OPEN, TRAINED_STYLE, RESET, render_segments

    if not record and sampled:
        return (
            "what the loss sees: the answers GRPO samples for each prompt while it trains (the data holds the prompts "
            "and their references; no answer of the data trains)"
        )
    if not record:
        return "what the loss sees: not shown (the model's tokenizer is not on this machine)"
    s = record["stats"]
    mark = f"{TRAINED_STYLE}highlighted{RESET}" if color else f"{OPEN}in brackets{CLOSE}"
    lines = [
        f"what the loss sees: {s['trained_share']:.1%} of {s['tokens']:,} tokens trained, loss on {record['mode']}, "
        f"end of turn {record.get('end_of_turn')}; trained tokens {mark}:"
    ]
    for ex in record["examples"]:
        where = ex["where"] + (f" ({ex['source']})" if ex.get("source") and len(record["examples"]) > 1 else "")
        lines.append(f"--- {where}: {ex['trained']} of {ex['tokens']} tokens trained")
        lines.append(render_segments(ex["segments"], color=color).rstrip("\n"))
    lines.append("---")
    served = record.get("served_prompt")
    if served and served.get("shapes"):  # launcher/data/served_check.py: the export's comparison, before training
        kwargs = served.get("chat_template_kwargs")
        lines.append(
            f"served prompt = trained prompt: {served['identical']} conversation shapes, trained with "
            f"{served['training_template']}"
            + (f", served with {', '.join(f'{k}={v}' for k, v in kwargs.items())}" if kwargs else "")
            + " (the model's own template as vLLM and llama.cpp render it; the export checks each runtime again)"
        )
    if statistics:
        cap = s.get("max_length")
        lines.append(
            f"{'sequences' if record.get('pairs') else 'examples'} {s['examples']:,}; tokens {s['tokens']:,} (after "
            f"max_length {cap}); trained {s['trained_tokens']:,} ({s['trained_share']:.1%})"
        )
        lines.append(f"length in tokens: p50 {s['p50']:,}, p90 {s['p90']:,}, p99 {s['p99']:,}, max {s['max']:,}")
        n = max(s["examples"], 1)
        lines.append(
            f"truncated by max_length {cap}: {s['truncated']:,} ({s['truncated'] / n:.1%}); trained part cut: "
            f"{s['cut']:,} ({s['cut'] / n:.1%}); nothing trained: {s['empty']:,} ({s['empty'] / n:.1%})"
        )
        pairs = record.get("pairs")
        if pairs:  # the sequences above are the pairs' two sides (launcher/data/stats.py pair_stats)
            lines.append(
                f"pairs {pairs['pairs']:,} (each example above is one side of a pair): answers "
                f"{pairs['chosen_mean_tokens']:g} tokens chosen, {pairs['rejected_mean_tokens']:g} rejected "
                f"on average; the chosen answer is the longer in {pairs['chosen_longer']:.0%} of the pairs"
                + (" (a length bias DPO learns as well)" if pairs["chosen_longer"] >= 0.8 else "")
            )
    return "\n".join(lines)
