"""The recipe changes an out of memory in the smoke test leads to, cheapest first (the plan's own faster settings,
then `auto_adjust`), and the recipe as a run trains it with the plan's settings and those changes applied."""

from __future__ import annotations

import json
from typing import Any, Optional

import yaml

from launcher.engine_kinds import SHARDING
from launcher.methods import METHODS
from launcher.plan.speed import left_to_plan
from launcher.recipe import Recipe
from launcher.store.rundir import RunDir


def with_plan_settings(recipe: Recipe, plan: dict[str, Any]) -> Recipe:
    """The recipe with the faster settings its plan chose for the keys it leaves out (plan.json `speed`)."""
    chosen = (plan.get("speed") or {}).get("set") or {}
    return recipe.model_copy(update=chosen) if chosen else recipe


def with_adjustments(run: RunDir, recipe: Recipe) -> Recipe:
    """The recipe as the run trains it: the keys left to the plan and GRPO's answer length as the run's recipe.yaml
    holds them (a resume keeps them, on any box), then the smoke test's out-of-memory adjustments."""
    update: dict[str, Any] = {}
    left = left_to_plan(recipe) | left_to_data(recipe)
    sized = recipe.objective_row.generates and "max_completion_length" not in recipe.grpo.model_fields_set
    if (left or sized) and run.recipe.is_file():
        try:
            recorded = yaml.safe_load(run.recipe.read_text()) or {}
        except yaml.YAMLError:  # a recipe.yaml this ftrun cannot read: the run's own views say so
            recorded = {}
        recorded = recorded if isinstance(recorded, dict) else {}
        update.update({k: recorded[k] for k in left if k in recorded})
        answer = (recorded.get("grpo") or {}).get("max_completion_length") if sized else None
        if isinstance(answer, int):  # sized from the references at the launch (launcher/data/stats.py): kept
            update["grpo"] = recipe.grpo.model_copy(update={"max_completion_length": answer})
    if run.plan.is_file():
        for adj in json.loads(run.plan.read_text()).get("adjustments", []):
            update.update(adj["set"])
    return recipe.model_copy(update=update) if update else recipe


def left_to_data(recipe: Recipe) -> set[str]:
    """The keys the recipe leaves to the data check (assistant_only_loss, launcher/data/loss_view.py
    resolve_answers_only): a resume trains with the value recorded in recipe.yaml."""
    return {"assistant_only_loss"} if recipe.assistant_only_loss is None else set()


def with_loss_resolved(recipe: Recipe, loss_view: Optional[dict[str, Any]]) -> Recipe:
    """The recipe with assistant_only_loss as the data check resolved it where left out (off without a loss view)."""
    if recipe.assistant_only_loss is not None:
        return recipe
    return recipe.model_copy(update={"assistant_only_loss": bool((loss_view or {}).get("assistant_only_loss"))})


def undo_plan_settings(recipe: Recipe, plan: dict[str, Any]) -> Optional[tuple[dict[str, Any], str]]:
    """Back to the recipe's own values where the plan chose faster ones that are still in force, or None."""
    speed = plan.get("speed") or {}
    chosen, was = speed.get("set") or {}, speed.get("from") or {}
    if not chosen or any(getattr(recipe, k) != v for k, v in chosen.items()):
        return None
    back = {k: v for k, v in was.items() if getattr(recipe, k) != v}
    if not back:
        return None
    return back, "the plan's faster settings undone: " + ", ".join(
        f"{k} {getattr(recipe, k)} -> {v}" for k, v in back.items()
    )


def next_adjustment(recipe: Recipe, plan: dict[str, Any]) -> Optional[tuple[dict[str, Any], str]]:
    """The cheapest change the recipe allows after an out-of-memory, or None. The plan's own faster settings go
    first, whatever auto_adjust says: they are the plan's, not the recipe's."""
    undo = undo_plan_settings(recipe, plan)
    if undo:
        return undo
    allowed = recipe.auto_adjust
    m, g = recipe.micro_batch_size, recipe.gradient_accumulation_steps
    m2 = m // 2 if m % 2 == 0 else 1
    if "batch" in allowed and m > 1 and m2 >= recipe.objective_row.min_micro_batch:  # KTO's KL term: 2 at least
        g2 = g * m // m2  # the effective batch stays the same, so does the training
        return (
            {"micro_batch_size": m2, "gradient_accumulation_steps": g2},
            f"micro_batch_size {m} -> {m2}, gradient_accumulation_steps {g} -> {g2} (same effective batch)",
        )
    if "checkpointing" in allowed and not recipe.gradient_checkpointing:
        return {"gradient_checkpointing": True}, "gradient_checkpointing off -> on (recomputes activations)"
    method = METHODS[recipe.method]
    if method.lighter and method.lighter_by in allowed:
        return {"method": method.lighter}, f"method {method.name} -> {method.lighter} ({method.lighter_why})"
    if "shard" in allowed:
        return shard_adjustment(recipe, plan)
    return None


def shard_adjustment(recipe: Recipe, plan: dict[str, Any]) -> Optional[tuple[dict[str, Any], str]]:
    """The `shard` step after an out-of-memory: on a GPU box FSDP over all its cards (or the most that divide the
    effective batch), DDP becoming FSDP; on CPU only under --memory-limit, DeepSpeed ZeRO-3 processes (FSDP does not
    shard on CPU). Never over an engine or process count the recipe chose, or several nodes. None when there is
    nothing to shard over; shard_blocker() says why."""
    return _shard(recipe, plan)[0]


def shard_blocker(recipe: Recipe, plan: dict[str, Any]) -> str:
    """Why the shard step was not taken (for the stop message), '' when it would be."""
    return _shard(recipe, plan)[1]


def _shard(recipe: Recipe, plan: dict[str, Any]) -> tuple[Optional[tuple[dict[str, Any], str]], str]:
    from launcher.plan.engine_software import _deepspeed_installed

    procs = int(plan.get("num_processes") or 1)
    m, g = recipe.micro_batch_size, recipe.gradient_accumulation_steps
    effective = m * g * procs
    sharded = plan.get("engine") in SHARDING
    cards = int((plan.get("hardware") or {}).get("count") or 1)
    if sharded and (plan.get("device") != "cuda" or procs >= cards):
        return None, f"already {plan.get('engine')} x {procs}" + (
            f" over all {cards} GPU(s) of this box" if plan.get("device") == "cuda" else ""
        )
    if recipe.engine != "auto":
        return None, f"the recipe sets engine: {recipe.engine}"
    if recipe.num_processes != "auto":
        return None, f"the recipe sets num_processes: {recipe.num_processes}"
    if plan.get("nodes"):
        return None, "the run spans several nodes"
    if plan.get("device") == "cuda" and METHODS[recipe.method].eight_bit_optimizer:
        from launcher.plan.engine import FULL_8BIT_FSDP

        return None, f"{FULL_8BIT_FSDP}; allow it with method: full (drop 'optimizer' from auto_adjust)"
    if plan.get("device") == "cuda":
        engine = "fsdp"
        fewest = procs + 1 if sharded else procs  # DDP -> FSDP on the same cards
        counts = range(cards, fewest - 1, -1)  # all cards first: more shards, more room, faster
        where = f"the box's {cards} GPUs"
        if cards < 2:
            return None, "this box has 1 GPU, none more to shard over"
    elif not plan.get("memory_limit_gb"):
        return None, "on CPU the processes share the same RAM; sharding is tried only under --memory-limit"
    elif not _deepspeed_installed():
        return None, "DeepSpeed, which shards on CPU, is not installed"
    else:
        engine, cores = "deepspeed", int((plan.get("hardware") or {}).get("cpu_count") or 1)
        counts = range(2, cores + 1)  # the processes share the cores: the fewest that shard
        where = f"CPU processes, each capped at {round(plan['memory_limit_gb'], 2):g} GB like a card"
    for k in counts:
        if k >= 2 and effective % (m * k) == 0:
            g2 = effective // (m * k)
            return (
                {"engine": engine, "num_processes": k, "gradient_accumulation_steps": g2},
                f"engine {plan.get('engine')} x {procs} -> {engine} x {k} over {where}, each holding 1/{k} of the "
                f"weights, gradients and optimizer states; gradient_accumulation_steps {g} -> {g2} "
                f"(same effective batch {effective})",
            ), ""
    return None, (
        f"the effective batch {effective} (micro-batch {m}) does not split evenly over "
        f"{where}: sharding would change the training"
    )
