"""report_to: wandb (offline), mlflow (a local file store) and trackio (local) with the tiny model; an absent package
refused at the plan and the launch with the install line; the tracked run continued, not duplicated, after a kill -9
of the worker; only rank 0 reporting under DDP."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path

import pytest

from launcher.worker import trackers
from launcher.errors import RecipeError
from launcher.recipe_loading import validate_recipe

TRACKER_ENV = (
    "WANDB_RUN_ID",
    "WANDB_RESUME",
    "WANDB_PROJECT",
    "WANDB_DIR",
    "WANDB_MODE",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_RUN_ID",
    "MLFLOW_ALLOW_FILE_STORE",
    "TENSORBOARD_LOGGING_DIR",
)


@pytest.fixture
def clean_env(monkeypatch):
    for name in TRACKER_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _recipe(tmp_path, **fields):
    raw = {"model": "a/b", "method": "lora", "data": "d.jsonl", "output_dir": str(tmp_path / "run"), **fields}
    return validate_recipe(raw, tmp_path, "r")


def test_report_to_defaults_to_tensorboard_and_refuses_unknown_trackers(tmp_path):
    assert _recipe(tmp_path).report_to == ["tensorboard"]
    assert _recipe(tmp_path, report_to=[]).report_to == []
    with pytest.raises(RecipeError, match="report_to"):
        _recipe(tmp_path, report_to=["wandb", "comet"])
    with pytest.raises(RecipeError, match="trainer.report_to -> report_to"):  # one surface for one setting
        _recipe(tmp_path, trainer={"report_to": ["wandb"]})


def test_absent_tracker_is_refused_at_plan_and_launch_with_the_install_line(
    tmp_path, write_recipe, monkeypatch, capsys
):
    from launcher.cli import main

    monkeypatch.setattr(trackers, "_installed", lambda tracker: tracker == "tensorboard")
    recipe = write_recipe(report_to=["tensorboard", "wandb", "mlflow"])
    for argv in (["plan", str(recipe)], [str(recipe)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "report_to names wandb, mlflow, but they are not installed" in err, err
        assert "pip install wandb mlflow-skinny" in err and "ftrun[trackers]" in err
    assert not (tmp_path / "run").exists()  # refused before the run directory, the smoke test, any GPU time
    monkeypatch.setattr(trackers, "_installed", lambda tracker: tracker != "tensorboard")
    trackers.check_installed(validate_recipe({"model": "a/b", "method": "lora", "data": "d"}, tmp_path, "r"))


def test_wandb_without_a_login_is_refused_at_the_launch(tmp_path, clean_env):
    """Online wandb needs a login; without one wandb.init would fail in the detached worker at every restart."""
    pytest.importorskip("wandb")  # the trackers extra (pyproject); without it the install line comes first
    recipe = _recipe(tmp_path, report_to=["wandb"])
    for name in ("WANDB_API_KEY", "NETRC", "WANDB_CONFIG_DIR"):
        clean_env.delenv(name, raising=False)
    clean_env.setenv("HOME", str(tmp_path))
    trackers.check_installed(recipe)  # the plan may be made on another machine than the run
    with pytest.raises(RecipeError, match="no W&B login") as err:
        trackers.check_installed(recipe, launching=True)
    assert "wandb login" in err.value.render() and "WANDB_MODE=offline" in err.value.render()
    clean_env.setenv("WANDB_MODE", "offline")
    trackers.check_installed(recipe, launching=True)
    clean_env.delenv("WANDB_MODE")
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    trackers.check_installed(recipe, launching=True)  # what `wandb login` writes


def test_the_tracked_run_keeps_its_ids_across_worker_starts(tmp_path, clean_env):
    clean_env.setattr(trackers, "_installed", lambda tracker: True)  # ids and environment only: no tracker starts
    run = tmp_path / "run"
    run.mkdir()
    recipe = _recipe(tmp_path, report_to=["tensorboard", "wandb", "mlflow", "trackio"])
    assert trackers.prepare(run, recipe, "smoke", 0) == (["none"], {})  # the smoke test reports nothing
    assert trackers.prepare(run, recipe, "full", 1) == (["none"], {})  # only the main process reports
    report_to, fields = trackers.prepare(run, recipe, "full", 0)
    assert report_to == ["tensorboard", "wandb", "mlflow", "trackio"]
    assert fields["run_name"].startswith("run-") and fields["project"] == "ftrun"
    first = {k: os.environ.get(k) for k in TRACKER_ENV}
    assert first["WANDB_RESUME"] == "allow" and first["WANDB_DIR"] == str(run) and len(first["WANDB_RUN_ID"]) == 8
    assert first["MLFLOW_TRACKING_URI"] == (run / "mlruns").resolve().as_uri() and first["MLFLOW_RUN_ID"] is None
    assert first["MLFLOW_ALLOW_FILE_STORE"] == "true"
    # what MLflow's start_run made, recorded by the callback after it
    ids = trackers.load_ids(run)
    ids["mlflow"] = {"run_id": "0123abcd", "tracking_uri": first["MLFLOW_TRACKING_URI"]}
    (run / trackers.TRACKERS_FILE).write_text(json.dumps(ids))

    for name in TRACKER_ENV:  # a new worker process (a restart, a resume on another day)
        clean_env.delenv(name, raising=False)
    time.sleep(1.1)  # a name made again now would differ
    _, again = trackers.prepare(run, recipe, "full", 0)
    assert again["run_name"] == fields["run_name"]
    assert os.environ["WANDB_RUN_ID"] == first["WANDB_RUN_ID"] and os.environ["MLFLOW_RUN_ID"] == "0123abcd"

    # a run fetched onto a new box: its checkpoints carry the file
    ckpt = run / "checkpoints" / "step-000010"
    ckpt.mkdir(parents=True)
    trackers.into_checkpoint(run, ckpt)
    other = tmp_path / "other"
    other.mkdir()
    trackers.restore_from_checkpoint(other, ckpt)
    assert trackers.load_ids(other) == trackers.load_ids(run)


def test_names_set_by_the_user_are_kept(tmp_path, clean_env):
    clean_env.setattr(trackers, "_installed", lambda tracker: True)  # ids and environment only: no tracker starts
    run = tmp_path / "run"
    run.mkdir()
    clean_env.setenv("WANDB_RUN_ID", "mine1234")
    clean_env.setenv("WANDB_PROJECT", "support-bot")
    recipe = _recipe(tmp_path, report_to=["wandb", "trackio"], trainer={"run_name": "exp-7", "project": "bots"})
    report_to, fields = trackers.prepare(run, recipe, "full", 0)
    assert fields == {}  # trainer: run_name and project pass through as the user wrote them
    ids = trackers.load_ids(run)
    assert ids["wandb"]["id"] == "mine1234" and ids["wandb"]["project"] == "support-bot"
    assert ids["trackio"] == {"project": "bots", "name": "exp-7"}


# ---------------------------------------------------------------------------------------------
# Real runs of the tiny model (slow tier)


def _tracker_env(tmp_path: Path) -> dict[str, str]:
    return {
        "WANDB_MODE": "offline",
        "MLFLOW_TRACKING_URI": f"file:{tmp_path / 'mlruns'}",
        "TRACKIO_DIR": str(tmp_path / "trackio"),
        "WANDB_SILENT": "true",
    }


def _mlflow_runs(tmp_path: Path) -> list[dict]:
    """Every run in the file store: its id and the steps it has a train loss for."""
    out = []
    for meta in (tmp_path / "mlruns").glob("*/*/meta.yaml"):
        loss = meta.parent / "metrics" / "loss"
        steps = sorted(int(line.split()[2]) for line in loss.read_text().splitlines()) if loss.is_file() else []
        out.append(
            {
                "id": meta.parent.name,
                "steps": steps,
                "params": sorted(p.name for p in (meta.parent / "params").iterdir()),
            }
        )
    return out


def _wandb_runs(run: Path) -> dict[str, list[str]]:
    """{run id: offline run folders}: wandb writes a folder per process start, named ...-<run id>."""
    out: dict[str, list[str]] = {}
    for folder in sorted((run / "wandb").glob("offline-run-*")):
        out.setdefault(folder.name.rsplit("-", 1)[1], []).append(folder.name)
    return out


def _trackio_runs(tmp_path: Path) -> dict[str, list[int]]:
    """{run id: steps logged} in the local Trackio project."""
    db = sqlite3.connect(tmp_path / "trackio" / "ftrun.db")
    out: dict[str, list[int]] = {}
    for run_id, metrics in db.execute("SELECT run_id, metrics FROM metrics"):
        step = json.loads(metrics).get("train/global_step")
        if step is not None:
            out.setdefault(run_id, []).append(step)
    return out


def _kill_rank_0_after_a_checkpoint(run: Path, max_steps: int, timeout: float = 240) -> int:
    """SIGKILL the main process (the one that reports) of a 2-process run once a checkpoint exists and steps remain:
    both ranks are held (SIGSTOP) while that is checked, and run in slices once they train, whatever the
    machine's speed. Returns the last logged step."""
    import psutil

    from helpers import has_checkpoint, is_training, metrics, read_state

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        launcher = read_state(run).get("worker_pid") if (run / "state.json").is_file() else None
        try:
            ranks = (
                [p for p in psutil.Process(launcher).children() if "launcher.worker.train" in " ".join(p.cmdline())]
                if launcher
                else []
            )
            if len(ranks) == 2:
                for p in ranks:
                    p.suspend()
                if has_checkpoint(run) and (run / "metrics.jsonl").is_file():
                    step = metrics(run)[-1]["step"]
                    # a step still to train besides the one in flight: the kill lands in training, not in the final save
                    assert step < max_steps - 1, "the run ended before its main process could be killed"
                    rank0 = next(p for p in ranks if p.environ().get("RANK") == "0")
                    rank0.kill()
                    for p in ranks:
                        if p is not rank0:
                            p.resume()
                    return step
                for p in ranks:
                    p.resume()
                if is_training(run):  # in slices, frozen between (helpers.run_in_slices): the wall-clock
                    time.sleep(0.01)  # checkpoint comes after a few steps on a fast box too
                    for p in ranks:
                        p.suspend()
        except psutil.Error:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for a checkpoint to kill rank 0 after")


@pytest.mark.slow
def test_trackers_continue_the_same_run_after_a_kill_9_and_only_rank_0_reports(tmp_path, tiny_model):
    """2 DDP processes report to all four trackers; rank 0, the one that reports, is killed with SIGKILL after a
    checkpoint; the supervisor restarts the launch from it. One tracked run each, continued, from rank 0 only."""
    from conftest import recipe_file
    from helpers import ftrun, wait_until_ended

    for package in ("wandb", "mlflow", "trackio"):  # the trackers extra (pyproject)
        pytest.importorskip(package)
    t0 = time.monotonic()
    run = tmp_path / "run"
    steps = 16  # steps left after the first checkpoint on a fast box too (8 were done before the kill landed once)
    recipe = recipe_file(
        tmp_path / "r.yaml",
        tiny_model,
        output_dir=run,
        max_steps=steps,
        micro_batch_size=4,
        keep_checkpoints=1,
        engine="ddp",
        num_processes=2,
        report_to=["tensorboard", "wandb", "mlflow", "trackio"],
        smoke={"enabled": False},
    )
    res = ftrun(recipe, cwd=tmp_path, env=_tracker_env(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    _kill_rank_0_after_a_checkpoint(run, steps)
    wait_until_ended(run, tmp_path)
    log = (run / "train.log").read_text()
    assert (
        "from the newest verified checkpoint" in log and "resuming from step-" in log
    )  # the supervisor's restart line
    ids = json.loads((run / "trackers.json").read_text())

    wandb = _wandb_runs(run)  # two launches, one run: `wandb sync` sends both folders to run <id>
    assert list(wandb) == [ids["wandb"]["id"]] and len(wandb[ids["wandb"]["id"]]) == 2, wandb

    mlflow = _mlflow_runs(tmp_path)
    assert [r["id"] for r in mlflow] == [ids["mlflow"]["run_id"]], mlflow
    assert mlflow[0]["steps"][0] == 1 and mlflow[0]["steps"][-1] == steps
    assert "ftrun.lora.r" in mlflow[0]["params"] and "learning_rate" in mlflow[0]["params"]  # recipe + trainer args
    assert log.count("mlflow: started run") == 1 and log.count("mlflow: continuing run " + ids["mlflow"]["run_id"]) == 1

    trackio = _trackio_runs(tmp_path)
    assert len(trackio) == 1 and max(next(iter(trackio.values()))) == steps, trackio
    db = sqlite3.connect(tmp_path / "trackio" / "ftrun.db")
    config = json.loads(db.execute("SELECT config FROM configs").fetchone()[0])
    assert config["ftrun_recipe"]["report_to"] == ["tensorboard", "wandb", "mlflow", "trackio"]
    assert list((run / "tensorboard").rglob("events.out.tfevents.*"))
    print(f"trackers: 2-process run with a kill -9 of rank 0 in {time.monotonic() - t0:.0f} s")


@pytest.mark.slow
def test_the_task_scores_are_summary_metrics_of_each_tracked_run(tmp_path, tiny_model):
    """The task evaluation's scores (the base model's, the fine-tuned model's after training, the merged folder's
    from the export's own process) reach the same tracked run of every tracker: W&B's summary, MLflow's metrics,
    Trackio's log, TensorBoard's scalars."""
    from conftest import recipe_file
    from helpers import ftrun

    for package in ("wandb", "mlflow", "trackio"):
        pytest.importorskip(package)
    run = tmp_path / "run"
    recipe = recipe_file(
        tmp_path / "r.yaml",
        tiny_model,
        output_dir=run,
        max_steps=4,
        export=["adapter", "merged"],
        report_to=["tensorboard", "wandb", "mlflow", "trackio"],
        smoke={"enabled": False},
        eval={"fraction": 0.05, "samples": 0, "task": {"examples": 10, "shots": 1}},
    )
    res = ftrun(recipe, "--foreground", cwd=tmp_path, env=_tracker_env(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    scores = json.loads((run / "final" / "task_eval.json").read_text())["scores"]
    assert {"base_zero_shot", "base_few_shot", "fine_tuned", "merged"} <= set(scores)
    ids = json.loads((run / "trackers.json").read_text())

    mlruns = [m.parent for m in (tmp_path / "mlruns").glob("*/*/meta.yaml")]
    assert [m.name for m in mlruns] == [ids["mlflow"]["run_id"]]
    for name in ("fine_tuned", "merged", "base_few_shot"):
        line = (mlruns[0] / "metrics" / "task" / name).read_text().split()
        assert float(line[1]) == pytest.approx(scores[name]), name

    # offline, W&B keeps a run's records (its summary updates among them) in the folder's run-<id>.wandb file,
    # which `wandb sync` sends; wandb 0.31 ships no reader for it, so the keys are looked for in its bytes
    folders = sorted((run / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(f.name.endswith(ids["wandb"]["id"]) for f in folders)  # the export reopened it
    records = [b"".join(p.read_bytes() for p in f.glob("run-*.wandb")) for f in folders]
    assert b"task/fine_tuned" in records[0] and b"task/merged" in records[1]

    db = sqlite3.connect(tmp_path / "trackio" / "ftrun.db")
    logged = {}
    for (metrics,) in db.execute("SELECT metrics FROM metrics"):
        logged.update({k: v for k, v in json.loads(metrics).items() if k.startswith("task/")})
    assert logged["task/fine_tuned"] == pytest.approx(scores["fine_tuned"]) and "task/merged" in logged
    assert len({r for (r,) in db.execute("SELECT run_id FROM metrics")}) == 1

    events = b"".join(p.read_bytes() for p in (run / "tensorboard").rglob("events.out.tfevents.*"))
    assert b"task/fine_tuned" in events and b"task/merged" in events
