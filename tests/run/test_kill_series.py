"""The kill series: one run, five `kill -9` of all its processes, one in each phase (the smoke test, a training
step, a checkpoint save, a checkpoint's upload, the export), each followed by the same command. The run ends
like the uninterrupted one: every logged loss and every tensor of the final adapter identical.

Each kill lands in its phase by construction: the run's process group is frozen (SIGSTOP) at short intervals,
the phase's marker is read while it is frozen (a log line, a folder, an object in the bucket, a state field), and
the kill comes while the marker holds; the random part (seeded) is which occurrence of the phase is hit. Phases
that last only milliseconds are made to last: a save is looked for with the group run in slices, an upload is held
by the S3 server at one of its objects (and looked for in slices, so that several checkpoints come before the end).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import pytest

from conftest import RESUME_FIELDS, recipe_file
from helpers import REPO, assert_same_run, ftrun, metrics, read_state, status, wait_for, wait_until_ended

pytestmark = pytest.mark.slow

BUCKET_PREFIX = "runs/kills"


def _frozen_when(
    group: Callable[[], Optional[int]],
    marker: Callable[[], bool],
    what: str,
    timeout: float = 240,
    run: Optional[Path] = None,
    slices: bool = False,
) -> int:
    """SIGSTOP the process group at short intervals until `marker()` holds while it is stopped; returns the
    group, still stopped. The marker is read only while nothing of the run moves, so the kill that follows
    lands in the phase the marker names.

    Between two looks the group runs 20 ms; with `slices` it runs 10 ms, then stays frozen 50 ms (as
    helpers.run_in_slices), so a phase that lasts a few ms of the run's time (a tiny checkpoint's save) spans
    several looks on any box. The smoke test is never run so: its measured speed plans the run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pgid = group()
        if pgid:
            try:
                os.killpg(pgid, signal.SIGSTOP)
            except ProcessLookupError:
                pgid = None
        if pgid:
            try:
                if marker():
                    return pgid
            except (OSError, ValueError):  # a file being replaced while read: not the moment
                pass
            os.killpg(pgid, signal.SIGCONT)
        time.sleep(0.01 if slices and pgid else 0.02)
        if slices and pgid:
            try:
                os.killpg(pgid, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            time.sleep(0.05)
    where = ""
    if run is not None and (run / "state.json").is_file():
        st = read_state(run)
        log = (run / "train.log").read_text(errors="replace")[-1500:] if (run / "train.log").is_file() else ""
        where = f"; the run is {st.get('state')!r}, its export {st.get('export')}; the end of its log:\n{log}"
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{where}")


def _kill(pgid: int) -> None:
    os.killpg(pgid, signal.SIGKILL)
    wait_for(lambda: not _group_alive(pgid), 30, f"process group {pgid} to die", 0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # zombies count as gone: their parent (this test, or init) reaps them
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def _supervisor_group(run: Path) -> Callable[[], Optional[int]]:
    def group() -> Optional[int]:
        st = read_state(run) if (run / "state.json").is_file() else {}
        # the supervisor runs in its own session (start_new_session): its group holds the worker and the export
        return st.get("supervisor_pid") if st.get("state") in ("running", "succeeded") else None

    return group


def _logged(run: Path) -> int:
    return len(metrics(run)) if (run / "metrics.jsonl").is_file() else 0


def test_five_kill9_one_in_each_phase_then_the_same_command_ends_like_the_uninterrupted_run(
    tmp_path, tiny_model, reference_run, s3_server
):  # noqa: F811
    import boto3

    rng = random.Random(16)
    run = tmp_path / "run"
    recipe = recipe_file(
        tmp_path / "r.yaml",
        tiny_model,
        output_dir=run,
        max_restarts=0,
        export=["merged"],
        sync={"to": f"s3://ftrun-test/{BUCKET_PREFIX}", "every_seconds": 0.3},
        **RESUME_FIELDS,
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", **s3_server.env)
    s3 = boto3.client("s3")
    t0 = time.monotonic()
    phases: list[str] = []

    def same_command() -> None:
        res = ftrun(recipe, cwd=tmp_path, env=s3_server.env)
        assert res.returncode == 0, res.stdout + res.stderr

    # 1. the smoke test: `ftrun RECIPE` runs it in the foreground, the launcher and its smoke worker are killed
    launcher = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", str(recipe)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    smoke_step = rng.randint(1, 2)
    smoke_log = run / "smoke" / "smoke.log"
    pgid = _frozen_when(
        lambda: launcher.pid if launcher.poll() is None else None,
        lambda: f"[ftrun worker] step {smoke_step}/" in smoke_log.read_text(),
        f"smoke step {smoke_step}",
    )
    _kill(pgid)
    launcher.wait()
    assert not (run / "smoke.json").is_file()
    phases.append(f"smoke test, after its step {smoke_step}")
    same_command()

    # 2. a training step: after a random number of further logged steps, not saving
    target = _logged(run) + rng.randint(2, 5)
    pgid = _frozen_when(
        _supervisor_group(run), lambda: _logged(run) >= target and not _saving(run), f"{target} logged steps"
    )
    _kill(pgid)
    phases.append(f"a step, {_logged(run)} logged")
    same_command()

    # 3. a save: the trainer writing checkpoint-N, or the background hashing of step-N (no manifest yet)
    saves = rng.randint(1, 3)
    seen: set[str] = set()

    def nth_save() -> bool:
        now = _saving(run)
        if now:
            seen.add(now)
        return bool(now) and len(seen) >= saves

    pgid = _frozen_when(_supervisor_group(run), nth_save, f"save number {saves}", run=run, slices=True)
    phases.append(f"a save ({_saving(run)})")
    _kill(pgid)
    same_command()

    # 4. a checkpoint's upload: its snapshot is being copied, some of its objects are in the bucket, its manifest
    # not. A tiny checkpoint's copy takes milliseconds, so the server holds the copy there, unanswered: its
    # `nth_put`-th object of the `uploads`-th checkpoint it is sent (the manifest comes last, after them all)
    uploads, nth_put = rng.randint(1, 2), rng.randint(2, 3)
    puts: dict[str, int] = {}
    ckpt_prefix = f"/ftrun-test/{BUCKET_PREFIX}/checkpoints/"

    def held_put(entry: dict) -> bool:
        if (
            entry["method"] != "PUT"
            or not entry["path"].startswith(ckpt_prefix)
            or entry["path"].endswith("/manifest.json")
        ):
            return False
        name = entry["path"][len(ckpt_prefix) :].split("/", 1)[0]
        puts[name] = puts.get(name, 0) + 1
        return len(puts) >= uploads and puts[name] == nth_put

    def nth_upload() -> bool:
        if not s3_server.requests.held.is_set():
            return False
        snap = next((p for p in (run / "checkpoints").glob(".sync-step-*")), None)
        assert snap is not None, "the server holds a checkpoint's object, but no upload snapshot is on the box"
        name = snap.name[len(".sync-") :]
        keys = [
            o["Key"]
            for o in s3.list_objects_v2(Bucket="ftrun-test", Prefix=f"{BUCKET_PREFIX}/checkpoints/{name}/").get(
                "Contents", []
            )
        ]
        assert keys and not any(k.endswith("/manifest.json") for k in keys), (name, keys)
        return True

    s3_server.requests.hold(held_put)
    # in slices too: the checkpoint cadence is wall-clock, so a fast box still makes several before training ends
    pgid = _frozen_when(_supervisor_group(run), nth_upload, f"upload number {uploads}", run=run, slices=True)
    held = next(e["path"] for e in s3_server.requests.entries if e.get("held"))
    phases.append(f"an upload (object {nth_put} of upload {uploads}: {held[len(ckpt_prefix) :]})")
    _kill(pgid)
    s3_server.requests.release()
    assert _logged(run) < RESUME_FIELDS["max_steps"], "training ended before the upload's kill"
    same_command()

    # 5. the export: after one of its progress lines
    export_lines = rng.randint(1, 2)

    def exporting() -> bool:
        st = read_state(run)
        log = (run / "train.log").read_text()
        return (st.get("export") or {}).get("state") == "running" and log[log.rfind("exporting: merged") :].count(
            "[ftrun export]"
        ) >= export_lines

    pgid = _frozen_when(_supervisor_group(run), exporting, f"{export_lines} export line(s)", run=run)
    phases.append(f"the export, after {export_lines} of its lines")
    _kill(pgid)
    same_command()
    wait_until_ended(run, tmp_path, timeout=300)
    seconds = time.monotonic() - t0

    assert_same_run(reference_run, run)  # every logged loss, every tensor of the adapter
    s = read_state(run)
    assert s["export"]["state"] == "succeeded", s["export"]
    report = json.loads((run / "final" / "export.json").read_text())
    assert report["ok"] and (run / "final" / "merged").is_dir()
    leftovers = [p.name for p in run.rglob(".*") if p.is_dir() and p.name != "smoke"]
    assert leftovers == [], leftovers  # no half-written export, no upload snapshot pinning old checkpoints
    off_box = status(run, tmp_path)
    assert off_box["offbox_checkpoint"] == f"step-{RESUME_FIELDS['max_steps']:06d}" and not off_box["sync_error"]
    assert s3.head_object(Bucket="ftrun-test", Key=f"{BUCKET_PREFIX}/final/merged/manifest.json")
    # every checkpoint's manifest went up once: a copy that completed is not sent again
    manifests = [
        e["path"]
        for e in s3_server.requests.entries
        if e["method"] == "PUT" and e["path"].endswith("/manifest.json") and "/checkpoints/" in e["path"]
    ]
    assert len(manifests) == len(set(manifests)), manifests
    print(f"kill series: {seconds:.0f} s; kills in: " + "; ".join(phases))


def _saving(run: Path) -> Optional[str]:
    """The checkpoint being written (the trainer's checkpoint-N) or hashed (step-N without its manifest)."""
    ckpts = run / "checkpoints"
    if not ckpts.is_dir():
        return None
    for p in ckpts.iterdir():
        if p.is_dir() and (
            p.name.startswith("checkpoint-") or (p.name.startswith("step-") and not (p / "manifest.json").is_file())
        ):
            return p.name
    return None
