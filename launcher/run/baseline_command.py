"""`ftrun baseline RECIPE`: the base model scored on the task before any training (launcher/run/task_baseline.py),
and the reference article's verdict: does a fine-tune pay?"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

from launcher.errors import EXIT_BAD_INPUT, RecipeError, RunError, UsageError
from launcher.recipe import Recipe
from launcher.recipe_loading import load_recipe
from launcher.run import facts, task_eval_view
from launcher.run.pipeline import prepare_only
from launcher.run.prepare import _say
from launcher.run.run_dirs import run_dir_of
from launcher.run.task_baseline import EXIT_WORKER_BAD_INPUT, run_worker, settled, training_began
from launcher.data.task_verdict import start_keys
from launcher.store.state import move


def as_json(t: dict[str, Any]) -> dict[str, Any]:
    """`ftrun baseline --json`: the metric, the examples, the starting point's two scores, the verdict."""
    scores = t.get("scores") or {}
    out = {
        "metric": t.get("metric"),
        "examples": t.get("examples"),
        "scores": {n: scores.get(n) for n in task_eval_view.BASE_SCORES if n in scores or n in start_keys(t)},
        "verdict": task_eval_view.task_verdict(t),
        "fine_tune_pays": t.get("fine_tune_pays"),
    }
    for key in ("not_applicable", "too_few", "fix"):
        if t.get(key) is not None:
            out[key] = t[key]
    return out


def baseline_command(recipe_path: str, overrides: list[str], json_out: bool = False) -> int:
    """`ftrun baseline RECIPE [--json]`: prepare the run as `ftrun smoke` does, score the base model, say the verdict.
    With --json every other line goes to stderr: stdout holds only the JSON."""
    recipe = load_recipe(recipe_path, overrides)
    if recipe.eval.task.examples <= 0:
        raise RecipeError(
            "eval.task.examples is 0: the task evaluation is off, so there is nothing to score",
            fix="set eval.task.examples (200 by default), e.g. `ftrun baseline RECIPE eval.task.examples=200`.",
        )
    with contextlib.redirect_stdout(sys.stderr if json_out else sys.stdout):
        t = _score_base(recipe)
    if json_out:
        print(json.dumps(as_json(t), indent=2), flush=True)
    else:
        _say(task_eval_view.format_task_eval(t))
    return EXIT_BAD_INPUT if t.get("too_few") is not None else 0


def _score_base(recipe: Recipe) -> dict[str, Any]:
    """The base model's facts: a finished run's as stored; otherwise checked, planned and scored now."""
    run = run_dir_of(recipe)
    if run.exists() and settled(run):  # scored before (the answers are kept): said again, nothing re-run
        return facts.task_eval(run, base_only=True)
    if run.exists() and training_began(run):
        raise UsageError(
            f"{run.root} has trained already, and its base model was not scored before training",
            fix="score the base model in a new run directory: `ftrun baseline RECIPE output_dir=runs/<new>`.",
        )
    recipe, run, prepared, _downloaded = prepare_only(recipe, "task baseline only")
    lock = prepared[5]
    try:
        rc, last = run_worker(run, prepared[4], _say)
        move(run, "plan", reason=f"task baseline {'scored' if rc == 0 else 'failed'}; `ftrun RECIPE` starts the run")
    finally:
        lock.release()
    t = facts.task_eval(run, base_only=True)
    if rc == EXIT_WORKER_BAD_INPUT:
        raise UsageError(
            f"the task evaluation refused its input: {task_eval_view.worker_line(last)}",
            fix="change the recipe's eval.task settings or the data as the line says, and run it again.",
        )
    if rc != 0 or t is None:
        raise RunError(
            task_eval_view.baseline_failed(rc, last, launching=False),
            fix=f"read the worker's lines above; `ftrun baseline` again resumes (answers are kept in "
            f"{run.root / 'task_eval'}).",
        )
    return t
