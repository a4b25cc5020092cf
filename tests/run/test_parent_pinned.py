"""init_from at a checkpoint of another run: the run trains from its own copy of it, pinned at launch, whatever the
parent's run deletes afterwards (its keep_checkpoints), and its resume trains on from that copy once the source is
gone."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from helpers import ftrun, stand_in_adapter, wait_until_ended
from launcher.errors import RecipeError
from launcher.recipe_loading import load_recipe
from launcher.run import parent, pipeline
from launcher.store.rundir import RunDir


def test_a_resume_whose_parent_is_gone_trains_on_from_the_runs_copy(write_recipe, tmp_path):
    source = stand_in_adapter(tmp_path / "sft")
    path = write_recipe("child.yaml", output_dir=str(tmp_path / "child"), init_from=str(source), lora=None)
    recipe = load_recipe(path)
    run = RunDir(Path(recipe.output_dir))
    run.root.mkdir()
    snapshot = {**recipe.snapshot(), "init_from": parent.pin(run, recipe.init_from)}  # as the launch records it
    run.recipe.write_text(yaml.safe_dump(snapshot, sort_keys=False))
    shutil.rmtree(source)  # the parent run moved or deleted while this one was interrupted
    again = load_recipe(path)
    assert again.init_from == str(run.root / "parent" / "sft")
    assert pipeline._recipe_differences(run, again) == {}  # the same command resumes, no "recipe differs"
    assert parent.pin(run, again.init_from) == again.init_from and run.pinned_parent()["init_from"] == str(source)
    with pytest.raises(RecipeError, match="does not exist"):  # a run without a copy still names the missing folder
        load_recipe(path, [f"output_dir={tmp_path / 'other'}"])


@pytest.mark.slow
def test_a_parent_checkpoint_deleted_after_the_launch_still_trains(write_recipe, tmp_path):
    parent = write_recipe(
        "parent.yaml", output_dir=str(tmp_path / "parent"), max_steps=4, checkpoint_every_minutes=0.0001
    )
    res = ftrun(parent, "--foreground", "smoke.enabled=false", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    checkpoint = sorted((tmp_path / "parent" / "checkpoints").glob("step-*"))[0]
    child = write_recipe(
        "child.yaml", output_dir=str(tmp_path / "child"), max_steps=3, init_from=str(checkpoint), lora=None
    )
    res = ftrun(child, "smoke.enabled=false", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    shutil.rmtree(checkpoint)  # what the parent's keep_checkpoints does while that run trains on
    s = wait_until_ended(tmp_path / "child", tmp_path)
    assert s["state"] == "succeeded"
    run = tmp_path / "child"
    copy = yaml.safe_load((run / "recipe.yaml").read_text())["init_from"]
    assert copy == str(run / "parent" / checkpoint.name)
    text = ftrun("status", run, cwd=tmp_path).stdout
    assert "succeeded" in text and "exited with code" not in text, text
    shutil.rmtree(tmp_path / "parent")  # the parent run itself deleted: the finished child is still shown
    again = ftrun(child, cwd=tmp_path)
    assert again.returncode == 0 and "does not exist" not in again.stdout + again.stderr, again.stdout + again.stderr
    assert "holds no adapter any more; this run trains on from the copy it took at its launch" in again.stdout


def test_a_parent_checkpoint_deleted_during_the_launch_is_read_from_the_copy(write_recipe, tmp_path):
    """The parent still trains, and its keep_checkpoints deletes the checkpoint this run starts from between the pin
    (launcher/run/prepare.py _prepare) and the rest of the launch (the base model's scoring, the smoke test's replan,
    which writes recipe.yaml again): the launch goes on with the run's copy, not "internal error: ValueError: ...
    step-000022 does not exist"."""
    from launcher.run.prepare import _prepare, as_written, make_plan

    source = stand_in_adapter(tmp_path / "parent" / "checkpoints" / "step-000022")
    path = write_recipe("child.yaml", output_dir=str(tmp_path / "child"), init_from=str(source), lora=None)
    recipe = load_recipe(path)
    run = RunDir(Path(recipe.output_dir))
    examples, lengths, stats, plan, plan_dict, lock, sha = _prepare(run, recipe, resuming=False, fresh=False)
    lock.release()
    shutil.rmtree(source)  # the parent's retention, while this launch goes on
    with pytest.raises(ValueError, match="step-000022 does not exist"):
        make_plan(recipe, stats)  # the recipe as loaded names the source
    written = as_written(run, recipe, stats, plan)
    assert written.init_from == str(run.root / "parent" / "step-000022")
    assert make_plan(written, stats).to_dict()["fits"]  # the smoke test's replan
    assert yaml.safe_load(run.recipe.read_text())["init_from"] == written.snapshot()["init_from"]
