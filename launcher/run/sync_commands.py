"""The run's copy at sync.to, fetched onto this box (`ftrun pull`) or brought up to date now (`ftrun push`)."""

from __future__ import annotations

from typing import Optional

from launcher.errors import RecipeError, SyncError, UsageError
from launcher.recipe import Recipe
from launcher.recipe_loading import load_recipe
from launcher.run.facts import run_status
from launcher.run.prepare import _say
from launcher.run.run_dirs import resolve_run, run_dir_of
from launcher.run.views import format_status
from launcher.store.rundir import RunDir
from launcher.store.state import RunLock, RunSnapshot, move
from launcher.store.sync import Syncer, pull, remote_has_run
from launcher.store.sync import kinds as sync_kinds


def _pull_if_remote_run(run: RunDir, recipe: Recipe) -> bool:
    """A fresh box with an empty output_dir: fetch the run from `sync.to` when it holds one."""
    try:
        found = remote_has_run(recipe.sync.to)
    except SyncError as exc:
        # a run that cannot reach its off-box copy must not start blind: it may be a lost box's resume
        raise SyncError(
            f"cannot look for an earlier copy of this run at sync.to={recipe.sync.to}: {exc.message}",
            fix="check that the destination is reachable from this box (for SSH: `ssh HOST true` with "
            "your ~/.ssh/config), or remove sync.to to train without an off-box copy.",
        ) from None
    if not found:
        return False
    if run.root.exists() and any(run.root.iterdir()):
        raise UsageError(
            f"{recipe.sync.to} holds this run, but output_dir {run.root} is not empty and is not an ftrun run",
            fix="empty that folder or choose another output_dir, then run the same command to fetch and resume.",
        )
    _say(f"{run.root} is empty on this box, {recipe.sync.to} holds the run: fetching the newest verified checkpoint")
    lock = RunLock(run).acquire()
    try:
        step = pull(recipe.sync.to, run, log=_say)
        data = RunSnapshot(run).state  # as fetched: its pids belong to the lost box
        if data:
            lost = ("supervisor_pid", "worker_pid", "supervisor_proc", "worker_proc", "launcher_proc")
            fetched = f"fetched from {recipe.sync.to}" + (f" at step {step}" if step is not None else "")
            move(run, "note", **dict.fromkeys(lost), reason=fetched)
    finally:
        lock.release()
    return True


def pull_command(recipe_path: str, overrides: list[str]) -> int:
    """`ftrun pull RECIPE`: fetch the run from sync.to without resuming it."""
    recipe = load_recipe(recipe_path, overrides)
    if not recipe.sync.to:
        raise RecipeError(
            "the recipe has no sync.to, so there is nothing to pull from",
            fix=f"set sync: {{to: ...}} in the recipe, one of: {sync_kinds.forms()}.",
        )
    run = run_dir_of(recipe)
    if run.exists():
        raise UsageError(
            f"{run.root} already holds a run; pulling would overwrite it",
            fix="choose an empty output_dir (output_dir=...) to fetch a copy.",
        )
    if not _pull_if_remote_run(run, recipe):
        raise UsageError(
            f"{recipe.sync.to} holds no ftrun run (no recipe.yaml there)",
            fix="check sync.to; a run copies itself there once its first checkpoint exists.",
        )
    _say(format_status(run_status(run)))
    return 0


def push_command(target: Optional[str]) -> int:
    """`ftrun push RUN`: copy the newest checkpoint, the final result and the metadata off the box now."""
    run = resolve_run(target)
    recipe = load_recipe(run.recipe)
    if not recipe.sync.to:
        raise RecipeError("the run's recipe has no sync.to", fix="set sync: {to: ...} in the recipe.")
    syncer = Syncer(run, recipe.sync.to, recipe.sync.keep, log=_say)
    if not syncer.sync_once(final=run.final.is_dir()):
        raise UsageError(f"the copy to {recipe.sync.to} failed (see above)", fix="check the destination and retry.")
    _say(f"{run.root}: copied to {recipe.sync.to} and verified")
    return 0
