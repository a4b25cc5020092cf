"""The worker's main flow, from the run directory to an exit code: load, resume, train, save, report.

Run as `python -m launcher.worker.train --run-dir DIR --mode full|smoke` (or under accelerate/torchrun). It resumes
from the newest verified checkpoint by itself and reports through files: metrics.jsonl, worker.json, checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Optional

# before any Hugging Face import: no network calls (telemetry) that a closed network would hang on, and no tqdm bars
# redrawn into train.log (ftrun prints the progress itself); huggingface_hub and datasets read these at import
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


from launcher.notices import quiet_known_notices  # noqa: E402

quiet_known_notices()  # before the libraries below are imported

from launcher.engine_kinds import SHARDING  # noqa: E402
from launcher.store import checkpoint as ckpt  # noqa: E402
from launcher.data import split  # noqa: E402
from launcher.worker import fused_head  # noqa: E402
from launcher.worker import memory  # noqa: E402
from launcher.worker import samples  # noqa: E402
from launcher.store.rundir import RunDir  # noqa: E402
from launcher.worker.callbacks import (  # noqa: E402
    TrainingComplete,
    _engine_check,
    _tracked_recipe,
    _write_verification,
    build_callbacks,
)
from launcher.worker.checkpointing import (  # noqa: E402
    _MANIFEST,
    _disk_full,
    _finish,
    _launch_identity,
    _launcher_started,
    _restore_metrics,
    _resume_steps_differ,
    _verifies_resume,
    _writes_this_disk,
)
from launcher.worker.exits import (  # noqa: E402
    EXIT_BAD_WORLD,
    EXIT_NAN,
    EXIT_STOPPED,
    _is_disk_full,
    _out_of_memory,
    _record_error,
    _record_stop_after_training,
)

# the launch flow reads every exit code from here (launcher/run/supervisor.py, launcher/run/smoke.py)
from launcher.worker.exits import EXIT_DISK_FULL, EXIT_OOM  # noqa: E402, F401
from launcher.worker.heartbeat import BEAT  # noqa: E402
from launcher.worker.inputs import (  # noqa: E402
    _data_changed,
    _data_spec,
    _eval_and_prompts,
    _local_data,
    _trained_tokens,
)
from launcher.worker.loss_plot import _redraw_loss_plot  # noqa: E402
from launcher.worker.process import _Stop, _on_signal, _rank, _say, _world_size  # noqa: E402
from launcher.worker.results import (
    _answer_after,
    _save_final,
    _score_after,
    _write_smoke_result,  # noqa: E402
    generation_speed,
)
from launcher.worker.trainer_config import padding_free_collator, process_group_seconds, trainer_config  # noqa: E402


def load_model_and_tokenizer(recipe, device: str, dtype, plan: Optional[dict] = None, run_dir: Optional[Path] = None):
    """The engine's loader: Unsloth's for engine unsloth, else launcher/worker/loading.py (in ZeRO-3's context)."""
    from launcher.worker import loading

    if (plan or {}).get("engine") == "unsloth":
        from launcher.worker.engines import unsloth as unsloth_engine

        model, tokenizer, source = unsloth_engine.load_model_and_tokenizer(recipe, device, dtype)
        _say(
            f"engine unsloth {unsloth_engine.version()}: "
            f"{'FastVisionModel' if loading.reads_images(recipe.model) else 'FastLanguageModel'} loaded {source}"
            f"{' in 4 bit' if recipe.method == 'qlora' else ''}; "
            f"{'; '.join(unsloth_engine.markers(model)) or 'no Unsloth marks'}"
        )
        _say(loading.describe_model(model))
        return model, tokenizer
    from launcher.worker.engines import loading_context

    return loading.load_model_and_tokenizer(
        recipe, device, dtype, plan, context=loading_context(plan or {}, run_dir), run_dir=run_dir
    )


def _refused(run: RunDir, mode: str, engine: str, check: str, seen: str, message: str) -> int:
    """A start refused before training (the wrong world size, Unsloth missing): said, and in worker.json."""
    print(f"[ftrun worker] {message}", file=sys.stderr, flush=True)
    checks = [{"check": check, "ok": False, "seen": seen}]
    _write_verification(
        run, mode, {"engine": engine, "world_size": _world_size(), "ok": False, "checks": checks}, message
    )
    return EXIT_BAD_WORLD


def run_worker(run_dir: Path, mode: str) -> int:
    run = RunDir(run_dir)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # an SSH logout is not a reason to stop

    from launcher.recipe_loading import load_recipe

    recipe = load_recipe(run.recipe)
    plan = json.loads(run.plan.read_text()) if run.plan.is_file() else {}
    if Path(recipe.model).is_dir() and _local_data(recipe.data):
        os.environ["HF_HUB_OFFLINE"] = "1"  # everything is local: no network calls at all

    from launcher.worker.engines import world_size as planned_world_size

    expected_world = planned_world_size(plan)
    if _world_size() != expected_world:
        message = (
            f"the plan asks for {expected_world} process(es) but {_world_size()} were started; "
            "refusing to train with a different engine than planned"
        )
        seen = f"{_world_size()} process(es), plan {expected_world}"
        return _refused(run, mode, plan.get("engine", "trl"), "world size", seen, message)

    if plan.get("engine") == "unsloth":  # before transformers/trl/peft, and never a silent fallback to plain TRL
        from launcher.worker.engines.unsloth import UnslothUnavailable, import_unsloth

        try:
            import_unsloth()
        except UnslothUnavailable as exc:
            return _refused(run, mode, "unsloth", "import unsloth", str(exc), str(exc))

    from launcher.worker.unused_libraries import keep_out, skip_deepspeed_unwrapping, unused

    engine = plan.get("engine", "trl")
    keep_out(unused(recipe, engine))  # before the libraries below import them
    # the time from the process's start to here is the import cost the export pays again (smoke.py's ETA)
    import peft  # noqa: F401
    import psutil
    import torch  # noqa: F401
    from transformers import set_seed

    import_seconds = time.time() - psutil.Process().create_time()
    from datasets import Dataset  # noqa: F401
    import trl  # noqa: F401

    from launcher.methods import trl_class

    Trainer = trl_class(recipe.objective, "trainer")
    skip_deepspeed_unwrapping(engine)

    from launcher.worker.engines import create_process_group, trainer_fields

    from launcher.data.dataset import load_data, to_dataset

    from launcher.worker.loading import attention_facts, local_rank, reads_images, sdpa_state, select_device

    device, dtype = select_device()  # this rank's own GPU (LOCAL_RANK), before anything touches CUDA
    group_timeout_s = process_group_seconds(recipe, run, mode)
    if plan.get("memory_limit_gb") and plan.get("engine") == "deepspeed" and device == "cpu":
        # before the cap, which counts training memory, not DeepSpeed's process group; others after the resume choice
        create_process_group(plan, device, group_timeout_s)
    if plan.get("memory_limit_gb"):
        memory.cap_memory(device, float(plan["memory_limit_gb"]))
    planned_device = plan.get("device")
    if planned_device and planned_device != device:
        print(
            f"[ftrun worker] the plan was made for device '{planned_device}' but this process sees '{device}'",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_BAD_WORLD

    if mode == "smoke":
        data_path = run.smoke_work / "data.jsonl"
        out_dir = run.smoke_work / "trainer"
        smoke_cfg = json.loads((run.smoke_work / "request.json").read_text())
        max_steps, max_seconds = smoke_cfg["max_steps"], smoke_cfg["max_seconds"]
        resume_from = None
    else:
        data_path = _data_spec(run, recipe)
        out_dir = run.checkpoints
        max_steps, max_seconds = recipe.max_steps, None
        # verified once per disk (_verifies_resume); the others take its choice from a file (no process group yet)
        if _verifies_resume(plan, _rank(), local_rank()):
            removed = ckpt.remove_incomplete(run.checkpoints)
            if removed:
                _say(f"removed incomplete checkpoint(s): {', '.join(removed)}")
            # checkpoints of this trajectory, or of an earlier one accepted with --allow-changes
            earlier = json.loads(run.state.read_text()).get("accepted_recipe_hashes", []) if run.state.is_file() else []
            accepted = [recipe.trajectory_hash(), *earlier]
            found, skipped = ckpt.newest_verified(run.checkpoints, {"recipe_hash": accepted})
            for line in skipped:
                _say(f"skipping checkpoint {line}")
            if _world_size() > 1:
                ckpt.publish_choice(run.root / ckpt.CHOICE, _launch_identity(), found, skipped)
            if _Stop.requested:  # as the waiters do: nothing trained yet, nothing to save
                _say(
                    f"stopped by {_Stop.signal_name} before training; "
                    f"{found.path.name if found else 'no checkpoint'} is where the same command resumes"
                )
                return EXIT_STOPPED
        else:
            try:
                found = ckpt.await_choice(
                    run.root / ckpt.CHOICE,
                    run.checkpoints,
                    _launch_identity(),
                    _launcher_started(),
                    ckpt.choice_timeout(run.checkpoints),
                    cancelled=lambda: _Stop.requested,
                )
            except ckpt.ChoiceCancelled:  # a clean stop (77), not a crash: nothing was trained
                _say(
                    f"stopped by {_Stop.signal_name} while waiting for the resume checkpoint to be "
                    "verified; nothing was trained"
                )
                return EXIT_STOPPED
        resume_from = found
        if found is not None:
            from launcher.worker.engines import resume_compatibility

            note, refused = resume_compatibility(found.manifest, plan)
            if refused:
                print(f"[ftrun worker] {note}", file=sys.stderr, flush=True)
                if _rank() == 0:
                    _record_error(run, note)
                return EXIT_BAD_WORLD
            if note and _rank() == 0:
                _say(note)

    if _rank() == 0:
        info = {
            "pid": os.getpid(),
            "mode": mode,
            "device": device,
            "dtype": str(dtype).replace("torch.", ""),
            "world_size": _world_size(),
            "started": time.time(),
            "resumed_from": resume_from.path.name if resume_from else None,
            "sdpa_backends": sdpa_state(),
            "attention": attention_facts(device, dtype, engine=plan.get("engine", "trl")),
        }
        ckpt.atomic_write_json(run.worker if mode == "full" else run.smoke_work / "worker.json", info)
        if resume_from:
            _say(f"resuming from {resume_from.path.name} (step {resume_from.step}, verified)")
            _restore_metrics(run.metrics, resume_from.path, resume_from.step)
            from launcher.worker import trackers

            trackers.restore_from_checkpoint(run.root, resume_from.path)
            carried = resume_from.path / samples.BEFORE_FILE
            if carried.is_file() and not (run.root / samples.BEFORE_FILE).is_file():  # a resume on another box
                shutil.copyfile(carried, run.root / samples.BEFORE_FILE)
        elif mode == "full" and run.metrics.is_file():
            # a restart before the first checkpoint trains from step 0 again: the rows after step 0 go
            _restore_metrics(run.metrics, run.checkpoints, 0)
        _say(f"device {device} ({info['dtype']}), method {recipe.method}, {_world_size()} process(es)")

    set_seed(recipe.seed)
    # the smoke sample as the launcher wrote it, or the recipe's data read again (its sha256 checked below)
    loaded = load_data(data_path, recipe.seed, columns=recipe.objective_row.generates)  # GRPO's rewards read them
    examples = loaded.examples
    if mode == "full":
        changed = _data_changed(run, recipe, loaded.sha256)  # a restart after a crash reads the data again
        if changed:
            print(f"[ftrun worker] {changed}", file=sys.stderr, flush=True)
            if _rank() == 0:
                _record_error(run, changed, 2)
            return 2
    held_out, prompts = _eval_and_prompts(run, recipe, mode, examples)
    if mode == "full":
        examples = [examples[i] for i in split.for_recipe(examples, recipe).train]  # eval never trains
        if recipe.objective_row.kl_forward:
            # KTOConfig reads the data in order (its KL pairs are built within each micro-batch: trl 1.16
            # kto_trainer.py _prepare_dataset), so it is shuffled here once, with the recipe's seed
            random.Random(f"ftrun-kto-{recipe.seed}").shuffle(examples)
    if held_out and _rank() == 0:
        scored_by = "the task evaluation scores" if recipe.objective_row.generates else "evaluating on"
        _say(f"training on {len(examples)} examples, {scored_by} {len(held_out)} held-out examples")
    generates = recipe.objective_row.generates
    if generates:
        from launcher.worker import sampling

        rows = sampling.prompt_rows(examples)
        dataset = to_dataset(rows)
        # GRPO's own eval pass would sample answers too: the task evaluation after training scores the held-out ones
        eval_dataset = None
    else:
        dataset = to_dataset(examples)
        eval_dataset = to_dataset(held_out) if held_out else None
    trainer = None

    def step() -> int:
        return trainer.state.global_step if trainer is not None else 0

    try:
        # Loading the model can run out of memory as well as training: both are inside.
        loading = time.monotonic()
        # after the resume choice, a wait on files that a stop ends cleanly (tests/store/test_checkpoint_hashing.py)
        create_process_group(plan, device, group_timeout_s)
        model, tokenizer = load_model_and_tokenizer(recipe, device, dtype, plan, run.root)
        if recipe.objective_row.templated_by_worker:
            from launcher.worker.inputs import templated

            dataset = to_dataset(templated(examples, tokenizer))
            eval_dataset = to_dataset(templated(held_out, tokenizer)) if held_out else None
        if hasattr(model, "create_or_update_model_card"):
            # no README.md template in the adapter folders (peft 0.21 peft_model.py create_or_update_model_card)
            model.create_or_update_model_card = lambda output_dir: None
        load_seconds = time.monotonic() - loading
        first_start = mode == "full" and resume_from is None and not run.metrics.is_file()
        args = trainer_config(
            recipe,
            run,
            mode,
            device,
            dtype,
            max_steps,
            out_dir,
            trainer_fields(plan, run.root),
            split.trainer_fields(recipe, eval_dataset is not None, first_start),
        )
        if plan.get("engine") != "unsloth":
            # TRL's fused LM head: on the CPU ours, never offloaded (launcher/worker/fused_head.py)
            fused_head.install(bool(getattr(args, "activation_offloading", False)))
        differ = _resume_steps_differ(resume_from, device)  # the process group exists from trainer_config on
        if differ:
            print(f"[ftrun worker] {differ}", file=sys.stderr, flush=True)
            if local_rank() == 0:
                _record_error(run, differ, EXIT_BAD_WORLD)
            return EXIT_BAD_WORLD
        meta = {
            "recipe_hash": recipe.trajectory_hash(),
            "method": recipe.method,
            "world_size": _world_size(),
            "engine": plan.get("engine", "trl"),
        }
        cadence, metrics = build_callbacks(
            run, recipe, mode, device, meta, max_seconds, evaluates=eval_dataset is not None
        )
        sharded = plan.get("engine") in SHARDING and _world_size() > 1
        before = samples.before_callback(
            run.root / samples.BEFORE_FILE,
            prompts,
            recipe.eval.max_new_tokens,
            tokenizer,
            writes=_rank() == 0,
            synced=sharded,
            say=_say,
        )
        from launcher.worker.window import carrying

        # checkpoints carry the logging window's sums: the logs after a resume equal an uninterrupted run's
        trainer_cls = carrying(Trainer, say=_say)
        if generates:
            trainer_cls = sampling.timed(trainer_cls)
            own = sampling.trainer_arguments(recipe, rows)
        else:
            own = {"data_collator": padding_free_collator(recipe, tokenizer)}
            if plan.get("engine") == "unsloth" and reads_images(recipe.model):
                from launcher.worker.engines.unsloth import vision_collator

                own = {"data_collator": vision_collator(model, tokenizer, recipe, args)}
        trainer = trainer_cls(
            model=model,
            args=args,
            train_dataset=dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            callbacks=[cadence, metrics, _engine_check(run, plan, mode, lambda: trainer), before],
            **own,
        )
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # our Metrics callback prints one compact line per log
        # no checkpoints/README.md (trl 1.16 base_trainer.py create_model_card): `ftrun publish` writes the card
        trainer.create_model_card = lambda *args, **kwargs: None
        trainer.add_callback(_tracked_recipe(run, recipe))  # last: after the trackers' own callbacks have started
        if _rank() == 0:
            told = sampling.described(rows, recipe) if generates else _trained_tokens(examples, trainer.train_dataset)
            _say(told)
        memory.reset_peak(device)
        try:
            trainer.train(resume_from_checkpoint=str(resume_from.path) if resume_from else None)
        except TrainingComplete as done:
            if _rank() == 0:
                _say(
                    f"{resume_from.path.name if resume_from else 'the checkpoint'} is the last step "
                    f"({done}) of the schedule: nothing left to train, writing the final result"
                )
    except FloatingPointError as exc:
        print(f"[ftrun worker] stopping: {exc}", file=sys.stderr, flush=True)
        return EXIT_NAN
    except Exception as exc:
        # not only torch.OutOfMemoryError: cuBLAS, NCCL and CUDA report running out as other RuntimeErrors (memory.py)
        if memory.is_out_of_memory(exc):
            return _out_of_memory(run, mode, device, memory.out_of_memory_text(exc), step())
        if not _is_disk_full(exc, run.root):
            raise
        return _disk_full(run, step(), _writes_this_disk(plan, recipe, run))

    if mode == "smoke":
        peak_gb = memory.peak_memory_over_ranks_gb(device)  # a collective: every rank, before rank 0 writes
        # after the peak: generation's memory is not training's, and the full run's evaluation comes after training
        try:
            speed = generation_speed(run, recipe, trainer, tokenizer, examples, sharded)
        except Exception as exc:  # a measure for the forecast, not training: said, and the smoke test goes on
            speed = {"generation_error": f"{type(exc).__name__}: {exc}"[:300]}
            _say(f"task eval: the generation speed could not be measured ({speed['generation_error']})")
        if _rank() == 0:
            _write_smoke_result(
                run,
                metrics.step_times,
                device,
                cadence.timed_out,
                cadence.save_seconds,
                {
                    "import_seconds": round(import_seconds, 3),
                    "load_seconds": round(load_seconds, 3),
                    "checkpoint_bytes": ckpt.tree_bytes(out_dir),
                    # the eval pass and the base model's answers: priced apart from the start-up
                    "eval_seconds": metrics.eval_seconds,
                    "samples_seconds": before.seconds,
                    # GRPO: the steps' time spent sampling answers (inside the step times above)
                    **(
                        {
                            "sampling_seconds": round(trainer.sampling_seconds, 3),
                            # each generate call's longest answer, and the cap the full run's may grow to
                            "sampling_longest": trainer.sampling_longest,
                            "max_completion_length": recipe.grpo.max_completion_length,
                            # each step's share of prompts whose answers all scored the same (logged every step here)
                            "frac_reward_zero_std": metrics.zero_std,
                        }
                        if generates
                        else {}
                    ),
                    **speed,
                },
                peak_gb=peak_gb,
            )
        return 0
    if cadence.stopped_by_signal and trainer.state.global_step < trainer.state.max_steps:
        code = _finish(run, device, step(), _writes_this_disk(plan, recipe, run))
        if code == 0:
            _say(
                f"stopped at step {trainer.state.global_step} after {_Stop.signal_name}; "
                "checkpoint saved, resume with the same command"
            )
        return EXIT_STOPPED if code == 0 else code
    # a stop from here on skips the evidence (samples, task eval), but not on ranks that generate together
    _Stop.trained = not sharded
    # every rank: ZeRO-3 and FSDP gather the sharded weights for the final save (rank 0 writes)
    BEAT.beat("export", step())
    _save_final(run, trainer, tokenizer, recipe)
    if not (_Stop.requested and _Stop.trained):
        _answer_after(run, recipe, trainer, tokenizer, prompts, sharded)  # final/samples.md
    if _rank() == 0:  # one drawer, as at the checkpoints
        _redraw_loss_plot(run.root, final=True)  # the last loss.png is complete when the worker ends
    BEAT.beat("hash")
    code = _finish(run, device, step(), _writes_this_disk(plan, recipe, run))
    if code == 0:
        # after the last checkpoint is sealed: a crash here resumes at the end, the task eval answers what is missing
        stopped = _Stop.requested and _Stop.trained
        if not stopped:
            stopped = not _score_after(
                run,
                recipe,
                trainer,
                tokenizer,
                loaded.examples,
                sharded,
                beat=lambda: BEAT.beat("export", step()),  # final/task_eval.json
                stop=lambda: _Stop.requested and _Stop.trained,
            )
        if stopped:
            if _rank() == 0:
                _record_stop_after_training(run, trainer.state.global_step)
            _say(
                f"stopped after training (step {trainer.state.global_step}) on {_Stop.signal_name}: the final "
                "result and its checkpoint are saved; the same command writes the samples and the task evaluation "
                "left" + (", then the export" if recipe.export else "")
            )
            return EXIT_STOPPED
    return code


def _recorded(fn):
    """fn under torch's errors.record where TORCHELASTIC_ERROR_FILE is set, for launcher/run/rank_ends.py (torch 2.13
    elastic/multiprocessing/errors/error_handler.py ErrorHandler.record_exception)."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return fn
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.worker.train", description=__doc__)
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--mode", choices=("full", "smoke"), default="full")
    ns = parser.parse_args(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank: die with the launcher, never train orphaned
        from launcher.worker.engines import die_with_parent

        die_with_parent()
    if ns.mode == "full":
        BEAT.start(ns.run_dir.resolve(), _rank())  # before the heavy imports: the watchdog sees the start too
    try:
        code = _recorded(run_worker)(ns.run_dir.resolve(), ns.mode)
    except Exception:
        BEAT.beat("error")  # the step it raised at: the supervisor's "same traceback at the same step"
        raise
    finally:
        _MANIFEST.wait()  # any exit, a crash included: a checkpoint already moved gets its manifest
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()  # avoids rank-1 aborts at exit ("terminate called ...")
        except ImportError:
            pass
    return code


if __name__ == "__main__":
    exit_code = main()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank, its work done and its process group destroyed
        from launcher.worker.process import leave_rank

        leave_rank(exit_code)
    sys.exit(exit_code)
