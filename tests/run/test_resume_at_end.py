"""A worker that dies after the schedule's last checkpoint, before it ends, is restarted from that checkpoint: the
restart writes the final result and trains nothing more (the Trainer's loop would otherwise train one step past
the schedule, at learning rate 0: transformers checks should_training_stop only after a step)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from helpers import adapter_tensors, ftrun, metrics


@pytest.mark.slow  # a long end-to-end run: the default tier stays under 6 minutes
def test_a_restart_from_the_last_steps_checkpoint_writes_the_final_result_and_trains_nothing(write_recipe, tmp_path):
    recipe = write_recipe(max_steps=4, checkpoint_every_minutes=60, smoke={"enabled": False}, export=[])
    res = ftrun(recipe, "--foreground", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    run = tmp_path / "run"
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]
    assert (run / "checkpoints" / "step-000004" / "manifest.json").is_file()
    before = adapter_tensors(run)
    shutil.rmtree(run / "final")  # as if the worker had died between its last checkpoint and its final save

    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    worker = subprocess.run(
        [sys.executable, "-m", "launcher.worker.train", "--run-dir", str(run), "--mode", "full"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert worker.returncode == 0, worker.stdout[-3000:] + worker.stderr[-3000:]
    assert "is the last step (4) of the schedule: nothing left to train" in worker.stdout
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]  # no step 5
    assert not (run / "checkpoints" / "step-000005").exists()
    after = adapter_tensors(run)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
