"""The init_from adapter pinned into the run directory at launch: what was planned is what trains.

A parent still training deletes and rewrites its adapters: the run copies it once into RUN/parent/<source name>/, and
parent.json records the source, so the user's recipe compares equal to the run's own on resume.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from launcher.errors import RecipeError
from launcher.recipe import parent_adapter
from launcher.store.checkpoint import atomic_write_json
from launcher.store.rundir import RunDir


def pin(run: RunDir, init_from: str) -> str:
    """Copy the adapter `init_from` names into the run (once); returns the copy's path, recipe.yaml's init_from."""
    held = run.pinned_parent()
    if held and init_from in (held["init_from"], held["copy"]):  # the copy itself: the source has gone since
        return held["copy"]
    source = parent_adapter(init_from)
    dest = run.root / "parent" / Path(init_from).name
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(source, tmp)
    except (OSError, shutil.Error) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RecipeError(
            f"init_from: {source} went away while ftrun copied it into the run ({exc})",
            fix="a checkpoint of a run that is still training is deleted when newer ones come (its keep_checkpoints): "
            "give its newest checkpoint folder, or let that run finish and give its run directory",
        ) from None
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    atomic_write_json(run.parent_record, {"init_from": init_from, "source": str(source), "copy": str(dest)})
    return str(dest)


def as_given(run: RunDir, snapshot: dict[str, Any]) -> dict[str, Any]:
    """The run's recipe snapshot with init_from as the user's recipe gives it (the source, not the pinned copy)."""
    held = run.pinned_parent()
    if held and snapshot.get("init_from") == held["copy"]:
        return {**snapshot, "init_from": held["init_from"]}
    return snapshot
