"""What the worker writes once training is done: the smoke test's measurements, or the full run's final result
(final/adapter or final/model, the sample answers, the task evaluation's score).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

from launcher.store import checkpoint as ckpt
from launcher.data.task_verdict import BASE_FEW_SHOT, BASE_ZERO_SHOT, FINE_TUNED, start_keys, start_name
from launcher.store.rundir import RunDir
from launcher.worker import samples, task_eval
from launcher.worker.process import StopRequested, _rank, _say


def _write_smoke_result(
    run: RunDir,
    step_times,
    device: str,
    timed_out: bool,
    checkpoint_seconds: Optional[float] = None,
    costs: Optional[dict[str, Any]] = None,
    *,
    peak_gb: float,
) -> None:
    # throughput from the end of step 1 (the warm-up) to the end of the last step
    steps = [t for t in step_times if t[0] > 0]
    first, last = (steps[0], steps[-1]) if len(steps) >= 2 else (step_times[0], step_times[-1])
    seconds = last[1] - first[1]
    tokens = last[2] - first[2]
    result = {
        "steps": last[0],
        "measured_steps": last[0] - first[0],
        "seconds": round(step_times[-1][1] - step_times[0][1], 3),
        "measured_seconds": round(seconds, 3),
        "tokens": int(tokens),
        "tokens_per_second": round(tokens / seconds, 1) if seconds > 0 else None,
        "seconds_per_step": round(seconds / max(last[0] - first[0], 1), 4),
        "warmup_seconds": round(first[1] - step_times[0][1], 3),
        "warmup_tokens": int(first[2] - step_times[0][2]),  # step 1: the longest batch (smoke.py)
        # (tokens, seconds) per measured step: smoke.py fits seconds = a + b * tokens
        "step_costs": [[int(b[2] - a[2]), round(b[1] - a[1], 4)] for a, b in zip(steps, steps[1:])],
        "peak_memory_gb": round(peak_gb, 3),  # the largest over ranks (memory.peak_memory_over_ranks_gb)
        "device": device,
        "timed_out": timed_out,
        "checkpoint_seconds": round(checkpoint_seconds, 3) if checkpoint_seconds is not None else None,
        **(costs or {}),
    }
    ckpt.atomic_write_json(run.smoke_work / "result.json", result)


def generation_speed(run: RunDir, recipe, trainer, tokenizer, examples: list, sharded: bool) -> dict[str, Any]:
    """The smoke test's timing of the task evaluation's generation: one batch of task.json's prompts (else the
    sample's) answered as after training. {} without a task or prompt. Every rank of a sharding engine generates."""
    import torch

    from launcher.data.task_examples import prompt_and_reference

    if not task_eval.enabled(recipe):
        return {}
    task = json.loads(run.task.read_text()) if run.task.is_file() else {}
    if task_eval.scores(task):
        prompts, max_new, switches = task["prompts"], task["max_new_tokens"], task.get("chat_template_kwargs")
    else:
        found = [p for p in (prompt_and_reference(e) for e in examples) if p]
        prompts = [{**p, "index": i} for i, p in enumerate(found)]
        max_new, switches = recipe.eval.task.max_new_tokens or recipe.eval.max_new_tokens, None
    model = trainer.accelerator.unwrap_model(trainer.model)
    device = getattr(model, "device", None) or next(model.parameters()).device
    batch = prompts[: task_eval.BATCH.get(torch.device(device).type, task_eval.BATCH["cpu"])]
    if not batch:
        return {}
    t0 = time.monotonic()
    rows = task_eval.answer(
        model,
        tokenizer,
        batch,
        max_new,
        run.smoke_work / "generation.jsonl",
        write=False,
        synced=sharded,
        batch_size=len(batch),
        template_kwargs=switches,
    )
    seconds = time.monotonic() - t0
    new = sum(int(r["new_tokens"]) for r in rows)
    return {
        "generation_seconds": round(seconds, 3),
        "generation_prompts": len(rows),
        "generation_new_tokens": new,
        "generation_longest": max(int(r["new_tokens"]) for r in rows),  # the batch decodes until this one ends
        "generation_max_new_tokens": max_new,
        "generation_tokens_per_second": round(new / seconds, 1) if seconds > 0 else None,
    }


def _save_final(run: RunDir, trainer, tokenizer, recipe) -> None:
    """final/adapter or final/model (with the tokenizer), written to a temporary folder then renamed. Every rank calls
    it (sharding engines gather collectively); the supervisor verifies it (launcher/store/final.py)."""
    import shutil

    import torch.distributed as dist

    from launcher.store import final
    from launcher.worker import saving
    from launcher.worker.engines.fsdp import is_sharded, save_full

    name = final.kind(recipe.method)
    tmp = run.final / f".{name}.tmp"
    dtype, source = saving.final_dtype(recipe)
    if _rank() == 0:
        run.final.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    if is_sharded(trainer.model):
        # FSDP2: gathered one tensor at a time (save_full); the checkpoints stay sharded
        save_full(trainer.model, tmp, write=_rank() == 0, dtype=dtype)
    elif dtype is not None and not trainer.is_deepspeed_enabled:
        if _rank() == 0:
            saving.save_model(trainer.accelerator.unwrap_model(trainer.model), tmp, dtype)
    else:
        trainer.save_model(str(tmp))  # collective under ZeRO-3 (its 16-bit gather); only the main process writes
        if dtype is not None and _rank() == 0:
            saving.recast_folder(tmp, dtype)  # ZeRO-3 wrote its training dtype (fp16 cards, the CPU's fp32)
    if _rank() != 0:
        return
    if recipe.objective_row.reference_pass and (tmp / "ref" / "adapter_config.json").is_file():
        # DPO from a parent adapter: trl's DPOTrainer added "ref", the parent's frozen copy; not part of the result
        shutil.rmtree(tmp / "ref")
    tokenizer.save_pretrained(str(tmp))  # or a vision-language model's processor: its files (worker/processor.py)
    dst = run.final / name
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(tmp, dst)
    print(
        f"[ftrun worker] final {name} saved to {dst}"
        + (f" in {str(dtype).replace('torch.', '')} (from {source})" if dtype is not None else ""),
        flush=True,
    )


def _answer_after(run: RunDir, recipe, trainer, tokenizer, prompts: list[dict[str, Any]], sharded: bool) -> None:
    """The trained model answers the base model's prompts (samples-before.json) into final/samples.md; without that
    record, a LoRA run's base answers come from the adapter switched off."""
    if not prompts or not (sharded or _rank() == 0):
        return
    before = samples.read_before(run.root / samples.BEFORE_FILE)
    asked = [{k: v for k, v in s.items() if k != "before"} for s in before["samples"]] if before else prompts
    model = trainer.accelerator.unwrap_model(trainer.model)
    t0 = time.monotonic()
    try:
        answers = samples.generate(model, tokenizer, asked, recipe.eval.max_new_tokens, sharded)
        if before is None and hasattr(model, "disable_adapter"):
            with model.disable_adapter():
                base = samples.generate(model, tokenizer, asked, recipe.eval.max_new_tokens, sharded)
            before = {"samples": [{**p, "before": a} for p, a in zip(asked, base)]}
    except Exception as exc:  # evidence, not training: the result is saved already
        _say(f"samples: the answers after training could not be generated ({type(exc).__name__}: {exc})")
        return
    if _rank() != 0:
        return
    start = f"parent adapter, {Path(recipe.init_from).name}" if recipe.init_from else "base model"
    path = samples.write_after(
        run.final,
        before,
        asked,
        answers,
        run_name=run.root.name,
        step=trainer.state.global_step,
        max_new_tokens=recipe.eval.max_new_tokens,
        start=start,
    )
    _say(f"samples: before and after training in {path} ({len(answers)} prompt(s), {time.monotonic() - t0:.1f} s)")
    rows = json.loads((run.final / samples.DATA).read_text())["samples"]
    for line in samples.summary(rows):
        _say(line)


def _score_after(
    run: RunDir, recipe, trainer, tokenizer, examples: list, sharded: bool, beat=lambda: None, stop=lambda: False
) -> bool:
    """The trained model's task score as "fine_tuned" into task_eval.json, final/task_eval.json and final/samples.md
    (task.json built from `examples` when no baseline did). Under a sharding engine every rank generates; rank 0
    writes. A failure is said and the run goes on. `beat`, `stop()`: after each batch; a stop returns False."""
    if not task_eval.enabled(recipe) or not (sharded or _rank() == 0):
        return True
    writes = _rank() == 0
    t0 = time.monotonic()
    try:
        task = task_eval.task_for_run(run, recipe, examples, write=writes, tokenizer=tokenizer)
        if not task_eval.scores(task):
            if writes:
                publish_scores(run, task_eval.record(run.root, task))
                _say(f"task eval: not scored: {task.get('not_applicable') or task['why']}")
            return True
        model = trainer.accelerator.unwrap_model(trainer.model)

        def after_batch(done: int, total: int) -> None:
            beat()
            if stop():
                raise StopRequested(f"{done} of {total}")

        kw = dict(synced=sharded, write=writes, on_batch=after_batch)
        scored = (task_eval.read_results(run.root) or {}).get("scores", {})
        # an adapter's base not scored before training: scored with the adapter off (not under init_from, where the
        # parent adapter would go too)
        if hasattr(model, "disable_adapter") and not recipe.init_from:
            for name, shots in ((BASE_ZERO_SHOT, False), (BASE_FEW_SHOT, True)):
                if name in scored:
                    continue
                with model.disable_adapter():
                    result = task_eval.score_model(
                        model, tokenizer, run.root, task, name, shots, identity=recipe.model, **kw
                    )
                if writes:
                    task_eval.record(run.root, task, name, result)
                    _say(f"task eval: {name} (the adapter switched off): {result['score']:.1%}")
        kw["identity"] = f"{recipe.model} step {trainer.state.global_step}"
        result = task_eval.score_model(model, tokenizer, run.root, task, FINE_TUNED, **kw)
    except StopRequested as where:
        _say(f"task eval: stopped after {where} answers of this model (kept in {run.task_answers})")
        return False
    except Exception as exc:  # evidence, not training: the result is saved already
        if writes:
            _say(f"task eval: the fine-tuned model could not be scored ({type(exc).__name__}: {exc})")
        return True
    if not writes:
        return True
    results = task_eval.record(run.root, task, FINE_TUNED, result)
    path = publish_scores(run, results)
    from launcher.worker import trackers

    logged = trackers.log_scores(
        run.root, [t for t in recipe.report_to if t != "none"], results["scores"], trainer.state.global_step
    )
    if logged:
        _say(f"task eval: the scores are summary metrics (task/...) of the tracked run in {', '.join(logged)}")
    base = results["scores"].get(start_keys(results)[0])  # the parent's under init_from
    _say(
        f"task eval: fine-tuned {result['score']:.1%} {task['metric']} on {result['examples']} held-out examples"
        + (f" ({start_name(results)} zero-shot {base:.1%})" if base is not None else "")
        + f", {time.monotonic() - t0:.1f} s: {path}"
    )
    return True


def publish_scores(run: RunDir, results: dict[str, Any]):
    """final/task_eval.json and the scores' table at the end of final/samples.md (begun for it if need be)."""
    run.final.mkdir(parents=True, exist_ok=True)
    path = run.final / run.task_eval.name
    ckpt.atomic_write_json(path, results)
    if "scores" in results or (run.final / samples.MARKDOWN).is_file():
        samples.append_scores(run.final, results)
    return path
