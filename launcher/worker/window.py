"""The logging window's running sums, carried in each checkpoint (ftrun_window.json) so the logs after a resume equal an
uninterrupted run's: the Trainer restarts the window's loss sum at zero, and TRL's window means and token total too.

Relies on transformers 5.24 trainer.py (`_inner_training_loop` sets `_tr_loss`, `_total_loss_scalar`,
`_globalstep_last_logged` before `on_train_begin`; `_maybe_log_save_evaluate` logs the gathered sum's mean over the
steps since the last log) and trl 1.16 sft_trainer.py (`compute_loss` appends to `_metrics["train"]`, adds to
`_total_train_tokens`; `log` clears them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

WINDOW_FILE = "ftrun_window.json"


def carrying(trainer_cls: type, say: Callable[[str], None] = print) -> type:
    """`trainer_cls` writing the window's sums into each checkpoint folder (inside the save, before the worker moves
    and hashes it) and restoring them at a resume before step 1."""
    from transformers import TrainerCallback

    class Restore(TrainerCallback):
        def __init__(self, trainer):
            self.trainer = trainer

        def on_train_begin(self, args, state, control, **kw):
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
    """The window's state now (each rank's float32 loss sum, in rank order: the next log's mean is the same bit for
    bit), or None for a trainer without a `_tr_loss` tensor."""
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
        # ORPO stores 0-d float32 tensors (orpo_trainer.py store_metrics): .item() is exact
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
        # another world size: every rank carries the mean, so the next log counts the earlier steps once
        mine = sum(sums) / len(sums)
        note = (
            f"{path.name} holds the loss sums of {len(sums)} process(es), this launch has "
            f"{trainer.args.world_size}: each carries their mean"
        )
    loss.fill_(mine)  # in place, on the Trainer's device and dtype: the loop adds to this very tensor
    trainer._globalstep_last_logged = int(saved["last_logged_step"])
    # the summary's train_loss averages this launch's steps only
    trainer._total_loss_scalar -= torch.tensor(sums, dtype=loss.dtype).mean().item()
    train = _trl_window(trainer)
    if "trl_metrics" in saved and train is not None:
        train.clear()
        train.update({key: list(values) for key, values in saved["trl_metrics"].items()})
        if saved.get("trl_total_train_tokens") is not None:
            trainer._total_train_tokens = saved["trl_total_train_tokens"]
    return note


def _trl_window(trainer) -> Optional[dict]:
    """TRL's figures since the last log: `_metrics["train"]` (SFT, DPO), `_stored_metrics["train"]` (ORPO), or None."""
    metrics = getattr(trainer, "_metrics", None)
    if isinstance(metrics, dict) and "train" in metrics:
        return metrics["train"]
    stored = getattr(trainer, "_stored_metrics", None)
    if stored is not None and hasattr(stored, "default_factory"):
        return stored["train"]
    return None
