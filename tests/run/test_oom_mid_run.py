"""An out of memory in the middle of a run (launcher/run/oom_restart.py): where the plan chose the faster setting, the
supervisor undoes it and restarts from the last checkpoint on the same trajectory, and `ftrun status` says so; where
the recipe chose it, the run stops with the error and its fix. The worker's out of memory is raised by a hook these
tests put on PYTHONPATH (as tests/worker/test_memory.py does): the Trainer's training step raises
torch.OutOfMemoryError as step FTRUN_TEST_OOM_AT_STEP begins while the run trains without gradient checkpointing, as
a card whose kept activations do not fit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, RESUME_FIELDS
from helpers import assert_same_run, ftrun, read_state, status
from launcher.recipe_loading import load_recipe, validate_recipe
from launcher.run.adjustments import with_adjustments
from launcher.run.oom_restart import undo_step
from launcher.run.views import oom_fatal_reason, oom_restart_line
from launcher.store.rundir import RunDir

# late in the 30 steps (RESUME_FIELDS): the faster settings' steps are short, and a wall-clock checkpoint
# (checkpoint_every_minutes 0.01) must exist before the out of memory; at step 14 the first one was sometimes not
# written yet (seen on 2026-12-07 in 7 of 11 tries), and the restart began from the start
OOM_AT = RESUME_FIELDS["max_steps"] - 4

# sitecustomize.py for the runs' processes: once transformers.trainer is imported, its training step raises what the
# caching allocator raises on a card, at step FTRUN_TEST_OOM_AT_STEP, only without activation checkpointing (or, with
# FTRUN_TEST_OOM_ABOVE_MICRO_BATCH, only with a larger micro-batch)
OOM_HOOK = """
import importlib.abc
import importlib.machinery
import os
import sys


def _patch(module):
    original = module.Trainer.training_step

    def training_step(self, *args, **kwargs):
        at = int(os.environ.get("FTRUN_TEST_OOM_AT_STEP") or 0)
        above = os.environ.get("FTRUN_TEST_OOM_ABOVE_MICRO_BATCH")
        checkpointing = getattr(self.args, "activation_checkpointing", None)
        if checkpointing is None:
            checkpointing = self.args.gradient_checkpointing
        too_much = self.args.per_device_train_batch_size > int(above) if above else not checkpointing
        if too_much and self.state.global_step + 1 == at:
            import torch

            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 2.00 GiB (the test's stand-in at step {at})"
            )
        return original(self, *args, **kwargs)

    module.Trainer.training_step = training_step


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "transformers.trainer":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
"""


def _ftrun_oom(tmp_path, step: int, *args, **extra: str) -> subprocess.CompletedProcess:
    """`ftrun ARGS` whose worker runs out of memory at `step` without checkpointing (helpers.ftrun, with the hook's
    folder first on PYTHONPATH)."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(OOM_HOOK)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(hook), str(REPO)]),
        HF_HUB_OFFLINE="1",
        FTRUN_TEST_OOM_AT_STEP=str(step),
        **extra,
    )
    cmd = [sys.executable, "-m", "launcher.cli", *map(str, args)]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def _planned(recipe) -> None:
    """The run directory as the launch plans it (plan.json, recipe.yaml, state planned), no process started: the
    first half of `ftrun smoke` (launcher/run/pipeline.py prepare_only), in this process. These tests edit the plan
    before the run trains; a whole `ftrun smoke` ran a smoke test no assertion reads (the file's slow tests: 107.1
    CPU s with it, 73.6 without, 2026-12-06), and the recipes turn the smoke test off (as reference_run trains:
    smoke.enabled=false), so the launch trains at once."""
    from launcher.run.pipeline import prepare_only

    prepared = prepare_only(load_recipe(recipe), "planned by the test")[2]
    prepared[5].release()  # the run's lock, which the launch takes next


def _as_a_gpu_plan_chose(run) -> None:
    """plan.json and recipe.yaml as a launch on a GPU with room writes them (launcher/plan/speed.py: checkpointing off
    for a recipe that leaves it out); the CPU plan keeps the recipe's values, so the test sets what a GPU's would."""
    plan = json.loads((run / "plan.json").read_text())
    plan["speed"] = {
        "set": {"gradient_checkpointing": False},
        "from": {"gradient_checkpointing": True},
        "reasons": ["gradient checkpointing off (the recipe leaves it to the plan)"],
    }
    (run / "plan.json").write_text(json.dumps(plan))
    text = (run / "recipe.yaml").read_text()
    assert "gradient_checkpointing: true" in text
    (run / "recipe.yaml").write_text(text.replace("gradient_checkpointing: true", "gradient_checkpointing: false"))


@pytest.mark.slow  # two runs of the tiny model: the default tier stays under 6 minutes
def test_an_oom_after_the_plans_checkpointing_off_restarts_with_it_on_on_the_same_trajectory(
    write_recipe, tmp_path, reference_run
):
    # gradient_checkpointing left to the plan, as reference_run's
    recipe = write_recipe(**RESUME_FIELDS, smoke={"enabled": False})
    _planned(recipe)
    run = tmp_path / "run"
    _as_a_gpu_plan_chose(run)

    res = _ftrun_oom(tmp_path, OOM_AT, recipe, "--foreground")
    assert res.returncode == 0, res.stdout + res.stderr
    log = (run / "train.log").read_text()
    assert f"out of memory at step {OOM_AT}" in log and "Traceback" not in log
    resumed = re.search(r"resuming from step-(\d+)", log)
    assert resumed, log[-3000:]
    n = int(resumed.group(1))
    assert 0 < n < OOM_AT

    # the state: restarted once, not against max_restarts; the checkpoints before the undo stay this run's
    state = read_state(run)
    assert state["state"] == "succeeded" and state["restarts"] == 1
    assert state["last_end"] == {"kind": "out-of-memory", "step": OOM_AT, "world": 1}
    plan = json.loads((run / "plan.json").read_text())
    [adj] = plan["adjustments"]
    assert adj["set"] == {"gradient_checkpointing": True}
    assert adj["mid_run"]["oom_step"] == OOM_AT and adj["mid_run"]["resumes_from_step"] == n
    assert yaml.safe_load((run / "recipe.yaml").read_text())["gradient_checkpointing"] is True

    # status says it
    text = ftrun("status", run, cwd=tmp_path).stdout
    line = f"restarted at step {n} with activation checkpointing on after an out-of-memory at step {OOM_AT}"
    assert line in text, text
    assert status(run, tmp_path)["oom_restarts"][0]["set"] == {"gradient_checkpointing": True}

    # exact: every loss and the final adapter equal the uninterrupted run's (checkpointing on or off changes no value)
    assert_same_run(reference_run, run)

    # the planner's change is not the user's: the same command finds the finished run, not a changed recipe ...
    again = ftrun(recipe, cwd=tmp_path)
    assert again.returncode == 0 and "this run has finished" in again.stdout, again.stdout + again.stderr
    # ... and a resume of it would compare as the same trajectory (pipeline's check, as an interrupted run meets it)
    from launcher.run.pipeline import _check_same_trajectory

    _check_same_trajectory(RunDir(run), with_adjustments(RunDir(run), load_recipe(recipe)))


@pytest.mark.slow  # a run of the tiny model up to its out of memory
def test_an_oom_of_the_recipes_own_setting_stays_fatal_with_its_fix(write_recipe, tmp_path):
    recipe = write_recipe(**{**RESUME_FIELDS, "gradient_checkpointing": False})  # the user's choice
    res = _ftrun_oom(tmp_path, 3, recipe, "--foreground", "smoke.enabled=false")
    assert res.returncode == 5, res.stdout + res.stderr
    state = read_state(tmp_path / "run")
    assert state["state"] == "failed" and state.get("restarts", 0) == 0
    assert state["reason"].startswith("out of memory at step 3 (peak ")
    assert "lower micro_batch_size (raise gradient_accumulation_steps" in state["reason"]
    assert "Traceback" not in res.stderr


@pytest.mark.slow  # a run of the tiny model, restarted
def test_an_oom_after_the_plans_larger_micro_batch_restarts_with_the_recipes_and_the_same_examples(
    write_recipe, tmp_path, reference_run
):
    """The plan's micro-batch 8 x accumulation 1 (the reference run's shape) runs out; the recipe's 2 x 4 takes over
    from the last checkpoint: the same 8 examples per optimizer step, so the steps before it are the reference's bit
    for bit and the ones after equal it up to the summation order of the accumulated micro-batches."""
    import torch

    from helpers import adapter_tensors, metrics

    recipe = write_recipe(  # 2 x 4
        **RESUME_FIELDS, micro_batch_size=None, gradient_accumulation_steps=None, smoke={"enabled": False}
    )
    _planned(recipe)
    run = tmp_path / "run"
    plan = json.loads((run / "plan.json").read_text())
    assert (plan["micro_batch_size"], plan["gradient_accumulation_steps"]) == (2, 4)
    wide = {"micro_batch_size": 8, "gradient_accumulation_steps": 1}
    plan.update(speed={"set": wide, "from": {"micro_batch_size": 2, "gradient_accumulation_steps": 4}}, **wide)
    (run / "plan.json").write_text(json.dumps(plan))
    chosen = {**yaml.safe_load((run / "recipe.yaml").read_text()), **wide}
    (run / "recipe.yaml").write_text(yaml.safe_dump(chosen, sort_keys=False))

    res = _ftrun_oom(tmp_path, OOM_AT, recipe, "--foreground", FTRUN_TEST_OOM_ABOVE_MICRO_BATCH="2")
    assert res.returncode == 0, res.stdout + res.stderr
    n = int(re.search(r"resuming from step-(\d+)", (run / "train.log").read_text()).group(1))
    text = ftrun("status", run, cwd=tmp_path).stdout
    assert (
        f"restarted at step {n} with the recipe's micro-batch 2 x accumulation 4 after an out-of-memory at step "
        f"{OOM_AT} (the plan had chosen micro-batch 8 x accumulation 1 for speed" in text
    ), text
    assert json.loads((run / "plan.json").read_text())["micro_batch_size"] == 2
    ref, got = metrics(reference_run), metrics(run)
    assert [r["step"] for r in ref] == [r["step"] for r in got]
    assert [r["loss"] for r in ref[:n]] == [r["loss"] for r in got[:n]]
    for a, b in zip(ref[n:], got[n:]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)
    ta, tb = adapter_tensors(reference_run), adapter_tensors(run)
    assert all(torch.allclose(ta[k], tb[k], rtol=1e-3, atol=1e-5) for k in ta)


# --- the decision and its words, without processes --------------------------------------------------------------


def _recipe(tmp_path, **keys):
    base = {"model": "Qwen/Qwen3-8B", "method": "lora", "data": "train.jsonl", "output_dir": str(tmp_path / "run")}
    return validate_recipe({**base, **keys}, tmp_path, "r", source="test")


SPEED = {
    "set": {"gradient_checkpointing": False, "micro_batch_size": 8, "gradient_accumulation_steps": 1},
    "from": {"gradient_checkpointing": True, "micro_batch_size": 2, "gradient_accumulation_steps": 4},
}


def test_the_plans_settings_are_undone_checkpointing_first_then_the_micro_batch_then_none(tmp_path):
    plan = {"speed": SPEED}
    chosen = _recipe(tmp_path, gradient_checkpointing=False, micro_batch_size=8, gradient_accumulation_steps=1)
    assert undo_step(chosen, plan) == {"gradient_checkpointing": True}
    on = chosen.model_copy(update={"gradient_checkpointing": True})
    assert undo_step(on, plan) == {"micro_batch_size": 2, "gradient_accumulation_steps": 4}  # the same 8 a step
    back = on.model_copy(update={"micro_batch_size": 2, "gradient_accumulation_steps": 4})
    assert undo_step(back, plan) is None  # the recipe's own values ran out: fatal
    # the recipe's own checkpointing off (the plan chose nothing) is never undone
    assert undo_step(_recipe(tmp_path, gradient_checkpointing=False), {}) is None
    assert undo_step(_recipe(tmp_path, gradient_checkpointing=False), {"speed": None}) is None


def test_the_words_status_and_the_stop_use():
    fact = {
        "set": {"gradient_checkpointing": True},
        "from": {"gradient_checkpointing": False},
        "oom_step": 412,
        "resumes_from_step": 400,
    }
    assert oom_restart_line(fact).startswith(
        "restarted at step 400 with activation checkpointing on after an out-of-memory at step 412"
    )
    batch = {
        "set": {"micro_batch_size": 2, "gradient_accumulation_steps": 4},
        "from": {"micro_batch_size": 8, "gradient_accumulation_steps": 1},
        "oom_step": 9,
        "resumes_from_step": None,
    }
    assert oom_restart_line(batch).startswith(
        "restarted from the start with the recipe's micro-batch 2 x accumulation 4 after an out-of-memory at step 9"
    )
    stop = oom_fatal_reason("out of GPU memory at step 500 (peak 78.10 GB): CUDA out of memory", "lower it", [fact])
    assert stop.startswith("out of GPU memory at step 500 (peak 78.10 GB): CUDA out of memory; lower it. The plan's")
    assert "already undone: restarted at step 400 with activation checkpointing on" in stop
