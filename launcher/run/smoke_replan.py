"""The launch's smoke test, tried again after each out of memory with the next change the recipe allows."""

from __future__ import annotations

from typing import Any, Optional

import yaml

from launcher.errors import HardwareError, PlanError, SmokeError, SmokeOOM
from launcher.recipe import Recipe
from launcher import notify
from launcher.run.adjustments import next_adjustment, shard_blocker
from launcher.run.ending import Ending, leave
from launcher.run.prepare import _check_shared_memory, _plan_record, _say, make_plan
from launcher.store.checkpoint import atomic_write_json
from launcher.store.rundir import RunDir
from launcher.store.state import move


def _smoke(
    run: RunDir,
    recipe: Recipe,
    plan_dict,
    examples,
    lengths,
    stats,
    download: Optional[dict[str, Any]] = None,
    own_session: bool = True,
) -> tuple[Recipe, dict[str, Any]]:
    """The smoke test; after an out-of-memory, re-plan with the cheapest allowed change and try again. Returns the
    adjusted recipe and the calibrated plan record. `own_session`: smoke.py start_worker."""
    from launcher.run.smoke import run_smoke
    from launcher.run.views import format_smoke

    move(run, "smoke")
    attempts: list[str] = []
    adjustments = list(plan_dict.get("adjustments", []))
    try:  # an error raised in the loop's own handler (SmokeOOM) is caught here too
        while True:
            try:
                report = run_smoke(run, recipe, plan_dict, examples, lengths, stats, own_session)
                break
            except SmokeOOM as exc:
                peak = f"peak {exc.peak_memory_gb:.2f} GB" if exc.peak_memory_gb is not None else "peak unknown"
                limit = plan_dict.get("memory_limit_gb") or (plan_dict.get("memory") or {}).get("capacity_gb")
                where = f"{peak}" + (f" of {round(limit, 2):g} GB" if limit else "")
                if plan_dict.get("device") == "cpu" and plan_dict.get("memory_limit_gb"):
                    where += " above the imports"  # what --memory-limit caps on CPU
                attempts.append(
                    f"engine {plan_dict.get('engine')} x {plan_dict.get('num_processes', 1)}: "
                    f"micro_batch_size={recipe.micro_batch_size} gradient_accumulation_steps="
                    f"{recipe.gradient_accumulation_steps} gradient_checkpointing={recipe.gradient_checkpointing} "
                    f"method={recipe.method}: out of memory ({where})"
                )
                step = next_adjustment(recipe, plan_dict)
                if step is None:
                    blocked = shard_blocker(recipe, plan_dict) if "shard" in recipe.auto_adjust else ""
                    reason = (
                        "the smoke test ran out of memory and nothing the recipe allows (auto_adjust: "
                        f"{recipe.auto_adjust}) is left to try"
                        + (f" (shard: {blocked})" if blocked else "")
                        + ". Attempts:\n"
                        + "\n".join(f"- {a}" for a in attempts)
                    )
                    raise SmokeError(
                        reason,
                        fix=f"lower max_length (now {recipe.max_length}), allow more in auto_adjust "
                        "(batch, checkpointing, optimizer, method, shard), or use a card with more memory "
                        "(`ftrun plan RECIPE --gpus ...` shows the options with time and cost).",
                    ) from None
                update, text = step
                change = {"set": update, "reason": f"{text}: out of memory at {where} on the longest batch"}
                adjustments.append(change)
                _say(f"smoke test: out of memory ({where}); re-planning: {text}")
                recipe = recipe.model_copy(update=update)
                plan_dict = {**plan_dict, "adjustments": adjustments}
                if "engine" in update:  # another engine and process count: the plan is made again for them
                    try:
                        replanned = make_plan(recipe, stats)
                    except PlanError as exc:
                        raise SmokeError(
                            f"the smoke test ran out of memory; re-planning for {text} failed: {exc.message}."
                            " Attempts:\n" + "\n".join(f"- {a}" for a in attempts),
                            fix=exc.fix,
                        ) from None
                    plan_dict = _plan_record(
                        replanned, plan_dict.get("memory_limit_gb"), adjustments, plan_dict.get("nodes")
                    )
                    _say(f"re-planned: engine {replanned.engine}, {replanned.num_processes} processes")
                    # a job now sharded over several processes needs NCCL's /dev/shm
                    _check_shared_memory(plan_dict)
                run.recipe.write_text(
                    "# resolved by ftrun: defaults < recipe < command line < OOM adjustments (plan.json)\n"
                    + yaml.safe_dump(recipe.snapshot(), sort_keys=False)
                )
                atomic_write_json(run.plan, plan_dict)
    except (SmokeError, HardwareError) as exc:  # the run's end, through its one door (launcher/run/ending.py)
        leave(run, recipe, Ending("failed-smoke", exc.message.splitlines()[0], exc.exit_code), log=_say)
        raise
    except KeyboardInterrupt:
        leave(run, recipe, Ending("failed-smoke", "smoke test interrupted (Ctrl-C)", 130), log=_say)
        raise
    if download:  # the download's time beside the forecast's parts (already spent: the full run reads the cache)
        report = {**report, **download}
        atomic_write_json(run.smoke, report)
    _say(format_smoke(report))
    notify.send(recipe.notify, f"ftrun: smoke test passed: {run.root.name}", format_smoke(report), _say)
    calibrated = make_plan(recipe, stats, smoke=report, nnodes=(plan_dict.get("nodes") or {}).get("nnodes", 1))
    record = _plan_record(calibrated, plan_dict.get("memory_limit_gb"), adjustments, plan_dict.get("nodes"))
    record["speed"] = plan_dict.get("speed")  # the plan's choice and its reasons, which the recipe now holds
    # the forecast the printed plan showed: `ftrun status`'s "plan forecast"
    record["estimate_as_planned"] = plan_dict.get("estimate_as_planned") or plan_dict.get("estimate")
    atomic_write_json(run.plan, record)
    return recipe, record
