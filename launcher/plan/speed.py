"""What the plan does with a card's spare memory: the faster settings a recipe left to it.

Where the recipe leaves `gradient_checkpointing` out, a job whose activations all fit is trained without recomputing
them; where it leaves both `micro_batch_size` and `gradient_accumulation_steps` out, the micro-batch grows and the
accumulation shrinks by the same factor. The examples per optimizer step (micro-batch x accumulation x processes),
their order and the loss stay the same, so does the trajectory. Only on a GPU, without any offload (HEADROOM and
HEADROOM_NO_CHECKPOINTING say how much room), and never into a quadratic cost: where padding-free rows carry SDPA's
dense mask (no variable-length kernel on the box: launcher/plan/attention.py), the micro-batch stays the recipe's.
docs/sizing.md, "Using the card".
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from launcher.plan import sizing_constants
from launcher.plan import throughput
from launcher.plan.choice import Choice
from launcher.plan.job import Job

# The recipe keys the plan may choose when the recipe leaves them out (pydantic's model_fields_set).
LEFT_TO_PLAN = ("gradient_checkpointing", "micro_batch_size", "gradient_accumulation_steps")
# A faster setting is taken only when its estimate times this fits the memory the plan may fill (USABLE_FRACTION of
# the card): the estimate was within 4% on the H200 at 8B (LoRA 18.9 GB planned, 19.6 measured; full 133.5 and
# 129.6) and within 7% (median) over the published rows (docs/sizing.md). The smoke test measures the peak, and an
# out of memory there undoes the faster settings first. Those measurements ran with gradient checkpointing on.
HEADROOM = 1.10
# With checkpointing off every layer's activations are per-step tensors of a new size each micro-batch, and the
# estimate leaves out what the measurements above did not show: the caching allocator's blocks cached from earlier,
# other shapes (fragmentation) and K/V repeated for a mask. The one variable-length measurement, the H200's padding
# step (docs/sizing.md, "Padding-free micro-batches"), reserved 29.9 GB where 23.3 were sized: 1.28x, with
# checkpointing on; checkpointing off is taken only where 1.30x of its estimate fits. An out of memory mid-run
# restarts from the last checkpoint with checkpointing back on (launcher/run/oom_restart.py).
HEADROOM_NO_CHECKPOINTING = 1.30


@dataclass(frozen=True)
class Faster:
    """The job and engine choice with the faster settings, what they set in the recipe, and why."""

    job: Job
    choice: Choice
    update: dict[str, Any] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)


def left_to_plan(recipe: Any) -> set[str]:
    """The LEFT_TO_PLAN keys the recipe does not set. A recipe-like namespace without model_fields_set (the GPU check's
    bench) sets every key: it measures exactly what it names."""
    given = getattr(recipe, "model_fields_set", None)
    if given is None:
        return set()
    return {k for k in LEFT_TO_PLAN if k not in given}


def _same_engine(a: Choice, b: Choice) -> bool:
    return (a.engine, a.processes, a.offload_params, a.offload_optimizer, a.offload_activations) == (
        b.engine,
        b.processes,
        b.offload_params,
        b.offload_optimizer,
        b.offload_activations,
    )


def headroom(job: Job) -> float:
    """The factor a faster setting's estimate must fit with: HEADROOM, HEADROOM_NO_CHECKPOINTING without
    checkpointing."""
    return HEADROOM if job.gradient_checkpointing else HEADROOM_NO_CHECKPOINTING


def _with_headroom(c: Choice, job: Job) -> bool:
    return (
        c.fits
        and c.estimate is not None
        and c.estimate.peak_gb * headroom(job) <= c.capacity_gb * sizing_constants.USABLE_FRACTION
    )


def faster(job: Job, choice: Choice, free: set[str], replan: Callable[[Job], Choice]) -> Faster | None:
    """The faster settings this box's memory allows for the keys in `free`, or None. `replan` sizes a job on the same
    box with the same engine rules (launcher/plan/engine.py choose); a setting that changes the engine, the process
    count or an offload is not taken."""
    if (
        not (choice.fits and choice.device == "cuda" and choice.estimate is not None)
        or choice.offload_params
        or choice.offload_optimizer
        or choice.offload_activations
        or job.offload_activations
    ):
        return None
    best, update, reasons = (job, choice), {}, []
    cap = choice.capacity_gb
    if "gradient_checkpointing" in free and job.gradient_checkpointing:
        cand = replace(job, gradient_checkpointing=False)
        c = replan(cand)
        if _same_engine(c, choice) and _with_headroom(c, cand):
            w = job.workload(choice.engine, choice.processes, choice.device)
            row = throughput.dense_row(w, job.seq_len)
            with_ = throughput.flops_per_token(
                job.arch, job.method, job.seq_len, True, bool(job.reference), row, job.kl_forward
            )
            without = throughput.flops_per_token(
                job.arch, job.method, job.seq_len, False, bool(job.reference), row, job.kl_forward
            )
            best, update["gradient_checkpointing"] = (cand, c), False
            reasons.append(
                f"gradient checkpointing off (the recipe leaves it to the plan): {c.estimate.peak_gb:.1f} GB of "
                f"{cap:.1f} GB per card with the activations kept, {headroom(cand):g}x of it within the "
                f"{sizing_constants.USABLE_FRACTION:.0%} the plan fills (headroom for the estimate's error); "
                f"recomputing them would cost {with_ / without - 1:.0%} more time per token"
            )
    quadratic = job.padding_free and job.dense_mask and choice.engine != "unsloth"
    if {"micro_batch_size", "gradient_accumulation_steps"} <= free and job.accumulation > 1 and quadratic:
        reasons.append(
            f"micro-batch kept at {job.micro_batch} x accumulation {job.accumulation} (the recipe leaves both to "
            "the plan): padding-free rows here carry SDPA's dense L x L mask over the micro-batch's tokens (no "
            "variable-length kernel), so a larger micro-batch costs the square of its tokens in attention and mask "
            "memory, not less time"
        )
    elif {"micro_batch_size", "gradient_accumulation_steps"} <= free and job.accumulation > 1:
        per_step = job.micro_batch * job.accumulation  # examples per optimizer step and process: kept
        for m in sorted((m for m in range(job.micro_batch + 1, per_step + 1) if per_step % m == 0), reverse=True):
            cand = replace(best[0], micro_batch=m, accumulation=per_step // m)
            c = replan(cand)
            if _same_engine(c, choice) and _with_headroom(c, cand):
                update.update(micro_batch_size=m, gradient_accumulation_steps=per_step // m)
                reasons.append(
                    f"micro-batch {m} x accumulation {per_step // m} instead of {job.micro_batch} x "
                    f"{job.accumulation} (the recipe leaves both to the plan; the same {per_step} examples per "
                    f"optimizer step and process): {c.estimate.peak_gb:.1f} GB of {cap:.1f} GB per card, "
                    f"{headroom(cand):g}x of it within the {sizing_constants.USABLE_FRACTION:.0%} the plan fills; "
                    f"fewer, larger micro-batches keep the card busier (the estimate counts only the "
                    f"{throughput.GPU_SECONDS_PER_MICRO_BATCH * 1000:.0f} ms fixed cost per micro-batch; the smoke "
                    f"test "
                    "measures the rest)"
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
