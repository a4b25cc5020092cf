"""Checkpoint hashing off the critical path: parallel digests, the manifest written last by a background thread,
the waits before the next save and before exit, and one verification per disk handed to the other processes."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO
from launcher import checkpoint as ckpt


def _files(folder: Path, sizes: dict[str, int]) -> dict[str, bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    data = {}
    for name, size in sizes.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        data[name] = os.urandom(size)
        (folder / name).write_bytes(data[name])
    return data


def _complete(root: Path, step: int, meta=None) -> Path:
    d = root / ckpt.step_dir_name(step)
    _files(d, {"adapter_model.safetensors": 3000 + step, "optimizer.pt": 5000, "rng_state.pth": 100})
    ckpt.write_manifest(d, step, meta or {"recipe_hash": "abc"})
    return d


@pytest.fixture
def gated_hash(monkeypatch):
    """Once armed, sha256_file blocks until the test opens the gate: a hash that is visibly still running."""
    gate, started = threading.Event(), threading.Event()
    real = ckpt.sha256_file

    def slow(path: Path) -> str:
        if ".sync-" not in str(path) and "offbox" not in str(path):  # the sync's own copies hash freely
            started.set()
            assert gate.wait(30), "the test never opened the gate"
        return real(path)

    return SimpleNamespace(gate=gate, started=started, arm=lambda: monkeypatch.setattr(ckpt, "sha256_file", slow))


def test_parallel_hashing_gives_the_sequential_digests_and_verification_still_catches_a_flipped_byte(tmp_path):
    # around the read size (8 MiB), empty, small, nested: every way a file splits into reads
    sizes = {"empty": 0, "one": 1, "small.json": 2047, "edge.bin": 8 << 20, "big.bin": (8 << 20) + 12345,
             "sub/dir/shard-00001.safetensors": 3 << 20}
    data = _files(tmp_path / "c", sizes)
    paths = [tmp_path / "c" / name for name in sizes]
    expected = [hashlib.sha256(data[name]).hexdigest() for name in sizes]
    assert [ckpt.sha256_file(p) for p in paths] == expected
    assert ckpt.sha256_files(paths, workers=1) == expected
    assert ckpt.sha256_files(paths, workers=4, fsync=True) == expected  # order kept, largest hashed first
    assert ckpt.sha256_files([], workers=4) == []

    manifest = ckpt.write_manifest(tmp_path / "c", 7, {"recipe_hash": "abc"}, workers=3)
    assert {k: v["sha256"] for k, v in manifest["files"].items()} == dict(zip(sizes, expected))
    assert ckpt.verify(tmp_path / "c", workers=3)[0]
    raw = bytearray(data["big.bin"])
    raw[-1] ^= 1  # same size: only the hash can tell
    (tmp_path / "c" / "big.bin").write_bytes(raw)
    ok, why = ckpt.verify(tmp_path / "c", workers=3)
    assert ok is None and why == "big.bin does not match its sha256"


def test_background_manifest_is_written_last_and_retention_and_sync_wait_for_it(tmp_path, gated_hash):
    from launcher.rundir import RunDir
    from launcher.sync import Syncer

    run = RunDir(tmp_path / "run")
    root = run.checkpoints
    older = _complete(root, 10)
    newer = root / ckpt.step_dir_name(20)
    _files(newer, {"adapter_model.safetensors": 4000, "optimizer.pt": 6000})
    seen = []
    gated_hash.arm()
    bg = ckpt.BackgroundManifest(log=seen.append)
    bg.start(newer, 20, {"recipe_hash": "abc"}, then=lambda: seen.append(ckpt.retain(root, keep=1)), workers=2)
    assert gated_hash.started.wait(10)
    # hashing: the new folder is not a checkpoint yet; the older one is still the newest complete one
    assert bg.pending and not bg.wait(timeout=0.2)
    assert not (newer / ckpt.MANIFEST).exists()
    assert ckpt.newest_step_unverified(root) == 10 and older.is_dir()
    # the sync copies the newest complete checkpoint, not the one being hashed
    assert Syncer(run, str(tmp_path / "offbox"), keep=2, log=seen.append).sync_once()
    assert sorted(p.name for p in (tmp_path / "offbox" / "checkpoints").iterdir()) == ["step-000010"]
    seen.clear()
    with pytest.raises(RuntimeError, match="wait"):
        bg.start(newer, 20, {})  # one at a time
    gated_hash.gate.set()
    assert bg.wait(timeout=30) and not bg.pending
    assert seen == [["step-000010"]] and bg.error is None and bg.seconds is not None
    ok, _ = ckpt.verify(newer)
    assert ok and ok.step == 20 and not older.exists()
    # the manifest is the newest file of the folder: nothing was written after it claimed completeness
    assert max(p.stat().st_mtime_ns for p in newer.iterdir()) == (newer / ckpt.MANIFEST).stat().st_mtime_ns


def test_a_manifest_that_cannot_be_written_leaves_the_folder_incomplete(tmp_path, monkeypatch):
    d = tmp_path / "checkpoints" / ckpt.step_dir_name(5)
    _files(d, {"a.bin": 10})

    def disk_full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "atomic_write_json", disk_full)
    lines, ran = [], []
    bg = ckpt.BackgroundManifest(log=lines.append)
    bg.start(d, 5, {}, then=lambda: ran.append(1))
    assert bg.wait(timeout=30)
    assert bg.error and "No space left" in bg.error and not ran  # no retention after a failed manifest
    assert not (d / ckpt.MANIFEST).exists() and "removed as incomplete at the next start" in lines[0]
    assert ckpt.remove_incomplete(tmp_path / "checkpoints") == ["step-000005"]


_HASH_THEN_EXIT = """
import os, sys, time
from pathlib import Path
from launcher import checkpoint as ckpt
real = ckpt.sha256_file
def slow(path):
    sys.stdout.write("hashing\\n")  # one write: never interleaved with the main thread's line
    sys.stdout.flush()
    time.sleep(float(sys.argv[2]))
    return real(path)
ckpt.sha256_file = slow
bg = ckpt.BackgroundManifest()
bg.start(Path(sys.argv[1]), 30, {"recipe_hash": "abc"}, workers=1)
sys.stdout.write("started\\n")
sys.stdout.flush()
"""


def _script(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_kill9_during_background_hashing_leaves_no_checkpoint_and_the_older_one_resumes(tmp_path):
    root = tmp_path / "checkpoints"
    _complete(root, 20)
    d = root / ckpt.step_dir_name(30)
    _files(d, {"adapter_model.safetensors": 1000})
    proc = subprocess.Popen([sys.executable, str(_script(tmp_path, "h.py", _HASH_THEN_EXIT)), str(d), "60"],
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # until the manifest is being hashed: kill -9 then
            if line.strip() == "hashing":
                break
        else:
            pytest.fail(f"the hashing process ended early: {proc.wait()}")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    assert not (d / ckpt.MANIFEST).exists()
    assert ckpt.remove_incomplete(root) == ["step-000030"]  # the next start
    found, skipped = ckpt.newest_verified(root, {"recipe_hash": "abc"})
    assert found and found.step == 20 and skipped == []


def test_a_process_that_returns_while_hashing_still_writes_the_manifest_before_it_exits(tmp_path):
    d = tmp_path / ckpt.step_dir_name(30)
    _files(d, {"adapter_model.safetensors": 1000})
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, str(_script(tmp_path, "h.py", _HASH_THEN_EXIT)), str(d), "1.5"],
                         cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert "started" in res.stdout and time.monotonic() - t0 >= 1.5
    assert ckpt.verify(d)[0]


def _cadence(tmp_path, monkeypatch, mode: str):
    from launcher import train
    from launcher.rundir import RunDir

    monkeypatch.setattr(train, "_redraw_loss_plot", lambda *a, **k: None)  # loss.png is not what is tested
    run = RunDir(tmp_path / "run")
    run.checkpoints.mkdir(parents=True)
    recipe = SimpleNamespace(checkpoint_every_minutes=10.0, keep_checkpoints=1)
    cadence, _ = train.build_callbacks(run, recipe, mode, "cpu", {"recipe_hash": "abc"}, None)
    return train, run, cadence


def _state(step: int, max_steps: int = 100):
    from transformers import TrainerState

    return TrainerState(global_step=step, max_steps=max_steps, is_world_process_zero=True,
                        is_local_process_zero=True)


def test_the_save_returns_while_hashing_and_the_next_save_and_the_exit_wait_for_it(tmp_path, monkeypatch, gated_hash):
    from transformers import TrainerControl

    train, run, cadence = _cadence(tmp_path, monkeypatch, "full")
    args = SimpleNamespace(output_dir=str(run.checkpoints), save_on_each_node=False)
    gated_hash.arm()
    _files(run.checkpoints / "checkpoint-10", {"adapter_model.safetensors": 2000, "optimizer.pt": 3000})
    cadence.on_save(args, _state(10), TrainerControl())  # returns at once: the training goes on
    step10 = run.checkpoints / "step-000010"
    assert step10.is_dir() and not (run.checkpoints / "checkpoint-10").exists()
    assert gated_hash.started.wait(10) and train._MANIFEST.pending and not (step10 / ckpt.MANIFEST).exists()

    # the next save waits for the previous manifest (and its retention) before its folder appears
    _files(run.checkpoints / "checkpoint-20", {"adapter_model.safetensors": 2000, "optimizer.pt": 3000})
    second = threading.Thread(target=cadence.on_save, args=(args, _state(20), TrainerControl()))
    second.start()
    time.sleep(0.5)
    assert second.is_alive() and (run.checkpoints / "checkpoint-20").is_dir()
    gated_hash.gate.set()
    second.join(30)
    assert (step10 / ckpt.MANIFEST).is_file()
    train._await_manifest("cpu")  # the worker's exit: no process group here, a plain wait
    assert not train._MANIFEST.pending
    ok, _ = ckpt.verify(run.checkpoints / "step-000020")
    assert ok and ok.step == 20
    assert not step10.exists()  # keep_checkpoints=1, removed only after step 20 was complete


def test_the_smoke_tests_timed_save_includes_hashing(tmp_path, monkeypatch):
    from transformers import TrainerControl

    real = ckpt.sha256_file

    def slow(path):
        time.sleep(0.3)
        return real(path)

    monkeypatch.setattr(ckpt, "sha256_file", slow)
    train, run, cadence = _cadence(tmp_path, monkeypatch, "smoke")
    out = tmp_path / "smoke-trainer"
    _files(out / "checkpoint-3", {"adapter_model.safetensors": 2000, "optimizer.pt": 3000})
    control = cadence.on_step_end(SimpleNamespace(), _state(3, max_steps=3), TrainerControl())
    assert control.should_save
    cadence.on_save(SimpleNamespace(output_dir=str(out), save_on_each_node=False), _state(3, 3), TrainerControl())
    assert ckpt.verify(out / "checkpoint-3")[0]  # hashed, in the foreground: nothing left pending
    assert not train._MANIFEST.pending
    assert cadence.save_seconds >= 0.3  # at least one file's (slowed) hash is inside the timed save


# --- verify once per disk: the handoff between two real processes ---------------------------------------------

_RANK = """
import json, os, sys, time
from pathlib import Path
from launcher import checkpoint as ckpt
from launcher import train
run, role = Path(sys.argv[1]), sys.argv[2]
if role == "verifier":
    time.sleep(float(sys.argv[3]))  # the waiter is already polling (and has seen the stale choice)
    found, skipped = ckpt.newest_verified(run / "checkpoints", {"recipe_hash": "abc"})
    ckpt.publish_choice(run / ckpt.CHOICE, train._launch_identity(), found, skipped)
    print(json.dumps({"step": found.step, "skipped": skipped}), flush=True)
else:
    def refuse(*a, **k):
        raise AssertionError("the waiter hashed checkpoint files")
    ckpt.sha256_files = refuse
    found = ckpt.await_choice(run / ckpt.CHOICE, run / "checkpoints", train._launch_identity(),
                              train._launcher_started(), timeout=float(sys.argv[3]))
    print(json.dumps({"step": found.step, "files": sorted(found.manifest["files"])}), flush=True)
"""

# A launcher like torchrun: starts both ranks with the same rendezvous identity, reports their output.
_LAUNCHER = """
import json, os, subprocess, sys
script, run = sys.argv[1], sys.argv[2]
env = dict(os.environ, TORCHELASTIC_RUN_ID="none", TORCHELASTIC_RESTART_COUNT="0", MASTER_ADDR="127.0.0.1",
           MASTER_PORT="29555", WORLD_SIZE="2")
procs = [subprocess.Popen([sys.executable, script, run, role, arg], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
         for role, arg in (("waiter", "60"), ("verifier", "1.0"))]
print(json.dumps([[p.wait(90), *p.communicate()] for p in procs]))
"""


def test_one_process_verifies_and_the_other_takes_its_choice_never_an_earlier_launchs(tmp_path):
    run = tmp_path / "run"
    root = run / "checkpoints"
    _complete(root, 10)
    bad = _complete(root, 20)
    (bad / "optimizer.pt").write_bytes(os.urandom(5000))  # same size, other bytes: torn the way only a hash sees
    # an earlier launch with the same static rendezvous id chose step 20 (then valid); it must not be taken
    ckpt.atomic_write_json(run / ckpt.CHOICE, {
        "launch": {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": "29555", "WORLD_SIZE": "2"},
        "written": time.time() - 5, "checkpoint": "step-000020", "step": 20,
        "manifest_sha256": ckpt.sha256_file(bad / ckpt.MANIFEST), "skipped": []})
    time.sleep(0.05)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, str(_script(tmp_path, "start.py", _LAUNCHER)),
                          str(_script(tmp_path, "rank.py", _RANK)), str(run)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    (wrc, wout, werr), (vrc, vout, verr) = json.loads(res.stdout)
    assert vrc == 0 and wrc == 0, werr + verr
    assert json.loads(vout) == {"step": 10, "skipped": ["step-000020: optimizer.pt does not match its sha256"]}
    assert json.loads(wout) == {"step": 10, "files": ["adapter_model.safetensors", "optimizer.pt", "rng_state.pth"]}


def test_a_waiter_gives_up_with_the_reason_and_never_takes_a_changed_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    d = _complete(root, 10)
    launch = {"TORCHELASTIC_RUN_ID": "x"}
    with pytest.raises(TimeoutError, match="local rank 0 when every node saves"):
        ckpt.await_choice(tmp_path / ckpt.CHOICE, root, launch, time.time(), timeout=0.3, poll=0.05)
    with pytest.raises(RuntimeError, match="stopped while waiting"):
        ckpt.await_choice(tmp_path / ckpt.CHOICE, root, launch, time.time(), timeout=30, cancelled=lambda: True)
    found, _ = ckpt.newest_verified(root)
    t = time.time()
    ckpt.publish_choice(tmp_path / ckpt.CHOICE, launch, found, [])
    assert ckpt.await_choice(tmp_path / ckpt.CHOICE, root, launch, t - 1, timeout=1).step == 10
    ckpt.publish_choice(tmp_path / ckpt.CHOICE, launch, None, ["step-000010: no manifest"])
    assert ckpt.await_choice(tmp_path / ckpt.CHOICE, root, launch, t - 1, timeout=1) is None  # start fresh
    ckpt.publish_choice(tmp_path / ckpt.CHOICE, launch, found, [])
    manifest = json.loads((d / ckpt.MANIFEST).read_text())
    manifest["step"] = 11
    (d / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(RuntimeError, match="changed after it was verified"):
        ckpt.await_choice(tmp_path / ckpt.CHOICE, root, launch, t - 1, timeout=1)
    assert ckpt.choice_timeout(root, rate=1000.0, floor=1.0) == pytest.approx(1.0 + sum(
        f["size"] for f in manifest["files"].values()) / 1000.0)


_TWO_RANKS = """
import json, os, sys, time
from pathlib import Path
import torch.distributed as dist
from launcher import checkpoint as ckpt
from launcher import train
dist.init_process_group("gloo")
folder = Path(sys.argv[1])
if dist.get_rank() == 0:
    real = ckpt.sha256_file
    def slow(path):
        time.sleep(8.0)  # longer than one round of the wait (5 s): several collectives
        return real(path)
    ckpt.sha256_file = slow
    train._MANIFEST.start(folder, 40, {"recipe_hash": "abc"}, workers=1)
train._await_manifest("cpu")
at_return = (folder / ckpt.MANIFEST).is_file()
# each node verified its own disk: the same step passes, different steps are refused on every rank
same = train._resume_steps_differ(ckpt.Verified(folder, 40, {}), "cpu")
differ = train._resume_steps_differ(ckpt.Verified(folder, 40, {}) if dist.get_rank() else None, "cpu")
(folder.parent / f"rank{dist.get_rank()}.json").write_text(json.dumps(
    {"rank": dist.get_rank(), "manifest_at_return": at_return, "same": same, "differ": differ}))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_no_rank_returns_before_rank_0s_background_manifest_and_resume_steps_must_agree(tmp_path):
    """Two gloo ranks under torchrun: rank 1 (nothing to hash) leaves the exit wait only once rank 0's manifest
    exists, so a rank that exits early (a stopped run exits 77) cannot make torchrun kill rank 0 mid-hash. And
    ranks whose disks chose different resume steps are stopped with the reason."""
    d = tmp_path / ckpt.step_dir_name(40)
    _files(d, {"adapter_model.safetensors": 1000})
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(_script(tmp_path, "ranks.py", _TWO_RANKS)), str(d)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["manifest_at_return"], r["same"]) for r in rows] == [(0, True, None), (1, True, None)]
    assert "oldest none, newest step-000040, this node none" in rows[0]["differ"]
    assert "this node step-000040" in rows[1]["differ"] and "(keep none)" in rows[1]["differ"]
    assert ckpt.verify(d)[0]
