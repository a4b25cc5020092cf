"""`ftrun data RECIPE`: the data as the loss sees it, one marked example per source and the dataset's statistics."""

from __future__ import annotations

import json
from pathlib import Path

from launcher.errors import UsageError
from launcher.recipe_loading import load_recipe
from launcher.run.data_view import data_line, format_loss_view, wants_color


def data_command(recipe_path: str, overrides: list[str]) -> int:
    """Read and check the recipe's data as the launch does (a refusal is the same DataError, exit 2); without the
    data or the tokenizer on this machine, what the run kept at its launch (data.json)."""
    from launcher.data.sources import sources_of
    from launcher.data.stats import data_stats

    recipe = load_recipe(recipe_path, overrides)
    here = all(not s.local or Path(s.path).exists() for s in sources_of(recipe.data))
    record, line = None, None
    if here:
        _, _, stats = data_stats(recipe)
        record, line = stats.loss_view, data_line(stats)
    if record is None:  # what the launch kept
        kept = Path(recipe.output_dir) / "data.json"
        if kept.is_file():
            record = json.loads(kept.read_text()).get("loss_view")
    if record is None and line is None:
        raise UsageError(
            f"the data of {recipe_path} is not on this machine, and no run of it has kept its view",
            fix="run it where the data is, or launch the recipe once (the run keeps data.json).",
        )
    if line:
        print(f"data: {line}")
    print(format_loss_view(record, color=wants_color(), statistics=True, sampled=recipe.objective_row.generates))
    return 0
