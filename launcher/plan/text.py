"""The plan as text for a reader: memory breakdown, engine with its reasons, tokens, time, cost, other boxes."""

from __future__ import annotations

from launcher.plan.figures import UNIT, _fmt_hours, _fmt_tokens
from launcher.plan.plan import Plan
from launcher.recipe import TOKENS_MEANING


def _fmt_minutes(minutes: float) -> str:
    """The recipe's checkpoint_every_minutes as read: "20 minutes", "1 minute", "15 s"."""
    if minutes < 1:
        return f"{minutes * 60:.3g} s"
    return "1 minute" if minutes == 1 else f"{minutes:g} minutes"


def format_plan(plan: Plan) -> str:
    """Human output: memory breakdown with each term explained, engine and reasons, tokens/time/cost, alternatives."""
    p = plan
    gpus = p.gpus
    box_count = gpus.get("box_count", p.num_processes)
    card = f"{gpus['name']} ({gpus['memory_gb']:.0f} GB{' each' if box_count > 1 else ''})"
    if p.device != "cuda":
        where = f"CPU ({gpus['memory_gb']:.0f} GB RAM)"
    elif p.num_processes == box_count:
        where = f"{box_count} x {card}"
    else:
        where = f"{p.num_processes} of the box's {box_count} x {card}"
    procs = f"{p.num_processes} process{'es' if p.num_processes > 1 else ''}"
    lines = [f"Plan: {p.method} of {p.model['name']} on {where} -> engine {p.engine}, {procs}", ""]
    mem = p.memory
    label = "per GPU" if p.device == "cuda" else "in RAM"
    src = "measured by the smoke test" if mem["source"] == "measured" else "estimated"
    # "whole job" is the sizer's figure: beside a measured peak it is named as the estimate it is
    whole = f"whole job {'estimated at ' if mem['source'] == 'measured' else ''}{mem['total_gb']} GB" + (
        " (cards + CPU RAM)" if p.offload_optimizer else ""
    )
    lines.append(f"Memory {label}: {mem['per_gpu_gb']} GB of {mem['capacity_gb']} GB ({src}); {whole}")
    width = max(len(k) for k in mem["breakdown_gb"])
    for k, v in mem["breakdown_gb"].items():
        lines.append(f"  {k:<{width}}  {v:8.2f} GB  {mem['explanations'].get(k, '')}")
    if mem["source"] == "measured":
        lines.append(f"  (estimate before measuring: {mem['estimated_per_gpu_gb']} GB)")
    if mem.get("offloaded_ram_gb"):
        lines.append(f"  + {mem['offloaded_ram_gb']} GB of activations offloaded to CPU RAM")
    if mem.get("offloaded_params_gb") and p.offload_optimizer:
        lines.append(
            f"  + {mem['offloaded_params_gb']} GB in CPU RAM (DeepSpeed CPU offload): fp32 master weights, "
            "gradients and Adam states"
            + (" and the 16-bit parameter partitions" if p.offload_params else "")
            + f"; {mem.get('train_ram_gb', 0)} GB of RAM while training"
        )
    elif mem.get("offloaded_params_gb"):
        lines.append(
            f"  + {mem['offloaded_params_gb']} GB of parameter shards, gradients and optimizer states "
            "offloaded to CPU RAM (FSDP parameter offload)"
        )
    if mem.get("load_explanation"):
        lines.append(f"  loading: {mem['load_explanation']}")
    lines += ["", "Why:", *(f"  - {r}" for r in p.reasons), ""]
    t = p.tokens
    tps_src = t["tokens_per_second_source"]
    lines.append(f"Tokens: {_fmt_tokens(t['training_tokens'])} training tokens ({t['source']})")
    lines.append(
        f"Speed:  {t['tokens_per_second']:,.0f} tokens/s ({tps_src})"
        + (f", estimate was {t['estimated_tokens_per_second']:,.0f}" if tps_src == "measured" else "")
        + (
            "; trains in fp16 with loss scaling (no bf16 below compute capability 8.0)"
            if t.get("precision") == "fp16"
            else ""
        )
    )
    e = p.estimate
    price = f"{p.price_per_hour_eur:.2f} EUR/h" if p.price_per_hour_eur is not None else "no price known: --price EUR/h"
    cost = f"{e['cost_eur']:.2f} EUR at {price}" if e["cost_eur"] is not None else f"unknown ({price})"
    lines.append(f"Time:   {_fmt_hours(e['hours'])} training; cost {cost}")
    if e.get("setup_hours") is not None:
        d = e["download"]
        fetch = (
            "download: none, " + d["source"]
            if d["cached"]
            else f"download {d['gb']} GB of {d['repo']} at {d['bandwidth_mb_s']:g} MB/s: "
            f"{_fmt_hours(d['seconds'] / 3600)}; size: {d['source']}"
        )
        total_cost = f", {e['total_cost_eur']:.2f} EUR" if e.get("total_cost_eur") is not None else ""
        lines.append(
            f"Setup:  {_fmt_hours(e['setup_hours'])} ({e['setup']['minutes']:g} min {e['setup']['what']}; {fetch})"
        )
        if e.get("total_hours") is not None:
            lines.append(f"Total:  {_fmt_hours(e['total_hours'])}{total_cost} on this box")
    clock = f" (every {_fmt_minutes(p.checkpoint_every_minutes)} by the clock)" if p.checkpoint_every_minutes else ""
    lines.append(
        f"Steps:  {p.total_steps:,} optimizer steps (micro-batch {p.micro_batch_size} x accumulation "
        f"{p.gradient_accumulation_steps} x {procs}); checkpoint about every {p.checkpoint_every_steps} steps{clock}"
    )
    r = p.cheapest_rental
    if r is not None and p.device == "cuda":
        money = _fmt_hours(r["hours"]) if r["cost_eur"] is not None else f"{r['price_per_hour_eur']:.2f} EUR/h"
        money += f", {r['cost_eur']:.2f} EUR" if r["cost_eur"] is not None else ""
        here = _fmt_hours(e["hours"]) + (f", {e['cost_eur']:.2f} EUR" if e["cost_eur"] is not None else "")
        lines.append(
            f"Rent:   this box as planned {here}; the cheapest box to rent instead is {r['gpus']} "
            f"({r['engine']}, {money}, training only)"
        )
    if p.alternatives:
        lines += ["", "Other boxes that hold the job (estimated; with ftrun's Docker image):"]
        lines.append(f"  {'gpus':<16} {'engine':<9} {'GB/card':>8} {'tokens/s':>9} {'time':>14} {'cost EUR':>9}")
        for a in p.alternatives:
            cost_a = f"{a['cost_eur']:.2f}" if a["cost_eur"] is not None else "-"
            lines.append(
                f"  {a['gpus']:<16} {a['engine']:<9} {a['per_gpu_gb']:>8} {a['tokens_per_second']:>9,} "
                f"{_fmt_hours(a['hours']):>14} {cost_a:>9}"
            )
        rates = [a["tokens_per_second"] for a in p.alternatives if a.get("tokens_per_second")]
        if len(rates) > 1 and max(rates) <= 1.1 * min(rates):
            # a T4 and an RTX 5090 at the same rate: the fixed per-step cost (throughput.GPU_SECONDS_PER_MICRO_BATCH)
            # dwarfs the model's FLOPs, so the table cannot rank the cards by speed
            lines.append(
                "  (the same rate on every card: for a model this small each step's fixed overhead, not the "
                "card's speed, sets it; a run measures its real rate)"
            )
    lines += ["", *(f"note: {n}" for n in p.notes), f"note: {UNIT}; tokens are {TOKENS_MEANING}"]
    return "\n".join(lines)
