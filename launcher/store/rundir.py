"""The run directory's layout: one place that names every file a run keeps."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

# where run directories go by default (<current folder>/runs/<recipe name>), and where commands look for them
RUNS = "runs"


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def recipe(self) -> Path:  # the resolved recipe snapshot
        return self.root / "recipe.yaml"

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def smoke(self) -> Path:
        return self.root / "smoke.json"

    @property
    def smoke_work(self) -> Path:  # scratch folder of the smoke test, removed after it
        return self.root / "smoke"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def lock(self) -> Path:
        return self.root / ".lock"

    @property
    def log(self) -> Path:
        return self.root / "train.log"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def worker(self) -> Path:  # what the worker reports about itself: pid, total steps, device
        return self.root / "worker.json"

    @property
    def heartbeats(self) -> Path:  # each rank's step and phase, one small file per rank (store/heartbeat_files.py)
        return self.root / "heartbeats"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def task(self) -> Path:  # what the task evaluation asks (prompts, references, shots, metric): built once
        return self.root / "task.json"

    @property
    def task_answers(self) -> Path:  # each scorer's answers, task_eval/<name>.jsonl (worker/task_eval.py)
        return self.root / "task_eval"

    @property
    def task_eval(self) -> Path:  # the task evaluation's scores so far; final/task_eval.json after training
        return self.root / "task_eval.json"

    @property
    def final(self) -> Path:
        return self.root / "final"

    def exists(self) -> bool:
        return self.recipe.is_file()

    @property
    def parent_record(self) -> Path:  # where the init_from adapter pinned into parent/ came from (run/parent.py)
        return self.root / "parent.json"

    def pinned_parent(self) -> Optional[dict[str, Any]]:
        """{"init_from": the recipe's source, "copy": the pinned folder} when this run pinned its parent, else None."""
        if not self.parent_record.is_file():
            return None
        info = json.loads(self.parent_record.read_text())
        return info if Path(info.get("copy", "")).is_dir() else None
