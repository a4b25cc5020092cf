"""init_from at a checkpoint of another run: the run trains from its own copy of it, pinned at launch, whatever the
parent's run deletes afterwards (its keep_checkpoints)."""

from __future__ import annotations

import shutil

import pytest
import yaml

from helpers import ftrun, wait_until_ended


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
