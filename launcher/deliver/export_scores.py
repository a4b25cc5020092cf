"""An export's task score, kept in the run's results beside the other models' scores."""

from __future__ import annotations

import json
from typing import Any, Optional

from launcher.data.task_verdict import FINE_TUNED
from launcher.deliver.export_inputs import Inputs
from launcher.deliver.messages import _say


def _task(inp: Inputs) -> Optional[dict[str, Any]]:
    """The run's task (RUN/task.json) when the recipe scores it and it can be scored."""
    from launcher.worker import task_eval

    if not task_eval.enabled(inp.recipe) or not inp.run.task.is_file():
        return None
    task = json.loads(inp.run.task.read_text())
    return task if task_eval.scores(task) else None


def _scored(task: dict[str, Any], answers: list[dict[str, Any]]) -> dict[str, Any]:
    """A score from answers generated outside transformers (the GGUF in llama.cpp), as task_eval.score_model gives."""
    from launcher.worker.task_eval import summary

    return {k: v for k, v in summary(task, task["prompts"], answers).items() if k != "per_example"}


def _score_export(inp: Inputs, task: dict[str, Any], name: str, result: dict[str, Any]) -> None:
    """An export's score into the run's task scores (task_eval.json, samples.md), said beside the fine-tuned's."""
    from launcher.worker import task_eval, trackers
    from launcher.worker.results import publish_scores

    results = task_eval.record(inp.run.root, task, name, result)
    publish_scores(inp.run, results)
    # a finished run: its last step is its total (worker.json)
    step = int(json.loads(inp.run.worker.read_text()).get("total_steps") or 0) if inp.run.worker.is_file() else 0
    trackers.log_scores(
        inp.run.root, [t for t in inp.recipe.report_to if t != "none"], {name: result["score"]}, step, say=_say
    )
    tuned = results["scores"].get(FINE_TUNED)
    _say(
        f"task eval: {name} {result['score']:.1%} {task['metric']} on {result['examples']} held-out examples"
        + (f" (fine-tuned {tuned:.1%})" if tuned is not None else "")
        + (f", {result['tokens_per_s']:.0f} tokens/s generated" if result.get("tokens_per_s") else "")
    )
