"""The run directory's layout: one place that names every file a run keeps."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

# where run directories go by default (<current folder>/runs/<recipe name>), and where commands look for them
RUNS = "runs"


def _entry(name: str) -> property:
    """A path of the layout: `name` below the run's root."""
    return property(lambda self: self.root / name)


@dataclass(frozen=True)
class RunDir:
    root: Path

    recipe = _entry("recipe.yaml")  # the resolved recipe snapshot
    plan = _entry("plan.json")
    smoke = _entry("smoke.json")
    smoke_work = _entry("smoke")  # scratch folder of the smoke test, removed after it
    state = _entry("state.json")
    lock = _entry(".lock")
    log = _entry("train.log")
    metrics = _entry("metrics.jsonl")
    worker = _entry("worker.json")  # what the worker reports about itself: pid, total steps, device
    heartbeats = _entry("heartbeats")  # each rank's step and phase, one small file per rank (store/heartbeat_files.py)
    checkpoints = _entry("checkpoints")
    task = _entry("task.json")  # what the task evaluation asks (prompts, references, shots, metric): built once
    task_answers = _entry("task_eval")  # each scorer's answers, task_eval/<name>.jsonl (worker/task_eval.py)
    task_eval = _entry("task_eval.json")  # the task evaluation's scores so far; final/task_eval.json after training
    final = _entry("final")
    parent_record = _entry("parent.json")  # where the init_from adapter pinned into parent/ came from (run/parent.py)

    def exists(self) -> bool:
        return self.recipe.is_file()

    def pinned_parent(self) -> Optional[dict[str, Any]]:
        """{"init_from": the recipe's source, "copy": the pinned folder} when this run pinned its parent, else None."""
        if not self.parent_record.is_file():
            return None
        info = json.loads(self.parent_record.read_text())
        return info if Path(info.get("copy", "")).is_dir() else None
