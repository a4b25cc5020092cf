"""The GPU check's command line: the step order, running one step into its JSON, recording its end, the summary."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import gpu_check as package
from gpu_check.attention import attention_child, step_attention
from gpu_check.bench import step_bench_full, step_bench_lora, step_bench_lora_fast
from gpu_check.common import Context, first_line, read_json, write_json
from gpu_check.device import step_device
from gpu_check.fsdp_check import fsdp_child, step_fsdp
from gpu_check.generation import generation_child, step_generation
from gpu_check.launch import step_launch_env
from gpu_check.loss_head import step_loss_head
from gpu_check.memory_check import step_oom, step_peak_memory
from gpu_check.padding import step_bench_padding
from gpu_check.placement_check import place_child, step_memory_cap, step_placement
from gpu_check.product import (
    step_product_dpo,
    step_product_grpo,
    step_product_lora,
    step_product_qlora,
    step_product_vision,
)
from gpu_check.resume_check import step_resume_exact
from gpu_check.smoke_check import step_smoke_bench
from gpu_check.tiny_model import step_tiny_model
from gpu_check.unsloth_check import step_unsloth, step_unsloth_vision
from gpu_check.vision_check import step_vision
from gpu_check.vs_trl import step_vs_trl, trl_child
from gpu_check.training import GPU_SHAPE

# Execution order: the torch-only checks first (seconds each, not in the product preset), then what one call on a lent
# GPU must answer (issue 55), in the product preset's order: ftrun itself on the tiny model (LoRA with its CPU
# comparison, GRPO from it), the attention kernels and generation's speed, the 8B padding-free step against the fixed
# shape and the plan's tokens/s at the calibration's shape, the exact resume, DPO and QLoRA; then what the preset
# leaves out, FSDP (a distributed launch: the likeliest to hang) and the trl-based benches last.
STEPS = (
    "tiny-model",
    "device",
    "launch-env",
    "placement",
    "memory-cap",
    "peak-memory",
    "oom",
    "loss-head",
    "product-lora",
    "product-grpo",
    "attention",
    "generation",
    "bench-padding",
    "bench-lora",
    "resume-exact",
    "product-dpo",
    "product-qlora",
    "product-vision",
    "vision",
    "vs-trl",
    "bench-lora-fast",
    "bench-full",
    "fsdp",
    "smoke-bench",
    "unsloth",
    "unsloth-vision",
)
# Each step's timeout in seconds, on a GPU and in the dry run (CPU): the most it may take; the script gives it less
# where the budget left, less what the later steps are estimated to need (preflight.py), says so, though never less
# than its own estimate and a half (scripts/gpu_check.sh: an earlier step matters more than a later one).
TIMEOUTS = {
    "tiny-model": (60, 90),
    "device": (45, 60),
    "launch-env": (90, 150),
    "placement": (90, 120),
    "memory-cap": (45, 60),
    "peak-memory": (45, 60),
    "oom": (60, 60),
    "loss-head": (60, 90),
    "product-lora": (200, 300),
    "product-grpo": (150, 300),
    "attention": (120, 150),
    "generation": (90, 120),
    "bench-padding": (150, 180),
    "resume-exact": (180, 300),
    "product-dpo": (120, 300),
    "product-qlora": (150, 480),
    "product-vision": (150, 300),
    "vision": (240, 120),
    "bench-lora": (90, 120),
    "vs-trl": (120, 300),
    "bench-lora-fast": (120, 120),
    "bench-full": (150, 120),
    "fsdp": (120, 150),
    "smoke-bench": (300, 300),
    "unsloth": (200, 60),
    "unsloth-vision": (150, 60),
}
# Named selections (GPU_CHECK_STEPS=product): what one call of 540 s on a lent GPU runs, in STEPS's order; the
# numbers issue 55's "Done when" names come from product-lora (the demo's step, GPU against 2 CPU cores),
# generation (tokens/s), bench-padding (padding-free 8B against the fixed shape), resume-exact (exact on CUDA) and
# bench-lora (the plan's tokens/s on a card it was not calibrated on), each its JSON's "decides".
PRESETS = {
    "product": (
        "tiny-model",
        "product-lora",
        "product-grpo",
        "attention",
        "generation",
        "bench-padding",
        "bench-lora",
        "resume-exact",
        "product-dpo",
        "product-qlora",
    ),
    # the second call: TRL 1.15 beside Unsloth, one stack; the vision path beside TRL's on the tiny VLM
    "unsloth": ("tiny-model", "product-lora", "unsloth", "product-vision", "unsloth-vision"),
    # issue 57: `ftrun recipes/tiny-cpu-vision.yaml` on the card; the tiny VLM's steps and the 7B shape's memory and
    # tokens/s against the plan
    "vision": ("product-vision", "vision"),
}
STEP_FUNCS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "tiny-model": step_tiny_model,
    "device": step_device,
    "launch-env": step_launch_env,
    "placement": step_placement,
    "memory-cap": step_memory_cap,
    "peak-memory": step_peak_memory,
    "oom": step_oom,
    "loss-head": step_loss_head,
    "bench-lora": step_bench_lora,
    "bench-lora-fast": step_bench_lora_fast,
    "bench-full": step_bench_full,
    "bench-padding": step_bench_padding,
    "fsdp": step_fsdp,
    "smoke-bench": step_smoke_bench,
    "attention": step_attention,
    "product-lora": step_product_lora,
    "generation": step_generation,
    "vs-trl": step_vs_trl,
    "resume-exact": step_resume_exact,
    "product-dpo": step_product_dpo,
    "product-grpo": step_product_grpo,
    "product-qlora": step_product_qlora,
    "product-vision": step_product_vision,
    "unsloth": step_unsloth,
    "unsloth-vision": step_unsloth_vision,
    "vision": step_vision,
}


def selected_steps(spec: str) -> list[str]:
    """GPU_CHECK_STEPS: step names and preset names (PRESETS), comma-separated, in the order they run; empty: none
    named (every step runs)."""
    names: list[str] = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        for name in PRESETS.get(item, (item,)):
            if name not in STEPS:
                raise ValueError(
                    f"GPU_CHECK_STEPS: {name!r} is no step or preset; steps: {', '.join(STEPS)}; "
                    f"presets: {', '.join(PRESETS)}"
                )
            if name not in names:
                names.append(name)
    return sorted(names, key=STEPS.index)  # run in STEPS's order, whatever order the list names them in


def step_limit(timeout: int, floor: int, left: int, reserve: int) -> tuple[int, str]:
    """A step's seconds: its timeout, no more than what is left of the budget less `reserve` (the later steps'
    estimates), though never less than its own estimate `floor` and a half where the budget has it (the steps run
    in the order of what matters: a step cut for a later one's sake would lose both). With why, where it is cut."""
    limit = min(timeout, left)
    want = min(floor * 3 // 2 + 10, limit)
    share = left - reserve
    if share >= limit:
        return limit, ""
    got = max(share, want)
    if got >= limit:
        return limit, ""
    return got, f"{got} s of its {timeout}: {left} s left, {reserve} s kept for the later steps' estimates"


def _terminated(signum, frame) -> None:  # noqa: ARG001 - a signal handler's signature
    raise SystemExit(124)


def _status(result: dict[str, Any]) -> str:
    return {True: "passed", False: "failed", None: "skipped"}[result.get("ok")]


def run_step(name: str, ctx_args: dict[str, Any]) -> int:
    """Run one step in this process; its JSON says "running" until it ends (so a kill leaves that behind)."""
    out = Path(ctx_args["out"])
    path = out / f"{name}.json"
    started = time.time()
    base = {"step": name, "status": "running", "started": started, "mode": "dry-run" if ctx_args["dry_run"] else "gpu"}
    write_json(path, base)
    ctx = Context(progress=lambda **kw: write_json(path, {**base, "partial": kw}), **ctx_args)
    # timeout(1) ends a step with SIGTERM (scripts/gpu_check.sh): as an exception it unwinds the step, whose cleanups
    # end what it started in sessions of their own (product.cli, attention.run_children, resume_check)
    signal.signal(signal.SIGTERM, _terminated)
    try:
        result = STEP_FUNCS[name](ctx)
    except Exception as exc:  # noqa: BLE001 - a failed step is a result, recorded with its reason
        result = {
            "ok": False,
            "error": first_line(exc),
            "traceback": traceback.format_exc()[-3000:],
            "line": f"error: {first_line(exc)}",
        }
        partial = (read_json(path) or {}).get("partial")
        if partial:
            result["partial"] = partial
    import resource

    cpu = sum(
        getattr(resource.getrusage(who), f)
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        for f in ("ru_utime", "ru_stime")
    )
    result = {
        **base,
        **result,
        "status": _status(result),
        "seconds": round(time.time() - started, 1),
        "cpu_seconds": round(cpu, 1),
    }
    write_json(path, result)
    return 0 if result["ok"] is not False else 1


def finish(out: Path, name: str, rc: int, limit: Optional[float], not_run: Optional[str] = None) -> str:
    """After a step's process ended (or was not started, `not_run` saying why): record what it could not,
    rewrite the summary, and return the step's one-line result."""
    path = out / f"{name}.json"
    data = read_json(path)
    if not_run is not None:
        data = {"step": name, "status": "not run", "ok": False, "error": not_run, "line": f"not run: {not_run}"}
        write_json(path, data)
    elif data is None or data.get("status") == "running":
        data = data or {"step": name}
        log = out / f"{name}.log"
        tail = ""
        if log.is_file():
            lines = [x for x in log.read_text(errors="replace").strip().splitlines() if x.strip()]
            tail = lines[-1][:200] if lines else ""
        if rc in (124, 137):  # timeout(1): 124 after SIGTERM, 128+9 after its SIGKILL
            why = f"timed out after {limit:g} s" if limit else "timed out"
            data.update(status="timed out")
        else:
            why = f"ended with exit {rc} without a result" + (f": {tail}" if tail else "")
            data.update(status="crashed")
        if data.get("partial"):
            why += f" (what it measured before is kept in {name}.json)"
        data.update(
            ok=False,
            error=why,
            log_tail=tail,
            line=why,
            seconds=round(time.time() - data.get("started", time.time()), 1),
        )
        write_json(path, data)
    elif rc != 0 and data.get("ok") is not False:
        data.update(ok=False, status="failed", error=f"exit {rc}", line=f"{data.get('line', '')} (exit {rc})")
        write_json(path, data)
    write_summary(out)
    mark = {
        "passed": "ok",
        "failed": "FAIL",
        "skipped": "skip",
        "timed out": "TIMEOUT",
        "crashed": "CRASH",
        "not run": "NOT RUN",
    }
    secs = f" [{data['seconds']:.0f} s]" if isinstance(data.get("seconds"), (int, float)) else ""
    return f"{mark.get(data['status'], data['status']):>7} {name}: {data.get('line', '')}{secs}"


def write_summary(out: Path) -> dict[str, Any]:
    steps = []
    decides: dict[str, Any] = {}
    pre = read_json(out / "preflight.json") or {}
    estimates = {k: v.get("estimate_seconds") for k, v in (pre.get("steps") or {}).items()}
    selected = selected_steps(os.environ.get("GPU_CHECK_STEPS", ""))
    for name in STEPS:
        data = read_json(out / f"{name}.json")
        if selected and name not in selected:
            steps.append({"step": name, "status": "not selected"})
            continue
        if data is None:
            steps.append({"step": name, "status": "pending"})
            continue
        steps.append(
            {
                "step": name,
                "status": data.get("status"),
                "ok": data.get("ok"),
                "seconds": data.get("seconds"),
                "estimated_seconds": estimates.get(name),
                "line": data.get("line"),
            }
        )
        for key, verdict in (data.get("decides") or {}).items():
            decides[key] = {"step": name, **verdict}
    counts: dict[str, int] = {}
    for s in steps:
        counts[s["status"]] = counts.get(s["status"], 0) + 1
    started = float(os.environ.get("GPU_CHECK_STARTED", "0") or 0)
    summary = {
        "mode": os.environ.get("GPU_CHECK_MODE", ""),
        "updated": time.time(),
        "elapsed_seconds": round(time.time() - started, 1) if started else None,
        "budget_seconds": float(os.environ.get("GPU_CHECK_BUDGET_S", "0") or 0) or None,
        "counts": counts,
        "all_passed": all(s["status"] in ("passed", "skipped", "not selected") for s in steps),
        "decides": decides,
        "steps": steps,
    }
    write_json(out / "summary.json", summary)
    return summary


def _context_args(out: Path, dry_run: bool) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("GPU_CHECK_WORK") or out / "work")
    work.mkdir(parents=True, exist_ok=True)
    shape = os.environ.get("GPU_CHECK_SHAPE") or ("tiny" if dry_run else GPU_SHAPE)
    return {"out": out, "work": work, "dry_run": dry_run, "device": "cpu" if dry_run else "cuda", "shape": shape}


def _preflight(out: Path, dry_run: bool) -> int:
    """`preflight`: the steps to run, each with its timeout and estimate, after preflight.run skipped the rest."""
    from gpu_check import preflight

    ctx = Context(progress=lambda **kw: None, **_context_args(out, dry_run))
    try:
        names = selected_steps(os.environ.get("GPU_CHECK_STEPS", "")) or list(STEPS)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    column = 1 if dry_run else 0
    modules = {n: STEP_FUNCS[n].__module__ for n in names}
    rows = preflight.run(ctx, names, {n: TIMEOUTS[n][column] for n in names}, preflight.env_budget(), modules)
    write_summary(out)
    for name, limit, floor in rows:
        print(name, limit, floor)
    return 0


def report(out: Path) -> str:
    """What the call decides: each "decides" entry the steps recorded (summary.json), met or not, and the steps
    that would have recorded one but did not finish."""
    summary = write_summary(out)
    lines = ["gpu_check decides:"]
    mark = {True: "MET", False: "NOT MET", None: "-"}
    for key, v in summary["decides"].items():
        lines.append(f"  {mark[v.get('met')]:>7} {key} ({v['step']}): {v.get('says')}; target {v.get('target')}")
    if summary["mode"] == "dry-run":  # the targets are a GPU's: the dry run shows the path, not the figures
        lines.append("  (dry run: the targets are a GPU's; the steps' lines above are the CPU's figures)")
        return "\n".join(lines)
    said = {v["step"] for v in summary["decides"].values()}
    for s in summary["steps"]:
        if s["step"] in DECIDING and s["step"] not in said and s["status"] != "not selected":
            lines.append(
                f"  {'MISSING':>7} {DECIDING[s['step']]} ({s['step']}, {s['status']}): {s.get('line') or 'no result'}"
            )
    return "\n".join(lines)


# The steps whose JSON carries a "decides" entry for issue 55's "Done when", and what it decides.
DECIDING = {
    "product-lora": "demo-step",
    "generation": "generation",
    "bench-padding": "padding-free",
    "resume-exact": "resume",
    "bench-lora": "plan-tokens-per-second",
}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m gpu_check", description=package.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("step", help="run one step, writing OUT/NAME.json")
    s.add_argument("name", choices=STEPS)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--dry-run", action="store_true", help="on the CPU, with CPU expectations and a tiny shape")
    f = sub.add_parser("finish", help="record a step's end (timeout, crash, skip), rewrite the summary, print its line")
    f.add_argument("name", choices=STEPS)
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("--rc", type=int, default=0)
    f.add_argument("--limit", type=float)
    f.add_argument("--not-run", help="the step was not started, for this reason")
    st = sub.add_parser("start", help="remove step results of an earlier run from OUT, write the first summary")
    st.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("place-child", help=argparse.SUPPRESS)
    c.add_argument("--model", type=Path, required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--load", action="store_true")
    d = sub.add_parser("fsdp-child", help=argparse.SUPPRESS)
    d.add_argument("--model", type=Path, required=True)
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--work", type=Path, required=True)
    d.add_argument("--device", choices=("cuda", "cpu"), required=True)
    a = sub.add_parser("attention-child", help=argparse.SUPPRESS)
    a.add_argument("--out", required=True)
    g = sub.add_parser("generation-child", help=argparse.SUPPRESS)
    g.add_argument("--model", type=Path, required=True)
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--force-cudnn", action="store_true")
    t = sub.add_parser("trl-child", help=argparse.SUPPRESS)
    t.add_argument("--model", type=Path, required=True)
    t.add_argument("--settings", type=Path, required=True)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--no-cudnn", action="store_true")
    pf = sub.add_parser(
        "preflight",
        help="measure the box, record the steps it cannot hold as skipped, print each step's estimate (stderr) and "
        "the steps to run as 'NAME LIMIT FLOOR' lines (stdout)",
    )
    pf.add_argument("--out", type=Path, required=True)
    pf.add_argument("--dry-run", action="store_true")
    bx = sub.add_parser("box-child", help=argparse.SUPPRESS)
    bx.add_argument("--device", choices=("cuda", "cpu"), required=True)
    bx.add_argument("--modules", default="")
    rp = sub.add_parser("report", help="print what the call decides (each step's 'decides') from OUT's results")
    rp.add_argument("--out", type=Path, required=True)
    lim = sub.add_parser("limit", help="print a step's seconds: TIMEOUT FLOOR LEFT RESERVE (step_limit)")
    lim.add_argument("name", choices=STEPS)
    lim.add_argument("numbers", type=int, nargs=4)
    sel = sub.add_parser("select", help="print the steps GPU_CHECK_STEPS selects (presets expanded), one a line")
    sel.add_argument("spec", nargs="?", default=None)
    ns = p.parse_args(argv)
    if ns.command == "select":
        try:
            print(
                "\n".join(
                    selected_steps(os.environ.get("GPU_CHECK_STEPS", "") if ns.spec is None else ns.spec) or STEPS
                )
            )
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        return 0
    if ns.command == "attention-child":
        return attention_child(ns.out)
    if ns.command == "generation-child":
        return generation_child(ns.model, ns.out, ns.force_cudnn)
    if ns.command == "trl-child":
        return trl_child(ns.model, ns.settings, ns.out, not ns.no_cudnn)
    if ns.command == "step":
        return run_step(ns.name, _context_args(ns.out, ns.dry_run))
    if ns.command == "preflight":
        return _preflight(ns.out, ns.dry_run)
    if ns.command == "limit":
        limit, why = step_limit(*ns.numbers)
        if why:
            print(f"gpu_check: {ns.name} gets {why}", file=sys.stderr, flush=True)
        print(limit)
        return 0
    if ns.command == "box-child":
        from gpu_check.preflight import box_child

        return box_child(ns.device, [m for m in ns.modules.split(",") if m])
    if ns.command == "report":
        print(report(ns.out), flush=True)
        return 0
    if ns.command == "start":
        ns.out.mkdir(parents=True, exist_ok=True)
        for name in STEPS:
            (ns.out / f"{name}.json").unlink(missing_ok=True)
        write_summary(ns.out)
        return 0
    if ns.command == "finish":
        print(finish(ns.out, ns.name, ns.rc, ns.limit, ns.not_run), flush=True)
        return 0
    if ns.command == "place-child":
        return place_child(ns.model, Path(ns.out.replace("{rank}", os.environ.get("RANK", "0"))), ns.load)
    return fsdp_child(ns.model, ns.out, ns.work, ns.device)
