"""Checkpoint layout (`checkpoints/step-000120/`), the manifest written last, verification, newest, retention."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from . import __version__

MANIFEST = "manifest.json"
PREFIX = "step-"


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:06d}"


def sha256_file(path: Path) -> str:
    return hash_file(path, hashlib.sha256())


def hash_file(path: Path, h: Any) -> str:
    """The hex digest of `h` (a hashlib object, possibly primed) updated with the file's bytes."""
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_bytes(path: Path) -> int:
    """Bytes of a file, or of every file below a folder."""
    path = Path(path)
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def atomic_write_json(path: Path, data: Any) -> None:
    """Write-then-rename, fsynced: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w") as fh:
            json.dump(data, fh, indent=2, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written temporary behind
        raise


def write_manifest(ckpt: Path, step: int, meta: dict[str, Any]) -> dict[str, Any]:
    """List every file with size and sha256, then write manifest.json last: its presence marks completeness."""
    files = {}
    for p in sorted(ckpt.rglob("*")):
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(f".{MANIFEST}"):
            rel = p.relative_to(ckpt).as_posix()
            files[rel] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    manifest = {"step": step, "files": files, "ftrun_version": __version__, **meta}
    # fsync the data files before the manifest claims them
    for rel in files:
        fd = os.open(ckpt / rel, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    atomic_write_json(ckpt / MANIFEST, manifest)
    return manifest


@dataclass(frozen=True)
class Verified:
    path: Path
    step: int
    manifest: dict[str, Any]


def verify(ckpt: Path, expect: Optional[dict[str, Any]] = None) -> tuple[Optional[Verified], str]:
    """(Verified, "") when every file matches the manifest (and `expect`'s keys match), else (None, why)."""
    mpath = ckpt / MANIFEST
    if not mpath.is_file():
        return None, "no manifest (the save did not finish)"
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        step = int(manifest["step"])
    except (ValueError, KeyError, TypeError) as exc:
        return None, f"unreadable manifest ({exc})"
    for key, value in (expect or {}).items():
        accepted = value if isinstance(value, (list, tuple, set, frozenset)) else (value,)
        if manifest.get(key) not in accepted:
            return None, f"manifest {key}={manifest.get(key)!r}, this run has {value!r}"
    for rel, info in files.items():
        p = ckpt / rel
        if not p.is_file():
            return None, f"{rel} is missing"
        if p.stat().st_size != info["size"]:
            return None, f"{rel} has {p.stat().st_size} bytes, manifest says {info['size']}"
        if sha256_file(p) != info["sha256"]:
            return None, f"{rel} does not match its sha256"
    return Verified(ckpt, step, manifest), ""


def candidates(ckpt_root: Path) -> list[Path]:
    """Checkpoint folders, newest step first."""
    if not ckpt_root.is_dir():
        return []
    found = []
    for p in ckpt_root.iterdir():
        if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit():
            found.append((int(p.name[len(PREFIX):]), p))
    return [p for _, p in sorted(found, reverse=True)]


def newest_verified(ckpt_root: Path, expect: Optional[dict[str, Any]] = None) -> tuple[Optional[Verified], list[str]]:
    """The newest checkpoint that verifies, and a line for each newer one skipped with its reason."""
    skipped = []
    for p in candidates(ckpt_root):
        ok, why = verify(p, expect)
        if ok:
            return ok, skipped
        skipped.append(f"{p.name}: {why}")
    return None, skipped


def newest_step_unverified(ckpt_root: Path) -> Optional[int]:
    """The newest step with a manifest present, without hashing (cheap, for `ftrun status`)."""
    for p in candidates(ckpt_root):
        if (p / MANIFEST).is_file():
            return int(p.name[len(PREFIX):])
    return None


def remove_incomplete(ckpt_root: Path) -> list[str]:
    """Delete half-written saves (the trainer's temporary `checkpoint-N` folders, step folders without manifest)."""
    removed = []
    if not ckpt_root.is_dir():
        return removed
    for p in ckpt_root.iterdir():
        if p.is_dir() and (p.name.startswith("checkpoint-") or (p.name.startswith(PREFIX) and not (p / MANIFEST).is_file())):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return removed


def retain(ckpt_root: Path, keep: int) -> list[str]:
    """Keep the newest `keep` complete checkpoints; delete older ones (never the newest complete one)."""
    complete = [p for p in candidates(ckpt_root) if (p / MANIFEST).is_file()]
    removed = []
    for p in complete[keep:]:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    return removed
