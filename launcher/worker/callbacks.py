"""The trainer callbacks through which ftrun drives the Trainer's loop: wall-clock checkpoints and evaluation, the
save after SIGTERM, the metrics rows and log lines (read by launcher/run/facts.py), the NaN guard, the smoke test's
timing, the engine check.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

from launcher import methods
from launcher.store import checkpoint as ckpt
from launcher.store.rundir import RunDir
from launcher.worker import memory
from launcher.worker import samples
from launcher.worker.checkpointing import METRICS_IN_CHECKPOINT, _MANIFEST, _await_manifest
from launcher.worker.exits import EXIT_BAD_WORLD
from launcher.worker.heartbeat import BEAT
from launcher.worker.loss_plot import _redraw_loss_plot
from launcher.worker.process import _Stop, _rank


class TrainingComplete(Exception):
    """Raised at the start of training when the checkpoint resumed from is the schedule's last step."""


def build_callbacks(
    run: RunDir,
    recipe,
    mode: str,
    device: str,
    checkpoint_meta: dict[str, Any],
    max_seconds: Optional[float],
    evaluates: bool = False,
):
    """The trainer callbacks: wall-clock checkpoints and evaluation, SIGTERM save, metrics, NaN guard, smoke timing."""
    import torch
    from transformers import TrainerCallback

    def agree(flag: bool) -> bool:
        # all ranks decide together, or the collective save deadlocks
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
                # resumed from the last step: the loop checks should_training_stop only after a step (transformers
                # 5.24 trainer.py, _run_epoch) and would train one past the schedule; the worker writes the result
                raise TrainingComplete(state.global_step)
            # the cadence counts training time, not the setup and loading before it (tests/run/test_rank_down.py)
            self.last_save = time.monotonic()
            BEAT.beat("step", state.global_step)

        def on_step_end(self, args, state, control, **kw):
            BEAT.beat("step", state.global_step)  # the watchdog's view of this rank (launcher/run/watchdog.py)
            due = time.monotonic() - self.last_save >= interval
            at_end = state.global_step >= state.max_steps
            stop = agree(_Stop.requested)
            over_time = max_seconds is not None and agree(time.monotonic() - self.started >= max_seconds)
            if mode == "full" and (agree(due) or at_end or stop):
                control.should_save = True
            # eval by wall clock and at the end (before the save: the row is in the checkpoint); the smoke once
            if (
                evaluates
                and not stop
                and (
                    at_end
                    or (over_time if mode == "smoke" else agree(time.monotonic() - self.last_eval >= eval_interval))
                )
            ):
                control.should_evaluate = True
            if stop:
                self.stopped_by_signal = True
                control.should_training_stop = True
            if over_time and not at_end:
                self.timed_out = True
                control.should_training_stop = True
            if mode == "smoke" and (at_end or over_time):
                # time one checkpoint for the ETA
                control.should_save = True
                self.save_started = time.monotonic()
            if mode == "full" and control.should_save:
                # every rank waits for the previous manifest here, in short collectives, not in on_save's barrier
                # where a long hash would outlast ddp_timeout
                BEAT.beat("hash")
                _await_manifest(device)
            if control.should_evaluate or control.should_save:  # the Trainer evaluates, then saves
                BEAT.beat("eval" if control.should_evaluate else "save")
            return control

        def on_evaluate(self, args, state, control, **kw):
            self.last_eval = time.monotonic()
            BEAT.beat("save" if control.should_save else "step")

        def on_save(self, args, state, control, **kw):
            self.last_save = time.monotonic()
            together = torch.distributed.is_available() and torch.distributed.is_initialized()
            if together:
                # every rank's part (rng state, ZeRO shards) is written before the folder moves
                torch.distributed.barrier()
            # one writer per disk: the main process, or each node's first one when every node saves
            writer = state.is_local_process_zero if args.save_on_each_node else state.is_world_process_zero
            src = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if mode == "smoke":
                if self.save_started is not None:
                    # the timed save includes the hashing, as the full run's do
                    if writer:
                        ckpt.write_manifest(src, state.global_step, checkpoint_meta)
                    self.save_seconds = time.monotonic() - self.save_started
                return control
            if writer:
                # the previous manifest and retention finish first; one that failed stops the run here
                _MANIFEST.wait()
                _MANIFEST.check()
                dst = run.checkpoints / ckpt.step_dir_name(state.global_step)
                if dst.exists():  # a save of the same step after a resume: the new one replaces it
                    shutil.rmtree(dst)
                os.replace(src, dst)
                if run.metrics.is_file():
                    # the metrics up to its step, for a resume on another box
                    shutil.copyfile(run.metrics, dst / METRICS_IN_CHECKPOINT)
                from launcher.worker import trackers

                trackers.into_checkpoint(run.root, dst)  # a resume on another box continues the same tracked runs
                if (run.root / samples.BEFORE_FILE).is_file():  # the base model's answers, for a resume elsewhere
                    shutil.copyfile(run.root / samples.BEFORE_FILE, dst / samples.BEFORE_FILE)

                def complete(dst: Path = dst) -> None:
                    # retention after the manifest: the newest complete checkpoint outlives the hashing
                    removed = ckpt.retain(run.checkpoints, recipe.keep_checkpoints)
                    print(
                        f"[ftrun worker] checkpoint {dst.name} saved and verified "
                        f"({ckpt.tree_bytes(dst) / 1e9:.2f} GB hashed in {_MANIFEST.seconds:.1f} s)"
                        + (f"; removed {', '.join(removed)}" if removed else ""),
                        flush=True,
                    )

                # hashing beside the training: no rank waits for it
                _MANIFEST.start(dst, state.global_step, checkpoint_meta, then=complete)
                _redraw_loss_plot(run.root)
            if together:
                torch.distributed.barrier()
            BEAT.beat("step")
            return control

    class Metrics(TrainerCallback):
        def __init__(self):
            self.t_last = None
            self.tokens_last = 0
            self.step_times: list[tuple[int, float, int]] = []  # (step, monotonic, tokens seen)
            self.eval_seconds: Optional[float] = None  # the last eval pass (the smoke's is priced for the ETA)
            self.zero_std: list[float] = []  # GRPO: each step's share of prompts without reward variance

        def on_train_begin(self, args, state, control, **kw):
            if state.is_world_process_zero and kw.get("optimizer") is not None:
                opt = kw["optimizer"]
                inner = getattr(opt, "optimizer", opt)  # accelerate wraps the real one
                print(f"[ftrun worker] optimizer: {type(inner).__module__}.{type(inner).__name__}", flush=True)
            self.t_last = time.monotonic()
            self.tokens_last = state.num_input_tokens_seen
            self.step_times.append((state.global_step, self.t_last, state.num_input_tokens_seen))
            if state.is_world_process_zero:
                # the mode's own file: a smoke test's step count is not the full run's
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
                _log_eval(run, mode, state, logs, recipe.objective_row.logged)
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
            # the objective's own figures (DPO's rewards/chosen ... rewards/accuracies: launcher/methods.py logged)
            row.update({k: float(logs[k]) for k in recipe.objective_row.logged if logs.get(k) is not None})
            # GRPO: each reward function's mean and spread apart (TRL's rewards/<name>/mean, /std: methods.py)
            row.update({k: float(v) for k, v in logs.items() if methods.is_reward_part(k) and v is not None})
            if row.get("frac_reward_zero_std") is not None:
                self.zero_std.append(row["frac_reward_zero_std"])
            self.t_last, self.tokens_last = now, tokens
            words = f"loss {loss:.4f} lr {row['learning_rate']:.2e} {row['tokens_per_second']:.0f} tok/s"
            _emit(run, mode, state, row, words + _objective_words(row))

    return Cadence(), Metrics()


def _objective_words(row: dict[str, Any]) -> str:
    """The step line's objective figures: DPO's margin and accuracy; GRPO's reward, spread, parts, zero-variance."""
    if "rewards/margins" in row and "rewards/accuracies" in row:
        return f" margin {row['rewards/margins']:.3f} acc {row['rewards/accuracies']:.2f}"
    if row.get("reward") is None:
        return ""
    parts = methods.reward_parts(row)
    words = f" reward {row['reward']:.3f} +- {row.get('reward_std') or 0:.3f}"
    if len(parts) > 1:
        each = (
            f"{name} {p['mean']:.3f} +- {p['std'] or 0:.3f}" if p["mean"] is not None else f"{name} none scored"
            for name, p in parts.items()
        )
        words += f" ({', '.join(each)})"
    if row.get("frac_reward_zero_std"):
        words += f", {row['frac_reward_zero_std']:.0%} of prompts without reward variance"
    return words


def _log_eval(run: RunDir, mode: str, state, logs: dict[str, Any], logged: tuple[str, ...] = ()) -> None:
    """An eval pass: its own row in metrics.jsonl (eval_loss, TRL's and the objective's eval_ figures), a log line."""
    row = {"step": state.global_step, "eval_loss": float(logs["eval_loss"])}
    for key in ("eval_mean_token_accuracy", "eval_entropy", *(f"eval_{k}" for k in logged)):
        if logs.get(key) is not None:
            row[key] = float(logs[key])
    row.update(epoch=round(state.epoch or 0.0, 4), eval_seconds=logs.get("eval_runtime"), time=time.time())
    # every pair tied (the policy still its reference, as at step 0) is no accuracy of 0 (run/views.py)
    tied = not row.get("eval_rewards/accuracies") and abs(row.get("eval_rewards/margins", 1.0)) < 1e-9
    held = (
        ""
        if "eval_rewards/accuracies" not in row
        else ", held-out pairs all tied (margin 0: the policy is its reference)"
        if tied
        else f", held-out preference accuracy {row['eval_rewards/accuracies']:.2f}"
    )
    _emit(run, mode, state, row, f"eval loss {row['eval_loss']:.4f}{held} ({row['eval_seconds'] or 0:.1f} s)")


def _emit(run: RunDir, mode: str, state, row: dict[str, Any], text: str) -> None:
    """A logged row from the main process: into metrics.jsonl (the full run's only) and one log line."""
    if not state.is_world_process_zero:
        return
    if mode == "full":
        with run.metrics.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
    print(f"[ftrun worker] step {row['step']}/{state.max_steps} {text}", flush=True)


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
                # past the trainer's error handling; every rank sees the same result
                raise SystemExit(EXIT_BAD_WORLD)
            if _rank() == 0:
                print(f"[ftrun worker] {line}", flush=True)

    return EngineCheck()


def _tracked_recipe(run: RunDir, recipe):
    """After the trackers' own callbacks: the recipe into each tracked run's config, where each run is in the log."""
    from launcher.worker import trackers

    return trackers.recipe_callback(run.root, recipe)
