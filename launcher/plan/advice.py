"""What to do instead of this box: catalog boxes that hold the job, recipe changes that fit it here, refusal words."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from launcher.plan import attention
from launcher.plan.choice import Choice, offload_words
from launcher.plan.engine import choose
from launcher.plan.figures import _fmt_hours, _fmt_tokens
from launcher.plan.hardware import Hardware, catalog, catalog_box
from launcher.plan.job import Job
from launcher.plan.sizing_constants import USABLE_RAM_FRACTION


# Box sizes the alternatives table and the refusal advice consider (the catalog lists 1, 2, 4, 8-card boxes).
BOX_SIZES = (1, 2, 4, 8)


def _box_rows(job: Job, forced: str, unsloth_ok: bool, workday_hours: float) -> list[dict[str, Any]]:
    """Every catalog box (1, 2, 4, 8 cards) with whether the job fits and its time and cost."""
    rows = []
    for name, entry in catalog().items():
        for count in BOX_SIZES:
            hw = catalog_box(name, count)
            # each box with its own attention kernel: a rented box runs ftrun's image (launcher/plan/attention.py)
            kernel = attention.box_kernels(hw)["implementation"]
            variant = replace(job, dense_mask=attention.dense_mask(kernel, "trl", job.padding_free))
            c = choose(variant, hw, forced=forced, unsloth_ok=unsloth_ok, workday_hours=workday_hours, in_hand=False)
            # not offered: a CPU offload the catalog's box RAM does not hold (so every box named plans as described),
            # and a box whose extra cards stay idle
            if not c.fits or (c.offload_optimizer and c.estimate.host_ram_gb > hw.ram_gb * USABLE_RAM_FRACTION):
                continue
            if count > 1 and c.processes == 1:
                continue
            price = entry.price_per_hour_eur * count if entry.price_per_hour_eur is not None else None
            rows.append(
                {
                    "gpus": f"{count}x{name}",
                    "engine": c.engine,
                    "per_gpu_gb": round(c.estimate.peak_gb, 1),
                    "card_gb": round(entry.memory_gb, 1),
                    "tokens_per_second": round(c.tokens_per_second),
                    "hours": round(c.hours, 2) if c.hours is not None else None,
                    "cost_eur": round(c.hours * price, 2) if c.hours is not None and price is not None else None,
                    "price_per_hour_eur": round(price, 2) if price is not None else None,
                }
            )
    return rows


def _by_cost(r: dict[str, Any]) -> tuple[float, float]:
    """Cheapest first (by the run's cost, else by the hour); boxes without a known price last."""
    money = r["cost_eur"] if r["cost_eur"] is not None else r["price_per_hour_eur"]
    return (money if money is not None else math.inf, r["hours"] if r["hours"] is not None else math.inf)


def _pick_alternatives(rows: list[dict[str, Any]], limit: int = 6) -> list[dict[str, Any]]:
    """Boxes that hold the job (rows only holds those): the cheapest, and the two fastest."""
    if not rows:
        return []
    by_cost = sorted(rows, key=_by_cost)
    by_time = sorted(rows, key=lambda r: (r["hours"] if r["hours"] is not None else math.inf, _by_cost(r)))
    picked: list[dict[str, Any]] = []
    for r in by_cost[: limit - 2] + (by_time[:2] if rows[0]["hours"] is not None else by_cost[limit - 2 : limit]):
        if r not in picked:
            picked.append(r)
    return sorted(picked, key=_by_cost)[:limit]


def cheapest_rental(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The catalog box with a known price that runs the job for the least money (by the hour without a token count)."""
    priced = [r for r in rows if r["price_per_hour_eur"] is not None]
    return min(priced, key=_by_cost) if priced else None


def _fixes_here(
    job: Job,
    hw: Hardware,
    forced: str,
    unsloth_ok: bool,
    workday_hours: float,
    offload: str = "auto",
    processes: int | None = None,
    nnodes: int = 1,
) -> list[str]:
    """Recipe changes that would make the job fit this box, each checked with the same rules and the recipe's
    other settings (num_processes included): a change is offered only when it fits as the recipe would run it."""
    tries: list[tuple[str, Job]] = []
    if job.seq_len > 256:
        for length in (job.seq_len // 2, job.seq_len // 4):
            if length >= 256:
                tries.append((f"max_length={length} (shorter sequences)", replace(job, seq_len=length)))
    if job.method == "lora":
        tries.append(("method=qlora (4-bit base model)", replace(job, method="qlora")))
    if job.method == "full":
        tries.append(("method=full-8bit (8-bit optimizer, no master copy)", replace(job, method="full-8bit")))
        tries.append(("method=qlora (train adapters on a 4-bit base instead)", replace(job, method="qlora")))
    if job.micro_batch > 1:
        acc = job.accumulation * job.micro_batch
        label = f"micro_batch_size=1 gradient_accumulation_steps={acc} (same effective batch)"
        tries.append((label, replace(job, micro_batch=1, accumulation=acc)))
    if not job.gradient_checkpointing:
        tries.append(("gradient_checkpointing=true", replace(job, gradient_checkpointing=True)))
    out = []
    for label, variant in tries:
        c = choose(variant, hw, forced, unsloth_ok, workday_hours, processes=processes, nnodes=nnodes, offload=offload)
        if c.fits and c.estimate is not None:
            out.append(f"{label}: fits, {c.estimate.per_gpu_gb:.1f} GB per {'card' if c.device == 'cuda' else 'box'}")
    return out


def _refusal_message(job: Job, hw: Hardware, c: Choice) -> str:
    where = hw.describe()
    return f"{job.method} of {job.arch.name} ({_fmt_tokens(job.arch.params)} params) does not fit {where}: {c.refusal}"


def _missing_message(job: Job, c: Choice) -> str:
    return f"{job.method} of {job.arch.name} needs software this machine lacks: {c.refusal}"


def _setting_fixes(
    job: Job,
    hw: Hardware,
    forced: str,
    unsloth_ok: bool,
    workday_hours: float,
    offload: str,
    processes: int | None,
    nnodes: int,
) -> list[str]:
    """The recipe's settings that pin the plan's choice (engine, offload, num_processes; the latter also at this box's
    cards or cores), changed one at a time, then two, then all: the fewest changes that fit are the fix. Empty when
    none fits: the job itself is too big for the box."""
    box_count = hw.cpu_count if hw.is_cpu_only else hw.count
    counts = (
        [processes]
        + ([None] if processes is not None else [])
        + ([box_count] if processes is not None and processes != box_count and box_count >= 2 else [])
    )
    tries: dict[int, list[tuple[str, str, int | None]]] = {}
    for engine in dict.fromkeys((forced, "auto")):
        for setting in dict.fromkeys((offload, "auto")):
            for count in counts:
                changed = (engine != forced) + (setting != offload) + (count != processes)
                if changed:
                    tries.setdefault(changed, []).append((engine, setting, count))
    for changed in sorted(tries):
        fixes: dict[tuple, list[str]] = {}  # the plan a change leads to -> the changes that lead to it
        words: dict[tuple, str] = {}
        for engine, setting, count in tries[changed]:
            c = choose(job, hw, engine, unsloth_ok, workday_hours, processes=count, nnodes=nnodes, offload=setting)
            if not (c.fits and c.estimate is not None):
                continue
            # as typed after the recipe on the command line, like the other fixes (method=qlora)
            pairs = (("engine", engine, forced), ("offload", setting, offload), ("num_processes", count, processes))
            change = " and ".join(f"{k}={v if v is not None else 'auto'}" for k, v, old in pairs if v != old)
            if count is not None and count == box_count and count != processes:
                change += f" (this box's {box_count} {'cores' if hw.is_cpu_only else 'cards'})"
            outcome = (c.engine, c.processes, c.offload_optimizer, c.offload_params)
            how = f" with {offload_words(c.offload_optimizer, c.offload_params)}" if c.offload_optimizer else ""
            fixes.setdefault(outcome, []).append(change)
            words.setdefault(
                outcome,
                f"the plan then runs it on this box with {c.engine}{how}, {c.processes} "
                f"process{'es' if c.processes != 1 else ''}, {c.estimate.peak_gb:.1f} GB per "
                f"{'card' if c.device == 'cuda' else 'process'}",
            )
        if fixes:
            return [f"set {' or '.join(changes)}: {words[outcome]}" for outcome, changes in fixes.items()]
    return []


def _refusal_options(
    job: Job,
    hw: Hardware,
    forced: str,
    unsloth_ok: bool,
    workday_hours: float,
    rows: list[dict[str, Any]],
    offload: str = "auto",
    processes: int | None = None,
    nnodes: int = 1,
) -> list[str]:
    """What to do instead, each checked: a box from rows (they all hold the job) and recipe changes that make it fit
    this box; when a recipe setting is what refuses, changing it is the only fix offered."""
    settings = _setting_fixes(job, hw, forced, unsloth_ok, workday_hours, offload, processes, nnodes)
    if settings:
        return settings
    options = []
    if rows:
        best = min(rows, key=_by_cost)
        money = (
            f"{_fmt_hours(best['hours'])}, {best['cost_eur']:.2f} EUR"
            if best["cost_eur"] is not None
            else f"{best['price_per_hour_eur']:.2f} EUR/h"
            if best["price_per_hour_eur"] is not None
            else "price unknown"
        )
        options.append(
            f"rent {best['gpus']} ({best['engine']}, {best['per_gpu_gb']} GB per card, {money}); "
            f"plan for it with --gpus {best['gpus']}"
        )
    else:
        options.append("no box in the GPU catalog holds this job; reduce it (below) or add a bigger box to the catalog")
    options += _fixes_here(job, hw, forced, unsloth_ok, workday_hours, offload, processes, nnodes)
    if len(options) == 1:
        options.append(
            "no single recipe change (shorter max_length, QLoRA, 8-bit optimizer, micro_batch_size=1, "
            "gradient checkpointing) makes it fit this box"
        )
    return options
