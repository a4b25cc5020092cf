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
from launcher.store import checkpoint as ckpt


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
    sizes = {
        "empty": 0,
        "one": 1,
        "small.json": 2047,
        "edge.bin": 8 << 20,
        "big.bin": (8 << 20) + 12345,
        "sub/dir/shard-00001.safetensors": 3 << 20,
    }
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
    from launcher.store.rundir import RunDir
    from launcher.store.sync import Syncer

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
from launcher.store import checkpoint as ckpt
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
    proc = subprocess.Popen(
        [sys.executable, str(_script(tmp_path, "h.py", _HASH_THEN_EXIT)), str(d), "60"],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE,
        text=True,
    )
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
    res = subprocess.run(
        [sys.executable, str(_script(tmp_path, "h.py", _HASH_THEN_EXIT)), str(d), "1.5"],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "started" in res.stdout and time.monotonic() - t0 >= 1.5
    assert ckpt.verify(d)[0]


def _cadence(tmp_path, monkeypatch, mode: str):
    from launcher.worker import callbacks, checkpointing
    from launcher.store.rundir import RunDir

    monkeypatch.setattr(callbacks, "_redraw_loss_plot", lambda *a, **k: None)  # loss.png is not what is tested
    run = RunDir(tmp_path / "run")
    run.checkpoints.mkdir(parents=True)
    recipe = SimpleNamespace(checkpoint_every_minutes=10.0, keep_checkpoints=1)
    cadence, _ = callbacks.build_callbacks(run, recipe, mode, "cpu", {"recipe_hash": "abc"}, None)
    return checkpointing, run, cadence


def _state(step: int, max_steps: int = 100):
    from transformers import TrainerState

    return TrainerState(global_step=step, max_steps=max_steps, is_world_process_zero=True, is_local_process_zero=True)


def test_the_save_returns_while_hashing_and_the_next_save_and_the_exit_wait_for_it(tmp_path, monkeypatch, gated_hash):
    from transformers import TrainerControl

    checkpointing, run, cadence = _cadence(tmp_path, monkeypatch, "full")
    args = SimpleNamespace(output_dir=str(run.checkpoints), save_on_each_node=False)
    gated_hash.arm()
    _files(run.checkpoints / "checkpoint-10", {"adapter_model.safetensors": 2000, "optimizer.pt": 3000})
    cadence.on_save(args, _state(10), TrainerControl())  # returns at once: the training goes on
    step10 = run.checkpoints / "step-000010"
    assert step10.is_dir() and not (run.checkpoints / "checkpoint-10").exists()
    assert gated_hash.started.wait(10) and checkpointing._MANIFEST.pending and not (step10 / ckpt.MANIFEST).exists()

    # the next save waits for the previous manifest (and its retention) before its folder appears
    _files(run.checkpoints / "checkpoint-20", {"adapter_model.safetensors": 2000, "optimizer.pt": 3000})
    second = threading.Thread(target=cadence.on_save, args=(args, _state(20), TrainerControl()))
    second.start()
    time.sleep(0.5)
    assert second.is_alive() and (run.checkpoints / "checkpoint-20").is_dir()
    gated_hash.gate.set()
    second.join(30)
    assert (step10 / ckpt.MANIFEST).is_file()
    checkpointing._await_manifest("cpu")  # the worker's exit: no process group here, a plain wait
    assert not checkpointing._MANIFEST.pending
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
    checkpointing, run, cadence = _cadence(tmp_path, monkeypatch, "smoke")
    out = tmp_path / "smoke-trainer"
    _files(out / "checkpoint-3", {"adapter_model.safetensors": 2000, "optimizer.pt": 3000})
    control = cadence.on_step_end(SimpleNamespace(), _state(3, max_steps=3), TrainerControl())
    assert control.should_save
    cadence.on_save(SimpleNamespace(output_dir=str(out), save_on_each_node=False), _state(3, 3), TrainerControl())
    assert ckpt.verify(out / "checkpoint-3")[0]  # hashed, in the foreground: nothing left pending
    assert not checkpointing._MANIFEST.pending
    assert cadence.save_seconds >= 0.3  # at least one file's (slowed) hash is inside the timed save


# --- verify once per disk: the handoff between two real processes ---------------------------------------------

_RANK = """
import json, os, sys, time
from pathlib import Path
from launcher.store import checkpoint as ckpt
from launcher.worker import checkpointing
run, role = Path(sys.argv[1]), sys.argv[2]
if role == "verifier":
    time.sleep(float(sys.argv[3]))  # the waiter is already polling (and has seen the stale choice)
    found, skipped = ckpt.newest_verified(run / "checkpoints", {"recipe_hash": "abc"})
    ckpt.publish_choice(run / ckpt.CHOICE, checkpointing._launch_identity(), found, skipped)
    print(json.dumps({"step": found.step, "skipped": skipped}), flush=True)
else:
    def refuse(*a, **k):
        raise AssertionError("the waiter hashed checkpoint files")
    ckpt.sha256_files = refuse
    found = ckpt.await_choice(run / ckpt.CHOICE, run / "checkpoints", checkpointing._launch_identity(),
                              checkpointing._launcher_started(), timeout=float(sys.argv[3]))
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
    ckpt.atomic_write_json(
        run / ckpt.CHOICE,
        {
            "launch": {
                "TORCHELASTIC_RUN_ID": "none",
                "TORCHELASTIC_RESTART_COUNT": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29555",
                "WORLD_SIZE": "2",
            },
            "written": time.time() - 5,
            "checkpoint": "step-000020",
            "step": 20,
            "manifest_sha256": ckpt.sha256_file(bad / ckpt.MANIFEST),
            "skipped": [],
        },
    )
    time.sleep(0.05)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run(
        [
            sys.executable,
            str(_script(tmp_path, "start.py", _LAUNCHER)),
            str(_script(tmp_path, "rank.py", _RANK)),
            str(run),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    (wrc, wout, werr), (vrc, vout, verr) = json.loads(res.stdout)
    assert vrc == 0 and wrc == 0, werr + verr
    assert json.loads(vout) == {"step": 10, "skipped": ["step-000020: optimizer.pt does not match its sha256"]}
    assert json.loads(wout) == {"step": 10, "files": ["adapter_model.safetensors", "optimizer.pt", "rng_state.pth"]}


def test_a_waiter_gives_up_with_the_reason_and_never_takes_a_changed_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    d = _complete(root, 10)
    launch = {"TORCHELASTIC_RUN_ID": "x"}
    with pytest.raises(TimeoutError, match="local rank 0 when the run spans several nodes"):
        ckpt.await_choice(tmp_path / ckpt.CHOICE, root, launch, time.time(), timeout=0.3, poll=0.05)
    with pytest.raises(ckpt.ChoiceCancelled, match="stopped while waiting"):  # run_worker: a clean 77
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
    assert ckpt.choice_timeout(root, rate=1000.0, floor=1.0) == pytest.approx(
        1.0 + sum(f["size"] for f in manifest["files"].values()) / 1000.0
    )


_TWO_RANKS = """
import json, os, sys, time
from pathlib import Path
import torch.distributed as dist
from launcher.store import checkpoint as ckpt
from launcher.worker import checkpointing
dist.init_process_group("gloo")
folder = Path(sys.argv[1])
if dist.get_rank() == 0:
    real = ckpt.sha256_file
    def slow(path):
        time.sleep(8.0)  # longer than one round of the wait (5 s): several collectives
        return real(path)
    ckpt.sha256_file = slow
    checkpointing._MANIFEST.start(folder, 40, {"recipe_hash": "abc"}, workers=1)
checkpointing._await_manifest("cpu")
at_return = (folder / ckpt.MANIFEST).is_file()
# each node verified its own disk: the same step passes, different steps are refused on every rank
same = checkpointing._resume_steps_differ(ckpt.Verified(folder, 40, {}), "cpu")
differ = checkpointing._resume_steps_differ(ckpt.Verified(folder, 40, {}) if dist.get_rank() else None, "cpu")
(folder.parent / f"rank{dist.get_rank()}.json").write_text(json.dumps(
    {"rank": dist.get_rank(), "manifest_at_return": at_return, "same": same, "differ": differ}))
dist.destroy_process_group()
from launcher.worker.process import leave_rank
leave_rank(0)
"""


@pytest.mark.slow
def test_no_rank_returns_before_rank_0s_background_manifest_and_resume_steps_must_agree(tmp_path):
    """Two gloo ranks under torchrun: rank 1 (nothing to hash) leaves the exit wait only once rank 0's manifest
    exists, so a rank that exits early (a stopped run exits 77) cannot make torchrun kill rank 0 mid-hash. And
    ranks whose disks chose different resume steps are stopped with the reason."""
    d = tmp_path / ckpt.step_dir_name(40)
    _files(d, {"adapter_model.safetensors": 1000})
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(_script(tmp_path, "ranks.py", _TWO_RANKS)),
            str(d),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["manifest_at_return"], r["same"]) for r in rows] == [(0, True, None), (1, True, None)]
    assert "oldest none, newest step-000040, this node none" in rows[0]["differ"]
    assert "this node step-000040" in rows[1]["differ"] and "(keep none)" in rows[1]["differ"]
    assert ckpt.verify(d)[0]


# --- the review's defects: who verifies and who deletes on each disk, failed manifests, the wait before a save ---


@pytest.mark.parametrize(
    "engine, nnodes, nproc, rank, local_rank, verifies",
    [
        ("trl", 1, 1, 0, 0, True),
        ("ddp", 1, 2, 0, 0, True),
        ("ddp", 1, 2, 1, 1, False),
        ("deepspeed", 1, 2, 1, 1, False),
        ("ddp", 2, 2, 2, 0, True),  # DDP saves on each node: node 1's first process verifies its own disk
        ("ddp", 2, 2, 3, 1, False),
        # DeepSpeed never sets save_on_each_node: node 1 waited for a choice only node 0 wrote (on its own disk)
        ("deepspeed", 2, 2, 2, 0, True),
        ("deepspeed", 2, 2, 3, 1, False),
        ("deepspeed", 2, 2, 0, 0, True),
        ("fsdp", 3, 1, 2, 0, True),  # one process per node: every process verifies its disk
    ],
)
def test_each_nodes_first_process_verifies_its_disk_whatever_the_engine(
    engine, nnodes, nproc, rank, local_rank, verifies
):
    from launcher.worker import checkpointing

    plan = {"engine": engine, "num_processes": nproc, **({"nodes": {"nnodes": nnodes}} if nnodes > 1 else {})}
    assert checkpointing._verifies_resume(plan, rank, local_rank) is verifies


def test_only_the_disks_writer_removes_a_folder_and_only_after_its_manifest(tmp_path, gated_hash, monkeypatch):
    """A full disk on another rank must not delete the checkpoint the writer is still hashing."""
    from launcher.worker import checkpointing
    from launcher.store.rundir import RunDir

    # the writer rule is the Trainer's (save_on_each_node: each node's first process, else the main one)
    ranks = ((0, 0), (1, 1), (2, 0))
    assert [checkpointing._writes_checkpoints(False, r, lr) for r, lr in ranks] == [True, False, False]
    assert [checkpointing._writes_checkpoints(True, r, lr) for r, lr in ranks] == [True, False, True]

    run = RunDir(tmp_path / "run")
    _complete(run.checkpoints, 10)
    hashing = run.checkpoints / ckpt.step_dir_name(20)
    _files(hashing, {"adapter_model.safetensors": 4000})
    partial = run.checkpoints / "checkpoint-30"  # the Trainer's save that hit the full disk
    _files(partial, {"optimizer.pt": 7000})
    gated_hash.arm()
    monkeypatch.setattr(checkpointing, "_MANIFEST", ckpt.BackgroundManifest(log=lambda line: None))
    checkpointing._MANIFEST.start(hashing, 20, {"recipe_hash": "abc"}, workers=1)
    assert gated_hash.started.wait(10)

    other = checkpointing._disk_full_message(run, 30, writer=False)  # another rank: reports, deletes nothing, no wait
    assert hashing.is_dir() and partial.is_dir() and checkpointing._MANIFEST.pending
    assert "removed by the process that writes this disk's checkpoints" in other and "7.0 MB" not in other

    result = []
    writer = threading.Thread(target=lambda: result.append(checkpointing._disk_full_message(run, 30, writer=True)))
    writer.start()
    time.sleep(0.3)
    assert writer.is_alive() and partial.is_dir()  # waits for its own manifest before removing anything
    gated_hash.gate.set()
    writer.join(30)
    assert ckpt.verify(hashing)[0] and not partial.exists()  # the hashed one is complete and kept
    assert "the partial save was removed, step-000020 is intact" in result[0]


def _failing_manifest(monkeypatch, errno_code: int):
    """manifest.json cannot be written (errno_code); every other JSON write works."""
    real = ckpt.atomic_write_json

    def write(path, data):
        if Path(path).name == ckpt.MANIFEST:
            raise OSError(errno_code, os.strerror(errno_code))
        return real(path, data)

    monkeypatch.setattr(ckpt, "atomic_write_json", write)


@pytest.mark.parametrize("errno_name", ["ENOSPC", "EIO"])
def test_a_failed_background_manifest_stops_the_next_save_and_the_exit(tmp_path, monkeypatch, errno_name):
    """Never only logged: the next save (every rank, before it saves) and the worker's exit raise it; a full disk
    ends as disk full (81, with its message in worker.json), anything else as a crash, never a clean 0 or 77."""
    import errno

    from transformers import TrainerControl

    from launcher.worker import callbacks, exits

    checkpointing, run, cadence = _cadence(tmp_path, monkeypatch, "full")
    fresh = ckpt.BackgroundManifest(log=lambda line: None)
    for module in (callbacks, checkpointing):  # on_save and the wait before a save or the exit
        monkeypatch.setattr(module, "_MANIFEST", fresh)
    _failing_manifest(monkeypatch, getattr(errno, errno_name))
    args = SimpleNamespace(output_dir=str(run.checkpoints), save_on_each_node=False)
    _files(run.checkpoints / "checkpoint-10", {"adapter_model.safetensors": 2000})
    cadence.on_save(args, _state(10), TrainerControl())
    assert checkpointing._MANIFEST.wait(30) and checkpointing._MANIFEST.error

    # the next save: the wait before it raises, on every rank, before any folder moves
    with pytest.raises(ckpt.ManifestFailed) as raised:
        cadence.on_step_end(args, _state(100, max_steps=100), TrainerControl())
    assert exits._is_disk_full(raised.value, run.root) is (errno_name == "ENOSPC")
    assert not (run.checkpoints / ckpt.step_dir_name(10) / ckpt.MANIFEST).exists()

    # the exit (after a stop's save, or the final one)
    if errno_name == "ENOSPC":
        assert checkpointing._finish(run, "cpu", 10, writer=True) == exits.EXIT_DISK_FULL
        info = json.loads(run.worker.read_text())
        assert (
            info["exit_code"] == exits.EXIT_DISK_FULL
            and "disk full while saving the checkpoint of step 10" in info["error"]
        )
        assert not (run.checkpoints / ckpt.step_dir_name(10)).exists()  # the unsealed folder, removed by its writer
    else:
        with pytest.raises(ckpt.ManifestFailed, match="Input/output error"):
            checkpointing._finish(run, "cpu", 10, writer=True)
        assert not run.worker.exists()


def test_the_wait_for_the_previous_manifest_comes_before_the_save_on_every_rank(tmp_path, monkeypatch, gated_hash):
    """on_step_end, where all ranks have agreed to save, waits for the previous hash; on_save then finds it done."""
    from transformers import TrainerControl

    checkpointing, run, cadence = _cadence(tmp_path, monkeypatch, "full")
    args = SimpleNamespace(output_dir=str(run.checkpoints), save_on_each_node=False)
    gated_hash.arm()
    _files(run.checkpoints / "checkpoint-10", {"adapter_model.safetensors": 2000})
    cadence.on_save(args, _state(10), TrainerControl())
    assert gated_hash.started.wait(10)
    # no save due: no wait (training goes on beside the hashing)
    assert not cadence.on_step_end(args, _state(11), TrainerControl()).should_save and checkpointing._MANIFEST.pending
    decided = []
    last = threading.Thread(
        target=lambda: decided.append(cadence.on_step_end(args, _state(100, 100), TrainerControl()))
    )
    last.start()
    time.sleep(0.5)
    assert last.is_alive() and not decided  # the save is decided, the previous manifest is awaited first
    gated_hash.gate.set()
    last.join(30)
    assert decided[0].should_save and (run.checkpoints / "step-000010" / ckpt.MANIFEST).is_file()
    assert not checkpointing._MANIFEST.pending


_PRESAVE = """
import datetime, json, os, sys, time
from pathlib import Path
from types import SimpleNamespace
import torch.distributed as dist
from transformers import TrainerControl, TrainerState
from launcher.store import checkpoint as ckpt
from launcher.worker import callbacks, checkpointing
from launcher.store.rundir import RunDir

run_root, group_timeout, hash_s = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=group_timeout))
rank = dist.get_rank()
checkpointing._MANIFEST_POLL_S = group_timeout / 4  # the rounds stay far below the group's timeout, as 5 s below 1800 s
callbacks._redraw_loss_plot = lambda *a, **k: None
real = ckpt.sha256_file
def slow(path):
    if path.name == "slow.bin":
        time.sleep(hash_s)  # a large checkpoint on slow storage: longer than the process group's timeout
    return real(path)
ckpt.sha256_file = slow
rounds = []
real_all_reduce = dist.all_reduce
def counted(t, *a, **k):
    rounds.append(t.numel())
    return real_all_reduce(t, *a, **k)
dist.all_reduce = counted

run = RunDir(run_root)
cadence, _ = callbacks.build_callbacks(run, SimpleNamespace(checkpoint_every_minutes=10.0, keep_checkpoints=2), "full",
                                   "cpu", {"recipe_hash": "abc"}, None)
args = SimpleNamespace(output_dir=str(run.checkpoints), save_on_each_node=False)
def state(step):
    return TrainerState(global_step=step, max_steps=20, is_world_process_zero=rank == 0,
                        is_local_process_zero=rank == 0)
if rank == 0:  # checkpoint 10, moved and hashing in the background (the save before)
    folder = run.checkpoints / ckpt.step_dir_name(10)
    folder.mkdir(parents=True)
    (folder / "slow.bin").write_bytes(os.urandom(1000))
    checkpointing._MANIFEST.start(folder, 10, {"recipe_hash": "abc"}, workers=1)
t0 = time.monotonic()
control = cadence.on_step_end(args, state(20), TrainerControl())  # the last step: every rank saves
pre_s, polled = time.monotonic() - t0, rounds.count(2)
sealed = (run.checkpoints / ckpt.step_dir_name(10) / ckpt.MANIFEST).is_file()
if rank == 0:  # the Trainer's save of step 20
    (run.checkpoints / "checkpoint-20").mkdir()
    (run.checkpoints / "checkpoint-20" / "adapter_model.safetensors").write_bytes(os.urandom(1000))
t0 = time.monotonic()
cadence.on_save(args, state(20), control)
save_s = time.monotonic() - t0
checkpointing._await_manifest("cpu")
(run_root / f"rank{rank}.json").write_text(json.dumps({"should_save": control.should_save, "pre_s": pre_s,
    "polled_rounds": polled, "sealed_before_save": sealed, "save_s": save_s}))
dist.destroy_process_group()
from launcher.worker.process import leave_rank
leave_rank(0)
"""


@pytest.mark.slow
def test_a_hash_longer_than_the_process_group_timeout_is_awaited_in_short_collectives_before_the_save(tmp_path):
    """Two gloo ranks under torchrun, a process group timeout of 2 s and a previous checkpoint whose hash takes 6 s:
    without the wait in on_step_end, rank 1 sat in on_save's barrier while rank 0 waited for the hash, past the
    timeout (the NCCL watchdog's abort on a GPU). With it, both ranks poll in short collectives, then save."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(_script(tmp_path, "presave.py", _PRESAVE)),
            str(run),
            "2",
            "6",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = [json.loads((run / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in rows:
        assert r["should_save"] and r["sealed_before_save"], rows
        assert r["pre_s"] >= 4.0 and r["polled_rounds"] >= 4, rows  # waited in several rounds of 0.5 s
        assert r["save_s"] < 2.0, rows  # the writer's wait inside on_save found the hash done
    assert ckpt.verify(run / "checkpoints" / "step-000010")[0] and ckpt.verify(run / "checkpoints" / "step-000020")[0]


# A worker whose manifests cannot be written: the real `launcher.worker.train` entry point, one process.
_FAILING_WORKER = """
import errno, os, signal, sys
from pathlib import Path
from launcher.store import checkpoint as ckpt
from launcher.worker import train
run_dir, code, stop = sys.argv[1], getattr(errno, sys.argv[2]), sys.argv[3] == "stop"
real_write = ckpt.atomic_write_json
def write(path, data):
    if Path(path).name == ckpt.MANIFEST:
        raise OSError(code, os.strerror(code))
    return real_write(path, data)
ckpt.atomic_write_json = write
real_load = train.load_model_and_tokenizer
def load_then_stop(*a, **k):
    loaded = real_load(*a, **k)
    if stop:  # after the resume choice, before step 1: the stop's save is the first checkpoint
        os.kill(os.getpid(), signal.SIGTERM)
    return loaded
train.load_model_and_tokenizer = load_then_stop
sys.exit(train.main(["--run-dir", run_dir, "--mode", "full"]))
"""


@pytest.mark.slow
def test_a_worker_whose_checkpoint_manifest_fails_never_exits_as_stopped_or_finished(write_recipe, tmp_path):
    """The real worker: a stop whose checkpoint cannot be sealed (ENOSPC) exits disk full, not 77 ("stopped after
    a checkpoint"); a finished run whose last manifest fails (EIO) exits as a crash, not 0."""
    from helpers import prepared_run

    script = _script(tmp_path, "worker.py", _FAILING_WORKER)
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cases = {"stop": ("ENOSPC", "stop"), "end": ("EIO", "end")}
    runs = {
        name: prepared_run(
            write_recipe(f"{name}.yaml", output_dir=str(tmp_path / name), max_steps=3, checkpoint_every_minutes=10),
            "smoke.enabled=false",
        )
        for name in cases
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(script), str(runs[name]), *cases[name]],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in cases
    }
    out = {name: (p.wait(300), *p.communicate()) for name, p in procs.items()}

    rc, stdout, stderr = out["stop"]
    assert rc == 81, stdout[-2000:] + stderr[-3000:]
    assert "SIGTERM received" in stdout and "checkpoint saved, resume" not in stdout
    info = json.loads((runs["stop"] / "worker.json").read_text())
    assert info["exit_code"] == 81 and "disk full while saving the checkpoint of step 1" in info["error"]
    assert not list((runs["stop"] / "checkpoints").glob("step-*"))  # the unsealed folder removed by its writer

    rc, stdout, stderr = out["end"]
    assert rc == 1, stdout[-2000:] + stderr[-3000:]
    assert "ManifestFailed" in stderr and "Input/output error" in stderr
    assert [p.name for p in (runs["end"] / "checkpoints").glob("step-*")] == ["step-000003"]
    assert not (runs["end"] / "checkpoints" / "step-000003" / ckpt.MANIFEST).exists()  # not a checkpoint


_WAITING_RANK = """
import sys
from launcher.store import checkpoint as ckpt
from launcher.worker import train
real = ckpt.await_choice
def announced(*a, **k):
    print("waiting for the resume choice", flush=True)
    return real(*a, **k)
ckpt.await_choice = announced
sys.exit(train.main(["--run-dir", sys.argv[1], "--mode", "full"]))
"""


@pytest.mark.slow
def test_a_stop_while_waiting_for_the_resume_choice_is_a_clean_stop(write_recipe, tmp_path):
    """Rank 1 of a 2-process DDP launch whose verifier never writes: SIGTERM during the wait ends it with 77."""
    from helpers import free_port, prepared_run

    run = prepared_run(write_recipe(max_steps=3), "engine=ddp", "num_processes=2", "smoke.enabled=false")
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        RANK="1",
        LOCAL_RANK="1",
        WORLD_SIZE="2",
        TORCHELASTIC_RUN_ID="t",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    proc = subprocess.Popen(
        [sys.executable, str(_script(tmp_path, "rank1.py", _WAITING_RANK)), str(run)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stdout:
            if line.strip() == "waiting for the resume choice":
                break
        else:
            pytest.fail(f"the rank ended before waiting: {proc.wait()} {proc.stderr.read()[-3000:]}")
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    finally:
        proc.kill()
    rest, err = proc.communicate()
    assert rc == 77, err[-3000:]
    assert "while waiting for the resume checkpoint to be verified; nothing was trained" in rest
    assert "Traceback" not in err and not (run / "metrics.jsonl").exists()
