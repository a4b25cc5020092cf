"""The results' permission bits follow the umask, whatever mode the library that wrote them chose."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from launcher.store import checkpoint as ckpt
from launcher.store.modes import apply_umask, share_results, umask


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    try:
        yield 0o027
    finally:
        os.umask(old)


def test_umask_is_read_without_changing_it(umask_027):
    assert umask() == 0o027
    assert umask() == 0o027 and os.umask(0o027) == 0o027


def test_safetensors_weights_get_the_mode_of_any_new_file(tmp_path, umask_027):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    folder = tmp_path / "adapter"
    folder.mkdir()
    save_file({"w": torch.zeros(2)}, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text("{}")
    script = folder / "run.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o700)
    private = folder / "sub"
    private.mkdir(mode=0o700)
    (private / "x.bin").write_bytes(b"x")
    (private / "x.bin").chmod(0o600)
    (folder / "link").symlink_to(folder / "adapter_config.json")

    assert apply_umask(folder) == []
    assert _mode(folder / "adapter_config.json") == 0o640  # what the umask gives: the reference
    assert _mode(folder / "adapter_model.safetensors") == 0o640
    assert _mode(private / "x.bin") == 0o640
    assert _mode(private) == 0o750 and _mode(folder) == 0o750
    assert _mode(script) == 0o750  # execute bits kept where the umask allows them


def test_a_checkpoint_is_readable_when_its_manifest_is_written(tmp_path, umask_027):
    d = tmp_path / ckpt.step_dir_name(3)
    d.mkdir()
    (d / "adapter_model.safetensors").write_bytes(b"0" * 64)
    (d / "adapter_model.safetensors").chmod(0o600)
    ckpt.write_manifest(d, 3, {})
    assert _mode(d / "adapter_model.safetensors") == 0o640 == _mode(d / ckpt.MANIFEST)
    assert ckpt.verify(d)[0] is not None


def test_a_file_that_cannot_be_changed_is_reported_not_raised(tmp_path, monkeypatch):
    final = tmp_path / "final"
    final.mkdir(mode=0o777 & ~umask())  # the folder has its mode already: only the file needs a change
    weights = final / "model.safetensors"
    weights.write_bytes(b"x")
    weights.chmod(0o600)

    def refuse(path, mode):
        raise PermissionError(1, "Operation not permitted", str(path))

    monkeypatch.setattr(os, "chmod", refuse)
    assert apply_umask(weights) == [f"{weights}: Operation not permitted"]
    said: list[str] = []
    share_results(final, said.append)
    assert said == [
        f"could not set the umask's mode on {weights}: Operation not permitted; a server running as "
        "another user may not read it"
    ]
