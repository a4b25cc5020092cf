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
)
from launcher.store.checkpoint import atomic_write_json
from launcher.data.dataset import DataStats, smoke_sample, write_jsonl
from launcher import export_formats, methods
from launcher.errors import WORKER_EXITS, SmokeError, SmokeOOM
from launcher.store.rundir import RunDir

REASONS = {code: (e.what, e.fix) for code, e in WORKER_EXITS.items()}


def training_tokens(recipe, stats: DataStats, processes: int) -> int:
    """Tokens the full run trains on: the data's tokens times epochs, or max_steps worth of batches (GRPO: each
    prompt's tokens once per sampled answer; its batches count answers)."""
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
    """Seconds of the full run's steps: a per-step cost plus a per-token cost, fitted on the smoke's steps.

    A plain tokens/s credits steps with fewer tokens than the smoke's with the per-token overhead of
    fuller ones (measured: ETA -30% on CPU when the sample held many long examples). Falls back to
    tokens / (tokens/s) when the fit is not usable.
    """
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
    """The full run's optimizer steps: max_steps, else the data's batches per epoch times epochs (GRPO's batch counts
    answers, num_generations per prompt)."""
    global_batch = recipe.micro_batch_size * recipe.gradient_accumulation_steps * processes
    return recipe.max_steps or math.ceil(stats.examples * _answers(recipe) / global_batch) * recipe.epochs


def sampled_step_seconds(measured: dict[str, Any]) -> Optional[float]:
    """GRPO: one full-run step's seconds from the smoke's measured steps, None without them.

    A GRPO step samples the same number of answers whatever its prompts' length, decoding token by token until the
    batch's longest answer ends, then trains on them: its cost is per step, not per token. Priced by tokens, the
    demo's forecast came out -74% to +265% (the smoke's steps hold the longest prompts, so more tokens per second
    than the full run's). The median of the measured steps (a short smoke has two or three, and one slowed by another
    process on a busy box would otherwise count for all), with its sampling part priced at the longest answer the full
    run may reach (grpo.max_completion_length) where the smoke's answers ended sooner: a model that learns from its
    rewards often answers longer (the demo's answers grew from 10 to 15 of 16 tokens)."""
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
    of them per prompt (a step of 16 answers is 4 prompts). Counted as 16, the smoke test drew four steps' worth of
    the longest prompts for its first step, and its measured steps were none of the full run's usual ones."""
    return recipe.micro_batch_size * recipe.gradient_accumulation_steps * processes // _answers(recipe)


def _answers(recipe) -> int:
    """Sequences each example trains as in a batch: GRPO's sampled answers per prompt, else 1."""
    return recipe.grpo.num_generations if recipe.objective_row.generates else 1


def saves_seconds(one_save: float, train_seconds: float, recipe) -> float:
    """The full run's checkpoint time: one every interval, one at the end, and the final model save
    (about one more), each as long as the save the smoke test timed."""
    every = recipe.checkpoint_every_minutes * 60.0
    return one_save * (math.floor(train_seconds / every) + 2)


MIN_RATE_BYTES = 64e6


def gguf_bytes_per_param(gguf_type: str) -> float:
    """Bytes written per parameter for a GGUF: the file, plus the 16-bit file a quantized type is made from."""
    from launcher.gguf_types import TYPES, bytes_per_param

    return bytes_per_param(gguf_type) + (0.0 if gguf_type in TYPES and TYPES[gguf_type].converter else 2.0)


def export_seconds(measured: dict[str, Any], recipe, params: int) -> float:
    """The exports after training (launcher/deliver/export.py, in their own process), from what the smoke measured:
    the process start and imports once, one model load per load the export and its checks make, and the
    bytes written (merged 16-bit, GGUF) at the disk rate of the smoke's timed checkpoint save."""
    formats = set(recipe.export)
    if not formats:
        return 0.0
    merged = "merged" in export_formats.made(formats)
    lora = methods.is_adapter(recipe.method)
    # adapter: the base (+ adapter); merged: the 16-bit reference for a full fine-tune, then the written
    # folder reloaded; gguf: the merged model once more and the GGUF file
    # gguf: llama.cpp's converter is a process of its own (the same imports), the file is read back once in
    # llama.cpp, and a quantized type is written twice: the 16-bit conversion, then the quantized file
    gguf = "gguf" in formats
    loads = (1 if lora else 0) + ((1 if lora else 2) if merged else 0) + (1 if gguf else 0)
    written = (2.0 * params if merged else 0.0) + (gguf_bytes_per_param(recipe.gguf_type) * params if gguf else 0.0)
    seconds = float(measured.get("import_seconds") or 0.0) * (2 if gguf else 1) + loads * float(
        measured.get("load_seconds") or 0.0
    )
    save_bytes, save_seconds = measured.get("checkpoint_bytes"), measured.get("checkpoint_seconds")
    # a save of less than MIN_RATE_BYTES (a LoRA checkpoint) is mostly fixed cost: its rate would
    # overstate the writing of a merged model many times its size, so the bytes are then left out
    if written and save_bytes and save_seconds and float(save_bytes) >= MIN_RATE_BYTES:
        seconds += written / (float(save_bytes) / float(save_seconds))
    return seconds


def task_eval_seconds(measured: dict[str, Any], recipe, examples: int, base_scored: bool) -> float:
    """The task evaluation after training (launcher/worker/task_eval.py), from the smoke test's generation of one
    batch of its prompts: `examples` prompts, in batches of that size, answered by the fine-tuned model and by each
    exported model (merged folder, GGUF), and by the base model twice more (zero-shot, with examples) where a LoRA
    run's baseline has not scored it yet. An upper bound, as the plan's forecast is: a batch decodes until its
    longest answer ends, and a trained model may answer to the cap (max_new_tokens) where the smoke's barely
    trained one stopped sooner (the demo's forecast ran 3-10 times low when priced from the smoke's answers)."""
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
    # The full run pays the same fixed start as the smoke worker (process start, imports, model load, data
    # preparation, the warm-up of step 1): the smoke's wall time minus its measured steps. Without it the
    # ETA of a short run is far too low (measured: -35% for a 5-minute run on CPU, docs/BENCHMARKS.md).
    save = float(measured.get("checkpoint_seconds") or 0.0)
    startup = max(0.0, wall - float(measured.get("measured_seconds") or 0.0) - save)
    if measured.get("warmup_tokens"):
        # step 1 is in the wall time too, but the full run's steps are all counted by the step estimate:
        # only what step 1 took beyond a step of its tokens (lazy initialisation, first allocations) is start-up
        fit, first = step_fit(measured), float(measured["warmup_tokens"])
        step1 = fit[0] + fit[1] * first if fit else first / float(measured["tokens_per_second"])
        if recipe.objective_row.generates and measured.get("step_costs"):  # GRPO: a step costs a step
            step1 = sorted(c[1] for c in measured["step_costs"])[len(measured["step_costs"]) // 2]
        startup = max(0.0, startup - step1)
    # the smoke's eval pass and the base model's answers are in its wall time: priced apart (the full run has
    # its own number of eval passes, and answers the same prompts once, after training)
    samples = float(measured.get("samples_seconds") or 0.0)
    startup = max(
        0.0,
        startup
        - float(measured.get("eval_seconds") or 0.0)
        - samples
        - float(measured.get("generation_seconds") or 0.0),
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
    `own_session`: the full run's worker will run in a session of its own (the detached run; start_worker), not in
    the launcher's (`--foreground`, where the launcher supervises)."""
    from launcher.worker.engines import world_size

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
    # The worker reads the sample in order: the longest batch first, so an out-of-memory shows in
    # step 1 (seconds, not hours); the rest in a seeded random order for a fair throughput.
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
        # the box's 1-minute load at the smoke's end: on a CPU box others use, the steps' time follows it (the demo's
        # GRPO step measured 0.5-1.1 s a step at a load of 8-13 on 2 cores, its full runs 0.3-0.45 s), and so does
        # the forecast: launcher/run/views.py load_note says so
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
    (the supervisor's, supervisor.start_detached), in the launcher's where `--foreground` supervises from it; so that
    the kernel shares the CPU out to it as it will to the run's.

    On Linux with autogroup scheduling (CONFIG_SCHED_AUTOGROUP, /proc/sys/kernel/sched_autogroup_enabled, the default
    of most desktop and server kernels) CFS shares the cores between sessions first, then between the processes of a
    session. Started in the launching shell's session, the smoke worker shared that session's share with whatever else
    ran there, while the detached run had a share of its own: with one busy process beside `ftrun` in the same shell
    until the run's end (scripts/grpo_eta.py --busy 1, 2026-12-06, load 3-5 on 2 cores), the demo's GRPO steps took
    0.59-0.61 s in the smoke test and 0.29-0.37 s in the run, forecast -29% and -33%; in a session of its own
    0.30-0.37 s against 0.24-0.29 s, -15%, -9% and +8%. Its own session also keeps the terminal's Ctrl-C to the
    launcher, which ends the worker (run_smoke), and a launcher that dies any other way takes the worker with it
    (engines.with_death_signal, as the supervisor's worker)."""
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
    from launcher.data.dataset import example_lengths

    if recipe.eval.data:
        held_examples = split.load_eval_data(recipe)
        held_lengths, _ = example_lengths(held_examples, recipe.model)
        held, pool = list(range(len(held_examples))), held_examples
    else:
        held, pool, held_lengths = parts.held_out, examples, lengths
    cost: dict[str, Any] = {}
    if held and recipe.objective_row.generates:
        # GRPO has no eval loss (its own eval pass would sample answers too): the held-out prompts are the task
        # evaluation's after training (launcher/worker/train.py passes no eval dataset)
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
    """Where the smoke test's peak is known to understate the full run's (measured, docs/BENCHMARKS.md): the cause
    and the factor, stored in smoke.json; launcher/run/views.py (memory_note) words it."""
    if device == "cpu" and methods.is_quantized(method):
        # bitsandbytes' CPU path holds more memory step after step while the live tensors stay the same:
        # over a 60-step run, peak RSS from 0.94 GB in the first steps (where the smoke test measures) to
        # 1.81 GB; LoRA on the same data stays flat.
        return {"cause": "bitsandbytes-cpu-qlora", "factor": 2.0}
    return None
