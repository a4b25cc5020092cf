"""Which run directory a command means: the recipe's output_dir, a run named on the command line, the only one."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from launcher.errors import UsageError
from launcher.recipe import Recipe
from launcher.recipe_loading import load_recipe
from launcher.store.rundir import RUNS, RunDir


def run_dir_of(recipe: Recipe) -> RunDir:
    """The recipe's run directory; an output_dir that names a file is a usage error, before anything runs."""
    root = Path(recipe.output_dir)
    if root.exists() and not root.is_dir():
        raise UsageError(
            f"output_dir {root} is a file, not a folder",
            fix="set output_dir to a folder (recipe or `output_dir=...`), e.g. runs/<name>; ftrun creates it.",
        )
    return RunDir(root)


def resolve_run(target: Optional[str], overrides: list[str] | None = None, command: str = "status") -> RunDir:
    """A run directory from a recipe path or a run directory (default: the only run under ./RUNS)."""
    if target is None:
        folder = Path.cwd() / RUNS
        runs = sorted(p for p in folder.glob("*") if (p / "recipe.yaml").is_file()) if folder.is_dir() else []
        if len(runs) == 1:
            return RunDir(runs[0])
        if not runs:
            raise UsageError(
                f"no runs under ./{RUNS} (the folder ftrun looks in when no run is named)",
                fix=f"start one with `ftrun RECIPE`, or name a recipe or run directory: "
                f"`ftrun {command} recipes/tiny-cpu.yaml`.",
            )
        raise UsageError(
            f"no run given and {len(runs)} runs are under ./{RUNS}",
            fix=f"name the recipe or the run directory, e.g. `ftrun {command} {RUNS}/{runs[0].name}` "
            "(`ftrun status` lists them).",
        )
    p = Path(target)
    if p.is_dir():
        if not (p / "recipe.yaml").is_file():
            raise UsageError(
                f"{p} is not an ftrun run directory (no recipe.yaml)",
                fix="give the run's output_dir or its recipe file.",
            )
        return RunDir(p.resolve())
    if p.is_file():
        return run_dir_of(load_recipe(p, overrides))
    raise UsageError(
        f"'{target}' is neither a recipe file nor a run directory",
        fix="give the recipe you started the run with, or its output_dir.",
    )
