"""hf://USER/REPO sync against a local stand-in for the Hub (no hub is reachable here).

The stand-in keeps the repo in a folder and answers like the Hub does: small files with their git blob id,
large ones as LFS with their sha256, both computed from the bytes it received. Every call is checked
against the installed huggingface_hub's own signatures, so a renamed argument fails here, not on a GPU box.
"""

from __future__ import annotations

import fnmatch
import hashlib
import inspect
import os
import shutil
import sys
from pathlib import Path

import pytest

from launcher import checkpoint as ckpt
from launcher.errors import SyncError
from launcher.rundir import RunDir

hf = pytest.importorskip("huggingface_hub")
REAL_API = hf.HfApi
LFS_ABOVE = 1024  # the stand-in stores files above this as LFS (the Hub: 10 MB or a binary type)


def not_found(what: str):
    """The error the Hub's 404 becomes (built from the response class huggingface_hub itself uses)."""
    response_cls = hf.errors.Response
    request_cls = sys.modules[response_cls.__module__.split(".")[0]].Request
    return hf.errors.RemoteEntryNotFoundError(f"404: {what}", response=response_cls(
        404, request=request_cls("GET", "https://huggingface.co/api/x")))


class FakeHub:
    """HfApi's calls that launcher/sync.py makes, on a folder; `mangle` changes what an upload stores."""

    def __init__(self, root: Path):
        self.root, self.calls, self.mangle, self.offline = root, [], None, False

    def _check(self, name, *args, **kwargs):
        inspect.signature(getattr(REAL_API, name)).bind(None, *args, **kwargs)  # TypeError on a wrong argument
        self.calls.append(name)

    def _store(self, src: Path, path_in_repo: str) -> None:
        dst = self.root / path_in_repo
        dst.parent.mkdir(parents=True, exist_ok=True)
        data = src.read_bytes()
        dst.write_bytes(self.mangle(path_in_repo, data) if self.mangle else data)

    def create_repo(self, *args, **kwargs):
        self._check("create_repo", *args, **kwargs)
        self.root.mkdir(parents=True, exist_ok=True)

    def upload_file(self, *args, **kwargs):
        self._check("upload_file", *args, **kwargs)
        self._store(Path(kwargs["path_or_fileobj"]), kwargs["path_in_repo"])

    def upload_folder(self, *args, **kwargs):
        self._check("upload_folder", *args, **kwargs)
        folder = Path(kwargs["folder_path"])
        for p in sorted(folder.rglob("*")):
            rel = p.relative_to(folder).as_posix()
            if p.is_file() and not any(fnmatch.fnmatch(rel, pat) for pat in kwargs.get("ignore_patterns") or []):
                self._store(p, f"{kwargs['path_in_repo']}/{rel}")

    def hf_hub_download(self, *args, **kwargs):
        self._check("hf_hub_download", *args, **kwargs)
        repo_id, filename = args
        if self.offline:  # what hf_hub_download raises when the Hub does not answer
            raise hf.errors.LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub")
        src = self.root / filename
        if not src.is_file():
            raise not_found(f"{filename} not in {repo_id}")
        assert kwargs.get("local_dir"), "downloads must not go through the global Hub cache"
        dst = Path(kwargs["local_dir"]) / filename
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        return str(dst)

    def list_repo_tree(self, *args, **kwargs):
        self._check("list_repo_tree", *args, **kwargs)
        base = self.root / (kwargs.get("path_in_repo") or "")
        if not base.is_dir():
            raise not_found(str(base))
        for p in sorted(base.iterdir()):
            rel = p.relative_to(self.root).as_posix()
            yield hf.hf_api.RepoFolder(path=rel, oid="0" * 40) if p.is_dir() else self._info(p)

    def delete_folder(self, *args, **kwargs):
        self._check("delete_folder", *args, **kwargs)
        shutil.rmtree(self.root / args[0])

    def get_paths_info(self, *args, **kwargs):
        self._check("get_paths_info", *args, **kwargs)
        assert 0 < len(args[1]) <= 1000, "the Hub takes 1 to 1,000 paths per call"
        return [self._info(self.root / p) for p in args[1] if (self.root / p).is_file()]

    def _info(self, p: Path):
        data = p.read_bytes()
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        lfs = {"size": len(data), "oid": hashlib.sha256(data).hexdigest(), "pointerSize": 134} \
            if len(data) > LFS_ABOVE else None
        return hf.hf_api.RepoFile(path=p.relative_to(self.root).as_posix(), size=len(data), oid=blob, lfs=lfs)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    fake = FakeHub(tmp_path / "hub" / "me" / "runs")
    monkeypatch.setattr(hf, "HfApi", lambda *a, **k: fake)
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
    from launcher.sync import destination, pull, push_checkpoint, push_metadata

    run = RunDir(tmp_path / "run")
    dest = destination("hf://me/runs/job1")
    for step in (10, 20):
        push_checkpoint(dest, run, _run_with_checkpoint(run.root, step), keep=1)
    push_metadata(dest, run)
    assert "hf_hub_download" not in hub.calls  # verified from the hashes the Hub reports
    assert sorted(p.name for p in (hub.root / "job1" / "checkpoints").iterdir()) == ["step-000020"]  # keep: 1

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
    from launcher.sync import destination, push_checkpoint

    run = RunDir(tmp_path / "run")
    hub.mangle = lambda path, data: bytes([data[0] ^ 0xFF]) + data[1:] if path.endswith(victim) else data
    with pytest.raises(SyncError, match=f"{victim} differs from the manifest off the box"):
        push_checkpoint(destination("hf://me/runs"), run, _run_with_checkpoint(run.root, 10), keep=2)


def test_hub_upload_cut_short_is_not_counted_as_off_the_box(tmp_path, hub):
    from launcher.sync import destination, push_checkpoint

    run = RunDir(tmp_path / "run")
    hub.mangle = lambda path, data: data[:100] if path.endswith(".safetensors") else data
    with pytest.raises(SyncError, match="has 100 bytes off the box, manifest says 4096"):
        push_checkpoint(destination("hf://me/runs"), run, _run_with_checkpoint(run.root, 10), keep=2)


def test_hub_url_without_a_repo_is_a_clear_error(hub):
    from launcher.sync import destination

    with pytest.raises(SyncError, match="does not name a repo"):
        destination("hf://justme")


def test_hub_small_file_that_no_longer_matches_its_manifest_does_not_verify(tmp_path, hub):
    """The blob id proves the Hub holds the sent file; the sent file must also be the one the manifest names."""
    from launcher.sync import destination, push_checkpoint

    run = RunDir(tmp_path / "run")
    d = _run_with_checkpoint(run.root, 10)
    (d / "trainer_state.json").write_text('{"global_step": 99}')  # changed after the manifest was written
    with pytest.raises(SyncError, match="trainer_state.json differs from the manifest"):
        push_checkpoint(destination("hf://me/runs"), run, d, keep=2)


def test_hub_that_does_not_answer_is_an_error_not_a_missing_run(tmp_path, hub):
    """'Not reachable' must not read as 'no run there': the same command would start afresh over the copy."""
    from launcher.sync import destination, pull, push_metadata, remote_has_run

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
    from launcher.sync import destination, push_checkpoint

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
    from launcher.pipeline import _pull_if_remote_run
    from launcher.recipe import validate_recipe
    from launcher.state import read_state, set_state
    from launcher.sync import destination, push_checkpoint, push_metadata

    old = RunDir(tmp_path / "old-box")
    dest = destination("hf://me/runs/job")
    for step in (10, 20):
        push_checkpoint(dest, old, _run_with_checkpoint(old.root, step), keep=2)
    set_state(old, "running", supervisor_pid=4242, worker_pid=4243)
    push_metadata(dest, old)

    recipe = validate_recipe({"model": "a/b", "method": "lora", "data": "d.jsonl", "output_dir": str(tmp_path / "new-box"),
                              "sync": {"to": "hf://me/runs/job"}}, tmp_path, "r")
    new = RunDir(tmp_path / "new-box")
    assert _pull_if_remote_run(new, recipe) is True
    assert sorted(p.name for p in new.checkpoints.iterdir()) == ["step-000020"]
    assert ckpt.verify(new.checkpoints / "step-000020")[0]
    state = read_state(new)
    assert state["supervisor_pid"] is None and state["worker_pid"] is None and "at step 20" in state["reason"]

    hub.offline = True  # a box that cannot reach the Hub refuses to start blind
    with pytest.raises(SyncError, match="cannot look for an earlier copy of this run"):
        _pull_if_remote_run(RunDir(tmp_path / "third-box"), recipe)
