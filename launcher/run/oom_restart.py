"""An out of memory in the middle of a run whose plan chose faster settings (launcher/plan/speed.py): the choice undone
in the run's recipe.yaml and plan.json, the run restarted from its last checkpoint on the same trajectory.
The earlier checkpoints' trajectory hash is accepted, and a resume applies the change as one of plan.json's adjustments
(docs/engines.md, "Out of memory mid-run and the allocator"). Nothing of the plan's left to undo: it stays fatal.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

import yaml

from launcher.plan.speed import BATCH
from launcher.recipe import Recipe
from launcher.recipe_loading import load_recipe
from launcher.store.checkpoint import atomic_write_json, newest_step_unverified
from launcher.store.rundir import RunDir


def undo_step(recipe: Recipe, plan: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The plan's faster setting an out of memory mid-run undoes, cheapest first: gradient checkpointing back on, then
    the recipe's own micro-batch and accumulation. None when neither is the plan's and still in force."""
    speed = plan.get("speed") or {}
    chosen, was = speed.get("set") or {}, speed.get("from") or {}
    if chosen.get("gradient_checkpointing") is False and not recipe.gradient_checkpointing:
        return {"gradient_checkpointing": True}
    if (
        all(k in chosen and k in was for k in BATCH)
        and all(getattr(recipe, k) == chosen[k] for k in BATCH)
        and any(was[k] != chosen[k] for k in BATCH)
    ):
        return {k: was[k] for k in BATCH}
    return None


def undo_after_oom(run: RunDir, oom: dict[str, Any]) -> Optional[dict[str, Any]]:
    """After a worker's out of memory (worker.json's `out_of_memory`): undo the plan's next faster setting in
    recipe.yaml and plan.json for the next worker. Returns the facts, or None with nothing left to undo."""
    recipe = load_recipe(run.recipe)
    plan = json.loads(run.plan.read_text())
    update = undo_step(recipe, plan)
    if update is None:
        return None
    fact = {
        "set": update,
        "from": {k: getattr(recipe, k) for k in update},
        "oom_step": oom.get("step"),
        "peak_memory_gb": oom.get("peak_memory_gb"),
        "resumes_from_step": newest_step_unverified(run.checkpoints),  # the worker verifies it before use
        "at": time.time(),
    }
    # recipe.yaml: the keys set in place, the rest as the launch wrote it (a pinned init_from copy included)
    text = run.recipe.read_text()
    data = yaml.safe_load(text) or {}
    data.update(update)
    header = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
    run.recipe.write_text(header + yaml.safe_dump(data, sort_keys=False))
    plan.setdefault("adjustments", []).append({"set": update, "mid_run": fact})
    if "micro_batch_size" in update:  # plan.json's own batch fields, as the run now trains
        plan.update(update)
    atomic_write_json(run.plan, plan)
    return {**fact, "trajectory_hash_before": recipe.trajectory_hash()}


def accepted_hashes(state: dict[str, Any], fact: dict[str, Any]) -> list[str]:
    """state.json's accepted_recipe_hashes with the trajectory hash of the checkpoints written before the undo."""
    return sorted(set(state.get("accepted_recipe_hashes", [])) | {fact["trajectory_hash_before"]})


def mid_run_undos(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The facts of every out of memory mid-run that undid a plan's setting, oldest first (plan.json)."""
    return [a["mid_run"] for a in plan.get("adjustments", []) if a.get("mid_run")]
