"""`ftrun logs` after a run, whichever way it was started: the foreground run keeps its train.log as a detached one."""

from __future__ import annotations

import pytest

from helpers import ftrun


@pytest.mark.slow
def test_a_foreground_run_keeps_its_log(write_recipe, tmp_path):
    recipe = write_recipe(max_steps=4, checkpoint_every_minutes=5)
    res = ftrun(recipe, "--foreground", "smoke.enabled=false", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # the terminal still sees the supervisor's and the worker's lines as they come
    assert "[ftrun worker] step 4/4" in res.stdout and "[ftrun supervisor" in res.stdout
    logs = ftrun("logs", tmp_path / "run", cwd=tmp_path)
    assert logs.returncode == 0 and "no log yet" not in logs.stdout
    assert "[ftrun worker] step 4/4" in logs.stdout, logs.stdout
    assert "training finished" in logs.stdout and "starting worker" in logs.stdout
