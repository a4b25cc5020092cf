"""Before the first step: what this box has (each step's imports tried in a child process, the card and its memory,
what a process start costs here, timed), the steps the card cannot hold (skipped before they start, with the sizer's
figure and the card's), and the seconds each selected step will take, printed with where each figure comes from.

A step's estimate is its own work priced by the plan's own models: process starts x the start measured here (the
imports a worker makes and the CUDA context), steps x the plan's seconds per micro-batch (launcher/plan/throughput.py,
which the tiny model's FLOPs do not move), the 8B benches' tokens at the plan's tokens/s for this card. The script
reserves each later step's estimate out of the budget (scripts/gpu_check.sh), so that a slow step costs its own time
and not the next one's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from gpu_check.common import GB, Context, child_env, first_line, module_cmd, read_json, record_skip, write_json

# What each step imports beyond torch (module names): a step whose needs do not import is skipped before it starts,
# with the import's own error. The product steps run `python -m launcher.cli`: the CLI, worker, task evaluation
# (sacrebleu: chrF, the text metric and GRPO's reward) and export import these (pyproject.toml's dependencies and
# train extra; bitsandbytes for QLoRA only).
CLI_NEEDS = (
    "transformers",
    "peft",
    "trl",
    "datasets",
    "pydantic",
    "yaml",
    "psutil",
    "jinja2",
    "tokenizers",
    "accelerate",
    "sacrebleu",
    "tensorboard",
    "safetensors",
)
NEEDS: dict[str, tuple[str, ...]] = {
    "tiny-model": ("transformers", "tokenizers"),
    "product-lora": CLI_NEEDS,
    "product-grpo": CLI_NEEDS,
    "product-dpo": CLI_NEEDS,
    "product-qlora": (*CLI_NEEDS, "bitsandbytes"),
    "product-vision": (*CLI_NEEDS, "PIL"),
    "resume-exact": CLI_NEEDS,
    "vs-trl": CLI_NEEDS,
    "unsloth": (*CLI_NEEDS, "unsloth"),
    "unsloth-vision": (*CLI_NEEDS, "unsloth", "PIL", "torchvision"),
    "generation": ("transformers", "sacrebleu", "pydantic", "yaml", "jinja2"),
    "attention": (),
    "bench-lora": ("transformers", "peft"),
    "bench-lora-fast": ("transformers", "peft"),
    "bench-full": ("transformers",),
    "bench-padding": ("transformers", "peft"),
    "loss-head": ("transformers", "trl"),
    "fsdp": ("transformers", "accelerate", "peft"),
    # vision_check.py: the processor's images (PIL), its chat template (jinja2), trl's collator (which imports datasets)
    "vision": ("transformers", "peft", "trl", "datasets", "PIL", "jinja2", "yaml"),
}
# Modules whose absence makes a step say "skipped" rather than fail (it checks them itself and says which wheels).
OPTIONAL = {"trl", "datasets", "pydantic", "peft", "bitsandbytes", "unsloth", "accelerate"}


def processes(name: str, device: str) -> int:
    """Python processes the step starts, its own included (counted from its code)."""
    from gpu_check import product, resume_check

    if name.startswith("product-"):
        return product.processes(device, name)
    return {
        "tiny-model": 1,
        "attention": 2,  # the step and its child (another only after a case times out)
        "generation": 3,  # the step, the default variant's child, cuDNN forced on (CUDA only)
        "resume-exact": 1 + resume_check.PROCESSES,
        "vs-trl": 4,
    }.get(name, 1)


@dataclass
class Estimate:
    seconds: float
    parts: list[str] = field(default_factory=list)  # each "N s: what (from where)"
    memory_gb: Optional[float] = None  # the sizer's GPU memory, where the step trains at a real shape
    memory_rule: str = ""

    def add(self, seconds: float, what: str) -> None:
        self.seconds += seconds
        self.parts.append(f"{seconds:.0f} s {what}")


# What a step's process imports, as most do (the worker, the task evaluation, the checks' children): the second,
# warm run of the box's child imports these, and its wall time is what a process start is priced at.
PROCESS_IMPORTS = ("transformers", "peft", "trl", "datasets")


def _box_run(device: str, modules: list[str], timeout: float) -> dict[str, Any]:
    cmd = module_cmd("box-child", "--device", device, "--modules", ",".join(modules))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    lines = [x for x in proc.stdout.splitlines() if x.startswith("PREFLIGHT ")]
    if not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        raise RuntimeError(f"the box's import check failed: {tail[-1] if tail else f'exit {proc.returncode}'}")
    box = json.loads(lines[-1][len("PREFLIGHT ") :])
    box["wall_seconds"] = round(wall, 2)
    return box


def measure_box(device: str, names: list[str], timeout: float = 120) -> dict[str, Any]:
    """Two child processes. The first imports what the steps `names` need, one module at a time, and starts CUDA:
    each import's seconds and error, the card's name and memory (and the disk reads paid once for every later
    process). The second, warm, imports what a step's process does (PROCESS_IMPORTS, those that import here) and
    starts CUDA: its wall time is what a process start is priced at."""
    modules = sorted({m for name in names for m in NEEDS.get(name, ())})
    box = _box_run(device, modules, timeout)
    usual = [m for m in PROCESS_IMPORTS if m in modules and not box["imports"].get(m, [0, "absent"])[1]]
    warm = _box_run(device, usual, timeout)
    box.update(
        cold_process_seconds=box["wall_seconds"],
        process_seconds=warm["wall_seconds"],
        process_imports=["torch", *usual],
    )
    return box


def box_child(device: str, modules: list[str]) -> int:
    """measure_box's child: torch, then each module imported and timed (its error's first line where it fails),
    the CUDA context started, the card read; one JSON line."""
    import importlib

    t0 = time.perf_counter()
    import torch

    out: dict[str, Any] = {"imports": {"torch": [round(time.perf_counter() - t0, 2), None]}, "torch": torch.__version__}
    for m in modules:
        t = time.perf_counter()
        err = None
        try:
            importlib.import_module(m)
        except BaseException as exc:  # noqa: BLE001 - any failure to import is the answer (a SystemExit included)
            err = first_line(exc)
        out["imports"][m] = [round(time.perf_counter() - t, 2), err]
    out["import_seconds"] = round(time.perf_counter() - t0, 2)
    if device == "cuda" and torch.cuda.is_available():
        t = time.perf_counter()
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        out.update(
            cuda_init_seconds=round(time.perf_counter() - t, 2),
            gpu=torch.cuda.get_device_name(0),
            gpu_total_gb=round(total / GB, 2),
            gpu_free_gb=round(free / GB, 2),
            capability=list(torch.cuda.get_device_capability(0)),
        )
    print("PREFLIGHT " + json.dumps(out), flush=True)
    return 0


def _plan_rates(ctx: Context) -> dict[str, Any]:
    """The plan's fixed cost of a call: a training micro-batch on this device, and any forward call (a decode step,
    an attention call) at the GPU's, whose launches a tiny model's call is bound by."""
    from launcher.plan import throughput

    cpu = ctx.device != "cuda"
    return {
        "micro_batch_seconds": throughput.CPU_SECONDS_PER_MICRO_BATCH
        if cpu
        else throughput.GPU_SECONDS_PER_MICRO_BATCH,
        "source": f"launcher/plan/throughput.py {'CPU' if cpu else 'GPU'}_SECONDS_PER_MICRO_BATCH",
        "call_seconds": throughput.GPU_SECONDS_PER_MICRO_BATCH,
        "call_source": "launcher/plan/throughput.py GPU_SECONDS_PER_MICRO_BATCH",
    }


def _bench_estimate(ctx: Context, name: str, est: Estimate) -> None:
    """The 8B benches: the sizer's memory and the plan's tokens/s for the step's own shape and micro-batch."""
    from gpu_check import bench
    from gpu_check.training import BENCH, architecture

    cfg = BENCH[ctx.device]
    arch = architecture(ctx)
    method, checkpointing, mb = bench.STEP_SHAPES[name](ctx.device)
    pred = bench.predict(ctx, arch, method, mb, cfg["seq"], bench._fused_head_importable(), checkpointing)
    steps = cfg["warmup"] + cfg["steps"]
    tokens = steps * mb * cfg["seq"]
    tps = pred.get("tokens_per_second")
    if tps:
        est.add(tokens / tps, f"{steps} steps of {mb} x {cfg['seq']} tokens at the plan's {tps:,.0f} tokens/s")
    est.memory_gb = pred.get("memory_gb")
    est.memory_rule = bench.memory_rule(name)


def estimate(ctx: Context, name: str, box: dict[str, Any], step_module: Optional[str] = None) -> Estimate:
    """The seconds the step will take on this box, each part with its source (module docstring); `step_module`: the
    module of the step's function (runner.STEP_FUNCS), whose own `estimate_seconds` prices a step named nowhere here."""
    from gpu_check import attention, generation, product, resume_check

    est = Estimate(0.0)
    n = processes(name, ctx.device)
    start = float(box.get("process_seconds") or 0)
    est.add(n * start, f"{n} process start(s) x {start:.1f} s (timed here just now)")
    rate = _plan_rates(ctx)
    per, call = rate["micro_batch_seconds"], rate["call_seconds"]
    if name.startswith("product-"):
        steps, calls, why = product.planned_calls(ctx.device, name)
        est.add(steps * per, f"{steps} training steps x {per:g} s ({rate['source']})")
        est.add(calls * call, f"{calls} generate calls x {call:g} s ({why}; {rate['call_source']})")
        if name == "product-lora" and ctx.device == "cuda":
            from launcher.plan import throughput

            cpu = throughput.CPU_SECONDS_PER_MICRO_BATCH
            smoke = product.smoke_steps("cuda", name)  # cpu_reference passes no overrides: the recipe's own
            est.add(
                smoke * cpu,
                f"the smoke test on {product.CPU_CORES} CPU cores: {smoke} steps x {cpu:g} s "
                "(throughput.CPU_SECONDS_PER_MICRO_BATCH)",
            )
    elif name == "resume-exact":
        steps = resume_check.STEPS[ctx.device] * resume_check.RUNS
        est.add(steps * per, f"{steps} steps x {per:g} s ({rate['source']})")
    elif name == "generation":
        calls = generation.decode_calls(ctx.device)
        est.add(calls * call, f"{calls} prefill and decode calls x {call:g} s ({rate['call_source']})")
    elif name == "attention":
        s = attention.SHAPES[ctx.device]
        calls = len(attention.cases()) * (len(s["lengths"]) * (1 + s["repeats"]) + 1)
        est.add(calls * call, f"{calls} attention calls x {call:g} s ({rate['call_source']})")
        if ctx.device == "cuda":
            builds = attention.cudnn_shapes(s)
            est.add(
                builds * attention.CUDNN_BUILD_S,
                f"{builds} new shapes for cuDNN x {attention.CUDNN_BUILD_S:g} s (the first H200 loan, docs/engines.md)",
            )
    elif name in ("bench-lora", "bench-lora-fast", "bench-full"):
        _bench_estimate(ctx, name, est)
    elif name != "tiny-model":  # the tiny model: its process start (a tokenizer trained on the demo data, seconds)
        own = _own_estimate(ctx, step_module)
        if own is None:  # no sizing of its own to price: the most it may take
            return Estimate(0.0, [], None)
        est.add(own[0], own[1])
    return est


def _own_estimate(ctx: Context, step_module: Optional[str]) -> Optional[tuple[float, str]]:
    """A step module's own `estimate_seconds(ctx) -> (seconds, source)`, where it has one."""
    module = sys.modules.get(step_module) if step_module else None
    fn = getattr(module, "estimate_seconds", None)
    return fn(ctx) if fn else None


def memory_verdict(est: Estimate, box: dict[str, Any]) -> Optional[str]:
    """Why the card cannot hold the step (None if it can or nothing is known)."""
    total = box.get("gpu_total_gb")
    if not total or est.memory_gb is None:
        return None
    from launcher.plan import sizing_constants, speed

    usable = total * sizing_constants.USABLE_FRACTION
    need = est.memory_gb * (speed.HEADROOM if est.memory_rule == "speed" else 1.0)
    if need <= usable:
        return None
    if est.memory_rule == "speed":
        headroom = f"{est.memory_gb:.1f} GB x {speed.HEADROOM:g}"
        said = f"{need:.1f} GB ({headroom}, launcher/plan/speed.py's headroom for what it chooses)"
    else:
        said = f"{need:.1f} GB (the sizer's figure)"
    return (
        f"needs {said}, more than the {usable:.1f} GB the plan fills of this {box.get('gpu')}'s {total:.1f} GB "
        f"({sizing_constants.USABLE_FRACTION:.0%})"
    )


def run(
    ctx: Context,
    names: list[str],
    timeouts: dict[str, int],
    budget: float,
    step_modules: Optional[dict[str, str]] = None,
) -> list[tuple[str, int, int]]:
    """Measure the box, skip what it cannot hold or import, print the estimates; returns (name, limit, floor) for
    the steps to run, in order: `limit` the step's own timeout, `floor` its estimate (what later steps reserve).
    `step_modules`: each step's module (the runner's, which imports this one: passed, not imported back)."""
    t0 = time.perf_counter()
    try:
        box = measure_box(ctx.device, names)
    except Exception as exc:  # noqa: BLE001 - the steps still run, on their timeouts, each saying what fails
        box = {"error": first_line(exc), "imports": {}}
        print(f"gpu_check preflight: the box could not be measured ({box['error']})", file=sys.stderr, flush=True)
    report: dict[str, Any] = {"box": box, "budget_seconds": budget, "steps": {}}
    rows, total = [], 0.0
    for name in names:
        needs = NEEDS.get(name, ())
        failed = {m: box["imports"].get(m, [0, "not tried"])[1] for m in needs if box["imports"].get(m, [0, None])[1]}
        entry: dict[str, Any] = {"timeout": timeouts[name]}
        skip = None
        hard = {m: e for m, e in failed.items() if m not in OPTIONAL}
        if hard:
            skip = "does not import here: " + "; ".join(f"{m} ({e})" for m, e in hard.items())
        try:
            est = estimate(ctx, name, box, (step_modules or {}).get(name))
        except Exception as exc:  # noqa: BLE001 - an estimate that fails is said; the step still runs
            est = Estimate(float(timeouts[name]), [f"{timeouts[name]} s: its timeout (the estimate failed: {exc})"])
        if not est.parts or est.seconds <= 0:
            est = Estimate(float(timeouts[name]), [f"{timeouts[name]} s, its timeout (nothing of its own to price)"])
        held = memory_verdict(est, box) if ctx.device == "cuda" else None
        skip = skip or held
        entry.update(estimate_seconds=round(est.seconds, 1), parts=est.parts, memory_gb=est.memory_gb, failed=failed)
        if failed and not hard:
            entry["note"] = "will say skipped: " + ", ".join(sorted(failed))
        if skip:
            entry["skipped"] = skip
            record_skip(ctx.out, name, skip, estimate=entry)
        else:
            total += est.seconds
            rows.append((name, timeouts[name], int(round(est.seconds))))
        entry["cumulative_seconds"] = round(total, 1)
        report["steps"][name] = entry
    report["seconds"] = round(time.perf_counter() - t0, 1)
    write_json(ctx.out / "preflight.json", report)
    _print(report, box, budget)
    return rows


def _print(report: dict[str, Any], box: dict[str, Any], budget: float) -> None:
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731 - stdout carries the step list
    gpu = f"{box.get('gpu')} ({box.get('gpu_total_gb')} GB, {box.get('gpu_free_gb')} free)" if box.get("gpu") else "CPU"
    cuda = " and the CUDA context" if box.get("gpu") else ""
    say(
        f"gpu_check preflight: {gpu}, torch {box.get('torch')}; a process start {box.get('process_seconds')} s "
        f"({', '.join(box.get('process_imports') or [])}{cuda}; the first, with every step's imports, "
        f"{box.get('cold_process_seconds')} s); the preflight took {report['seconds']} s"
    )
    for name, e in report["steps"].items():
        state = f"SKIP: {e['skipped']}" if e.get("skipped") else f"~{e['estimate_seconds']:.0f} s"
        say(f"  {name:<16} {state}  [{'; '.join(e['parts'])}]" + (f" ({e['note']})" if e.get("note") else ""))
    over = max(0.0, max((e["cumulative_seconds"] for e in report["steps"].values()), default=0) - budget)
    say(
        f"  estimated {max((e['cumulative_seconds'] for e in report['steps'].values()), default=0):.0f} s of the "
        f"{budget:.0f} s budget" + (f": {over:.0f} s over, the last steps may be left out" if over else "")
    )


def load(out) -> Optional[dict[str, Any]]:
    return read_json(out / "preflight.json")


def env_budget() -> float:
    return float(os.environ.get("GPU_CHECK_BUDGET_S", "0") or 0)
