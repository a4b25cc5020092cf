"""The logging window's running sums, carried in each checkpoint so the logs after a resume equal an uninterrupted
run's.

A logged loss is the mean over the optimizer steps since the last log (`logging_steps` of them). The Trainer keeps
that window's sum in memory and starts it from zero at a resume, so a checkpoint that falls between two logs made
the first log after a resume average only the steps since the checkpoint (a jump in the curve; the weights were
the same). TRL's entropy and mean_token_accuracy are window means too, and its num_tokens a running total that
restarted at zero. The checkpoint now carries those sums (ftrun_window.json, hashed into the manifest like every
other file), and the resume puts them back before the first step.

What this relies on, in transformers 5.24 trainer.py: `_inner_training_loop` sets `self._tr_loss` (a float32
tensor, this rank's loss sum since the last log), `self._total_loss_scalar` and `self._globalstep_last_logged`
right before `on_train_begin`; `_maybe_log_save_evaluate` logs `nested_gather(tr_loss).mean() / (global_step -
_globalstep_last_logged)`, then saves through `_save_checkpoint`. In trl 1.16 sft_trainer.py: `compute_loss`
appends to `self._metrics["train"]` (values already gathered over ranks, the same on each) and adds to
`self._total_train_tokens`; `log` averages and clears the lists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

WINDOW_FILE = "ftrun_window.json"


def carrying(trainer_cls: type, say: Callable[[str], None] = print) -> type:
    """`trainer_cls` (TRL's SFTTrainer, or the one Unsloth patched) that writes the logging window's sums into each
    checkpoint folder, inside the save and so before the worker moves and hashes the folder, and restores them at
    a resume before step 1."""
    from transformers import TrainerCallback

    class Restore(TrainerCallback):
        def __init__(self, trainer):
            self.trainer = trainer

        def on_train_begin(self, args, state, control, **kw):
            # after the Trainer zeroed the window (see the module's docstring), before the first step
            checkpoint = self.trainer._ftrun_resume
            if checkpoint is not None:
                note = restore(self.trainer, Path(checkpoint))
                if note and self.trainer.is_world_process_zero():
                    say(note)

    class WindowCarrying(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._ftrun_resume: Optional[str] = None
            self.add_callback(Restore(self))

        def train(self, resume_from_checkpoint=None, **kwargs):
            self._ftrun_resume = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

        def _save_checkpoint(self, model, trial):
            super()._save_checkpoint(model, trial)
            saved = capture(self)  # a collective: every rank saves, each rank's loss sum is gathered
            if saved is not None and self.args.should_save:  # the writer of this disk, as for trainer_state.json
                from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

                from launcher.store.checkpoint import atomic_write_json

                folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
                atomic_write_json(folder / WINDOW_FILE, saved)

    WindowCarrying.__name__ = WindowCarrying.__qualname__ = f"WindowCarrying{trainer_cls.__name__}"
    return WindowCarrying


def capture(trainer) -> Optional[dict[str, Any]]:
    """The window's state now, or None for a trainer that keeps the loss sum to itself (no `_tr_loss` tensor).

    Each rank's own loss sum, in rank order: at the next log the Trainer gathers every rank's sum and takes the
    mean, and a rank that carries its own float32 sum adds the same steps in the same order as without the
    interruption, so the gathered value is the same bit for bit."""
    import torch
    from transformers.trainer_pt_utils import nested_gather

    loss = getattr(trainer, "_tr_loss", None)
    if not isinstance(loss, torch.Tensor):
        return None
    sums = nested_gather(loss.detach().clone(), trainer.args.parallel_mode)  # the Trainer's own gather for the log
    saved: dict[str, Any] = {
        "step": trainer.state.global_step,
        "last_logged_step": trainer._globalstep_last_logged,
        "loss_sums": [float(v) for v in sums.reshape(-1).tolist()],  # float32 as a double: exact
        "loss_dtype": str(loss.dtype).replace("torch.", ""),
    }
    train = _trl_window(trainer)
    if train is not None:
        # DPO's and SFT's values are floats; ORPO stores 0-d tensors (experimental/orpo/orpo_trainer.py store_metrics)
        # and averages them in float32 at the log: .item() of a float32 is exact as a double, and back again
        window = {key: [v.item() if hasattr(v, "item") else v for v in values] for key, values in train.items()}
        try:
            json.dumps(window)
        except TypeError:
            window = None  # a metric that is not a plain number: those logs restart at the resume, as before
        if window is not None:
            saved["trl_metrics"] = window
            saved["trl_total_train_tokens"] = getattr(trainer, "_total_train_tokens", None)
    return saved


def restore(trainer, checkpoint: Path) -> Optional[str]:
    """Put the checkpoint's window back into the trainer (every rank); a note for the log when it cannot."""
    import torch

    path = checkpoint / WINDOW_FILE
    consequence = (
        "the first logged values after the resume average only the steps since the checkpoint "
        "(the weights are the same)"
    )
    if not path.is_file():
        return (
            f"checkpoint {checkpoint.name} carries no logging-window state (saved by an earlier ftrun): {consequence}"
        )
    loss = getattr(trainer, "_tr_loss", None)
    if not isinstance(loss, torch.Tensor):
        return f"this trainer keeps its logging window to itself: {consequence}"
    saved = json.loads(path.read_text())
    if saved.get("step") != trainer.state.global_step:
        return (
            f"{path.name} of {checkpoint.name} is for step {saved.get('step')}, the checkpoint's state for "
            f"step {trainer.state.global_step}: {consequence}"
        )
    sums = saved["loss_sums"]
    note = None
    if len(sums) == trainer.args.world_size:
        mine = sums[trainer.args.process_index]
    elif saved["last_logged_step"] == saved["step"]:
        mine = 0.0  # saved right after a log: nothing to carry, whatever the number of processes
    else:
        # Another number of processes than at the save (a resume across world sizes): every rank carries the
        # mean, so the gathered mean at the next log still counts the window's earlier steps once.
        mine = sum(sums) / len(sums)
        note = (
            f"{path.name} holds the loss sums of {len(sums)} process(es), this launch has "
            f"{trainer.args.world_size}: each carries their mean"
        )
    loss.fill_(mine)  # in place, on the Trainer's device and dtype: the loop adds to this very tensor
    trainer._globalstep_last_logged = int(saved["last_logged_step"])
    # The summary's train_loss averages the losses of this launch's steps: the carried sum is not one of them.
    trainer._total_loss_scalar -= torch.tensor(sums, dtype=loss.dtype).mean().item()
    train = _trl_window(trainer)
    if "trl_metrics" in saved and train is not None:
        train.clear()
        for key, values in saved["trl_metrics"].items():
            train[key] = list(values)
        if saved.get("trl_total_train_tokens") is not None:
            trainer._total_train_tokens = saved["trl_total_train_tokens"]
    return note


def _trl_window(trainer) -> Optional[dict]:
    """The TRL trainer's own figures since the last log (train): SFTTrainer's and DPOTrainer's `_metrics["train"]`,
    ORPOTrainer's `_stored_metrics["train"]` (a defaultdict, made again after each log); None for a trainer with
    neither."""
    metrics = getattr(trainer, "_metrics", None)
    if isinstance(metrics, dict) and "train" in metrics:
        return metrics["train"]
    stored = getattr(trainer, "_stored_metrics", None)
    if stored is not None and hasattr(stored, "default_factory"):
        return stored["train"]
    return None
