"""hf://USER/REPO sync against the stand-in for the Hub in fake_hub.py (no hub is reachable here): the commit
model, retention that frees storage, 429 bursts and 5xx, verification from the Hub's listing, the token."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from launcher.store import checkpoint as ckpt
from launcher.errors import SyncError
from launcher.store.rundir import RunDir

hf = pytest.importorskip("huggingface_hub")

from fake_hub import LFS_ABOVE, FakeHub, hub_error  # noqa: E402 - after the importorskip


@pytest.fixture
def hub(tmp_path, monkeypatch):
    fake = FakeHub()
    monkeypatch.setattr(hf, "HfApi", lambda *a, **k: fake)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token_for_the_stand_in")
    return fake


def _run_with_checkpoint(root: Path, step: int) -> Path:
    run = RunDir(root)
    d = run.checkpoints / f"{ckpt.PREFIX}{step:06d}"
    d.mkdir(parents=True)
    (d / "adapter_model.safetensors").write_bytes(os.urandom(4096))  # LFS-sized
    (d / "trainer_state.json").write_text('{"global_step": %d}' % step)  # small: a git blob
    ckpt.write_manifest(d, step, {"recipe_hash": "abc"})
    run.recipe.write_text("model: a/b\n")
    return d


def test_hub_round_trip_verifies_without_downloading_and_keeps_the_newest(tmp_path, hub):
    from launcher.store.sync import destination, pull, push_checkpoint, push_metadata

    run = RunDir(tmp_path / "run")
    dest = destination("hf://me/runs/job1")
    for step in (10, 20):
        push_checkpoint(dest, run, _run_with_checkpoint(run.root, step), keep=1)
    push_metadata(dest, run)
    assert "hf_hub_download" not in hub.calls  # verified from the hashes the Hub reports
    assert hub.ls("job1/checkpoints") == ["step-000020"]  # keep: 1

    fresh = RunDir(tmp_path / "fresh-box")
    lines = []
    assert pull("hf://me/runs/job1", fresh, log=lines.append) == 20
    assert ckpt.verify(fresh.checkpoints / "step-000020")[0]
    assert fresh.recipe.read_text() == "model: a/b\n"
    assert not [p for p in fresh.checkpoints.rglob(".hf-get-*")]  # the download folders are gone


@pytest.mark.parametrize("victim", ["adapter_model.safetensors", "trainer_state.json"])
def test_hub_copy_that_differs_is_not_counted_as_off_the_box(tmp_path, hub, victim):
    """The Hub lists a file under other hashes than the sent one (an LFS sha256, a small file's git blob id):
    the copy does not count as off the box. (For LFS the sha256 is the id the upload was made under.)"""
    from launcher.store.sync import destination, push_checkpoint

    run = RunDir(tmp_path / "run")
    hub.mangle = lambda path, data: bytes([data[0] ^ 0xFF]) + data[1:] if path.endswith(victim) else data
    with pytest.raises(SyncError, match=f"{victim} differs from the manifest off the box"):
        push_checkpoint(destination("hf://me/runs"), run, _run_with_checkpoint(run.root, 10), keep=2)


def test_hub_upload_cut_short_is_not_counted_as_off_the_box(tmp_path, hub):
    from launcher.store.sync import destination, push_checkpoint

    run = RunDir(tmp_path / "run")
    hub.mangle = lambda path, data: data[:100] if path.endswith(".safetensors") else data
    with pytest.raises(SyncError, match="has 100 bytes off the box, manifest says 4096"):
        push_checkpoint(destination("hf://me/runs"), run, _run_with_checkpoint(run.root, 10), keep=2)


def test_hub_url_without_a_repo_is_a_clear_error(hub):
    from launcher.store.sync import destination

    with pytest.raises(SyncError, match="does not name a repo"):
        destination("hf://justme")


def test_hub_small_file_that_no_longer_matches_its_manifest_does_not_verify(tmp_path, hub):
    """The blob id proves the Hub holds the sent file; the sent file must also be the one the manifest names."""
    from launcher.store.sync import destination, push_checkpoint

    run = RunDir(tmp_path / "run")
    d = _run_with_checkpoint(run.root, 10)
    (d / "trainer_state.json").write_text('{"global_step": 99}')  # changed after the manifest was written
    with pytest.raises(SyncError, match="trainer_state.json differs from the manifest"):
        push_checkpoint(destination("hf://me/runs"), run, d, keep=2)


def test_hub_that_does_not_answer_is_an_error_not_a_missing_run(tmp_path, hub):
    """'Not reachable' must not read as 'no run there': the same command would start afresh over the copy."""
    from launcher.store.sync import destination, pull, push_metadata, remote_has_run

    run = RunDir(tmp_path / "run")
    _run_with_checkpoint(run.root, 10)
    push_metadata(destination("hf://me/runs"), run)
    assert remote_has_run("hf://me/runs") and not remote_has_run("hf://me/runs/other")
    hub.offline = True
    with pytest.raises(SyncError, match="cannot reach the Hub"):
        remote_has_run("hf://me/runs")
    with pytest.raises(SyncError, match="cannot reach the Hub"):
        pull("hf://me/runs", RunDir(tmp_path / "fresh"))


def test_hub_checkpoint_with_many_files_is_checked_in_batches(tmp_path, hub):
    from launcher.store.sync import destination, push_checkpoint

    run = RunDir(tmp_path / "run")
    d = run.checkpoints / f"{ckpt.PREFIX}{10:06d}"
    (d / "shards").mkdir(parents=True)
    for i in range(1200):  # per-rank shards of a large multi-node run
        (d / "shards" / f"rank{i:04d}.pt").write_bytes(b"%d" % i)
    ckpt.write_manifest(d, 10, {"recipe_hash": "abc"})
    assert push_checkpoint(destination("hf://me/runs"), run, d, keep=2) == 10
    assert hub.calls.count("get_paths_info") == 3


def test_a_fresh_box_fetches_a_run_lost_mid_run_from_the_hub(tmp_path, hub):
    """The flow of `ftrun RECIPE` on a new box: the run is found, the newest verified checkpoint and the
    metadata come back (no final/ yet: the machine was lost mid-run), the lost box's pids are dropped."""
    from launcher.run.sync_commands import _pull_if_remote_run
    from launcher.recipe_loading import validate_recipe
    from launcher.store.state import read_state, set_state
    from launcher.store.sync import destination, push_checkpoint, push_metadata

    old = RunDir(tmp_path / "old-box")
    dest = destination("hf://me/runs/job")
    for step in (10, 20):
        push_checkpoint(dest, old, _run_with_checkpoint(old.root, step), keep=2)
    set_state(old, "running", supervisor_pid=4242, worker_pid=4243)
    push_metadata(dest, old)

    recipe = validate_recipe(
        {
            "model": "a/b",
            "method": "lora",
            "data": "d.jsonl",
            "output_dir": str(tmp_path / "new-box"),
            "sync": {"to": "hf://me/runs/job"},
        },
        tmp_path,
        "r",
    )
    new = RunDir(tmp_path / "new-box")
    assert _pull_if_remote_run(new, recipe) is True
    assert sorted(p.name for p in new.checkpoints.iterdir()) == ["step-000020"]
    assert ckpt.verify(new.checkpoints / "step-000020")[0]
    state = read_state(new)
    assert state["supervisor_pid"] is None and state["worker_pid"] is None and "at step 20" in state["reason"]

    hub.offline = True  # a box that cannot reach the Hub refuses to start blind
    with pytest.raises(SyncError, match="cannot look for an earlier copy of this run"):
        _pull_if_remote_run(RunDir(tmp_path / "third-box"), recipe)


# --- the commit model, retention, rate limits -------------------------------------------------


def _syncer(run: RunDir, url: str = "hf://me/runs/job", keep: int = 1, log=None):
    from launcher.store.sync import Syncer

    return Syncer(run, url, keep=keep, log=log if log is not None else (lambda line: None))


def _lfs_of(step_dir: Path) -> set[str]:
    return {ckpt.sha256_file(p) for p in step_dir.rglob("*") if p.is_file() and p.stat().st_size > LFS_ABOVE}


def test_hub_each_checkpoint_is_one_commit_and_retention_frees_its_storage(tmp_path, hub):
    """A checkpoint arrives in one commit with its manifest (the stand-in refuses a manifest without its files);
    retention deletes the old ones in one commit and squashes the history, after which no commit references
    their LFS objects any more (deleting the folder alone left them referenced)."""
    run = RunDir(tmp_path / "run")
    syncer = _syncer(run, keep=1)
    steps = {}
    for step in (10, 20, 30):
        steps[step] = _run_with_checkpoint(run.root, step)
        assert syncer.sync_once()
        assert len(hub.commits_adding(f"job/checkpoints/step-{step:06d}/")) == 1
    assert [c["message"] for c in hub.commits_adding("job/checkpoints/step-000030/")] == [
        "ftrun: checkpoints/step-000030"
    ]
    assert set(hub.commits_adding("job/checkpoints/step-000030/")[0]["added"]) >= {
        f"job/checkpoints/step-000030/{n}" for n in ("adapter_model.safetensors", "trainer_state.json", "manifest.json")
    }
    assert hub.ls("job/checkpoints") == ["step-000030"]

    # the deletion commit alone freed nothing: the history still referenced the deleted checkpoint's objects
    assert len(hub.before_squash) == 2  # one squash per retention (at steps 20 and 30)
    assert _lfs_of(steps[10]) <= hub.before_squash[0] and _lfs_of(steps[20]) <= hub.before_squash[1]
    old = _lfs_of(steps[10]) | _lfs_of(steps[20])
    assert len(hub.commits) == 1 and not old & hub.lfs_referenced()  # squashed: the old objects are unreferenced
    assert _lfs_of(steps[30]) <= hub.lfs_referenced()


def test_hub_metadata_goes_only_when_changed_and_together(tmp_path, hub):
    run = RunDir(tmp_path / "run")
    _run_with_checkpoint(run.root, 10)
    run.metrics.write_text('{"step": 1, "loss": 2.0}\n')
    (run.root / "state.json").write_text('{"state": "running"}')
    syncer = _syncer(run)
    assert syncer.sync_once()

    def meta_commits():
        return [c for c in hub.commits if c["message"].startswith("ftrun: run metadata")]

    assert len(meta_commits()) == 1 and set(meta_commits()[0]["added"]) >= {
        "job/recipe.yaml",
        "job/metrics.jsonl",
        "job/state.json",
    }
    n = len(hub.calls)
    assert syncer.sync_once()
    assert len(hub.calls) == n  # nothing changed: not a single request

    with run.metrics.open("a") as fh:
        fh.write('{"step": 2, "loss": 1.9}\n')
    (run.root / "state.json").write_text('{"state": "succeeded"}')
    assert syncer.sync_once()
    assert len(meta_commits()) == 2 and sorted(meta_commits()[-1]["added"]) == ["job/metrics.jsonl", "job/state.json"]


def test_hub_metadata_commits_are_spaced_while_training_and_sent_at_the_end(tmp_path, hub):
    """While the copier runs, changed metadata goes at most every `metadata_every` seconds (commits are rate
    limited); the last copy sends what changed since, whatever the spacing."""
    from helpers import wait_for
    from launcher.store.sync import HubDestination

    run = RunDir(tmp_path / "run")
    _run_with_checkpoint(run.root, 10)
    run.metrics.write_text('{"step": 0, "loss": 1.0}\n')  # there before the first copy, which sends it
    syncer = _syncer(run).start(interval=0.02)
    try:
        wait_for(lambda: hub.commits_adding("job/metrics.jsonl"), 60, "the first copy")
        deadline = time.monotonic() + 1.5
        i = 1
        while time.monotonic() < deadline:  # a training that logs all the time
            with run.metrics.open("a") as fh:
                fh.write('{"step": %d, "loss": 1.0}\n' % i)
            i += 1
            time.sleep(0.01)
        # while the copier runs: the first copy only (counted before stop(), whose last pass sends unthrottled)
        assert len(hub.commits_adding("job/metrics.jsonl")) == 1
    finally:
        syncer.stop()
    assert HubDestination.metadata_every >= 60
    assert syncer.finish(final=False)
    assert len(hub.commits_adding("job/metrics.jsonl")) == 2  # the end sends what changed since, once
    assert hub.read("job/metrics.jsonl") == run.metrics.read_bytes()


def test_hub_429_burst_waits_as_asked_shows_it_in_status_and_loses_nothing(tmp_path, hub, monkeypatch):
    """The Hub answers a checkpoint's commit with three 429s (Retry-After: 30) and a 503: the copier waits what
    the Hub asks, `ftrun status` shows the wait while it lasts, and the checkpoint arrives once, in one
    commit; a fresh box gets it back verified."""
    from launcher.store.sync import HubDestination, pull, status_fields

    run = RunDir(tmp_path / "run")
    _run_with_checkpoint(run.root, 10)
    syncer = _syncer(run)
    assert syncer.sync_once()  # step 10 and the metadata are off the box
    d = run.checkpoints / "step-000020"
    shutil.copytree(run.checkpoints / "step-000010", d)
    (d / "adapter_model.safetensors").write_bytes(os.urandom(8192))
    ckpt.write_manifest(d, 20, {"recipe_hash": "abc"})

    hub.refuse("create_commit", 429, times=3, headers={"Retry-After": "30"})
    hub.refuse("create_commit", 503)
    waits, seen = [], []

    def sleep(seconds):  # the copier's wait: what status says at that moment
        waits.append(seconds)
        seen.append(status_fields(run))  # what `ftrun status` shows of the copy

    monkeypatch.setattr(HubDestination, "sleep", staticmethod(sleep))
    lines = []
    syncer.log = lines.append
    assert syncer.sync_once()

    assert waits[:3] == [30, 30, 30] and len(waits) == 4 and 0 < waits[3] <= 60
    assert all(s["sync_backoff"] for s in seen)
    assert "429" in seen[0]["sync_backoff"] and "Retry-After" in seen[0]["sync_backoff"]
    assert "try 2 of" in seen[0]["sync_backoff"] and 25 < seen[0]["sync_backoff_seconds"] <= 30
    assert "503" in seen[3]["sync_backoff"] and "backoff" in seen[3]["sync_backoff"]
    after = status_fields(run)
    assert after["sync_backoff"] is None and after["sync_retries"] == 4
    assert after["offbox_checkpoint"] == "step-000020" and after["sync_error"] is None
    assert sum("answered 429" in line for line in lines) == 3

    assert len(hub.commits_adding("job/checkpoints/step-000020/")) == 1
    fresh = RunDir(tmp_path / "fresh")
    assert pull("hf://me/runs/job", fresh, log=lambda line: None) == 20
    assert ckpt.verify(fresh.checkpoints / "step-000020")[0]


def test_hub_commit_whose_answer_is_lost_is_not_made_twice(tmp_path, hub, monkeypatch):
    """A 502 after the Hub applied the commit: before retrying, the copier finds the files there (sizes and
    hashes) and does not commit again."""
    from launcher.store.sync import HubDestination, destination, push_checkpoint

    monkeypatch.setattr(HubDestination, "sleep", staticmethod(lambda s: None))
    run = RunDir(tmp_path / "run")
    hub.refuse("create_commit", 502, landed=True)
    assert push_checkpoint(destination("hf://me/runs"), run, _run_with_checkpoint(run.root, 10), keep=2) == 10
    assert len(hub.commits_adding("checkpoints/step-000010/")) == 1 and hub.calls.count("create_commit") == 1


def _let_time_pass(run: RunDir) -> None:
    """The moment the Hub named has come (sync.json's wait ends now)."""
    state = json.loads((run.root / "sync.json").read_text())
    state["backoff"]["until"] = time.time() - 1
    (run.root / "sync.json").write_text(json.dumps(state))


def test_hub_that_keeps_refusing_is_an_error_the_copier_reports(tmp_path, hub, monkeypatch):
    from launcher.store.sync import HubDestination, status_fields

    monkeypatch.setattr(HubDestination, "sleep", staticmethod(lambda s: None))
    run = RunDir(tmp_path / "run")
    _run_with_checkpoint(run.root, 10)
    syncer = _syncer(run)
    hub.refuse("create_commit", 503, times=HubDestination.ATTEMPTS)
    assert not syncer.sync_once()
    fields = status_fields(run)
    assert "503" in fields["sync_error"] and fields["offbox_checkpoint"] is None
    assert fields["sync_retries"] == HubDestination.ATTEMPTS and "next try in" in fields["sync_backoff"]
    n = len(hub.calls)
    assert not syncer.sync_once() and len(hub.calls) == n  # nothing sent before the time it named
    _let_time_pass(run)
    assert syncer.sync_once()  # the next round, the Hub answers again
    assert status_fields(run)["offbox_checkpoint"] == "step-000010" and status_fields(run)["sync_backoff"] is None
    assert len(hub.commits_adding("job/checkpoints/step-000010/")) == 1


def test_hub_commit_limit_spent_for_the_hour_is_not_waited_for_here(tmp_path, hub, monkeypatch):
    """ "Retry in 43 minutes" (the commits-per-hour limit): no wait in the copier (a stop or the end of the run
    would be held for it); status shows when the next try is, and nothing goes to the Hub before then."""
    from launcher.store.sync import HubDestination, status_fields

    waits = []
    monkeypatch.setattr(HubDestination, "sleep", staticmethod(waits.append))
    run = RunDir(tmp_path / "run")
    _run_with_checkpoint(run.root, 10)
    syncer = _syncer(run)
    hub.refuse("create_commit", 429, headers={"Retry-After": str(43 * 60)})
    assert not syncer.sync_once()
    fields = status_fields(run)
    assert waits == [] and "429" in fields["sync_backoff"] and "next try in 2580 s" in fields["sync_backoff"]
    assert 2500 < fields["sync_backoff_seconds"] <= 2580
    assert not syncer.finish(final=False, attempts=1)  # the end of a run does not wait 43 minutes either
    assert hub.calls.count("create_commit") == 1
    _let_time_pass(run)
    assert syncer.sync_once() and len(hub.commits_adding("job/checkpoints/step-000010/")) == 1


def test_hub_retry_delay_follows_the_hub():
    from email.utils import formatdate

    from launcher.store.sync import hub_retry_delay

    assert hub_retry_delay({"Retry-After": "17"}, 1) == (17.0, "Retry-After")
    wait, source = hub_retry_delay({"retry-after": formatdate(time.time() + 90, usegmt=True)}, 1)
    assert source == "Retry-After" and 85 <= wait <= 91
    assert hub_retry_delay(
        {"RateLimit": '"api";r=0;t=55', "RateLimit-Policy": '"fixed window";"api";q=500;w=300'}, 1
    ) == (55.0, "RateLimit")
    assert hub_retry_delay({"RateLimit": '"api";r=3;t=55'}, 2) == (4.0, "backoff")  # not spent: not the reason
    assert hub_retry_delay({}, 3) == (8.0, "backoff") and hub_retry_delay({}, 12) == (300.0, "backoff")


def test_hub_token_comes_from_huggingface_hub(tmp_path, hub, monkeypatch):
    """HF_TOKEN, else the token `hf auth login` stored (huggingface_hub.get_token); none: a clear error."""
    import huggingface_hub.constants  # noqa: F401 - a lazy submodule

    from launcher.store.sync import destination

    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(hf.constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    with pytest.raises(SyncError, match="no Hugging Face token") as err:
        destination("hf://me/runs")
    assert "hf auth login" in err.value.render()
    (tmp_path / "token").write_text("hf_stored_by_login\n")
    assert destination("hf://me/runs").repo == "me/runs"


def test_hub_that_refuses_the_token_is_a_clear_error_before_anything_starts(tmp_path, hub, monkeypatch):
    from launcher.store.sync import destination

    def refuse(*args, **kwargs):
        raise hub_error(403, url="https://huggingface.co/api/repos/create")

    monkeypatch.setattr(hub, "create_repo", refuse)
    with pytest.raises(SyncError, match="refused to open or create the private repo me/runs") as err:
        destination("hf://me/runs")
    assert "hf auth whoami" in err.value.render()


# --- a real run -------------------------------------------------------------------------------


@pytest.mark.slow
def test_hub_machine_loss_during_a_429_burst_resumes_on_a_fresh_box_and_loses_nothing(
    tmp_path, tiny_model, reference_run
):
    """`ftrun` with sync.to=hf://, the stand-in shared with the run's processes: the first checkpoint's commit
    meets three 429s (Retry-After: 4), `ftrun status` shows the wait; the machine is lost (supervisor and worker
    killed, the run folder deleted) once the checkpoint is off the box; the same command on a "new box" fetches
    it from the Hub and ends with the uninterrupted run's losses and adapter. Every checkpoint arrived in exactly
    one commit, retention squashed the history, and the result and the metadata are on the Hub."""
    import signal
    import subprocess
    import sys

    from conftest import RESUME_FIELDS, recipe_file
    from fake_hub import install
    from helpers import (
        REPO,
        assert_same_run,
        freeze_worker,
        has_checkpoint,
        metrics,
        status,
        wait_for,
        wait_until_ended,
    )

    hub = FakeHub(tmp_path / "hub")
    hub.refuse("create_commit", 429, times=3, headers={"Retry-After": "4"}, message="checkpoints/")
    env = dict(
        os.environ,
        PYTHONPATH=f"{install(tmp_path / 'inject')}{os.pathsep}{REPO}",
        HF_HUB_OFFLINE="1",
        FTRUN_TEST_FAKE_HUB=str(tmp_path / "hub"),
        HF_TOKEN="hf_stand_in_token",
    )
    run = tmp_path / "run"
    recipe = recipe_file(
        tmp_path / "r.yaml",
        tiny_model,
        output_dir=run,
        sync={"to": "hf://me/runs/job", "every_seconds": 0.5, "keep": 2},
        **RESUME_FIELDS,
    )

    def launch():
        res = subprocess.run(
            [sys.executable, "-m", "launcher.cli", str(recipe), "smoke.enabled=false"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, res.stdout + res.stderr
        return res

    t0 = time.monotonic()
    launch()
    st = freeze_worker(run, has_checkpoint)  # the supervisor's copier goes on
    seen = wait_for(lambda: status(run, tmp_path)["sync_backoff"], 30, "status to show the wait for the Hub")
    assert seen.startswith('429 to "ftrun: checkpoints/step-') and "(Retry-After)" in seen, seen

    def synced():
        p = run / "sync.json"
        return json.loads(p.read_text()).get("synced_step") if p.is_file() else None

    synced_step = wait_for(synced, 60, "the checkpoint copied off the box")
    assert json.loads((run / "sync.json").read_text())["retries"] == 3
    for pid in (st["supervisor_pid"], st["worker_pid"]):  # the machine is gone, with its disk
        os.kill(pid, signal.SIGKILL)
    assert metrics(run)[-1]["step"] < RESUME_FIELDS["max_steps"], "the run ended before the machine was lost"
    shutil.rmtree(run)

    res = launch()  # the same command on a new box
    assert "fetching the newest verified checkpoint" in res.stdout, res.stdout
    wait_until_ended(run, tmp_path)
    assert "resuming from step-" in (run / "train.log").read_text()
    assert_same_run(reference_run, run)

    hub.reload()
    arrivals: dict[str, int] = {}
    for commit in hub.made:
        for step in {p.split("/")[2] for p in commit["added"] if p.startswith("job/checkpoints/")}:
            arrivals[step] = arrivals.get(step, 0) + 1
    assert arrivals.get(f"step-{synced_step:06d}") == 1 and set(arrivals.values()) == {1}, arrivals
    # keep: 2 of what arrived: the final step and the newest before it that the copier sent (it sends the newest
    # checkpoint of each pass, so which one that is depends on the box's speed: 29 on a quiet box, 21 seen busy)
    kept = hub.ls("job/checkpoints")
    assert len(kept) <= 2 and kept[-1] == f"step-{RESUME_FIELDS['max_steps']:06d}", kept
    assert kept == sorted(arrivals)[-len(kept) :]
    # the squash freed every checkpoint no longer kept: no commit of the history references one (metadata files
    # committed after the last squash keep their older versions in the history: kilobytes, not checkpoints)
    ckpt_lfs = {
        oid
        for c in hub.commits
        for path, (oid, lfs) in c["tree"].items()
        if lfs and path.startswith("job/checkpoints/")
    }
    assert len(hub.commits) < len(hub.made)
    assert ckpt_lfs <= {oid for path, (oid, lfs) in hub.head.items() if lfs and path.startswith("job/checkpoints/")}
    assert "job/final/adapter/adapter_model.safetensors" in hub.head
    assert hub.read("job/metrics.jsonl") == (run / "metrics.jsonl").read_bytes()
    s = status(run, tmp_path)
    assert s["offbox_checkpoint"] == f"step-{RESUME_FIELDS['max_steps']:06d}" and s["sync_backoff"] is None
    print(
        f"hub machine loss with a 429 burst: {len(hub.made)} commits, {len(arrivals)} checkpoints off the box, "
        f"{time.monotonic() - t0:.0f} s"
    )
