"""The task evaluation's forecast: the answers it generates, who gives them, their time before any smoke test."""

from __future__ import annotations

from typing import Any

from launcher import export_formats, methods
from launcher.data.task_verdict import BARE_BASE_LABEL
from launcher.plan import throughput
from launcher.plan.figures import _fmt_hours
from launcher.plan.models import Architecture


def _task_eval_note(recipe: Any, data_stats: Any) -> list[str]:
    """What the task evaluation will generate (launcher/worker/task_eval.py): its examples, who answers each and the
    answers' longest length."""
    task = getattr(getattr(recipe, "eval", None), "task", None)
    if task is None or not task.examples:
        return []
    ev = recipe.eval
    if ev.data:
        held = f"up to {task.examples} examples of eval.data:"
    elif ev.fraction:
        held = f"the held-out examples ({ev.fraction:.0%} of the data, at most {task.examples}):"
    else:
        return ["task evaluation: nothing is held out (eval.fraction or eval.data), so nothing is scored"]
    scorers = _task_eval_scorers(recipe)
    longest = task.max_new_tokens or ev.max_new_tokens
    times = "once" if len(scorers) == 1 else f"{len(scorers)} times"
    return [
        f"task evaluation: {held} each answered greedily {times} ({', '.join(scorers)}), "
        f"up to {longest} new tokens each; the smoke test measures the generation speed and forecasts its time"
    ]


def _task_eval_scorers(recipe: Any) -> list[str]:
    """Who answers the task evaluation's prompts: the base model twice where the launch scores it (under init_from:
    the parent adapter twice and the bare base once), or after training with the adapter switched off (results.py
    _score_after), then the fine-tuned model and each export."""
    task = recipe.eval.task
    formats = set(recipe.export)
    parent = getattr(recipe, "init_from", None)
    start = "parent adapter" if parent else "base model"
    if task.baseline == "run":
        base = [BARE_BASE_LABEL] * bool(parent) + [f"{start} zero-shot", f"with {task.shots} examples"]
    elif methods.is_adapter(recipe.method) and not parent:
        base = [f"{start} zero-shot (after training, the adapter switched off)", f"with {task.shots} examples"]
    else:
        base = []
    exports = ["merged"] * ("merged" in export_formats.made(formats)) + ["GGUF"] * ("gguf" in formats)
    return base + ["fine-tuned"] + exports


def _bound(arch: Architecture, gpu: Any) -> str:
    """What sets the speed of the evaluation's decode step (throughput.decode_step_seconds), in words."""
    batch = throughput.GENERATION_BATCH["cuda"]
    bound = throughput.decode_step_seconds(arch, gpu.memory_bandwidth_gb_s, gpu.tflops_bf16, batch)[1]
    if bound == "launch":
        return (
            f"bound by launching its {throughput.decode_kernels(arch, 0, batch):,} kernels from Python at "
            f"{throughput.EAGER_OP_SECONDS * 1e6:g} us each, transformers' eager generate"
        )
    if bound == "memory":
        return (
            f"bound by reading the weights once at {throughput.GENERATION_EFFICIENCY:.0%} of {gpu.name}'s "
            f"{gpu.memory_bandwidth_gb_s:,.0f} GB/s"
        )
    return f"bound by {gpu.name}'s {gpu.tflops_bf16:g} TFLOP/s"


def _task_eval_time(
    recipe: Any, data_stats: Any, arch: Architecture, gpu: Any, box_price: float | None
) -> dict[str, Any] | None:
    """The task evaluation's time and cost before any smoke test, on a GPU the catalog knows the bandwidth of: an upper
    bound, every answer at its max_new_tokens; the smoke test then measures the run's own rate."""
    task = getattr(getattr(recipe, "eval", None), "task", None)
    if task is None or not task.examples or gpu is None or not (recipe.eval.fraction or recipe.eval.data):
        return None
    tps = throughput.generation_tokens_per_second(arch, gpu.memory_bandwidth_gb_s, gpu.tflops_bf16)
    if not tps:
        return None
    held = getattr(data_stats, "held_out", 0) if data_stats is not None else 0
    examples = min(task.examples, held) if held else task.examples
    longest = task.max_new_tokens or recipe.eval.max_new_tokens
    scorers = _task_eval_scorers(recipe)
    tokens = len(scorers) * examples * longest
    seconds = tokens / tps
    cost = seconds / 3600 * box_price if box_price is not None else None
    reason = (
        f"task evaluation: at most {len(scorers)} scorers x {examples} examples x {longest} new tokens = "
        f"{tokens:,} tokens at ~{tps:,.0f} tokens/s (estimated: {throughput.GENERATION_BATCH['cuda']} prompts a "
        f"decode step, {_bound(arch, gpu)}) = {_fmt_hours(seconds / 3600)}"
        + (f", {cost:.2f} EUR" if cost is not None else "")
        + "; the smoke test measures the run's own rate"
    )
    return {
        "reason": reason,
        "seconds": round(seconds, 1),
        "cost_eur": round(cost, 2) if cost is not None else None,
        "generation_tokens_per_second": round(tps, 1),
        "new_tokens": tokens,
        "scorers": scorers,
        "examples": examples,
    }
