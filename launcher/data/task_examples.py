"""The task evaluation's examples: each held-out example's last assistant turn as the reference and the turns before
it as the prompt, a seeded draw of them, and few-shot prompts built from training examples placed as earlier turns.

Pure (no torch). The same prompts are answered by the base model (zero- and few-shot, `ftrun baseline`), by the
fine-tuned model and by each export, so their scores compare.
"""

from __future__ import annotations

import random
from typing import Any, Optional

from launcher.data import formats

MIN_EXAMPLES = 10  # fewer held-out examples than this give a score too coarse to read (one example = 10 points)


def prompt_and_reference(example: Any) -> Optional[dict[str, Any]]:
    """{"messages": ..., "reference": ...}: the turns before the last answer (a pair's chosen, a completion, a prompt
    row's reference) and that answer; "text" too for a plain-string prompt. None where there is no such answer."""
    if isinstance(example, dict) and "chosen" in example:
        example = formats.sequences(example)[0]
    if isinstance(example, dict) and example.get(formats.LABEL) is False:
        return None  # an undesirable answer (KTO's unpaired data) is no reference to score against
    if isinstance(example, dict) and formats.example_form(example) == "prompt":
        prompt, reference = example["prompt"], example.get("reference")
        if reference is None:
            return None
        if isinstance(prompt, str):
            return {"text": prompt, "messages": [{"role": "prompt", "content": prompt}], "reference": reference}
        return {"messages": [dict(m) for m in prompt], "reference": reference}
    if isinstance(example, dict) and "prompt" in example and "completion" in example:
        prompt, completion = example["prompt"], example["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return {"text": prompt, "messages": [{"role": "prompt", "content": prompt}], "reference": completion}
        if isinstance(prompt, list) and isinstance(completion, list):
            example = {"messages": prompt + completion}
    messages = example.get("messages") if isinstance(example, dict) else example
    if not isinstance(messages, list):
        return None
    last = max(
        (k for k, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"), default=None
    )
    if not last or not isinstance(messages[last].get("content"), str):
        return None  # no assistant turn, or nothing before it to prompt with
    prompt = {"messages": [dict(m) for m in messages[:last]], "reference": messages[last]["content"]}
    if isinstance(example, dict) and example.get("images"):
        # image data (launcher/data/images.py): every image sits in a turn before the answer, so the prompt has all
        prompt["images"] = list(example["images"])
    return prompt


def pick(examples: list, pool: list[int], n: int, seed: int, salt: str = "task") -> list[dict[str, Any]]:
    """Up to n prompts with their references from `pool` (indices into examples), a seeded draw."""
    order = list(pool)
    random.Random(f"ftrun-{salt}-{seed}").shuffle(order)
    picked = []
    for i in order:
        if len(picked) >= n:
            break
        pr = prompt_and_reference(examples[i])
        if pr is not None:
            picked.append({"index": i, **pr})
    return picked


def not_applicable(examples: list) -> Optional[str]:
    """Why the task evaluation does not apply to this data, or None when it does."""
    if not examples:
        return "the data has no examples"
    if all(prompt_and_reference(e) is None for e in examples):
        return (
            "no example has an answer to score: plain text (and chat without an assistant turn after a prompt) "
            "has no reference answer; the eval loss measures such data"
        )
    return None


def with_shots(prompt: dict[str, Any], shots: list[dict[str, Any]]) -> dict[str, Any]:
    """The prompt with the shots before it as earlier turns (a system turn stays first), or as text before it."""
    if "text" in prompt:
        text = "".join(s["text"] + s["reference"] + "\n\n" for s in shots if "text" in s) + prompt["text"]
        return {**prompt, "text": text, "messages": [{"role": "prompt", "content": text}]}
    msgs = prompt["messages"]
    system = [m for m in msgs[:1] if m.get("role") == "system"]
    turns: list[dict[str, Any]] = []
    for s in shots:
        if "text" not in s:
            turns += [m for m in s["messages"] if m.get("role") != "system"]
            turns.append({"role": "assistant", "content": s["reference"]})
    shown = {**prompt, "messages": system + turns + msgs[len(system) :]}
    pictures = [p for s in shots if "text" not in s for p in s.get("images", [])] + list(prompt.get("images", []))
    if pictures:  # image data: the shots' images come first, in the order their placeholders do
        shown["images"] = pictures
    return shown


def shots_for(examples: list, train: list[int], k: int, seed: int) -> list[dict[str, Any]]:
    """k training examples (a seeded draw, the same for every prompt) to place in front of each prompt."""
    return pick(examples, train, k, seed, salt="shots")


def build_task(
    examples: list,
    held_out: list[int],
    train: list[int],
    settings,
    seed: int,
    eval_examples: Optional[list] = None,
    max_new_tokens_cap: int = 128,
) -> dict[str, Any]:
    """What the task evaluation asks, stored in the run so every scorer asks the same ({"metric", "prompts", "shots",
    ...}, or {"not_applicable"} / {"too_few"}). `eval_examples`: eval.data's examples, all held out."""
    from launcher.data import task_metrics

    pool_examples, pool = (eval_examples, list(range(len(eval_examples)))) if eval_examples else (examples, held_out)
    if not pool:
        return {
            "not_applicable": "the recipe holds no examples out (set eval.fraction, e.g. 0.05, or eval.data): "
            "scoring examples the model trained on would say nothing about the task"
        }
    why = not_applicable([pool_examples[i] for i in pool])
    if why:
        return {"not_applicable": why}
    prompts = pick(pool_examples, pool, settings.examples, seed)
    if len(prompts) < MIN_EXAMPLES:
        return {
            "too_few": len(prompts),
            "why": f"only {len(prompts)} held-out example(s) have an answer to score; at least {MIN_EXAMPLES} "
            "give a score worth reading (one example would be 10 points or more)",
            "fix": "hold out more: raise eval.fraction or give a larger eval.data",
        }
    references = [p["reference"] for p in prompts]
    if settings.metric == task_metrics.AUTO:
        metric, reason = task_metrics.choose(references)
    else:
        metric, reason = settings.metric, f"{settings.metric}, as the recipe sets (eval.task.metric)"
    longest = max(len(r) for r in references)
    needed = 2 * longest // 3 + 1  # the longest reference's tokens, about 2 per 3 characters
    limit = settings.max_new_tokens or min(max_new_tokens_cap, max(8, 2 * needed))
    task = {
        "metric": metric,
        "metric_reason": reason,
        "prompts": prompts,
        "shots": shots_for(examples, train, settings.shots, seed),
        "max_new_tokens": limit,
    }
    if limit < needed:  # an answer as long as the reference is cut: the score says so (run/task_eval_view.py)
        task["capped"] = {
            "max_new_tokens": limit,
            "reference_tokens": needed,
            "key": "eval.task.max_new_tokens" if settings.max_new_tokens else "eval.max_new_tokens",
        }
    return task


def refusals(
    settings,
    examples: list,
    lengths: list[int],
    held_out: list[int],
    train: list[int],
    max_length: int,
    seed: int,
    eval_examples: Optional[list] = None,
) -> list[str]:
    """The eval.task settings other than their defaults that this data cannot honour, each with the largest value
    that fits (the plan refuses them). `lengths`: each example's tokens, for the shots against max_length."""
    from launcher.data import task_metrics

    if not settings.examples:
        return []
    defaults = type(settings)()
    out: list[str] = []
    pool_examples, pool = (eval_examples, list(range(len(eval_examples)))) if eval_examples else (examples, held_out)
    answered = [i for i in pool if prompt_and_reference(pool_examples[i]) is not None]
    if settings.examples != defaults.examples and not pool:
        out.append(
            f"eval.task.examples {settings.examples}: the recipe holds no examples out, so the task evaluation "
            "would score none; set eval.fraction (e.g. 0.05) or eval.data, or eval.task.examples: 0 to turn "
            "it off"
        )
    elif settings.examples != defaults.examples and settings.examples > len(answered):
        out.append(
            f"eval.task.examples {settings.examples}: {len(answered)} held-out example(s) have an answer to "
            f"score; the largest that fits is {len(answered)} (or hold out more: eval.fraction, eval.data)"
        )
    prompts = pick(pool_examples, pool, settings.examples, seed) if answered else []
    if settings.metric == "json" and prompts:
        references = [p["reference"] for p in prompts]
        if not any(task_metrics._json_object(r) is not None for r in references):
            metric, why = task_metrics.choose(references)
            out.append(
                f"eval.task.metric json: none of the {len(references)} held-out references parses as a JSON "
                f"object, so every answer would score 0 (auto chooses {metric} for them: {why}); set "
                f"eval.task.metric: {metric} or leave it out"
            )
    if settings.shots != defaults.shots and settings.shots:
        drawn = shots_for(examples, train, settings.shots, seed)
        longest = max(lengths[p["index"]] for p in prompts) if prompts and not eval_examples else None

        def fits(k: int) -> bool:  # the longest task prompt (the whole example) after k drawn examples
            return (
                longest is None
                or longest + sum(lengths[s["index"]] for s in shots_for(examples, train, k, seed)) <= max_length
            )

        # the largest count whose own draw fits (each count draws its own examples): a binary search over the draws
        low, high = 0, len(drawn)
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid) else (low, mid - 1)
        if len(drawn) < settings.shots:
            out.append(
                f"eval.task.shots {settings.shots}: the training examples hold {len(drawn)} with an answer "
                f"to place before a prompt; the largest that fits is {low}"
                + (f" (more run the longest task prompt over max_length {max_length:,})" if low < len(drawn) else "")
            )
        elif low < settings.shots:
            total = longest + sum(lengths[s["index"]] for s in drawn)
            out.append(
                f"eval.task.shots {settings.shots}: the longest task prompt with {settings.shots} "
                f"training examples before it comes to about {total:,} tokens, over max_length "
                f"{max_length:,}; the largest that fits is {low} (or raise max_length)"
            )
    return out
