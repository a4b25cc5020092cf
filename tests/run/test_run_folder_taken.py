"""Another recipe pointed at a run folder that is busy (a run in progress) or finished (issue 33): refused with the
keys that differ named, busy with the documented exit code, the run's files untouched. The same recipe again
still shows the run and exits 0 (tests/run/test_pipeline.py runs that end to end)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from helpers import ftrun
from launcher import cli
from launcher.errors import EXIT_BAD_INPUT, EXIT_BUSY
from launcher.recipe_loading import load_recipe
from launcher.store.rundir import RunDir
from launcher.store.state import RunLock, process_identity, set_state

BASE = {
    "model": "Qwen/Qwen3-8B",
    "method": "qlora",
    "data": "/nowhere/absent.jsonl",
    "max_steps": 20,
    "learning_rate": 1e-4,
    "lora": {"r": 16},
    "output_dir": "run",
}


def _recipe(path: Path, **fields) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({**BASE, **fields}))
    return path


def _run(tmp_path: Path, state: str) -> RunDir:
    """A run folder as a launch leaves it: the resolved recipe.yaml, a plan and the state."""
    first = _recipe(tmp_path / "first.yaml")
    run = RunDir(Path(load_recipe(first).output_dir))
    run.root.mkdir()
    run.recipe.write_text("# resolved by ftrun\n" + yaml.safe_dump(load_recipe(first).snapshot(), sort_keys=False))
    run.plan.write_text(json.dumps({"adjustments": []}))
    set_state(run, state, reason="test")
    return run


def _files(run: RunDir) -> dict:
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.root.rglob("*") if p.is_file() and p != run.lock}


def _launch(capsys, *argv) -> tuple[int, str]:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    text = out.out + out.err
    assert "Traceback" not in text and "internal error" not in text, text
    return rc, text


@pytest.fixture
def busy(tmp_path):
    """A run in progress: its lock held and this process recorded as its supervisor, as a live supervisor is."""
    run = _run(tmp_path, "planned")
    lock = RunLock(run).acquire()
    set_state(run, "running", supervisor_pid=os.getpid(), supervisor_proc=process_identity(os.getpid()))
    yield run
    lock.release()


@pytest.mark.parametrize(
    "fields, overrides, named",
    [
        ({"learning_rate": 2e-4}, [], ["learning_rate: run has 0.0001, recipe now says 0.0002"]),
        ({}, ["lora.r=8", "max_steps=30"], ["lora.r: run has 16, recipe now says 8", "max_steps: run has 20"]),
        ({"export": ["adapter", "gguf"]}, [], ["export: run has"]),
        ({"trainer": {"lr_scheduler_type": "linear"}}, [], ["trainer.lr_scheduler_type: run has None"]),
    ],
)
def test_another_recipe_on_a_busy_run_is_busy_with_the_differences_named(
    busy, tmp_path, capsys, fields, overrides, named
):
    before = _files(busy)
    second = _recipe(tmp_path / "second" / "r.yaml", output_dir=str(busy.root), **fields)
    rc, text = _launch(capsys, str(second), *overrides)
    assert rc == EXIT_BUSY, text
    assert "ftrun: busy:" in text and f"{busy.root} is busy: a run is in progress there" in text
    assert all(n in text for n in named), text
    assert "output_dir" in text and "ftrun stop" in text  # the ways out
    assert _files(busy) == before


def test_the_same_recipe_on_a_busy_run_shows_it(busy, tmp_path, capsys):
    rc, text = _launch(capsys, str(tmp_path / "first.yaml"))
    assert rc == 0 and "already active" in text and "differs" not in text


@pytest.mark.parametrize("state", ["succeeded", "trained-not-exported"])
@pytest.mark.parametrize(
    "fields, overrides, named",
    [
        ({"learning_rate": 3e-4}, [], ["learning_rate: run has 0.0001, recipe now says 0.0003"]),
        ({}, ["seed=7"], ["seed: run has 42, recipe now says 7"]),
        (
            {"method": "lora", "lora": {"r": 16, "alpha": 64}},
            [],
            ["method: run has 'qlora', recipe now says 'lora'", "lora.alpha: run has 16, recipe now says 64"],
        ),
    ],
)
def test_another_recipe_on_a_finished_run_names_the_keys_that_differ(tmp_path, capsys, state, fields, overrides, named):
    run = _run(tmp_path, state)
    before = _files(run)
    second = _recipe(tmp_path / "second" / "r.yaml", output_dir=str(run.root), **fields)
    rc, text = _launch(capsys, str(second), *overrides)
    assert rc == EXIT_BAD_INPUT, text
    assert f"{run.root} holds a finished run, and this recipe differs from it" in text
    assert all(n in text for n in named), text
    assert "--fresh" in text and "output_dir" in text
    assert _files(run) == before


def test_only_another_export_on_a_finished_run_points_at_ftrun_export(tmp_path, capsys):
    run = _run(tmp_path, "succeeded")
    rc, text = _launch(capsys, str(tmp_path / "first.yaml"), "export=[adapter,gguf]", "gguf_type=q8_0")
    assert rc == EXIT_BAD_INPUT and "export: run has" in text and "gguf_type: run has" in text, text
    assert f"`ftrun export {run.root} --merged` or `--gguf TYPE`" in text


def test_the_same_recipe_on_a_finished_run_says_so_and_exits_0(tmp_path, capsys):
    run = _run(tmp_path, "succeeded")
    before = _files(run)
    rc, text = _launch(capsys, str(tmp_path / "first.yaml"))
    assert rc == 0 and "this run has finished" in text and "differs" not in text, text
    assert _files(run) == before


def test_the_smoke_tests_adjustments_are_the_runs_not_a_difference(tmp_path, capsys):
    run = _run(tmp_path, "succeeded")
    adjusted = load_recipe(tmp_path / "first.yaml").model_copy(
        update={"micro_batch_size": 1, "gradient_accumulation_steps": 8}
    )
    run.recipe.write_text(yaml.safe_dump(adjusted.snapshot(), sort_keys=False))
    run.plan.write_text(
        json.dumps(
            {
                "adjustments": [
                    {"set": {"micro_batch_size": 1, "gradient_accumulation_steps": 8}, "reason": "out of memory"}
                ]
            }
        )
    )
    rc, text = _launch(capsys, str(tmp_path / "first.yaml"))
    assert rc == 0 and "this run has finished" in text, text


def test_a_busy_run_through_the_real_command(busy, tmp_path):
    second = _recipe(tmp_path / "second" / "r.yaml", output_dir=str(busy.root), max_steps=40)
    res = ftrun(second, cwd=tmp_path)
    assert res.returncode == EXIT_BUSY and "Traceback" not in res.stdout + res.stderr
    assert "max_steps: run has 20, recipe now says 40" in res.stderr


def test_two_recipes_of_one_name_share_runs_name_and_the_second_is_told(tmp_path, capsys, monkeypatch):
    """a/r.yaml and b/r.yaml without output_dir both default to ./runs/r: the second one is named, not dropped."""
    monkeypatch.chdir(tmp_path)
    first = _recipe(tmp_path / "a" / "r.yaml", output_dir=None)
    first.write_text(yaml.safe_dump({k: v for k, v in {**BASE, "data": "train.jsonl"}.items() if k != "output_dir"}))
    second = tmp_path / "b" / "r.yaml"
    second.parent.mkdir()
    second.write_text(first.read_text())
    run = RunDir(tmp_path / "runs" / "r")
    run.root.mkdir(parents=True)
    run.recipe.write_text(yaml.safe_dump(load_recipe(first).snapshot()))
    set_state(run, "succeeded", reason="test")
    rc, text = _launch(capsys, str(second))
    assert rc == EXIT_BAD_INPUT and f"- data: run has '{tmp_path / 'a' / 'train.jsonl'}'" in text, text


@pytest.mark.parametrize(
    "overrides",
    [
        ["smoke.enabled=false"],
        ["box=1xH100-80GB", "tokens=15M"],
        ["resume=true", "auto_adjust=[]", "price_per_hour_eur=2.5"],
    ],
)
def test_keys_that_only_decide_how_a_run_starts_are_no_difference(busy, tmp_path, capsys, overrides):
    rc, text = _launch(capsys, str(tmp_path / "first.yaml"), *overrides)
    assert rc == 0 and "already active" in text and "differs" not in text, text
