"""What the plan does with a card's spare memory: the faster settings a recipe left to it (gradient checkpointing off,
a larger micro-batch with the accumulation shrunk by the same factor: the same trajectory). Only on a GPU, without
offload, and never into SDPA's quadratic dense mask. docs/sizing.md, "Using the card".
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from launcher.plan import sizing_constants, throughput
from launcher.plan.choice import Choice
from launcher.plan.job import Job

# The recipe keys the plan may choose when the recipe leaves them out (pydantic's model_fields_set).
BATCH = ("micro_batch_size", "gradient_accumulation_steps")  # the batch's two keys (run/oom_restart.py asks too)
LEFT_TO_PLAN = ("gradient_checkpointing", *BATCH)
# A faster setting's estimate times this must fit USABLE_FRACTION of the card (docs/sizing.md, "Using the card")
HEADROOM = 1.10
HEADROOM_NO_CHECKPOINTING = 1.30


@dataclass(frozen=True)
class Faster:
    """The job and engine choice with the faster settings, what they set in the recipe, and why."""

    job: Job
    choice: Choice
    update: dict[str, Any] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)


def left_to_plan(recipe: Any) -> set[str]:
    """The LEFT_TO_PLAN keys the recipe does not set (none for a namespace without model_fields_set: the GPU check's
    bench measures exactly what it names)."""
    given = getattr(recipe, "model_fields_set", None)
    return set() if given is None else {k for k in LEFT_TO_PLAN if k not in given}


def _same_engine(a: Choice, b: Choice) -> bool:
    keys = ("engine", "processes", "offload_params", "offload_optimizer", "offload_activations")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def headroom(job: Job) -> float:
    return HEADROOM if job.gradient_checkpointing else HEADROOM_NO_CHECKPOINTING


def _with_headroom(c: Choice, job: Job) -> bool:
    usable = c.capacity_gb * sizing_constants.USABLE_FRACTION
    return c.fits and c.estimate is not None and c.estimate.peak_gb * headroom(job) <= usable


def faster(job: Job, choice: Choice, free: set[str], replan: Callable[[Job], Choice]) -> Faster | None:
    """The faster settings this box's memory allows for the keys in `free`, or None. `replan` sizes a job on the same
    box with the same engine rules (launcher/plan/engine.py choose); a setting that changes the engine, the process
    count or an offload is not taken."""
    offloads = (
        choice.offload_params or choice.offload_optimizer or choice.offload_activations or job.offload_activations
    )
    if offloads or not (choice.fits and choice.device == "cuda" and choice.estimate is not None):
        return None
    best, update, reasons = (job, choice), {}, []
    cap = choice.capacity_gb
    if "gradient_checkpointing" in free and job.gradient_checkpointing:
        cand = replace(job, gradient_checkpointing=False)
        c = replan(cand)
        if _same_engine(c, choice) and _with_headroom(c, cand):
            w = job.workload(choice.engine, choice.processes, choice.device)
            row = throughput.dense_row(w, job.seq_len)
            args = (job.arch, job.method, job.seq_len)
            with_, without = (
                throughput.flops_per_token(*args, gc, bool(job.reference), row, job.kl_forward) for gc in (True, False)
            )
            best, update["gradient_checkpointing"] = (cand, c), False
            reasons.append(
                f"gradient checkpointing off (the recipe leaves it to the plan): {c.estimate.peak_gb:.1f} GB of "
                f"{cap:.1f} GB per card with the activations kept, {headroom(cand):g}x of it within the "
                f"{sizing_constants.USABLE_FRACTION:.0%} the plan fills (headroom for the estimate's error); "
                f"recomputing them would cost {with_ / without - 1:.0%} more time per token"
            )
    quadratic = job.padding_free and job.dense_mask and choice.engine != "unsloth"
    if set(BATCH) <= free and job.accumulation > 1 and quadratic:
        reasons.append(
            f"micro-batch kept at {job.micro_batch} x accumulation {job.accumulation} (the recipe leaves both to "
            "the plan): padding-free rows here carry SDPA's dense L x L mask over the micro-batch's tokens (no "
            "variable-length kernel), so a larger micro-batch costs the square of its tokens in attention and mask "
            "memory, not less time"
        )
    elif set(BATCH) <= free and job.accumulation > 1:
        per_step = job.micro_batch * job.accumulation  # examples per optimizer step and process: kept
        for m in sorted((m for m in range(job.micro_batch + 1, per_step + 1) if per_step % m == 0), reverse=True):
            cand = replace(best[0], micro_batch=m, accumulation=per_step // m)
            c = replan(cand)
            if _same_engine(c, choice) and _with_headroom(c, cand):
                update.update(micro_batch_size=m, gradient_accumulation_steps=per_step // m)
                reasons.append(
                    f"micro-batch {m} x accumulation {per_step // m} instead of {job.micro_batch} x {job.accumulation} "
                    f"(the recipe leaves both to the plan; the same {per_step} examples per optimizer step and "
                    f"process): {c.estimate.peak_gb:.1f} GB of {cap:.1f} GB per card, {headroom(cand):g}x of it within "
                    f"the {sizing_constants.USABLE_FRACTION:.0%} the plan fills; fewer, larger micro-batches keep the "
                    f"card busier (the estimate counts only the {throughput.GPU_SECONDS_PER_MICRO_BATCH * 1000:.0f} ms "
                    "fixed cost per micro-batch; the smoke test measures the rest)"
                )
                best = (cand, c)
                break
    if not update:
        return None if not reasons else Faster(best[0], best[1], update, reasons)
    reasons.append(
        "an out of memory in the smoke test first undoes these (back to the recipe's values); setting the "
        "keys in the recipe keeps them as given"
    )
    return Faster(best[0], best[1], update, reasons)


def record(job: Job, sped: Faster | None) -> dict[str, Any] | None:
    """plan.json's `speed`: what the plan set, the recipe's values it replaced (what an out of memory goes back to),
    and why; None when it set nothing."""
    if sped is None or not sped.update:
        return None
    was = {
        "gradient_checkpointing": job.gradient_checkpointing,
        "micro_batch_size": job.micro_batch,
        "gradient_accumulation_steps": job.accumulation,
    }
    return {"set": dict(sped.update), "from": {k: was[k] for k in sped.update}, "reasons": list(sped.reasons)}
