"""Lose nothing: copies off the box (rsync to a real sshd on 127.0.0.1, fsspec), resume on a fresh box,
torn checkpoints, SIGTERM preemption, a full disk."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import RESUME_FIELDS, recipe_file
from helpers import (
    assert_same_run,
    free_port,
    freeze_worker,
    ftrun,
    has_checkpoint,
    logged_steps,
    metrics,
    polled_status,
    status,
    wait_for,
    wait_until_ended,
)
from launcher.store import checkpoint as ckpt
from launcher.errors import RecipeError
from launcher.recipe_loading import load_recipe

FIELDS = RESUME_FIELDS


@pytest.fixture
def reference(reference_run) -> Path:
    return reference_run


@pytest.fixture(scope="module")
def ssh_alias(tmp_path_factory):
    """A real sshd on 127.0.0.1 with a throwaway key; yields (alias, env for rsync's ssh)."""
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not Path(sshd).exists() or not shutil.which("rsync"):
        # scripts/test.sh installs them where it can (root with apt-get); elsewhere these tests are skipped, never
        # failed
        pytest.skip(
            "the rsync/SSH copy tests need Debian's openssh-server and rsync: "
            "apt-get install -y openssh-server rsync (scripts/test.sh does it when run as root)"
        )
    d = tmp_path_factory.mktemp("sshd")
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
    port = free_port()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nStrictModes no\nUsePAM no\n"
        f"PidFile {d / 'sshd.pid'}\nPermitRootLogin prohibit-password\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)
    proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(d / "sshd_config")], stderr=open(d / "sshd.log", "wb"))
    (d / "ssh_config").write_text(
        f"Host ftrun-test\n  HostName 127.0.0.1\n  Port {port}\n  User {os.environ.get('USER', 'root')}\n"
        f"  IdentityFile {d / 'client_key'}\n  IdentitiesOnly yes\n  StrictHostKeyChecking no\n"
        "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n"
    )
    env = {"RSYNC_RSH": f"ssh -F {d / 'ssh_config'}"}

    def reachable():
        res = subprocess.run(["ssh", "-F", str(d / "ssh_config"), "ftrun-test", "true"], capture_output=True)
        return res.returncode == 0

    wait_for(reachable, 20, f"sshd on port {port} ({(d / 'sshd.log')})", 0.3)
    yield "ftrun-test", env
    proc.terminate()
    proc.wait(timeout=10)


def _running(pid: int) -> bool:
    """The process exists and is not a zombie waiting for a parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _machine_loss_then_resume_elsewhere(
    tmp_path: Path, tiny_model: Path, reference: Path, sync_to: str, remote_ls, env: dict
) -> None:
    recipe = recipe_file(
        tmp_path / "r.yaml",
        tiny_model,
        output_dir=tmp_path / "run",
        sync={"to": sync_to, "every_seconds": 0.5},
        **FIELDS,
    )
    run = tmp_path / "run"
    res = ftrun(recipe, "smoke.enabled=false", cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stdout + res.stderr

    # freeze the worker after its first checkpoint; the supervisor's copier still runs
    st = freeze_worker(run, has_checkpoint)

    def synced():
        p = run / "sync.json"
        return json.loads(p.read_text()).get("synced_step") if p.is_file() else None

    synced_step = wait_for(synced, 120, "the checkpoint copied off the box")
    # the machine is gone, with its disk: every process of the run at once (the supervisor's group: the worker and
    # its children, such as a loss.png drawing that would otherwise still write into the folder removed below)
    os.killpg(st["supervisor_pid"], signal.SIGKILL)
    wait_for(lambda: not any(map(_running, (st["supervisor_pid"], st["worker_pid"]))), 30, "the run's processes gone")
    last_step_before = metrics(run)[-1]["step"]
    assert last_step_before < FIELDS["max_steps"], "the run ended before the machine was lost; nothing resumed"
    shutil.rmtree(run)
    assert remote_ls(f"checkpoints/step-{synced_step:06d}/manifest.json")

    res = ftrun(recipe, cwd=tmp_path, env=env)  # the same command on a "new box"
    assert res.returncode == 0, res.stdout + res.stderr
    assert "fetching the newest verified checkpoint" in res.stdout
    wait_until_ended(run, tmp_path)
    log = (run / "train.log").read_text()
    assert "resuming from step-" in log
    assert_same_run(reference, run)
    # the final result and the metadata went off the box too
    assert remote_ls("final/adapter/adapter_model.safetensors") and remote_ls("metrics.jsonl")
    assert status(run, tmp_path)["offbox_checkpoint"] == f"step-{FIELDS['max_steps']:06d}"


@pytest.mark.slow  # the same machine loss as the fsspec path's (default tier), over another destination
def test_rsync_over_ssh_machine_loss_resume_on_fresh_box(tmp_path, tiny_model, reference, ssh_alias):
    alias, env = ssh_alias
    remote = tmp_path / "remote-box"  # the sshd runs here, so the remote path is local to look at
    _machine_loss_then_resume_elsewhere(
        tmp_path, tiny_model, reference, f"{alias}:{remote}", lambda rel: (remote / rel).is_file(), env
    )


@pytest.mark.slow  # a long end-to-end run: the default tier stays under 6 minutes
def test_fsspec_path_machine_loss_resume_and_no_secrets(tmp_path, tiny_model, reference):
    remote = tmp_path / "bucket" / "runs" / "r1"
    secret = "hf_SECRETtoken1234567890"
    _machine_loss_then_resume_elsewhere(
        tmp_path, tiny_model, reference, str(remote), lambda rel: (remote / rel).is_file(), {"HF_TOKEN": secret}
    )
    for folder in (tmp_path / "run", remote):
        for p in folder.rglob("*"):
            if p.is_file():
                assert secret.encode() not in p.read_bytes(), p


@pytest.mark.slow  # the same machine loss as the fsspec path's (default tier), over another destination
def test_s3_machine_loss_resume_on_fresh_box(tmp_path, tiny_model, reference, s3_endpoint):
    import fsspec

    fs, root = fsspec.core.url_to_fs("s3://ftrun-test/runs/r1")

    def remote_ls(rel: str) -> bool:
        fs.invalidate_cache()
        return fs.exists(f"{root}/{rel}")

    _machine_loss_then_resume_elsewhere(
        tmp_path, tiny_model, reference, "s3://ftrun-test/runs/r1", remote_ls, s3_endpoint
    )


def _checkpoint_with_a_multipart_file(root: Path, step: int, big: int) -> Path:
    d = root / ckpt.step_dir_name(step)
    d.mkdir(parents=True)
    (d / "adapter_model.safetensors").write_bytes(os.urandom(4096))
    (d / "optimizer.pt").write_bytes(os.urandom(big))  # several parts at the test's part size
    (d / "trainer_state.json").write_text('{"global_step": %d}' % step)
    ckpt.write_manifest(d, step, {"recipe_hash": "abc"})
    return d


def test_s3_copy_is_verified_by_the_stores_checksums_without_reading_it_back(tmp_path, s3_server, monkeypatch):
    """Each object goes up with its SHA-256 (a multipart one with a SHA-256 per part); the verification reads
    S3's checksums with one HEAD per file and no GET, where reading the copy back would GET every byte."""
    from launcher.store.rundir import RunDir
    from launcher.store.sync import FsspecDestination, push_checkpoint

    monkeypatch.setattr(FsspecDestination, "part_bytes", 5 << 20)  # S3's smallest part: a 11 MiB file is 3 parts
    step_dir = _checkpoint_with_a_multipart_file(tmp_path / "run" / "checkpoints", 10, 11 << 20)
    dest = FsspecDestination("s3://ftrun-test/runs/r1")
    s3_server.requests.clear()
    assert push_checkpoint(dest, RunDir(tmp_path / "run"), step_dir, keep=2) == 10
    sent = sum(p.stat().st_size for p in step_dir.iterdir())
    assert s3_server.requests.object_reads() == [] and dest.read_back == {"files": 0, "bytes": 0}
    heads = [e for e in s3_server.requests.entries if e["method"] == "HEAD" and "/step-000010/" in e["path"]]
    assert len(heads) == 3  # one per file the manifest lists (retention's listing aside)
    print(
        f"checkpoint of {sent} bytes: {len(s3_server.requests.entries)} requests, {len(heads)} HEAD, 0 GET, "
        f"0 bytes read back (reading it back: {sent - (step_dir / 'manifest.json').stat().st_size} bytes)"
    )

    import boto3

    s3 = boto3.client("s3")
    key = "runs/r1/checkpoints/step-000010/optimizer.pt"
    import base64
    import hashlib

    # what S3 computed of what it received: a multipart object's SHA-256 of its parts' SHA-256s, a small one's own
    head = s3.head_object(Bucket="ftrun-test", Key=key, ChecksumMode="ENABLED")
    data = (step_dir / "optimizer.pt").read_bytes()
    parts = b"".join(hashlib.sha256(data[i : i + (5 << 20)]).digest() for i in range(0, len(data), 5 << 20))
    assert head["ChecksumSHA256"].split("-")[0] == base64.b64encode(hashlib.sha256(parts).digest()).decode()
    assert head["ETag"].strip('"').endswith("-3")
    small = s3.head_object(
        Bucket="ftrun-test", Key=key.replace("optimizer.pt", "adapter_model.safetensors"), ChecksumMode="ENABLED"
    )
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert base64.b64decode(small["ChecksumSHA256"]).hex() == manifest["files"]["adapter_model.safetensors"]["sha256"]
    # another process (`ftrun push` after a restart) computes the same digests from the local files
    s3_server.requests.clear()
    fresh = FsspecDestination("s3://ftrun-test/runs/r1")
    assert fresh.verify_dir("checkpoints/step-000010", manifest, local=step_dir) == (True, "")
    assert s3_server.requests.object_reads() == []


@pytest.mark.parametrize("how", ["rewritten with a SHA-256 checksum", "rewritten without one", "deleted"])
def test_s3_copy_changed_on_the_server_after_the_upload_does_not_verify(tmp_path, s3_server, how):
    """The copy changes on the server between the upload and its verification (another writer, a broken
    replication): the store's checksum tells at once, or, where the new object carries none, the read back."""
    import boto3

    from launcher.store.sync import FsspecDestination

    step_dir = _fake_checkpoint(tmp_path / "checkpoints", 20)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    dest = FsspecDestination("s3://ftrun-test/runs/r2")
    dest.put_dir(step_dir, "checkpoints/step-000020")
    s3, key = boto3.client("s3"), "runs/r2/checkpoints/step-000020/optimizer.pt"
    data = bytearray((step_dir / "optimizer.pt").read_bytes())
    data[100] ^= 0x01  # same size, one bit
    if how == "deleted":
        s3.delete_object(Bucket="ftrun-test", Key=key)
    elif how == "rewritten with a SHA-256 checksum":
        s3.put_object(Bucket="ftrun-test", Key=key, Body=bytes(data), ChecksumAlgorithm="SHA256")
    else:
        s3.put_object(Bucket="ftrun-test", Key=key, Body=bytes(data))  # botocore's default CRC32 only
    s3_server.requests.clear()
    ok, why = dest.verify_dir("checkpoints/step-000020", manifest, local=step_dir)
    assert not ok
    reads = s3_server.requests.object_reads()
    if how == "deleted":
        assert why == "checkpoints/step-000020/optimizer.pt is missing off the box" and reads == []
    else:
        assert why == "checkpoints/step-000020/optimizer.pt differs from the manifest off the box"
        # S3's own SHA-256 of the new object decides without a read; an object without one is read back
        assert len(reads) == (0 if "with a SHA-256" in how else 1), reads


def test_credentials_in_sync_url_are_refused(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(
        yaml.safe_dump(
            {"model": "a/b", "method": "lora", "data": "d.jsonl", "sync": {"to": "s3://KEY:SECRET@bucket/x"}}
        )
    )
    with pytest.raises(RecipeError, match="credentials do not belong in the recipe"):
        load_recipe(p)


def test_unknown_destination_is_a_clear_error():
    from launcher.errors import SyncError
    from launcher.store.sync import destination

    with pytest.raises(SyncError, match="not a destination ftrun knows"):
        destination("just-a-word")


def _fake_checkpoint(root: Path, step: int) -> Path:
    d = root / ckpt.step_dir_name(step)
    d.mkdir(parents=True)
    (d / "adapter_model.safetensors").write_bytes(os.urandom(4096))
    (d / "optimizer.pt").write_bytes(os.urandom(8192))
    ckpt.write_manifest(d, step, {"recipe_hash": "abc"})
    return d


def test_torn_checkpoints_are_never_resumed_from(tmp_path):
    root = tmp_path / "checkpoints"
    _fake_checkpoint(root, 10)
    truncated = _fake_checkpoint(root, 20)
    no_manifest = _fake_checkpoint(root, 30)
    other_run = _fake_checkpoint(root, 40)
    flipped = _fake_checkpoint(root, 50)
    with open(truncated / "optimizer.pt", "r+b") as fh:
        fh.truncate(100)
    (no_manifest / ckpt.MANIFEST).unlink()
    data = bytearray((flipped / "adapter_model.safetensors").read_bytes())
    data[7] ^= 0xFF
    (flipped / "adapter_model.safetensors").write_bytes(bytes(data))
    manifest = json.loads((other_run / ckpt.MANIFEST).read_text())
    manifest["recipe_hash"] = "another-recipe"
    (other_run / ckpt.MANIFEST).write_text(json.dumps(manifest))

    found, skipped = ckpt.newest_verified(root, {"recipe_hash": "abc"})
    assert found.step == 10
    assert [s.split(":")[0] for s in skipped] == ["step-000050", "step-000040", "step-000030", "step-000020"]
    assert "does not match its sha256" in skipped[0]
    assert "recipe_hash='another-recipe'" in skipped[1]
    assert "no manifest" in skipped[2]
    assert "has 100 bytes, manifest says 8192" in skipped[3]


class _Killed(BaseException):
    """The copier's process dies here (a BaseException: the copier's `except Exception` does not catch it)."""


@pytest.mark.parametrize("killed", ["after the copy, before it was recorded", "before the manifest went up"])
def test_a_copy_that_completed_before_the_copier_was_killed_is_not_sent_again(tmp_path, monkeypatch, killed):
    """The copier dies after its copy of a checkpoint completed off the box but before sync.json recorded it.
    The next copier checks the copy off the box (manifest last, then every file) and does not send it again;
    one that died before the manifest went up sends it all again."""
    from launcher.store.rundir import RunDir
    from launcher.store.sync import Syncer
    from launcher.store.sync import transfer
    from launcher.store.sync.object_store import FsspecDestination

    run = RunDir(tmp_path / "run")
    _fake_checkpoint(run.checkpoints, 10)
    remote = tmp_path / "remote"
    real_write, real_put = transfer._write_sync_state, FsspecDestination.put_file

    def dies_before_the_record(r, **fields):
        if "synced_step" in fields:
            raise _Killed
        return real_write(r, **fields)

    def dies_at_the_manifest(self, local, rel):
        if rel.endswith(ckpt.MANIFEST):
            raise _Killed
        return real_put(self, local, rel)

    if killed.startswith("after"):
        monkeypatch.setattr(transfer, "_write_sync_state", dies_before_the_record)
    else:
        monkeypatch.setattr(FsspecDestination, "put_file", dies_at_the_manifest)
    with pytest.raises(_Killed):
        Syncer(run, str(remote), keep=2, log=lambda _: None).sync_once()
    monkeypatch.undo()
    assert json.loads((run.root / "sync.json").read_text())["sending"] == {"to": str(remote), "what": "step-000010"}

    sent: list[str] = []
    monkeypatch.setattr(
        FsspecDestination, "put_file", lambda self, local, rel: (sent.append(rel), real_put(self, local, rel))
    )
    assert Syncer(run, str(remote), keep=2, log=lambda _: None).sync_once()
    ckpt_sent = sorted(r for r in sent if r.startswith("checkpoints/"))
    if killed.startswith("after"):
        assert ckpt_sent == []
    else:
        assert ckpt_sent == [
            f"checkpoints/step-000010/{n}" for n in ("adapter_model.safetensors", ckpt.MANIFEST, "optimizer.pt")
        ]
    state = json.loads((run.root / "sync.json").read_text())
    assert state["synced_step"] == 10 and state["sending"] is None
    assert ckpt.verify(remote / "checkpoints" / "step-000010")[0]
    # a copy off the box under the same name whose files are not the manifest's is sent again
    (remote / "checkpoints" / "step-000010" / "optimizer.pt").write_bytes(b"other")
    real_write(run, synced_step=None, sending={"to": str(remote), "what": "step-000010"})
    sent.clear()
    assert Syncer(run, str(remote), keep=2, log=lambda _: None).sync_once()
    assert "checkpoints/step-000010/optimizer.pt" in sent
    assert ckpt.verify(remote / "checkpoints" / "step-000010")[0]


def test_pull_skips_a_remote_checkpoint_whose_upload_did_not_finish(tmp_path):
    from launcher.store.rundir import RunDir
    from launcher.store.sync import pull

    remote = tmp_path / "remote"
    (remote).mkdir()
    (remote / "recipe.yaml").write_text("model: a/b\n")
    _fake_checkpoint(remote / "checkpoints", 10)
    half = _fake_checkpoint(remote / "checkpoints", 20)
    (half / ckpt.MANIFEST).unlink()
    lines = []
    step = pull(str(remote), RunDir(tmp_path / "local"), log=lines.append)
    assert step == 10
    assert any("skipping step-000020: no manifest" in l for l in lines)
    assert ckpt.verify(tmp_path / "local" / "checkpoints" / "step-000010")[0]


@pytest.mark.slow  # a long end-to-end run: the default tier stays under 6 minutes
def test_sigterm_is_a_preemption_checkpoint_then_exact_resume(tmp_path, tiny_model, reference):
    recipe = recipe_file(
        tmp_path / "r.yaml", tiny_model, output_dir=tmp_path / "run", **{**FIELDS, "checkpoint_every_minutes": 30}
    )
    run = tmp_path / "run"
    assert ftrun(recipe, "smoke.enabled=false", cwd=tmp_path).returncode == 0
    st = freeze_worker(run, logged_steps(3))
    t0 = time.monotonic()
    os.kill(st["supervisor_pid"], signal.SIGTERM)  # a provider's stop notice
    os.kill(st["worker_pid"], signal.SIGCONT)
    wait_for(lambda: polled_status(run)["state"] == "preempted", 60, "state preempted")
    s = status(run, tmp_path)
    assert time.monotonic() - t0 < 60  # within the default grace period
    assert s["last_checkpoint"] and int(s["last_checkpoint"].split("-")[1]) >= 3  # saved on SIGTERM, not by cadence
    assert "preempted (SIGTERM)" in s["reason"]
    res = ftrun(recipe, cwd=tmp_path)
    assert res.returncode == 0 and "continuing" in res.stdout
    wait_until_ended(run, tmp_path)
    assert_same_run(reference, run)


@pytest.mark.slow  # a long end-to-end run: the default tier stays under 6 minutes
def test_disk_full_during_a_save_keeps_the_older_checkpoint(tmp_path, tiny_model):
    disk = tmp_path / "small-disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        # As root (this machine, CI) a failed mount is a failure, not a silent skip of the disk-full path.
        assert os.geteuid() != 0, f"mount -t tmpfs failed as root: {mounted.stderr.decode().strip()}"
        pytest.skip(reason="a small tmpfs needs root to mount; the disk-full path is untested for this user")
    try:
        recipe = recipe_file(tmp_path / "r.yaml", tiny_model, output_dir=disk / "run", **{**FIELDS, "max_steps": 400})
        run = disk / "run"
        assert ftrun(recipe, "smoke.enabled=false", "checkpoint_every_minutes=0.03", cwd=tmp_path).returncode == 0
        st = freeze_worker(run, has_checkpoint)
        # fill the disk, leaving less than a checkpoint needs but room for log lines
        free = shutil.disk_usage(disk).free
        with open(disk / "filler", "wb") as fh:
            fh.write(b"\0" * max(free - 256 * 1024, 0))
        os.kill(st["worker_pid"], signal.SIGCONT)
        wait_for(lambda: polled_status(run)["state"] not in ("running", "recovering"), 120, "the run to stop")
        s = status(run, tmp_path)
        assert s["state"] == "failed" and "disk full while saving the checkpoint" in s["reason"], s
        assert "MB free" in s["reason"] and "partial save was removed" in s["reason"]
        assert not list((run / "checkpoints").glob("checkpoint-*"))  # no half-written save left
        kept = [p for p in ckpt.candidates(run / "checkpoints") if (p / ckpt.MANIFEST).is_file()]
        assert kept and all(ckpt.verify(p)[0] for p in kept)
    finally:
        if os.environ.get("FTRUN_KEEP_DISK"):
            shutil.copytree(disk / "run", tmp_path / "run-copy", ignore_dangling_symlinks=True)
        subprocess.run(["umount", "-l", str(disk)])


def test_unreachable_sync_destination_stops_before_anything_starts(tmp_path, tiny_model):
    env = {"RSYNC_RSH": "ssh -o BatchMode=yes -o ConnectTimeout=3 -p 1"}  # nothing listens on port 1
    recipe = recipe_file(
        tmp_path / "r.yaml", tiny_model, output_dir=tmp_path / "run", sync={"to": "127.0.0.1:/nowhere"}
    )
    res = ftrun(recipe, cwd=tmp_path, env=env)
    assert res.returncode == 5, res.stdout + res.stderr
    assert "cannot look for an earlier copy of this run at sync.to=127.0.0.1:/nowhere" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "run").exists()
