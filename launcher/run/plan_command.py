"""`ftrun plan`: the plan of a recipe for a box (--gpus, this machine, the recipe's box:), as text or JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from launcher.data.stats import data_stats, with_data_defaults
from launcher.errors import DataError, FtrunError, MissingSoftware, PlanError, RecipeError
from launcher.recipe_loading import load_recipe
from launcher.recipe_trainer import check_trainer_fields
from launcher.run.adjustments import with_adjustments
from launcher.run.data_view import data_line, format_loss_view, wants_color
from launcher.store.rundir import RunDir
from launcher.worker.trackers import check_installed as check_trackers_installed


def plan_command(
    recipe_path: str,
    overrides: list[str],
    gpus: Optional[str],
    tokens: Optional[str],
    as_json: bool,
    price: Optional[float] = None,
) -> int:
    """`ftrun plan`: size the job for --gpus, else this machine's GPUs, else the recipe's box:, else this CPU
    machine; exit 0 when it fits. With --json, stdout is JSON whatever happens: the plan, the plan that does
    not fit (fits: false, with its reasons and options), or {"fits": null, "error": ...}."""
    try:
        return _plan_command(recipe_path, overrides, gpus, tokens, as_json, price)
    except PlanError as exc:
        if not as_json or getattr(exc, "plan", None) is None:
            raise
        print(json.dumps(exc.plan.to_dict(), indent=2))
        return exc.exit_code
    except FtrunError as exc:
        if not as_json:
            raise
        print(json.dumps({"fits": None, "error": exc.kind, "message": exc.message, "fix": exc.fix}, indent=2))
        return exc.exit_code


def _ask_the_hub_once(recipe, sources, read_data: bool) -> Optional[str]:
    """Why the Hub did not answer one short request, when the plan would ask it (then offline: launcher/hub_access.py);
    None when it answered, nothing would ask it, or it is off by setting."""
    from launcher import hub_access

    asks = not Path(recipe.model).expanduser().is_dir() or (read_data and not all(s.local for s in sources))
    if not asks or hub_access.offline_reason():
        return None
    return hub_access.probe()


def _plan_command(
    recipe_path: str,
    overrides: list[str],
    gpus: Optional[str],
    tokens: Optional[str],
    as_json: bool,
    price: Optional[float],
) -> int:
    import importlib.util

    from launcher.plan import this_box
    from launcher.plan.plan import make_plan as plan_job
    from launcher.plan.text import format_plan
    from launcher.recipe import parse_token_count

    recipe = load_recipe(recipe_path, overrides)
    check_trackers_installed(recipe)
    notes = []
    if recipe.sync.to and recipe.sync.to.startswith("hf://"):
        from huggingface_hub import get_token

        if not get_token():  # the copy would fail at its first upload, after the smoke test spent GPU time
            raise RecipeError(
                f"sync.to={recipe.sync.to} is a Hugging Face repo, but no Hugging Face token is set on this box",
                fix="run `hf auth login`, or set HF_TOKEN to a token with write access "
                "(never in the recipe); or copy elsewhere (sync.to).",
            )
    if importlib.util.find_spec("trl") is not None:
        check_trainer_fields(recipe)  # an unknown trainer: field fails here, not after the smoke test started
    elif recipe.trainer:
        notes.append("trainer: fields not checked: trl is not installed here (pip install 'ftrun[train]')")
    count = parse_token_count(tokens, "--tokens") if tokens is not None else None
    stats = None
    from launcher.data.sources import sources_of

    sources = sources_of(recipe.data)
    unanswered = _ask_the_hub_once(recipe, sources, read_data=count is None)
    if unanswered:
        notes.append(
            f"planned offline: {unanswered}; the model's figures come from the built-in catalog or this "
            "machine's Hugging Face cache, the data's from this machine or the recipe's tokens"
        )
    if count is None:
        missing = [s.path for s in sources if s.local and not Path(s.path).exists()]
        if not missing:
            try:
                _, _, stats = data_stats(recipe)
                recipe = with_data_defaults(recipe, stats)  # what the data sized (GRPO's answer length)
            except DataError as exc:
                # a Hub dataset this machine cannot reach plans like a missing local file
                if recipe.tokens is None or all(s.local for s in sources):
                    raise
                count = recipe.tokens
                notes.append(
                    f"data not read here ({exc.message}): time and cost use the recipe's tokens: {recipe.tokens:,}"
                )
        elif recipe.tokens is not None:
            count = recipe.tokens
            notes.append(
                f"data {', '.join(missing)} is not on this machine: time and cost use the recipe's "
                f"tokens: {recipe.tokens:,}"
            )
        else:
            notes.append(
                f"data {', '.join(missing)} is not on this machine and no token count was given: memory "
                "is planned, time and cost are not; add `tokens: 15M` to the recipe or pass --tokens 15M"
            )
    smoke = None
    run = RunDir(Path(recipe.output_dir))
    if run.smoke.is_file() and gpus is None:  # this run's measurements, on the recipe as the smoke test adjusted it
        smoke = json.loads(run.smoke.read_text())
        recipe = with_adjustments(run, recipe)
    box, why = this_box.for_plan(gpus, recipe.box)
    blocked = None
    try:
        plan = plan_job(
            recipe,
            box,
            data_stats=stats,
            tokens=count,
            smoke=smoke,
            price=price,
            box_reason=why,
            tokens_from="--tokens" if tokens is not None else "the recipe's tokens:",
        )
    except MissingSoftware as exc:  # the job fits, but this box lacks what an output needs: the plan, then that
        if getattr(exc, "plan", None) is None or not exc.plan.fits:
            raise
        plan, blocked = exc.plan, exc
    plan.notes[:0] = notes
    if stats is not None and not as_json:
        print(f"data: {data_line(stats)}")
        if stats.loss_view:  # the example as the loss sees it (launcher/data/loss_view.py)
            print(format_loss_view(stats.loss_view, color=wants_color()))
    print(json.dumps(plan.to_dict(), indent=2) if as_json else format_plan(plan), flush=True)
    if blocked is not None:
        if as_json:
            return blocked.exit_code
        raise blocked
    return 0
