"""The smoke test: train on a sample of the data (longest examples included), measure, extrapolate the full run.

Its settings are the recipe's `smoke:` (SmokeSettings); the fraction applies to the training examples
(dataset.smoke_sample) and to the held-out ones (split.smoke_subset). launcher/run/views.py words the report.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import time
from typing import Any, Optional

from launcher.data import split
from launcher.worker import train
from launcher.plan.sampling import uses_vllm
from launcher.worker.engines import (
    MULTI_PROCESS,
    failed_verification,
    launch_command,
    launch_env,
    with_death_signal,
    worker_file,
    world_size,
)
from launcher.store.checkpoint import atomic_write_json
from launcher.data.dataset import DataStats, example_lengths, smoke_sample, write_jsonl
from launcher import export_formats, methods
from launcher.errors import WORKER_EXITS, SmokeError, SmokeOOM
from launcher.store.rundir import RunDir

REASONS = {code: (e.what, e.fix) for code, e in WORKER_EXITS.items()}


def training_tokens(recipe, stats: DataStats, processes: int) -> int:
    """Tokens the full run trains on: the data's (GRPO: once per answer) times epochs, or max_steps of batches."""
    per_epoch = stats.total_tokens * _answers(recipe)
    if recipe.max_steps:
        global_batch = recipe.micro_batch_size * recipe.gradient_accumulation_steps * processes
        return int(recipe.max_steps * global_batch * stats.mean_tokens)  # max_steps overrides epochs, as in the Trainer
    return int(per_epoch * recipe.epochs)


def step_fit(measured: dict[str, Any]) -> tuple[float, float] | None:
    """(a, b) of seconds = a + b * tokens per step, least squares over the smoke's measured steps; None when
    there are too few steps or the noise is larger than the effect."""
    costs = measured.get("step_costs") or []
    if len(costs) < 3:
        return None
    n = len(costs)
    mx = sum(c[0] for c in costs) / n
    my = sum(c[1] for c in costs) / n
    var = sum((c[0] - mx) ** 2 for c in costs)
    if var <= 0:
        return None
    b = sum((c[0] - mx) * (c[1] - my) for c in costs) / var
    a = my - b * mx
    return (a, b) if a >= 0 and b > 0 else None


def step_seconds(measured: dict[str, Any], total_tokens: int, recipe, stats: DataStats, processes: int) -> float:
    """Seconds of the full run's steps: a per-step plus a per-token cost fitted on the smoke's steps (a plain
    tokens/s is biased by the sample's long examples: docs/BENCHMARKS.md, "Smoke-test ETA accuracy"); tokens /
    (tokens/s) when the fit is not usable."""
    if recipe.objective_row.generates:
        per_step = sampled_step_seconds(measured)
        if per_step is not None:
            return per_step * _full_steps(recipe, stats, processes)
    fallback = total_tokens / measured["tokens_per_second"]
    fit = step_fit(measured)
    if fit is None:
        return fallback
    a, b = fit
    return a * _full_steps(recipe, stats, processes) + b * total_tokens


def _full_steps(recipe, stats: DataStats, processes: int) -> int:
    """The full run's optimizer steps: max_steps, else the data's batches per epoch times epochs."""
    global_batch = recipe.micro_batch_size * recipe.gradient_accumulation_steps * processes
    return recipe.max_steps or math.ceil(stats.examples * _answers(recipe) / global_batch) * recipe.epochs


def sampled_step_seconds(measured: dict[str, Any]) -> Optional[float]:
    """GRPO: one full-run step's seconds, None without measured steps. A GRPO step's cost is per step, not per
    token: the median of the smoke's steps, its sampling part priced at grpo.max_completion_length where the smoke's
    answers ended sooner (docs/BENCHMARKS.md, "Smoke-test ETA accuracy")."""
    costs = sorted(c[1] for c in measured.get("step_costs") or [])
    if not costs:
        return None
    mid = len(costs) // 2
    step = costs[mid] if len(costs) % 2 else (costs[mid - 1] + costs[mid]) / 2
    longest, cap = measured.get("sampling_longest") or [], measured.get("max_completion_length")
    sampled, total = measured.get("sampling_seconds"), measured.get("seconds")
    if longest and cap and sampled and total:
        share = min(1.0, float(sampled) / float(total))  # of the steps' time, step 1 included as in the sum
        grown = float(cap) / max(1.0, sum(longest) / len(longest))
        step *= 1.0 + share * max(0.0, grown - 1.0)
    return step


def examples_per_step(recipe, processes: int) -> int:
    """The examples one optimizer step takes, all processes together: GRPO's batch counts answers, num_generations
    of them per prompt (a step of 16 answers is 4 prompts)."""
    return recipe.micro_batch_size * recipe.gradient_accumulation_steps * processes // _answers(recipe)


def _answers(recipe) -> int:
    """Sequences each example trains as in a batch: GRPO's sampled answers per prompt, else 1."""
    return recipe.grpo.num_generations if recipe.objective_row.generates else 1


def _measured(measured: dict[str, Any], key: str) -> float:
    return float(measured.get(key) or 0.0)


def saves_seconds(one_save: float, train_seconds: float, recipe) -> float:
    """The full run's checkpoint time: one every interval, one at the end and the final model, each as timed."""
    every = recipe.checkpoint_every_minutes * 60.0
    return one_save * (math.floor(train_seconds / every) + 2)


MIN_RATE_BYTES = 64e6


def gguf_bytes_per_param(gguf_type: str) -> float:
    """Bytes written per parameter for a GGUF: the file, plus the 16-bit file a quantized type is made from."""
    from launcher.gguf_types import TYPES, bytes_per_param

    return bytes_per_param(gguf_type) + (0.0 if gguf_type in TYPES and TYPES[gguf_type].converter else 2.0)


def export_seconds(measured: dict[str, Any], recipe, params: int) -> float:
    """The exports after training (launcher/deliver/export.py): its imports, one model load per load it makes, and
    the bytes written at the disk rate of the smoke's timed checkpoint save."""
    formats = set(recipe.export)
    if not formats:
        return 0.0
    merged = "merged" in export_formats.made(formats)
    lora = methods.is_adapter(recipe.method)
    # loads: adapter the base; merged a full fine-tune's 16-bit reference, then the folder; gguf the file read back.
    # gguf: llama.cpp's converter imports again, and a quantized type is written twice (16-bit, then quantized)
    gguf = "gguf" in formats
    loads = (1 if lora else 0) + ((1 if lora else 2) if merged else 0) + (1 if gguf else 0)
    written = (2.0 * params if merged else 0.0) + (gguf_bytes_per_param(recipe.gguf_type) * params if gguf else 0.0)
    seconds = _measured(measured, "import_seconds") * (2 if gguf else 1) + loads * _measured(measured, "load_seconds")
    save_bytes, save_seconds = measured.get("checkpoint_bytes"), measured.get("checkpoint_seconds")
    # a save under MIN_RATE_BYTES (a LoRA checkpoint) is mostly fixed cost: its rate says nothing of a merged model's
    if written and save_bytes and save_seconds and float(save_bytes) >= MIN_RATE_BYTES:
        seconds += written / (float(save_bytes) / float(save_seconds))
    return seconds


def task_eval_seconds(measured: dict[str, Any], recipe, examples: int, base_scored: bool) -> float:
    """The task evaluation after training (launcher/worker/task_eval.py) from the smoke's timed batch of prompts:
    `examples` prompts for the fine-tuned model, each export, and the base model twice where not scored yet. An
    upper bound: answers priced at the cap (max_new_tokens)."""
    seconds, asked = measured.get("generation_seconds"), measured.get("generation_prompts")
    if not seconds or not asked or not examples:
        return 0.0
    longest, cap = measured.get("generation_longest"), measured.get("generation_max_new_tokens")
    per_batch = float(seconds) * (float(cap) / float(longest) if longest and cap and cap > longest else 1.0)
    formats = set(recipe.export)
    scorers = 1 + ("merged" in export_formats.made(formats)) + ("gguf" in formats)
    if not base_scored and methods.is_adapter(recipe.method) and not recipe.init_from:  # results.py _score_after
        scorers += 2
    return scorers * math.ceil(examples / int(asked)) * per_batch


def estimate(
    measured: dict[str, Any],
    wall: float,
    recipe,
    stats: DataStats,
    processes: int,
    params: int,
    task_examples: int = 0,
    base_scored: bool = True,
) -> dict[str, float]:
    """The full run's wall time in parts, from the smoke worker's measurements and its wall time `wall`;
    `task_examples`: the prompts the task evaluation will ask after training (task_eval_seconds)."""
    # The full run pays the smoke worker's fixed start (imports, model load, data, step 1's warm-up): its wall time
    # minus its measured steps (docs/BENCHMARKS.md, "Smoke-test ETA accuracy")
    save = _measured(measured, "checkpoint_seconds")
    startup = max(0.0, wall - _measured(measured, "measured_seconds") - save)
    if measured.get("warmup_tokens"):
        # only what step 1 took beyond a step of its tokens is start-up: the step estimate counts every step
        fit, first = step_fit(measured), float(measured["warmup_tokens"])
        step1 = fit[0] + fit[1] * first if fit else first / float(measured["tokens_per_second"])
        if recipe.objective_row.generates and measured.get("step_costs"):  # GRPO: a step costs a step
            step1 = sorted(c[1] for c in measured["step_costs"])[len(measured["step_costs"]) // 2]
        startup = max(0.0, startup - step1)
    # the smoke's eval pass and the base model's answers are priced apart (the full run has its own number of them)
    samples = _measured(measured, "samples_seconds")
    startup = max(
        0.0, startup - _measured(measured, "eval_seconds") - samples - _measured(measured, "generation_seconds")
    )
    total_tokens = training_tokens(recipe, stats, processes)
    train = step_seconds(measured, total_tokens, recipe, stats, processes)
    saves = saves_seconds(save, train, recipe)
    export = export_seconds(measured, recipe, params)
    evals = split.eval_seconds(measured, train, recipe)
    task = task_eval_seconds(measured, recipe, task_examples, base_scored)
    return {
        "startup_seconds": startup,
        "train_seconds": train,
        "saves_seconds": saves,
        "export_seconds": export,
        "eval_seconds": evals,
        "samples_seconds": samples,
        "task_eval_seconds": task,
        "estimated_seconds": startup + train + saves + export + evals + samples + task,
    }


def run_smoke(
    run: RunDir, recipe, plan: dict[str, Any], examples, lengths: list[int], stats: DataStats, own_session: bool = True
) -> dict[str, Any]:
    """Run the worker on the sample in the foreground; write and return smoke.json, or raise SmokeError.
    `own_session`: as the full run's worker will run (start_worker)."""
    processes = world_size(plan)  # all nodes' processes share the global batch
    global_batch = examples_per_step(recipe, processes)
    parts = split.for_recipe(examples, recipe)  # held-out examples never train, here neither
    drawn = smoke_sample(
        [lengths[i] for i in parts.train],
        recipe.smoke.fraction,
        recipe.smoke.min_steps * global_batch,
        recipe.seed,
        longest=global_batch,
    )
    idx = [parts.train[j] for j in drawn]
    shutil.rmtree(run.smoke_work, ignore_errors=True)
    run.smoke_work.mkdir(parents=True)
    eval_cost = _write_eval_request(run, recipe, examples, lengths, parts, processes)
    # the longest batch first, so an out-of-memory shows in step 1; the rest seeded random, for a fair throughput
    by_length = sorted(idx, key=lambda i: (-lengths[i], i))
    first, rest = by_length[:global_batch], by_length[global_batch:]
    random.Random(recipe.seed).shuffle(rest)
    write_jsonl(run.smoke_work / "data.jsonl", [examples[i] for i in first + rest])
    steps = max(1, len(idx) // global_batch)
    atomic_write_json(
        run.smoke_work / "request.json", {"max_steps": steps, "max_seconds": recipe.smoke.max_minutes * 60.0}
    )
    print(
        f"smoke test: {len(idx)} of {stats.examples} examples ({len(idx) / stats.examples:.1%}, the longest "
        f"included), {steps} steps, at most {recipe.smoke.max_minutes:g} min ...",
        flush=True,
    )
    log_path = run.smoke_work / "smoke.log"
    t0 = time.monotonic()
    with log_path.open("wb") as log:
        env = {**os.environ, **launch_env(plan, vllm=uses_vllm(recipe))}
        proc = start_worker(launch_command(plan, run.root, "smoke"), plan, log, env, own_session)
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
            raise
    wall = time.monotonic() - t0
    if rc != 0 and failed_verification(worker_file(run.root, "smoke")):
        rc = train.EXIT_BAD_WORLD  # torchrun reports any failed worker as 1; the worker said why
    result_path = run.smoke_work / "result.json"
    oom_path = run.smoke_work / "oom.json"
    if rc == train.EXIT_OOM or (rc != 0 and oom_path.is_file()):  # torchrun reports a worker's 78 as 1
        oom = json.loads(oom_path.read_text()) if oom_path.is_file() else {}
        raise SmokeOOM(
            oom.get("error", "out of memory"), fix=REASONS[train.EXIT_OOM][1], peak_memory_gb=oom.get("peak_memory_gb")
        )
    if rc != 0 or not result_path.is_file():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        what, fix = REASONS.get(rc, (f"the worker exited with code {rc}", f"read {log_path} (last lines below)"))
        raise SmokeError(f"{what}; the full run was not started.\n--- last lines of {log_path} ---\n{tail}", fix=fix)
    measured = {**json.loads(result_path.read_text()), **eval_cost}
    tps = measured.get("tokens_per_second")
    if not tps:
        raise SmokeError(
            "the smoke test finished too few steps to measure throughput",
            fix="raise smoke.min_steps or smoke.max_minutes.",
        )
    total_tokens = training_tokens(recipe, stats, processes)
    task = json.loads(run.task.read_text()) if run.task.is_file() else {}
    scored = json.loads(run.task_eval.read_text()).get("scores", {}) if run.task_eval.is_file() else {}
    task_examples = (
        len(task["prompts"])
        if "prompts" in task
        else 0
        if task
        else min(recipe.eval.task.examples, len(parts.held_out) or (stats.examples if recipe.eval.data else 0))
    )
    parts = estimate(
        measured,
        wall,
        recipe,
        stats,
        processes,
        int((plan.get("model") or {}).get("params") or 0),
        task_examples=task_examples,
        base_scored="base_few_shot" in scored,
    )
    est_seconds = parts["estimated_seconds"]
    price = float(plan.get("price_per_hour_eur") or 0.0)
    report = {
        **measured,
        "examples": len(idx),
        "wall_seconds": round(wall, 2),
        "training_tokens": total_tokens,
        **{k: round(v, 1) for k, v in parts.items()},
        "estimated_hours": round(est_seconds / 3600, 3),
        "price_per_hour_eur": price,
        "estimated_cost": round(est_seconds / 3600 * price, 2),
        "planned_memory_gb": (plan.get("memory") or {}).get("per_gpu_gb"),
        # a later plan applies these measurements only to the same engine and process count
        "engine": plan.get("engine"),
        "num_processes": processes,
    }
    from launcher.plan.mfu import model_flops_utilization

    mfu = model_flops_utilization(plan, tps) if measured.get("device") == "cuda" else None
    if mfu is not None:
        report["mfu"] = round(mfu, 3)  # docs/BENCHMARKS.md, "MFU"; silent on a CPU
    if measured.get("sampling_seconds") is not None and measured.get("seconds"):
        # GRPO: the share of the smoke's steps (step 1 included, as in the sampling's sum) spent sampling answers
        report["sampling_share"] = round(min(1.0, measured["sampling_seconds"] / measured["seconds"]), 3)
    cores = int((plan.get("hardware") or {}).get("cpu_count") or 0)
    if measured.get("device") == "cpu" and cores:
        # the box's 1-minute load: on a shared CPU box the steps' time, and so the forecast, follow it (views.load_note)
        report["load_average"], report["cpu_cores"] = round(os.getloadavg()[0], 2), cores
    growth = memory_growth(measured.get("device"), recipe.method)
    if growth:
        report["memory_growth"] = growth
    atomic_write_json(run.smoke, report)
    shutil.rmtree(run.smoke_work / "trainer", ignore_errors=True)
    return report


def start_worker(
    cmd: list[str], plan: dict[str, Any], log, env: dict[str, str], own_session: bool = True
) -> subprocess.Popen:
    """The smoke worker, started as the full run's worker will be: in a session of its own where the run is detached
    (supervisor.start_detached), in the launcher's under `--foreground`, so that Linux's autogroup scheduling shares
    the CPU out to it as to the run's (docs/engines.md, "GRPO"). Ctrl-C reaches the launcher, which ends the
    worker (run_smoke); a launcher that dies otherwise takes it along (engines.with_death_signal)."""
    death = signal.SIGKILL if plan.get("engine") in MULTI_PROCESS else signal.SIGTERM  # as supervisor.py's
    return subprocess.Popen(
        with_death_signal(cmd, death),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=own_session,
    )


def _write_eval_request(run: RunDir, recipe, examples, lengths: list[int], parts, processes: int) -> dict[str, Any]:
    """The smoke worker's eval pass and prompts: a share of the held-out examples (smoke/eval.jsonl) and the full
    run's sample prompts (smoke/prompts.json, unless the base model answered them already). Returns the token
    counts that scale the measured pass to the full run's (launcher/data/split.py)."""
    from launcher.worker import samples

    if recipe.eval.data:
        held_examples = split.load_eval_data(recipe)
        held_lengths, _ = example_lengths(held_examples, recipe.model)
        held, pool = list(range(len(held_examples))), held_examples
    else:
        held, pool, held_lengths = parts.held_out, examples, lengths
    cost: dict[str, Any] = {}
    if held and recipe.objective_row.generates:
        # GRPO has no eval loss: the held-out prompts are the task evaluation's (worker/train.py passes no eval set)
        print(
            f"evaluation: {len(held)} held-out prompts ({len(held) / len(examples):.1%} of the data, a seeded draw "
            "that never trains), scored by the task evaluation after training; no eval loss (GRPO samples its answers)",
            flush=True,
        )
    elif held:
        subset = split.smoke_subset(held, recipe, processes)
        write_jsonl(run.smoke_work / "eval.jsonl", [pool[i] for i in subset])
        clip = recipe.max_length
        cost = {
            "eval_examples": len(held),
            "eval_tokens": sum(min(held_lengths[i], clip) for i in subset),
            "eval_full_tokens": sum(min(held_lengths[i], clip) for i in held),
        }
        print(
            f"evaluation: {len(held)} held-out examples"
            + (
                f" ({len(held) / len(examples):.1%} of the data, a seeded draw that never trains)"
                if not recipe.eval.data
                else f" from {split.source_name(recipe.eval.data)}"
            )
            + f", every {recipe.eval.every_minutes:g} min, at the start and at the end; the smoke test "
            f"evaluates {len(subset)} of them",
            flush=True,
        )
    if recipe.eval.samples and not (run.root / samples.BEFORE_FILE).is_file():
        prompts = samples.pick(
            pool,
            held,
            parts.train if not recipe.eval.data else [],
            recipe.eval.samples,
            recipe.seed,
            split.source_name(recipe.eval.data or recipe.data),
        )
        atomic_write_json(run.smoke_work / "prompts.json", prompts)
    return cost


def memory_growth(device: Optional[str], method: str) -> Optional[dict[str, Any]]:
    """Where the smoke test's peak understates the full run's: the cause and factor for smoke.json (views.memory_note
    words it). bitsandbytes' CPU QLoRA: 0.94 -> 1.81 GB over 60 steps (docs/BENCHMARKS.md, "Why QLoRA under-predicts
    on CPU")."""
    if device == "cpu" and methods.is_quantized(method):
        return {"cause": "bitsandbytes-cpu-qlora", "factor": 2.0}
    return None
