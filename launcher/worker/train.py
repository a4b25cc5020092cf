"""The worker: the process that trains (smoke test or full run), the same code on CPU and GPU.

Run as `python -m launcher.worker.train --run-dir DIR --mode full|smoke` (or under accelerate/torchrun for
several processes). It reads the run directory's recipe snapshot and plan, resumes from the newest
verified checkpoint by itself, and reports through files: metrics.jsonl, worker.json, checkpoints.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

# Before any Hugging Face import: a local run makes no network calls (telemetry, download
# counters), which on a closed network would hang until a timeout.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The log carries ftrun's lines and the libraries' real warnings, not noise: tqdm bars (weights loading, dataset
# preparation) redraw with carriage returns into train.log, and ftrun prints the progress itself (step, loss,
# tokens/s). Read at import by huggingface_hub (and transformers through it) and datasets.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


from launcher.notices import quiet_known_notices  # noqa: E402

quiet_known_notices()  # before the libraries below are imported

from launcher.store import checkpoint as ckpt  # noqa: E402
from launcher.data import split as evaluation  # noqa: E402
from launcher.worker import memory  # noqa: E402
from launcher.worker import samples  # noqa: E402
from launcher.store.rundir import RunDir  # noqa: E402

METRICS_IN_CHECKPOINT = "ftrun_metrics.jsonl"
EXIT_STOPPED = 77  # stopped by SIGTERM/SIGINT after saving a checkpoint (preemption, `ftrun stop`)
EXIT_OOM = 78
EXIT_NAN = 79
EXIT_BAD_WORLD = 80
EXIT_DISK_FULL = 81


class TrainingComplete(Exception):
    """Raised at the start of training when the checkpoint resumed from is the schedule's last step."""


class _Stop:
    """Set by SIGTERM/SIGINT; the trainer callback saves a checkpoint and stops at the next step."""

    requested = False
    signal_name = ""


def _on_signal(signum, _frame):
    _Stop.requested = True
    _Stop.signal_name = signal.Signals(signum).name
    print(f"[ftrun worker] {_Stop.signal_name} received: saving a checkpoint at the end of this step, then stopping",
          flush=True)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _restore_metrics(path: Path, checkpoint: Path, last_step: int) -> None:
    """On resume, metrics.jsonl = the rows the checkpoint carries (steps up to its own); later rows will be logged again."""
    source = checkpoint / METRICS_IN_CHECKPOINT
    if not source.is_file():
        source = path
    if not source.is_file():
        return
    keep = [line for line in source.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= last_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def _launch_identity() -> dict[str, str]:
    """What the processes of one launch share (torchrun/accelerate set it): the rendezvous, its address, the
    restart. The run id repeats across launches under a static rendezvous: _launcher_started tells those apart."""
    return {k: os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                                              "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")}


def _resume_steps_differ(resume_from, device: str) -> Optional[str]:
    """Each node verifies its own disk when the run spans several nodes: all ranks must still resume from the same
    step, or their step counts, optimizer states and data positions part ways. The message when they do not."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    step = resume_from.step if resume_from is not None else -1
    t = torch.tensor([float(step), float(-step)], device="cuda" if device == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    newest, oldest = int(t[0].item()), int(-t[1].item())
    if newest == oldest:
        return None

    def name(s: int) -> str:
        return ckpt.step_dir_name(s) if s >= 0 else "none"

    keep = f"keep {name(oldest)} and older" if oldest >= 0 else "keep none"
    return (f"the nodes would resume from different checkpoints (oldest {name(oldest)}, newest {name(newest)}, this "
            f"node {name(step)}): a node was stopped before its copy of the newest checkpoint was complete. On every "
            f"node remove the newer step-* folders under checkpoints/ ({keep}), then run the same command.")


def _launcher_started() -> float:
    """When this process's launcher started: a resume choice written earlier belongs to an earlier launch (under
    a static rendezvous every node's launcher starts before any worker of the launch)."""
    import psutil

    try:
        return psutil.Process(os.getppid()).create_time()
    except psutil.Error:
        return psutil.Process().create_time() - 1.0  # the verifier writes after its imports, seconds later


def build_callbacks(run: RunDir, recipe, mode: str, device: str, checkpoint_meta: dict[str, Any], max_seconds: Optional[float],
                    evaluates: bool = False):
    """The trainer callbacks: wall-clock checkpoints and evaluation, SIGTERM save, metrics, NaN guard, smoke timing."""
    import torch
    from transformers import TrainerCallback

    def agree(flag: bool) -> bool:
        # Wall clocks and signals differ between ranks; all ranks must decide to save together
        # or the collective save deadlocks.
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            t = torch.tensor([1.0 if flag else 0.0], device="cuda" if device == "cuda" else "cpu")
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            return bool(t.item())
        return flag

    interval = recipe.checkpoint_every_minutes * 60.0 if mode == "full" else math.inf
    eval_interval = recipe.eval.every_minutes * 60.0 if mode == "full" and evaluates else math.inf

    class Cadence(TrainerCallback):
        def __init__(self):
            self.last_save = time.monotonic()
            self.started = time.monotonic()
            self.stopped_by_signal = False
            self.timed_out = False
            self.save_started: Optional[float] = None
            self.save_seconds: Optional[float] = None  # smoke: one timed checkpoint, for the ETA
            self.last_eval = time.monotonic()

        def on_train_begin(self, args, state, control, **kw):
            if state.global_step >= state.max_steps > 0:
                # Resumed from the last step's checkpoint (a worker that died after it, before it ended): the
                # Trainer's loop checks should_training_stop only after a step (transformers 5.24 trainer.py,
                # _run_epoch), so it would train one step past the schedule. The weights are the checkpoint's by
                # now (loaded before on_train_begin): leave the loop, and the worker writes the final result.
                raise TrainingComplete(state.global_step)

        def on_step_end(self, args, state, control, **kw):
            due = time.monotonic() - self.last_save >= interval
            at_end = state.global_step >= state.max_steps
            stop = agree(_Stop.requested)
            over_time = max_seconds is not None and agree(time.monotonic() - self.started >= max_seconds)
            if mode == "full" and (agree(due) or at_end or stop):
                control.should_save = True
            # eval by wall clock and at the end (the Trainer evaluates before it saves: the row is in the checkpoint);
            # the smoke test evaluates once, at its end, for the ETA
            if evaluates and not stop and (at_end or (over_time if mode == "smoke" else
                                                      agree(time.monotonic() - self.last_eval >= eval_interval))):
                control.should_evaluate = True
            if stop:
                self.stopped_by_signal = True
                control.should_training_stop = True
            if over_time and not at_end:
                self.timed_out = True
                control.should_training_stop = True
            if mode == "smoke" and (at_end or over_time):
                # The full run pays a checkpoint every interval and at the end: time one here.
                control.should_save = True
                self.save_started = time.monotonic()
            if mode == "full" and control.should_save:
                # Every rank (the decision above is the same on all), before the save: the previous checkpoint's
                # manifest, in short collectives. on_save's writer then finds it done instead of hashing on
                # while the others sit in its barrier, where a large checkpoint on slow storage outlasts the
                # process group's timeout (ddp_timeout, 1800 s by default) and the watchdog aborts every rank.
                _await_manifest(device)
            return control

        def on_evaluate(self, args, state, control, **kw):
            self.last_eval = time.monotonic()

        def on_save(self, args, state, control, **kw):
            self.last_save = time.monotonic()
            together = torch.distributed.is_available() and torch.distributed.is_initialized()
            if together:
                # every rank has written its part (rng_state_<rank>.pth, ZeRO shards) before rank 0
                # moves the folder and hashes it
                torch.distributed.barrier()
            # one writer per disk: the main process, or each node's first one when every node saves
            writer = state.is_local_process_zero if args.save_on_each_node else state.is_world_process_zero
            src = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if mode == "smoke":
                if self.save_started is not None:
                    # The full run's checkpoints are hashed too (in the background, and each save waits
                    # for the previous one's): the timed save includes the hashing, so the ETA counts it.
                    if writer:
                        ckpt.write_manifest(src, state.global_step, checkpoint_meta)
                    self.save_seconds = time.monotonic() - self.save_started
                return control
            if writer:
                # The previous checkpoint's manifest and retention finish before this folder appears (at once
                # after on_step_end's wait); one that failed stops the run here, never silently.
                _MANIFEST.wait()
                _MANIFEST.check()
                dst = run.checkpoints / ckpt.step_dir_name(state.global_step)
                if dst.exists():  # a save of the same step after a resume: the new one replaces it
                    shutil.rmtree(dst)
                os.replace(src, dst)
                if run.metrics.is_file():
                    # The checkpoint carries the metrics up to its step: a resume on another box
                    # restores them from here, whatever state the copied metrics.jsonl is in.
                    shutil.copyfile(run.metrics, dst / METRICS_IN_CHECKPOINT)
                from launcher.worker import trackers

                trackers.into_checkpoint(run.root, dst)  # a resume on another box continues the same tracked runs
                if (run.root / samples.BEFORE_FILE).is_file():  # the base model's answers, for a resume elsewhere
                    shutil.copyfile(run.root / samples.BEFORE_FILE, dst / samples.BEFORE_FILE)

                def complete(dst: Path = dst) -> None:
                    # retention after the manifest: the newest complete checkpoint outlives the hashing
                    removed = ckpt.retain(run.checkpoints, recipe.keep_checkpoints)
                    print(f"[ftrun worker] checkpoint {dst.name} saved and verified "
                          f"({ckpt.tree_bytes(dst) / 1e9:.2f} GB hashed in {_MANIFEST.seconds:.1f} s)"
                          + (f"; removed {', '.join(removed)}" if removed else ""), flush=True)

                # Hashing after the barrier, beside the training: no rank waits for it.
                _MANIFEST.start(dst, state.global_step, checkpoint_meta, then=complete)
                _redraw_loss_plot(run.root)
            if together:
                torch.distributed.barrier()
            return control

    class Metrics(TrainerCallback):
        def __init__(self):
            self.t_last = None
            self.tokens_last = 0
            self.step_times: list[tuple[int, float, int]] = []  # (step, monotonic, tokens seen)
            self.eval_seconds: Optional[float] = None  # the last eval pass (the smoke's is priced for the ETA)

        def on_train_begin(self, args, state, control, **kw):
            if state.is_world_process_zero and kw.get("optimizer") is not None:
                opt = kw["optimizer"]
                inner = getattr(opt, "optimizer", opt)  # accelerate wraps the real one
                print(f"[ftrun worker] optimizer: {type(inner).__module__}.{type(inner).__name__}", flush=True)
            self.t_last = time.monotonic()
            self.tokens_last = state.num_input_tokens_seen
            self.step_times.append((state.global_step, self.t_last, state.num_input_tokens_seen))
            if state.is_world_process_zero:
                # the mode's own file: a smoke test's step count is not the full run's (status read "0/6")
                path = run.worker if mode == "full" else run.smoke_work / "worker.json"
                info = json.loads(path.read_text()) if path.is_file() else {}
                info.update(total_steps=state.max_steps, start_step=state.global_step)
                ckpt.atomic_write_json(path, info)

        def on_step_end(self, args, state, control, **kw):
            self.step_times.append((state.global_step, time.monotonic(), state.num_input_tokens_seen))

        def on_log(self, args, state, control, logs=None, **kw):
            logs = logs or {}
            if "eval_loss" in logs:
                self.eval_seconds = logs.get("eval_runtime")
                _log_eval(run, mode, state, logs)
                return
            if "loss" not in logs:
                return
            loss = float(logs["loss"])
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {state.global_step}")
            now = time.monotonic()
            dt = max(now - (self.t_last or now), 1e-9)
            tokens = state.num_input_tokens_seen
            row = {
                "step": state.global_step,
                "loss": loss,
                "learning_rate": logs.get("learning_rate"),
                "grad_norm": logs.get("grad_norm"),
                "epoch": round(state.epoch or 0.0, 4),
                "tokens_seen": int(tokens),
                "tokens_per_second": round((tokens - self.tokens_last) / dt, 1),
                # every rank logs (the loss above was gathered from all): a collective, the largest card's peak
                "peak_memory_gb": round(memory.peak_memory_over_ranks_gb(device), 3),
                "time": time.time(),
            }
            self.t_last, self.tokens_last = now, tokens
            _emit(run, mode, state, row, f"loss {loss:.4f} lr {row['learning_rate']:.2e} "
                                         f"{row['tokens_per_second']:.0f} tok/s")

    return Cadence(), Metrics()


def _log_eval(run: RunDir, mode: str, state, logs: dict[str, Any]) -> None:
    """An eval pass: a row of its own in metrics.jsonl (step, eval_loss, TRL's eval metrics) and a log line."""
    row = {"step": state.global_step, "eval_loss": float(logs["eval_loss"])}
    for key in ("eval_mean_token_accuracy", "eval_entropy"):
        if logs.get(key) is not None:
            row[key] = float(logs[key])
    row.update(epoch=round(state.epoch or 0.0, 4), eval_seconds=logs.get("eval_runtime"), time=time.time())
    _emit(run, mode, state, row, f"eval loss {row['eval_loss']:.4f} ({row['eval_seconds'] or 0:.1f} s)")


def _emit(run: RunDir, mode: str, state, row: dict[str, Any], text: str) -> None:
    """A logged row from the main process: into metrics.jsonl (the full run's only) and one log line."""
    if not state.is_world_process_zero:
        return
    if mode == "full":
        with run.metrics.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
    print(f"[ftrun worker] step {row['step']}/{state.max_steps} {text}", flush=True)


def load_model_and_tokenizer(recipe, device: str, dtype, plan: Optional[dict] = None, run_dir: Optional[Path] = None):
    """The engine's loader: Unsloth's FastLanguageModel for engine unsloth, else launcher/worker/loading.py
    (inside DeepSpeed's partitioned loading for ZeRO-3)."""
    from launcher.worker import loading

    if (plan or {}).get("engine") == "unsloth":  # FastLanguageModel + its get_peft_model (launcher/worker/engines/unsloth.py)
        from launcher.worker.engines import unsloth as unsloth_engine

        model, tokenizer, source = unsloth_engine.load_model_and_tokenizer(recipe, device, dtype)
        print(f"[ftrun worker] engine unsloth {unsloth_engine.version()}: FastLanguageModel loaded {source}"
              f"{' in 4 bit' if recipe.method == 'qlora' else ''}; "
              f"{'; '.join(unsloth_engine.markers(model)) or 'no Unsloth marks'}", flush=True)
        print("[ftrun worker] " + loading.describe_model(model), flush=True)
        return model, tokenizer
    from launcher.worker.engines import loading_context

    return loading.load_model_and_tokenizer(recipe, device, dtype, plan, context=loading_context(plan or {}, run_dir))


def sft_config(recipe, run: RunDir, mode: str, device: str, dtype, max_steps: Optional[int], output_dir: Path,
               engine_fields: Optional[dict] = None, eval_fields: Optional[dict] = None):
    import torch
    from trl import SFTConfig

    fields: dict[str, Any] = dict(
        output_dir=str(output_dir),
        max_length=recipe.max_length,
        per_device_train_batch_size=recipe.micro_batch_size,
        gradient_accumulation_steps=recipe.gradient_accumulation_steps,
        num_train_epochs=recipe.epochs if mode == "full" else 1,
        max_steps=max_steps if max_steps else -1,
        learning_rate=recipe.learning_rate,
        packing=recipe.packing,
        assistant_only_loss=recipe.assistant_only_loss,
        seed=recipe.seed,
        data_seed=recipe.seed,
        logging_steps=recipe.logging_steps if mode == "full" else 1,
        save_strategy="no",  # ftrun saves by wall clock (callback), not every N steps
        save_only_model=False,
        **_trackers(run, recipe, mode),  # report_to, and the run's name for the trackers (launcher/worker/trackers.py)
        include_num_input_tokens_seen="non_padding",  # real tokens, not padding
        use_cpu=device == "cpu",
        bf16=device == "cuda" and dtype == torch.bfloat16,
        fp16=device == "cuda" and dtype == torch.float16,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    # transformers 5.2x renamed gradient_checkpointing to activation_checkpointing (old name warns);
    # older releases (the ones Unsloth pins) only know the old name.
    import dataclasses

    ac = "activation_checkpointing" if any(f.name == "activation_checkpointing" for f in dataclasses.fields(SFTConfig)) \
        else "gradient_checkpointing"
    fields[ac] = recipe.gradient_checkpointing
    fields[f"{ac}_kwargs"] = {"use_reentrant": False}
    if mode == "smoke" and any(f.name == "train_sampling_strategy" for f in dataclasses.fields(SFTConfig)):
        # The smoke sample is written longest batch first: an out-of-memory shows in step 1.
        fields["train_sampling_strategy"] = "sequential"
    if recipe.method == "full-8bit":
        # 8-bit AdamW states (bitsandbytes): about 2 bytes/param of optimizer state instead of 8.
        fields["optim"] = "adamw_bnb_8bit"
    # Otherwise TRL's default (fused AdamW), which torch also runs on the CPU: the same optimizer a
    # plain TRL script gets.
    for key, value in (engine_fields or {}).items():  # launcher/backends: what the engine needs
        fields[ac if key == "activation_checkpointing" else key] = value
    fields.update(eval_fields or {})  # launcher/data/split.py; trainer: may still set the eval batch and the like
    fields.update(recipe.trainer)
    return SFTConfig(**fields)


def padding_free_collator(recipe, tokenizer):
    """The micro-batch as one row without padding (position_ids mark the examples), or None for TRL's default.

    TRL's own `padding_free=True` refuses a max_length without packing, although its dataset preparation
    truncates to max_length either way; passing its padding-free collator keeps the truncation. The loss is
    the same as padded (each example attends only to itself, the first token of each is not a target), the
    compute on pad tokens is gone: on data with a long tail, most of a padded batch is padding. With packing,
    TRL's BFD packing is padding-free already.
    """
    if not recipe.padding_free or recipe.packing:
        return None
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id, padding_free=True)


def _trained_tokens(examples: list, prepared, sample: int = 2000) -> str:
    """What TRL made of the data: its form and the share of tokens the loss is computed on (plain text: all of
    them, no chat template; prompt/completion: the completion), read from the prepared dataset's labels."""
    from launcher.data.formats import example_form

    form = {"chat": "chat (the model's chat template)", "text": "plain text (no chat template)",
            "prompt_completion": "prompt/completion"}[example_form(examples[0])]
    rows = prepared.select(range(min(sample, len(prepared))))
    ids = rows["input_ids"]
    labels = rows["labels"] if "labels" in rows.column_names else ids
    total = sum(len(x) for x in ids)
    trained = sum(1 for row in labels for t in row if t != -100)
    return (f"data as TRL prepared it: {form}, {len(prepared):,} examples; loss on {trained:,} of {total:,} tokens "
            f"({trained / max(total, 1):.1%}{f', first {len(rows):,} examples' if len(rows) < len(prepared) else ''})")


def _data_spec(run: RunDir, recipe):
    """The recipe's data, Hub datasets pinned at the revisions the launcher read (data.json)."""
    from launcher.data.sources import pinned

    record = run.root / "data.json"
    return pinned(recipe.data, json.loads(record.read_text()).get("sources", [])) if record.is_file() else recipe.data


def _data_changed(run: RunDir, recipe, data_sha256: str) -> Optional[str]:
    """Why the data read now is not what the launcher checked and recorded (data.json), or None. The launcher
    refuses a resume on changed data; this catches a change between two starts of the worker under one
    supervisor (a crash and its restart), which would otherwise train on other examples unnoticed."""
    from launcher.data.dataset import identity, load_data

    record = run.root / "data.json"
    recorded = json.loads(record.read_text()).get("sha256") if record.is_file() else None
    if not recorded:
        return None
    eval_sha = load_data(recipe.eval.data, recipe.seed).sha256 if recipe.eval.data else None
    now = identity(data_sha256, eval_sha)
    if now == recorded:
        return None
    return (f"the data changed since the launch checked it (sha256 {recorded[:12]}... -> {now[:12]}...): not "
            "training on other examples than the run started with; restore the data and run the same command "
            "again (it resumes), or add --allow-changes / --fresh")


def _local_data(spec) -> bool:
    from launcher.data.sources import sources_of

    return all(s.local and Path(s.path).exists() for s in sources_of(spec))


def _write_verification(run: RunDir, mode: str, result: dict[str, Any], error: Optional[str] = None) -> None:
    """worker.json gets the engine verification (and the error when it failed): status and the supervisor read it."""
    from launcher.worker.engines import worker_file

    path = worker_file(run.root, mode)
    info = json.loads(path.read_text()) if path.is_file() else {}
    info["verification"] = result
    if error:
        info["error"] = error
    path.parent.mkdir(parents=True, exist_ok=True)
    ckpt.atomic_write_json(path, info)


def _engine_check(run: RunDir, plan: dict[str, Any], mode: str, get_trainer):
    """A callback: once the trainer has wrapped the model, before step 1, check that the planned engine runs."""
    from transformers import TrainerCallback

    from launcher.worker.engines import format_verification, verify

    class EngineCheck(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            result = verify(plan, get_trainer())
            line = format_verification(result)
            if _rank() == 0:
                _write_verification(run, mode, result, None if result["ok"] else line)
            if not result["ok"]:
                print(f"[ftrun worker] {line}", file=sys.stderr, flush=True)
                # SystemExit passes the trainer's error handling; every rank sees the same result and exits.
                raise SystemExit(EXIT_BAD_WORLD)
            if _rank() == 0:
                print(f"[ftrun worker] {line}", flush=True)

    return EngineCheck()


def _trackers(run: RunDir, recipe, mode: str) -> dict[str, Any]:
    """SFTConfig's report_to (the recipe's, on the full run's main process; TensorBoard event files in
    run_dir/tensorboard) and run_name/project, the environment each tracker reads set (launcher/worker/trackers.py)."""
    from launcher.worker import trackers

    report_to, fields = trackers.prepare(run.root, recipe, mode, _rank())
    return {"report_to": report_to, **fields}


def _tracked_recipe(run: RunDir, recipe):
    """After the trackers' own callbacks: the recipe into each tracked run's config, where each run is in the log."""
    from launcher.worker import trackers

    return trackers.recipe_callback(run.root, recipe)


def run_worker(run_dir: Path, mode: str) -> int:
    run = RunDir(run_dir)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # an SSH logout is not a reason to stop

    from launcher.recipe import load_recipe

    recipe = load_recipe(run.recipe)
    plan = json.loads(run.plan.read_text()) if run.plan.is_file() else {}
    if Path(recipe.model).is_dir() and _local_data(recipe.data):
        os.environ["HF_HUB_OFFLINE"] = "1"  # everything is local: no network calls at all

    from launcher.worker.engines import world_size as planned_world_size

    expected_world = planned_world_size(plan)
    if _world_size() != expected_world:
        message = (f"the plan asks for {expected_world} process(es) but {_world_size()} were started; "
                   "refusing to train with a different engine than planned")
        print(f"[ftrun worker] {message}", file=sys.stderr, flush=True)
        _write_verification(run, mode, {"engine": plan.get("engine", "trl"), "world_size": _world_size(), "ok": False,
                                        "checks": [{"check": "world size", "ok": False,
                                                    "seen": f"{_world_size()} process(es), plan {expected_world}"}]},
                            message)
        return EXIT_BAD_WORLD

    if plan.get("engine") == "unsloth":
        # Unsloth patches transformers/trl/peft when imported: it comes before them, and a plan that says
        # unsloth never trains without it (no silent fallback to plain TRL).
        from launcher.worker.engines.unsloth import UnslothUnavailable, import_unsloth

        try:
            import_unsloth()
        except UnslothUnavailable as exc:
            print(f"[ftrun worker] {exc}", file=sys.stderr, flush=True)
            _write_verification(run, mode, {"engine": "unsloth", "world_size": _world_size(), "ok": False,
                                            "checks": [{"check": "import unsloth", "ok": False, "seen": str(exc)}]},
                                str(exc))
            return EXIT_BAD_WORLD

    import peft  # noqa: F401
    import psutil
    import torch
    from transformers import set_seed

    # process start and the imports the export after training pays again (smoke.py's ETA): not trl, datasets
    import_seconds = time.time() - psutil.Process().create_time()
    from datasets import Dataset
    from trl import SFTTrainer

    from launcher.worker.engines import trainer_fields
    from launcher.data.dataset import load_data, to_dataset

    from launcher.worker.loading import local_rank, select_device

    device, dtype = select_device()  # this rank's own GPU (LOCAL_RANK), before anything touches CUDA
    if plan.get("memory_limit_gb"):
        if plan.get("engine") == "deepspeed" and device == "cpu":
            # the cap counts training memory, not the engine's code and its process group's threads
            # (on a GPU, the CUDA context is outside the per-process fraction too)
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")
        memory.cap_memory(device, float(plan["memory_limit_gb"]))  # this rank's own device
    planned_device = plan.get("device")
    if planned_device and planned_device != device:
        print(f"[ftrun worker] the plan was made for device '{planned_device}' but this process sees '{device}'",
              file=sys.stderr, flush=True)
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
        # Verified once per disk (_verifies_resume); the others of this launch take its choice from a file,
        # since the process group does not exist yet (the Trainer makes it).
        if _verifies_resume(plan, _rank(), local_rank()):
            removed = ckpt.remove_incomplete(run.checkpoints)
            if removed:
                print(f"[ftrun worker] removed incomplete checkpoint(s): {', '.join(removed)}", flush=True)
            # Checkpoints of this trajectory, or of an earlier one the user accepted with --allow-changes.
            accepted = [recipe.trajectory_hash(), *json.loads(run.state.read_text()).get("accepted_recipe_hashes", [])] \
                if run.state.is_file() else [recipe.trajectory_hash()]
            found, skipped = ckpt.newest_verified(run.checkpoints, {"recipe_hash": accepted})
            for line in skipped:
                print(f"[ftrun worker] skipping checkpoint {line}", flush=True)
            if _world_size() > 1:
                ckpt.publish_choice(run.root / ckpt.CHOICE, _launch_identity(), found, skipped)
            if _Stop.requested:  # as the waiters do: nothing trained yet, nothing to save
                print(f"[ftrun worker] stopped by {_Stop.signal_name} before training; "
                      f"{found.path.name if found else 'no checkpoint'} is where the same command resumes", flush=True)
                return EXIT_STOPPED
        else:
            try:
                found = ckpt.await_choice(run.root / ckpt.CHOICE, run.checkpoints, _launch_identity(),
                                          _launcher_started(), ckpt.choice_timeout(run.checkpoints),
                                          cancelled=lambda: _Stop.requested)
            except ckpt.ChoiceCancelled:  # a clean stop (77), not a crash: nothing was trained
                print(f"[ftrun worker] stopped by {_Stop.signal_name} while waiting for the resume checkpoint to be "
                      "verified; nothing was trained", flush=True)
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
                print(f"[ftrun worker] {note}", flush=True)

    if _rank() == 0:
        info = {"pid": os.getpid(), "mode": mode, "device": device, "dtype": str(dtype).replace("torch.", ""),
                "world_size": _world_size(), "started": time.time(),
                "resumed_from": resume_from.path.name if resume_from else None}
        ckpt.atomic_write_json(run.worker if mode == "full" else run.smoke_work / "worker.json", info)
        if resume_from:
            print(f"[ftrun worker] resuming from {resume_from.path.name} (step {resume_from.step}, verified)", flush=True)
            _restore_metrics(run.metrics, resume_from.path, resume_from.step)
            from launcher.worker import trackers

            trackers.restore_from_checkpoint(run.root, resume_from.path)
            carried = resume_from.path / samples.BEFORE_FILE
            if carried.is_file() and not (run.root / samples.BEFORE_FILE).is_file():  # a resume on another box
                shutil.copyfile(carried, run.root / samples.BEFORE_FILE)
        print(f"[ftrun worker] device {device} ({info['dtype']}), method {recipe.method}, "
              f"{_world_size()} process(es)", flush=True)

    set_seed(recipe.seed)
    # the smoke sample as the launcher wrote it (canonical lines), or the recipe's data read again: the launcher
    # checked it and recorded its sha256 (data.json), and refuses a resume on changed data
    loaded = load_data(data_path, recipe.seed)
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
        examples = [examples[i] for i in evaluation.for_recipe(examples, recipe).train]  # eval never trains
    if held_out and _rank() == 0:
        _say(f"training on {len(examples)} examples, evaluating on {len(held_out)} held-out examples")
    dataset = to_dataset(examples)
    eval_dataset = to_dataset(held_out) if held_out else None
    trainer = None

    def step() -> int:
        return trainer.state.global_step if trainer is not None else 0

    try:
        # Loading the model can run out of memory as well as training: both are inside.
        loading = time.monotonic()
        model, tokenizer = load_model_and_tokenizer(recipe, device, dtype, plan, run.root)
        load_seconds = time.monotonic() - loading
        first_start = mode == "full" and resume_from is None and not run.metrics.is_file()
        args = sft_config(recipe, run, mode, device, dtype, max_steps, out_dir, trainer_fields(plan, run.root),
                          evaluation.trainer_fields(recipe, eval_dataset is not None, first_start))
        differ = _resume_steps_differ(resume_from, device)  # the process group exists from sft_config on
        if differ:
            print(f"[ftrun worker] {differ}", file=sys.stderr, flush=True)
            if local_rank() == 0:
                _record_error(run, differ, EXIT_BAD_WORLD)
            return EXIT_BAD_WORLD
        meta = {"recipe_hash": recipe.trajectory_hash(), "method": recipe.method, "world_size": _world_size(),
                "engine": plan.get("engine", "trl")}
        cadence, metrics = build_callbacks(run, recipe, mode, device, meta, max_seconds, evaluates=eval_dataset is not None)
        sharded = plan.get("engine") in ("fsdp", "deepspeed") and _world_size() > 1
        before = samples.before_callback(run.root / samples.BEFORE_FILE, prompts, recipe.eval.max_new_tokens, tokenizer,
                                         writes=_rank() == 0, synced=sharded, say=_say)
        from launcher.worker.window import carrying

        # checkpoints carry the logging window's sums: the logs after a resume equal an uninterrupted run's
        trainer_cls = carrying(SFTTrainer, say=lambda line: print(f"[ftrun worker] {line}", flush=True))
        trainer = trainer_cls(model=model, args=args, train_dataset=dataset, eval_dataset=eval_dataset,
                              processing_class=tokenizer, data_collator=padding_free_collator(recipe, tokenizer),
                              callbacks=[cadence, metrics, _engine_check(run, plan, mode, lambda: trainer), before])
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # our Metrics callback prints one compact line per log
        trainer.add_callback(_tracked_recipe(run, recipe))  # last: after the trackers' own callbacks have started
        if _rank() == 0:
            print(f"[ftrun worker] {_trained_tokens(examples, trainer.train_dataset)}", flush=True)
        memory.reset_peak(device)
        try:
            trainer.train(resume_from_checkpoint=str(resume_from.path) if resume_from else None)
        except TrainingComplete as done:
            if _rank() == 0:
                print(f"[ftrun worker] {resume_from.path.name if resume_from else 'the checkpoint'} is the last step "
                      f"({done}) of the schedule: nothing left to train, writing the final result", flush=True)
    except FloatingPointError as exc:
        print(f"[ftrun worker] stopping: {exc}", file=sys.stderr, flush=True)
        return EXIT_NAN
    except Exception as exc:
        # not only torch.OutOfMemoryError: cuBLAS, NCCL and CUDA runtime calls report running out as other
        # RuntimeErrors (launcher/worker/memory.py), which would otherwise count as a crash and be restarted
        if memory.is_out_of_memory(exc):
            return _out_of_memory(run, mode, device, memory.out_of_memory_text(exc), step())
        if not _is_disk_full(exc, run.root):
            raise
        return _disk_full(run, step(), _writes_this_disk(plan, recipe, run))

    if mode == "smoke":
        peak_gb = memory.peak_memory_over_ranks_gb(device)  # a collective: every rank, before rank 0 writes
        if _rank() == 0:
            _write_smoke_result(run, metrics.step_times, device, cadence.timed_out, cadence.save_seconds,
                                {"import_seconds": round(import_seconds, 3), "load_seconds": round(load_seconds, 3),
                                 "checkpoint_bytes": ckpt.tree_bytes(out_dir),
                                 # the eval pass and the base model's answers: priced apart from the start-up
                                 "eval_seconds": metrics.eval_seconds, "samples_seconds": before.seconds},
                                peak_gb=peak_gb)
        return 0
    if cadence.stopped_by_signal and trainer.state.global_step < trainer.state.max_steps:
        code = _finish(run, device, step(), _writes_this_disk(plan, recipe, run))  # the checkpoint sealed, or why not
        if code == 0:
            print(f"[ftrun worker] stopped at step {trainer.state.global_step} after {_Stop.signal_name}; "
                  "checkpoint saved, resume with the same command", flush=True)
        return EXIT_STOPPED if code == 0 else code
    # every rank: ZeRO-3 and FSDP gather the sharded weights for the final save (rank 0 writes)
    _save_final(run, trainer, tokenizer, recipe)
    _answer_after(run, recipe, trainer, tokenizer, prompts, sharded)  # final/samples.md
    if _rank() == 0:  # one drawer, as at the checkpoints
        _redraw_loss_plot(run.root, final=True)  # the last loss.png is complete when the worker ends
    return _finish(run, device, step(), _writes_this_disk(plan, recipe, run))  # the last checkpoint complete at the end


def _say(line: str) -> None:
    print(f"[ftrun worker] {line}", flush=True)


def _eval_and_prompts(run: RunDir, recipe, mode: str, examples: list) -> tuple[list, list[dict[str, Any]]]:
    """The eval examples and the sample prompts. The full run splits the data itself (launcher/data/split.py);
    the smoke test reads what its launcher wrote: a share of the held-out examples and the full run's prompts."""
    from launcher.data.dataset import load_data

    if mode == "smoke":
        held = run.smoke_work / "eval.jsonl"
        asked = run.smoke_work / "prompts.json"
        return (load_data(held, recipe.seed).examples if held.is_file() else [],
                json.loads(asked.read_text()) if asked.is_file() else [])
    parts = evaluation.for_recipe(examples, recipe)
    if recipe.eval.data:
        held_examples = evaluation.load_eval_data(recipe)
        prompts = samples.pick(held_examples, list(range(len(held_examples))), [], recipe.eval.samples, recipe.seed,
                               evaluation.source_name(recipe.eval.data))
        return held_examples, prompts
    prompts = samples.pick(examples, parts.held_out, parts.train, recipe.eval.samples, recipe.seed,
                           evaluation.source_name(recipe.data))
    return [examples[i] for i in parts.held_out], prompts


def _answer_after(run: RunDir, recipe, trainer, tokenizer, prompts: list[dict[str, Any]], sharded: bool) -> None:
    """The trained model answers the prompts the base model answered (samples-before.json), into final/samples.md.
    Without a before record (none was generated), a LoRA run's base answers come from the adapter switched off."""
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
    path = samples.write_after(run.final, before, asked, answers, run_name=run.root.name,
                               step=trainer.state.global_step, max_new_tokens=recipe.eval.max_new_tokens)
    _say(f"samples: before and after training in {path} ({len(answers)} prompt(s), "
         f"{time.monotonic() - t0:.1f} s)")
    rows = json.loads((run.final / samples.DATA).read_text())["samples"]
    for line in samples.summary(rows):
        _say(line)


def _out_of_memory(run: RunDir, mode: str, device: str, text: str, step: int) -> int:
    peak = memory.out_of_memory_peak_gb(device)  # this rank's: the others may be gone or stuck in a collective
    first = text.strip().splitlines()[0] if text.strip() else "out of memory"
    measured = f"peak {peak:.2f} GB" if peak is not None else "peak unknown"
    message = f"out of {'GPU ' if device == 'cuda' else ''}memory at step {step + 1} ({measured}): {first[:300]}"
    print(f"[ftrun worker] {message}", file=sys.stderr, flush=True)
    if mode == "smoke":  # any rank: under ZeRO-3 or FSDP one rank may run out before the others
        ckpt.atomic_write_json(run.smoke_work / "oom.json", {"peak_memory_gb": None if peak is None else round(peak, 3),
                                                              "step": step + 1, "rank": _rank(), "error": first[:500]})
    else:  # any rank, for the same reason; worker.json is written atomically
        _record_error(run, message, EXIT_OOM)
    return EXIT_OOM


def _says_disk_full(exc: BaseException) -> bool:
    """ENOSPC or EDQUOT anywhere in the exception's causes and contexts."""
    import errno

    seen: Optional[BaseException] = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _is_disk_full(exc: BaseException, where: Path) -> bool:
    import shutil

    if _says_disk_full(exc):
        return True
    # torch.save reports a full disk as one of several RuntimeErrors ("file write failed", "iostream
    # error", "unexpected pos"): ask the disk itself whether a checkpoint still fits.
    kept = [p for p in ckpt.candidates(where / "checkpoints") if (p / ckpt.MANIFEST).is_file()]
    last = ckpt.tree_bytes(kept[0]) if kept else 0
    return shutil.disk_usage(where).free < max(64 * 1024 * 1024, 2 * last)


def _disk_full_message(run: RunDir, step: int, writer: bool = True) -> str:
    """Remove the half-written save (the disk's writer only); name the sizes so the user knows how much to free."""
    import shutil

    partial = [p for p in run.checkpoints.glob("checkpoint-*") if p.is_dir()]
    partial_bytes = sum(ckpt.tree_bytes(p) for p in partial)
    if writer:
        # Only the process that moves and hashes this disk's checkpoints, after its own manifest is done: a
        # step folder without manifest is one it may still be hashing, which another rank would delete.
        _MANIFEST.wait()
        ckpt.remove_incomplete(run.checkpoints)
    kept = [p for p in ckpt.candidates(run.checkpoints) if (p / ckpt.MANIFEST).is_file()]
    last_size = ckpt.tree_bytes(kept[0]) if kept else 0
    free = shutil.disk_usage(run.root).free
    removed = "the partial save was removed" if writer else \
        "the partial save is removed by the process that writes this disk's checkpoints (or at the next start)"
    return (f"disk full while saving the checkpoint of step {step}: {free / 1e6:.1f} MB free on {run.root}, "
            f"a checkpoint takes about {max(last_size, partial_bytes) / 1e6:.1f} MB; {removed}, "
            f"{kept[0].name if kept else 'no earlier checkpoint'} is intact. Free space (or lower keep_checkpoints), "
            "then run the same command to resume.")


def _disk_full(run: RunDir, step: int, writer: bool) -> int:
    """The disk-full exit: the reason in the log and in worker.json, the partial save removed by the disk's writer."""
    message = _disk_full_message(run, step, writer)
    print(f"[ftrun worker] {message}", file=sys.stderr, flush=True)
    _record_error(run, message, EXIT_DISK_FULL)  # under torchrun the supervisor sees 1: it reads this one
    return EXIT_DISK_FULL


def _finish(run: RunDir, device: str, step: int, writer: bool) -> int:
    """0 once the last checkpoint's manifest is on disk (every rank waits); a manifest that failed is never a
    clean exit: a full disk takes the disk-full exit, anything else is raised (a crash, restarted from the
    newest verified checkpoint)."""
    try:
        _await_manifest(device)
    except ckpt.ManifestFailed as exc:
        if not _is_disk_full(exc, run.root):
            raise
        return _disk_full(run, step, writer)
    return 0


def _verifies_resume(plan: dict[str, Any], rank: int, local_rank: int) -> bool:
    """Whether this process verifies the checkpoints at resume, one per disk, and hands its choice to the others.

    A plan over several nodes counts on a disk per node whatever the engine: DeepSpeed never sets
    save_on_each_node, so a rule that follows it left the ranks of nodes >= 1 waiting for a choice that nobody
    writes on their disk. Each node's local rank 0 verifies its own disk (on a shared one, the same choice);
    _resume_steps_differ stops the run when nodes chose different steps. One node: rank 0.
    """
    from launcher.worker.engines import world_size

    several_nodes = world_size(plan) > int(plan.get("num_processes", 1))
    return (local_rank if several_nodes else rank) == 0


def _writes_checkpoints(save_on_each_node: bool, rank: int, local_rank: int) -> bool:
    """Whether this process moves, hashes and removes checkpoint folders on its disk: the rule of Cadence.on_save
    (the Trainer's own, TrainingArguments.should_save): each node's first process when every node saves, else the
    main process. A step folder without manifest may be its hash in progress: no other process deletes one."""
    return (local_rank if save_on_each_node else rank) == 0


def _writes_this_disk(plan: dict[str, Any], recipe, run: RunDir) -> bool:
    from launcher.worker.engines import trainer_fields
    from launcher.worker.loading import local_rank

    fields = {**trainer_fields(plan, run.root), **dict(getattr(recipe, "trainer", None) or {})}
    return _writes_checkpoints(bool(fields.get("save_on_each_node")), _rank(), local_rank())


def _record_error(run: RunDir, message: str, exit_code: Optional[int] = None) -> None:
    info = json.loads(run.worker.read_text()) if run.worker.is_file() else {}
    info["error"] = message
    if exit_code is not None:  # torchrun reports any rank's exit as 1: the supervisor reads the real one here
        info["exit_code"] = exit_code
    try:
        ckpt.atomic_write_json(run.worker, info)
    except OSError:  # the disk may be too full even for this; the log line above already says it
        pass


_PLOT: dict[str, Any] = {"child": None, "pending": False}
# The newest checkpoint's manifest, hashed and written in the background by the disk's writer.
_MANIFEST = ckpt.BackgroundManifest(log=lambda line: print(f"[ftrun worker] {line}", flush=True))


_MANIFEST_POLL_S = 5.0  # one round of _await_manifest: far below any process group timeout


def _await_manifest(device: str) -> None:
    """Every rank waits until the writer's background manifest is on disk. A rank that exited first would make
    torchrun stop the others (a stopped run exits 77), cutting the hashing and losing the checkpoint. The wait
    is short collectives in a loop, not one barrier, so a long hash never meets the process group's timeout.

    Then every rank raises ManifestFailed when a writer's manifest was not written, so all ranks leave the same
    way: with ENOSPC/EDQUOT among its causes when the disk was full (the disk-full exit), else a crash."""
    import errno

    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        _MANIFEST.wait()
        _MANIFEST.check()
        return
    while True:
        done = _MANIFEST.wait(timeout=_MANIFEST_POLL_S)
        failed = _MANIFEST.exception if done else None
        state = torch.tensor([0.0 if done else 1.0, 0.0 if failed is None else 2.0 if _says_disk_full(failed) else 1.0],
                             device="cuda" if device == "cuda" else "cpu")
        dist.all_reduce(state, op=dist.ReduceOp.MAX)
        if not state[0].item():
            break
    _MANIFEST.check()  # the writer whose manifest failed: its own error
    if state[1].item():
        full = state[1].item() == 2.0
        raise ckpt.ManifestFailed("the checkpoint's manifest could not be written by the process that writes "
                                  "checkpoints on a disk of this run (its log says why)") from (
            OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if full else None)


def _redraw_loss_plot(run_root: Path, final: bool = False) -> None:
    """loss.png in a child process: matplotlib's import and drawing never hold up a training step. While one
    drawing runs, the next checkpoint's is skipped; at the end the last one is waited for (and made, if a
    checkpoint came since it started), so the finished run's plot is complete."""
    child = _PLOT["child"]
    if child is not None and child.poll() is None and not final:
        _PLOT["pending"] = True
        return
    if child is not None:
        _reap(child)
        _PLOT["child"] = None
        if final and not _PLOT["pending"]:
            return
    _PLOT["pending"] = False
    _PLOT["child"] = subprocess.Popen([sys.executable, "-m", "launcher.deliver.plots", str(run_root)],
                                      stdin=subprocess.DEVNULL, cwd=str(Path(__file__).resolve().parents[2]))
    if final:
        _reap(_PLOT["child"])
        _PLOT["child"] = None


def _reap(child: subprocess.Popen, timeout: float = 60.0) -> None:
    """Wait for a drawing; one that hangs is killed (a plot is not worth a run that never ends)."""
    try:
        child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        print(f"[ftrun worker] loss.png not updated: the drawing took more than {timeout:.0f} s", flush=True)


def _write_smoke_result(run: RunDir, step_times, device: str, timed_out: bool,
                        checkpoint_seconds: Optional[float] = None, costs: Optional[dict[str, Any]] = None, *,
                        peak_gb: float) -> None:
    # The first step pays for warm-up (allocator, kernels, lazy init): throughput is measured
    # from the end of step 1 to the end of the last step.
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
        # (tokens, seconds) of each measured step: smoke.py fits seconds = a + b * tokens, so steps with
        # other token counts than the smoke's (another micro-batch mix, a short run) are priced right.
        "step_costs": [[int(b[2] - a[2]), round(b[1] - a[1], 4)] for a, b in zip(steps, steps[1:])],
        "peak_memory_gb": round(peak_gb, 3),  # the largest over ranks (memory.peak_memory_over_ranks_gb)
        "device": device,
        "timed_out": timed_out,
        "checkpoint_seconds": round(checkpoint_seconds, 3) if checkpoint_seconds is not None else None,
        **(costs or {}),
    }
    ckpt.atomic_write_json(run.smoke_work / "result.json", result)


def _save_final(run: RunDir, trainer, tokenizer, recipe) -> None:
    """final/adapter (PEFT adapter + tokenizer) or final/model, written to a temporary folder then renamed.
    Every rank calls it (the sharding engines gather collectively); the supervisor verifies the result
    (launcher/store/final.py) before the run counts as succeeded."""
    import shutil

    import torch.distributed as dist

    from launcher.store import final
    from launcher.worker import saving
    from launcher.worker.engines.fsdp import is_sharded, save_full

    name = final.kind(recipe.method)
    tmp = run.final / f".{name}.tmp"
    # a whole model is written in the base model's dtype, whatever dtype training kept (launcher/worker/saving.py)
    dtype, source = saving.final_dtype(recipe)
    if _rank() == 0:
        run.final.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    if is_sharded(trainer.model):
        # FSDP2: Trainer.save_model writes nothing unless the checkpoints' state dict type is FULL_STATE_DICT
        # (see save_full); the final result is gathered here one tensor at a time, the checkpoints stay sharded.
        save_full(trainer.model, tmp, write=_rank() == 0, dtype=dtype)
    elif dtype is not None and not trainer.is_deepspeed_enabled:
        # trl/ddp train fp32 master weights: rank 0 casts them tensor by tensor while saving (no collective)
        if _rank() == 0:
            saving.save_model(trainer.accelerator.unwrap_model(trainer.model), tmp, dtype)
    else:
        trainer.save_model(str(tmp))  # collective under ZeRO-3 (its 16-bit gather); only the main process writes
        if dtype is not None and _rank() == 0:
            saving.recast_folder(tmp, dtype)  # ZeRO-3 wrote its training dtype (fp16 cards, the CPU's fp32)
    if _rank() != 0:
        return
    tokenizer.save_pretrained(str(tmp))
    dst = run.final / name
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(tmp, dst)
    print(f"[ftrun worker] final {name} saved to {dst}"
          + (f" in {str(dtype).replace('torch.', '')} (from {source})" if dtype is not None else ""), flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.worker.train", description=__doc__)
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--mode", choices=("full", "smoke"), default="full")
    ns = parser.parse_args(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank: die with the launcher, never train orphaned
        from launcher.worker.engines import die_with_parent

        die_with_parent()
    try:
        code = run_worker(ns.run_dir.resolve(), ns.mode)
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
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # A torchrun rank whose work is done and whose process group is destroyed: leave without the interpreter's
        # teardown. C++ destructors of the distributed stack abort a rank now and then at that point ("terminate
        # called without an active exception", SIGABRT; seen about once in four 2-process runs here), which
        # torchrun reports as a failed worker and the supervisor would restart a finished run.
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
    sys.exit(exit_code)
