"""The product steps: the demo recipe end to end through `python -m launcher.cli` (plan, base-model task evaluation,
smoke test, foreground run, task evaluation, adapter export) with LoRA, QLoRA, and DPO and GRPO from the LoRA run,
and what each run directory says about its speed (GRPO: the share of each step spent sampling answers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from gpu_check.common import REPO, Context, child_env, read_json

RECIPES = REPO / "recipes"
SFT_RECIPE = RECIPES / "tiny-cpu.yaml"
DPO_RECIPE = RECIPES / "tiny-cpu-dpo.yaml"
GRPO_RECIPE = RECIPES / "tiny-cpu-grpo.yaml"
VISION_RECIPE = RECIPES / "tiny-cpu-vision.yaml"
# What the CLI imports besides torch and transformers: the lent box gets them as wheels (scripts/device_wheels.sh).
NEEDS = ("trl", "datasets", "pydantic", "peft")
# The demo's 5 epochs are 240 steps: on the loan one epoch (48 steps) says the per-step cost as well; the dry run
# trains 4, enough for a median of the second half's step times and GRPO's rewards row by row (it shows the path,
# not the figures). logging_steps=1 gives metrics.jsonl a row per step.
STEPS = {"cuda": 48, "cpu": 4}
# The dry run trims each phase (and leaves out the exports CPU_TRIMS names): the task evaluation asks 10 prompts (the
# fewest it scores) instead of the 20 held out, the smoke test trains 3 steps, no eval pass between the start's and
# the end's, and the base model is scored in the worker after training instead of in a process of its own before it
# (under init_from not at all). On 2 busy cores a base-model pass took a minute and QLoRA's smoke test (quantization
# on the CPU) 141 s.
DRY_RUN = {
    "cuda": (),
    "cpu": ("eval.task.examples=10", "smoke.min_steps=3", "eval.every_minutes=60", "eval.task.baseline=skip"),
}
# On a GPU the runs after product-lora leave out what product-lora already measured, to fit one call: the base
# model's task evaluation (a process of its own) and, for DPO and GRPO, the export (a process of its own; the same
# adapter export product-lora times). QLoRA keeps its export: merging into a 4-bit base is its own path.
GPU_TRIMS = {
    "product-grpo": ("eval.task.baseline=skip", "export=[]"),
    "product-dpo": ("eval.task.baseline=skip", "export=[]"),
    "product-qlora": ("eval.task.baseline=skip",),
}
# The dry run leaves out what the GPU's call leaves out of DPO and GRPO: their export (export=[] is the loan's path for
# these two steps). product-lora's adapter export on the CPU is what tests/run/test_one_value_per_figure.py makes of
# the same recipe in the slow tier (adapter and merged, export.json checked figure by figure): the dry run leaves it
# out too. product-qlora keeps its export (the 4-bit base's parity loads), the one export of the dry run, so
# run_record's export fields are read on the CPU as on a GPU.
CPU_TRIMS = {
    "product-lora": ("export=[]",),
    "product-grpo": ("export=[]",),
    "product-dpo": ("export=[]",),
    "product-vision": ("export=[]",),  # the demo's fourth step exports it on the CPU (scripts/demo.sh)
}
RECIPE_OF = {
    "product-lora": SFT_RECIPE,
    "product-qlora": SFT_RECIPE,
    "product-dpo": DPO_RECIPE,
    "product-grpo": GRPO_RECIPE,
    "product-vision": VISION_RECIPE,
}


def overrides(device: str, name: str) -> tuple[str, ...]:
    """The fields a product run sets beyond the recipe, on this device."""
    return DRY_RUN[device] + CPU_TRIMS.get(name, ()) if device == "cpu" else GPU_TRIMS.get(name, ())


def processes(device: str, name: str) -> int:
    """Python processes the run starts: the step's, the CLI's (plan and data check), the base model's task
    evaluation (launcher/run/task_baseline.py), the smoke test's worker, the run's worker and the export
    (launcher/run/after_training.py), less the phases its overrides leave out."""
    fields = overrides(device, name)
    cpu_side = 2 if device == "cuda" and name == "product-lora" else 0  # cpu_reference: the CLI and its smoke worker
    return 6 - ("eval.task.baseline=skip" in fields) - ("export=[]" in fields) + cpu_side


def _recipe(name: str) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(RECIPE_OF[name].read_text())


def smoke_steps(device: str, name: str) -> int:
    """The smoke test's steps: its min_steps from the recipe or the device's overrides."""
    fields = dict(x.split("=", 1) for x in overrides(device, name))
    return int(fields.get("smoke.min_steps", _recipe(name)["smoke"]["min_steps"]))


def planned_calls(device: str, name: str) -> tuple[int, int, str]:
    """(training steps, generate calls, how they were counted) of the run, from its recipe and overrides: the
    smoke test's and the run's steps; GRPO's sampling (each step a prefill and a decode call per completion token)
    and the task evaluations' prefill and decode calls per batch of prompts (launcher/plan/throughput.py
    GENERATION_BATCH). For the estimate of the step's seconds (preflight.py)."""
    import math

    from launcher.plan import throughput

    recipe = _recipe(name)
    fields = dict(x.split("=", 1) for x in overrides(device, name))
    steps = smoke_steps(device, name) + STEPS[device]
    per_step = 0
    if recipe.get("objective") == "grpo":
        per_step = 1 + int(recipe["grpo"]["max_completion_length"])
    data = RECIPES / recipe["data"]
    examples = sum(1 for x in data.read_text().splitlines() if x.strip())
    held_out = int(fields.get("eval.task.examples", 0)) or max(1, round(examples * recipe["eval"]["fraction"]))
    evaluations = 1 + ("eval.task.baseline=skip" not in overrides(device, name))
    batches = math.ceil(held_out / throughput.GENERATION_BATCH[device])
    decode = evaluations * batches * (1 + int(recipe["eval"]["max_new_tokens"]))
    calls = steps * per_step + decode
    why = (f"sampling: {steps} steps x {per_step}, " if per_step else "") + (
        f"{evaluations} task evaluation(s) of {held_out} prompts: {batches} batch(es) x "
        f"{1 + int(recipe['eval']['max_new_tokens'])}"
    )
    return steps, calls, why


def missing_packages(extra: tuple[str, ...] = ()) -> Optional[dict[str, Any]]:
    """The step's skip result when the CLI cannot import on this box, else None."""
    import importlib.util

    missing = [m for m in (*NEEDS, *extra) if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    why = f"{', '.join(missing)} not installed (scripts/device_wheels.sh's wheels, carried as .cache/device-wheels)"
    return {"ok": None, "skipped": why, "line": f"skipped: {why}"}


def cli(
    args: list[str], cwd: Path, timeout: float, log: Path, cpus: Optional[set[int]] = None, **env: str
) -> tuple[int, float, str]:
    """`python -m launcher.cli ARGS` as a user runs it: (exit code, seconds, its output), the output appended to
    `log` (a step's log in OUT). A run that outlives `timeout` is killed with its process group. `cpus`: the cores
    it and its children may use (sched_setaffinity, which ftrun's CPU count reads: launcher/plan/hardware.py)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", *args],
        cwd=cwd,
        env=child_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        out, _ = proc.communicate()
        out += f"\n[gpu_check] killed after {timeout:.0f} s"
    except BaseException:  # the step itself is ended (its timeout's SIGTERM: runner.run_step): the run goes with it
        _kill_session(proc)
        raise
    seconds = time.perf_counter() - t0
    with log.open("a") as fh:
        fh.write(f"$ ftrun {' '.join(args)}  (exit {proc.returncode}, {seconds:.1f} s)\n{out}\n")
    return proc.returncode, seconds, out


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the CLI's process group (its own session: the step's timeout(1) does not reach it), and with it the
    run's worker, which a foreground run starts in that group (a detached run's supervisor leads a session of its
    own: resume_check.end_detached)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def tiny_model(ctx: Context) -> Path:
    """The tiny-model step's model, built here when that step was not run in this OUT/work."""
    path = ctx.work / "tiny-model"
    if not (path / "config.json").is_file():
        from gpu_check.tiny_model import step_tiny_model

        step_tiny_model(ctx)
    return path


def budget(default: float) -> float:
    return float(os.environ.get("GPU_CHECK_STEP_BUDGET", default))


def metrics_rows(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def train_rows(run: Path) -> list[dict[str, Any]]:
    return [r for r in metrics_rows(run) if "loss" in r]


def step_seconds(rows: list[dict[str, Any]]) -> list[float]:
    """Seconds between consecutive logged steps (a row per step with logging_steps=1), evaluation rows apart."""
    return [round((b["time"] - a["time"]) / max(1, b["step"] - a["step"]), 4) for a, b in zip(rows, rows[1:])]


def generation_rate(run: Path) -> dict[str, Any]:
    """The task evaluation's answers (task_eval/<scorer>.jsonl: new tokens and seconds per answer): tokens/s per
    scorer, as it generated them (batched greedy, launcher/worker/task_eval.py)."""
    rates = {}
    for path in sorted(run.rglob("task_eval/*.jsonl")):
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        seconds = sum(float(r.get("seconds", 0)) for r in rows)
        tokens = sum(int(r.get("new_tokens", 0)) for r in rows)
        rates[f"{path.parent.parent.name}/{path.stem}" if path.parent.parent != run else path.stem] = {
            "answers": len(rows),
            "new_tokens": tokens,
            "seconds": round(seconds, 3),
            "tokens_per_second": round(tokens / seconds, 1) if seconds else None,
        }
    return rates


def phases(run: Path, started: float) -> dict[str, Any]:
    """Wall time per phase from state.json's history (planned: plan and data check done; smoking: the base model's
    task evaluation done; running: the smoke test done; succeeded: training and its task evaluation done) and the
    export after it (the supervisor's, state.json export.seconds)."""
    state = read_json(run / "state.json") or {}
    marks = [("launch", started)] + [(h["state"], h["at"]) for h in state.get("history", [])]
    named = {
        "planned": "plan and data check",
        "smoking": "base-model task evaluation",
        "running": "smoke test",
        "succeeded": "training and task evaluation",
    }
    out = {}
    for (_, a), (state_b, b) in zip(marks, marks[1:]):
        out[named.get(state_b, f"until {state_b}")] = round(b - a, 1)
    export = state.get("export") or {}
    if "seconds" in export:
        out["export"] = export["seconds"]
    return out


def run_record(run: Path, started: float) -> dict[str, Any]:
    """What a finished run directory says about its speed, memory and result."""
    smoke = read_json(run / "smoke.json") or {}
    plan = read_json(run / "plan.json") or {}
    worker = read_json(run / "worker.json") or {}
    state = read_json(run / "state.json") or {}
    rows = train_rows(run)
    per_step = step_seconds(rows)
    tail = per_step[len(per_step) // 2 :]  # the second half: past the first shapes' one-time costs
    peaks = [r["peak_memory_gb"] for r in rows if isinstance(r.get("peak_memory_gb"), (int, float))]
    return {
        "state": state.get("state"),
        "ending": state.get("reason"),
        "phases_seconds": phases(run, started),
        "plan": {
            "tokens": plan.get("tokens"),
            "micro_batch_size": plan.get("micro_batch_size"),
            "gradient_accumulation_steps": plan.get("gradient_accumulation_steps"),
            "device": plan.get("device"),
            "engine": plan.get("engine"),
            "cheapest_rental_tokens_per_second": (plan.get("cheapest_rental") or {}).get("tokens_per_second"),
        },
        "smoke": {
            k: smoke.get(k)
            for k in (
                "tokens_per_second",
                "seconds_per_step",
                "step_costs",
                "peak_memory_gb",
                "planned_memory_gb",
                "generation_tokens_per_second",
                "sampling_share",  # GRPO: the share of the smoke steps spent sampling answers
                "import_seconds",
                "load_seconds",
                "warmup_seconds",
                "train_seconds",
                "startup_seconds",
                "export_seconds",
                "wall_seconds",
                "estimated_seconds",
            )
        },
        "steps": [r["step"] for r in rows],
        "losses": [round(r["loss"], 4) for r in rows],
        "step_seconds": per_step,
        "median_step_seconds_second_half": sorted(tail)[len(tail) // 2] if tail else None,
        "logged_tokens_per_second": [r.get("tokens_per_second") for r in rows],
        "peak_memory_gb": max(peaks) if peaks else None,
        "task_eval": read_json(run / "final" / "task_eval.json"),
        "generation": generation_rate(run),
        "worker": worker,
        "sdpa_backends": worker.get("sdpa_backends"),
        "attention": worker.get("attention"),  # the kernel of padded, padding-free and decode batches
        "final_check": state.get("final_check"),
        "export": state.get("export"),
    }


def run_demo(
    ctx: Context, name: str, recipe: Path, *extra: str, timeout: float, model: Optional[Path] = None
) -> dict[str, Any]:
    """`ftrun RECIPE --foreground model=... output_dir=...` in the work folder, and its record; `model`: the tiny
    model by default."""
    run = ctx.work / "runs" / name
    log = ctx.out / f"{name}.cli.log"
    steps = STEPS[ctx.device]
    args = [
        str(recipe),
        "--foreground",
        "--fresh",
        f"model={model or tiny_model(ctx)}",
        f"output_dir={run}",
        f"max_steps={steps}",
        "logging_steps=1",
        *overrides(ctx.device, name),
        *extra,
    ]
    started = time.time()
    code, seconds, out = cli(args, ctx.work, timeout, log)
    record = {
        "command": "python -m launcher.cli " + " ".join(args),
        "exit": code,
        "wall_seconds": round(seconds, 1),
        "run_dir": str(run),
        "log": log.name,
    }
    if run.is_dir():
        record.update(run_record(run, started))
    if code != 0:
        lines = [x for x in out.strip().splitlines() if x.strip()]
        record["error"] = lines[-1][:300] if lines else f"exit {code}"
    return record


def summary_line(record: dict[str, Any]) -> str:
    if record.get("exit") != 0:
        return f"failed: {record.get('error')}"
    smoke = record.get("smoke") or {}
    plan = (record.get("plan") or {}).get("tokens") or {}
    gen = [g["tokens_per_second"] for g in (record.get("generation") or {}).values() if g.get("tokens_per_second")]
    parts = [
        f"{len(record.get('steps') or [])} steps, median {record.get('median_step_seconds_second_half')} s/step",
        f"smoke {smoke.get('tokens_per_second')} tok/s (plan {plan.get('estimated_tokens_per_second')})",
        f"peak {record.get('peak_memory_gb')} GB",
        f"generation {', '.join(f'{g:.0f}' for g in gen) or '-'} tok/s",
        f"{record.get('wall_seconds')} s in all",
    ]
    return "; ".join(parts)


def _step(
    ctx: Context,
    name: str,
    recipe: Path,
    *extra: str,
    needs: tuple[str, ...] = (),
    reserve: float = 0.0,
    model: Optional[Path] = None,
) -> dict[str, Any]:
    """Run the recipe through the CLI within the step's budget, less `reserve` seconds kept for what follows where
    the budget has them (the run comes first: it gets three quarters of the budget at least)."""
    skipped = missing_packages(needs)
    if skipped:
        return skipped
    total = budget(300) - 10
    timeout = max(30.0, total - reserve, 0.75 * total)
    record = run_demo(ctx, name, recipe, *extra, timeout=timeout, model=model)
    ok = record.get("exit") == 0 and record.get("state") == "succeeded" and bool(record.get("steps"))
    return {"ok": ok, **record, "line": summary_line(record)}


# The CPU side of "the demo's step on the GPU against 2 CPU cores" (issue 55): the demo's smoke test on 2 of the
# box's cores, CUDA hidden, after the GPU run; its seconds per step against the GPU run's smoke test and steps.
CPU_CORES = 2
CPU_RESERVE_S = 40.0  # of product-lora's budget, kept for it: two process starts and 6 smoke steps on 2 cores


def cpu_reference(ctx: Context, timeout: float) -> dict[str, Any]:
    """`ftrun smoke recipes/tiny-cpu.yaml` with CUDA hidden, on CPU_CORES cores of this box: the smoke test's
    seconds per step as the demo runs on a 2-core machine."""
    cores = sorted(os.sched_getaffinity(0))[:CPU_CORES]
    run = ctx.work / "runs" / "product-lora-cpu"
    log = ctx.out / "product-lora.cli.log"
    args = ["smoke", str(SFT_RECIPE), f"model={tiny_model(ctx)}", f"output_dir={run}"]
    code, seconds, out = cli(args, ctx.work, timeout, log, cpus=set(cores), CUDA_VISIBLE_DEVICES="")
    smoke = read_json(run / "smoke.json") or {}
    record = {
        "command": "python -m launcher.cli " + " ".join(args),
        "cores": cores,
        "exit": code,
        "wall_seconds": round(seconds, 1),
        "seconds_per_step": smoke.get("seconds_per_step"),
        "tokens_per_second": smoke.get("tokens_per_second"),
        "device": (read_json(run / "worker.json") or {}).get("device") or smoke.get("device"),
    }
    if code != 0:
        lines = [x for x in out.strip().splitlines() if x.strip()]
        record["error"] = lines[-1][:300] if lines else f"exit {code}"
    return record


def demo_step_verdict(gpu: dict[str, Any], cpu: dict[str, Any]) -> dict[str, Any]:
    """Issue 55's "the demo's step faster on the GPU than on 2 CPU cores": the smoke tests' seconds per step side
    by side (the same recipe, steps and batches), and the GPU run's median step beside them."""
    g = (gpu.get("smoke") or {}).get("seconds_per_step")
    c = cpu.get("seconds_per_step")
    met = None if not (g and c) else g < c
    return {
        "value": {
            "gpu_smoke_seconds_per_step": g,
            "cpu_smoke_seconds_per_step": c,
            "gpu_run_median_step_seconds": gpu.get("median_step_seconds_second_half"),
        },
        "target": f"the GPU's smoke step faster than {CPU_CORES} CPU cores'",
        "met": met,
        "says": f"demo step: GPU {g} s vs {CPU_CORES} CPU cores {c} s (smoke tests; the GPU run's median "
        f"{gpu.get('median_step_seconds_second_half')} s)",
    }


def step_product_lora(ctx: Context) -> dict[str, Any]:
    """The demo recipe with LoRA, as the demo runs it (recipes/tiny-cpu.yaml); on a GPU, then the same recipe's
    smoke test on 2 CPU cores of the box, the other side of the demo step's comparison."""
    ctx_started = time.monotonic()
    result = _step(ctx, "product-lora", SFT_RECIPE, reserve=CPU_RESERVE_S if ctx.device == "cuda" else 0.0)
    if ctx.device != "cuda" or result.get("exit") != 0:
        return result
    ctx.progress(**result)  # the run's record stays in the step's JSON if the comparison is cut short
    left = budget(300) - 15 - (time.monotonic() - ctx_started)
    if left < 15:
        cpu = {"skipped": f"{left:.0f} s of the step's budget left for it"}
    else:
        started = time.monotonic()
        cpu = cpu_reference(ctx, left)
        cpu["seconds"] = round(time.monotonic() - started, 1)
    verdict = demo_step_verdict(result, cpu)
    result.update(cpu_reference=cpu, decides={"demo-step": verdict})
    result["line"] += f"; {verdict['says']}"
    return result


def step_product_qlora(ctx: Context) -> dict[str, Any]:
    """The demo recipe with method=qlora (bitsandbytes' 4-bit base)."""
    return _step(ctx, "product-qlora", SFT_RECIPE, "method=qlora", needs=("bitsandbytes",))


def step_product_dpo(ctx: Context) -> dict[str, Any]:
    """The demo's second step (recipes/tiny-cpu-dpo.yaml): DPO on the preference pairs from product-lora's adapter."""
    parent = ctx.work / "runs" / "product-lora"
    if not (parent / "final" / "adapter").is_dir():
        why = "product-lora's run has no final/adapter in this work folder (run product-lora first)"
        return {"ok": None, "skipped": why, "line": f"skipped: {why}"}
    return _step(ctx, "product-dpo", DPO_RECIPE, f"init_from={parent}")


def step_product_grpo(ctx: Context) -> dict[str, Any]:
    """The demo's third step (recipes/tiny-cpu-grpo.yaml): GRPO from product-lora's adapter, rewarded by the task
    metric; the record adds the smoke test's sampling share and the rewards logged (docs/engines.md: what only a GPU
    shows of GRPO is the speed of sampling with transformers' generate)."""
    parent = ctx.work / "runs" / "product-lora"
    if not (parent / "final" / "adapter").is_dir():
        why = "product-lora's run has no final/adapter in this work folder (run product-lora first)"
        return {"ok": None, "skipped": why, "line": f"skipped: {why}"}
    result = _step(ctx, "product-grpo", GRPO_RECIPE, f"init_from={parent}")
    run = ctx.work / "runs" / "product-grpo"
    rows = []
    if (run / "metrics.jsonl").is_file():
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rewards = [[r["step"], r["reward"], r.get("reward_std")] for r in rows if r.get("reward") is not None]
    share = (result.get("smoke") or {}).get("sampling_share")
    result.update({"rewards": rewards, "sampling_share": share})
    if result.get("exit") == 0:
        result["line"] += f"; sampling {share if share is None else f'{share:.0%}'} of the smoke steps" + (
            f"; reward {rewards[0][1]:.3f} -> {rewards[-1][1]:.3f}" if rewards else ""
        )
    return result


def step_product_vision(ctx: Context) -> dict[str, Any]:
    """The demo's fourth step (recipes/tiny-cpu-vision.yaml) on the device: `ftrun` itself on the tiny
    vision-language model (scripts/make_tiny_vlm.py, built in the work folder), through the plan with the tower and
    each image's tokens, the smoke test, the run, the task score with the images in the prompt and, on a GPU, the
    export with the processor files; the record adds the task score before and after."""
    from gpu_check.vision_check import tiny_vlm

    skipped = missing_packages(("PIL",))
    if skipped:
        return skipped
    result = _step(ctx, "product-vision", VISION_RECIPE, model=tiny_vlm(ctx))
    task = result.get("task_eval") or {}
    if result.get("exit") == 0 and task.get("scores"):
        said = ", ".join(f"{k} {v:.0%}" for k, v in task["scores"].items() if isinstance(v, (int, float)))
        result["line"] += f"; task score ({task.get('metric')}) {said}"
    return result
