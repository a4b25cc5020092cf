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
from pathlib import Path

import pytest

from launcher import checkpoint as ckpt
from launcher.errors import SyncError
from launcher.rundir import RunDir

hf = pytest.importorskip("huggingface_hub")
REAL_API = hf.HfApi
LFS_ABOVE = 1024  # the stand-in stores files above this as LFS (the Hub: 10 MB or a binary type)


class FakeHub:
    """HfApi's calls that launcher/sync.py makes, on a folder; `mangle` changes what an upload stores."""

    def __init__(self, root: Path):
        self.root, self.calls, self.mangle = root, [], None

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
        src = self.root / filename
        if not src.is_file():
            raise hf.errors.EntryNotFoundError(f"{filename} not in {repo_id}")
        assert kwargs.get("local_dir"), "downloads must not go through the global Hub cache"
        dst = Path(kwargs["local_dir"]) / filename
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        return str(dst)

    def list_repo_tree(self, *args, **kwargs):
        self._check("list_repo_tree", *args, **kwargs)
        base = self.root / (kwargs.get("path_in_repo") or "")
        if not base.is_dir():
            raise hf.errors.EntryNotFoundError(str(base))
        for p in sorted(base.iterdir()):
            rel = p.relative_to(self.root).as_posix()
            yield hf.hf_api.RepoFolder(path=rel, oid="0" * 40) if p.is_dir() else self._info(p)

    def delete_folder(self, *args, **kwargs):
        self._check("delete_folder", *args, **kwargs)
        shutil.rmtree(self.root / args[0])

    def get_paths_info(self, *args, **kwargs):
        self._check("get_paths_info", *args, **kwargs)
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
    """A byte changed on the way, in an LFS file or in a small one: the copy does not verify."""
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
