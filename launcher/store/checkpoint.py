"""Checkpoint layout (`checkpoints/step-000120/`), the manifest written last, verification, newest, retention.

Retention here (`retain`, the recipe's `keep_checkpoints`) prunes the checkpoints on the box only; the copies off
the box are pruned separately by launcher/store/sync/transfer.py `push_checkpoint` (the recipe's `sync.keep`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from launcher import __version__
from launcher.store.modes import apply_umask

MANIFEST = "manifest.json"
PREFIX = "step-"
# The resume choice of the one process per disk that verified, for the others of the same launch.
CHOICE = ".resume-choice.json"
_READ = 8 << 20  # bytes per read, one buffer per file being hashed: few system calls, hashed without the GIL


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:06d}"


def sha256_file(path: Path) -> str:
    return hash_file(path, hashlib.sha256())


def hash_file(path: Path, h: Any) -> str:
    """The hex digest of `h` (a hashlib object, possibly primed) updated with the file's bytes."""
    buf = bytearray(_READ)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])  # hashlib releases the GIL on buffers over 2 KiB: threads hash in parallel
    return h.hexdigest()


def hash_workers() -> int:
    """Threads for hashing: one per core of the affinity, at most 16 (past that the disk is the limit)."""
    return max(1, min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def sha256_files(paths: list[Path], workers: Optional[int] = None, fsync: bool = False) -> list[str]:
    """sha256 of each file (in the order given), several at once, the largest first; `fsync`: flush each after."""
    workers = max(1, min(workers or hash_workers(), len(paths) or 1))

    def one(path: Path) -> str:
        digest = sha256_file(path)
        if fsync:
            with path.open("rb") as fh:
                os.fsync(fh.fileno())
        return digest

    if workers == 1:
        return [one(p) for p in paths]
    # Plain threads: concurrent.futures refuses work once the interpreter exits, and a background manifest must finish
    queue = iter(sorted(range(len(paths)), key=lambda i: paths[i].stat().st_size, reverse=True))
    digests: list[Optional[str]] = [None] * len(paths)
    failed: list[BaseException] = []
    lock = threading.Lock()

    def work() -> None:
        while not failed:
            with lock:
                i = next(queue, None)
            if i is None:
                return
            try:
                digests[i] = one(paths[i])
            except BaseException as exc:  # noqa: BLE001 - raised in the caller below
                failed.append(exc)

    threads = [threading.Thread(target=work, name=f"ftrun-hash-{k}") for k in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise failed[0]
    return digests  # type: ignore[return-value]


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


def write_manifest(ckpt: Path, step: int, meta: dict[str, Any], workers: Optional[int] = None) -> dict[str, Any]:
    """List every file with size and sha256, then write manifest.json last: its presence marks completeness."""
    # the weights as readable as the rest (safetensors writes them 0600, store/modes.py)
    apply_umask(ckpt)
    files = (p for p in sorted(ckpt.rglob("*")) if p.is_file())
    paths = [p for p in files if p.name != MANIFEST and not p.name.startswith(f".{MANIFEST}")]
    # each data file is fsynced before the manifest claims it
    digests = sha256_files(paths, workers, fsync=True)
    files = {p.relative_to(ckpt).as_posix(): {"size": p.stat().st_size, "sha256": d} for p, d in zip(paths, digests)}
    manifest = {"step": step, "files": files, "ftrun_version": __version__, **meta}
    atomic_write_json(ckpt / MANIFEST, manifest)
    return manifest


class ManifestFailed(RuntimeError):
    """A checkpoint's manifest was not written, so that checkpoint does not exist (the cause: the writer's error)."""


class ChoiceCancelled(RuntimeError):
    """A stop (SIGTERM/SIGINT) came while waiting for the resume choice: nothing was trained, nothing to save."""


class BackgroundManifest:
    """The newest checkpoint's manifest, hashed and written by a background thread while training goes on; until
    then the folder is no checkpoint. The owner waits for it before the next checkpoint and before it exits."""

    def __init__(self, log: Callable[[str], None] = print):
        self.log = log
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[str] = None  # why the last manifest was not written
        self.exception: Optional[BaseException] = None  # the same, as raised (check() raises from it)
        self.seconds: Optional[float] = None  # how long the last one took

    @property
    def pending(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(
        self,
        ckpt: Path,
        step: int,
        meta: dict[str, Any],
        then: Optional[Callable[[], None]] = None,
        workers: Optional[int] = None,
    ) -> None:
        """Hash `ckpt` and write its manifest in the background; `then` runs after the manifest (retention)."""
        if self.pending:
            raise RuntimeError("a checkpoint's manifest is still being written: wait() for it first")
        self.error = self.exception = None

        def work() -> None:
            t0 = time.monotonic()
            try:
                write_manifest(ckpt, step, meta, workers)
            except BaseException as exc:  # noqa: BLE001 - check() raises it in the owner, the folder stays incomplete
                self.error, self.exception = f"{type(exc).__name__}: {exc}", exc
                self.log(
                    f"checkpoint {ckpt.name} not completed, its manifest could not be written ({self.error}); "
                    "the folder is removed as incomplete at the next start"
                )
                return
            self.seconds = time.monotonic() - t0
            if then is not None:
                try:
                    then()
                except Exception as exc:  # retention or a report: the checkpoint itself is complete
                    self.log(f"after checkpoint {ckpt.name}: {type(exc).__name__}: {exc}")

        # not a daemon: an interpreter that exits for any reason still finishes the manifest first
        self._thread = threading.Thread(target=work, name=f"ftrun-manifest-{step}", daemon=False)
        self._thread.start()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """True when no manifest is being written any more (at once when none was)."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
        return True

    def check(self) -> None:
        """After wait(): raise ManifestFailed when the last manifest was not written (else saves pile up)."""
        if self.exception is not None and not self.pending:
            raise ManifestFailed(f"the checkpoint's manifest could not be written ({self.error})") from self.exception


@dataclass(frozen=True)
class Verified:
    path: Path
    step: int
    manifest: dict[str, Any]


def verify(
    ckpt: Path, expect: Optional[dict[str, Any]] = None, workers: Optional[int] = None
) -> tuple[Optional[Verified], str]:
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
    for rel, info in files.items():  # the cheap checks first: a torn copy fails without hashing anything
        p = ckpt / rel
        if not p.is_file():
            return None, f"{rel} is missing"
        if p.stat().st_size != info["size"]:
            return None, f"{rel} has {p.stat().st_size} bytes, manifest says {info['size']}"
    rels = list(files)
    for rel, digest in zip(rels, sha256_files([ckpt / rel for rel in rels], workers)):
        if digest != files[rel]["sha256"]:
            return None, f"{rel} does not match its sha256"
    return Verified(ckpt, step, manifest), ""


def candidates(ckpt_root: Path) -> list[Path]:
    """Checkpoint folders, newest step first."""
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    found = [p for p in found if p.name[len(PREFIX) :].isdigit()]
    return sorted(found, key=lambda p: (int(p.name[len(PREFIX) :]), p), reverse=True)


def newest_verified(
    ckpt_root: Path, expect: Optional[dict[str, Any]] = None, workers: Optional[int] = None
) -> tuple[Optional[Verified], list[str]]:
    """The newest checkpoint that verifies, and a line for each newer one skipped with its reason."""
    skipped = []
    for p in candidates(ckpt_root):
        ok, why = verify(p, expect, workers)
        if ok:
            return ok, skipped
        skipped.append(f"{p.name}: {why}")
    return None, skipped


# Verify once per disk: one process hashes, the others of the same launch take its choice.


def publish_choice(path: Path, launch: dict[str, Any], found: Optional[Verified], skipped: list[str]) -> None:
    """Write the verifier's resume choice for the other processes of this launch (atomically)."""
    atomic_write_json(
        path,
        {
            "launch": launch,
            "written": time.time(),
            "checkpoint": found.path.name if found else None,
            "step": found.step if found else None,
            # the waiters check that the manifest they read is the one that was verified
            "manifest_sha256": sha256_file(found.path / MANIFEST) if found else None,
            "skipped": skipped,
        },
    )


def await_choice(
    path: Path,
    ckpt_root: Path,
    launch: dict[str, Any],
    not_before: float,
    timeout: float,
    cancelled: Callable[[], bool] = lambda: False,
    poll: float = 0.2,
) -> Optional[Verified]:
    """The checkpoint the verifier of this launch chose (None: start fresh), without hashing the files again; a
    choice counts when it names this launch and was written after `not_before` (the launcher's start)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            choice = json.loads(path.read_text())
        except (OSError, ValueError):
            choice = None
        if choice and choice.get("launch") == launch and float(choice.get("written", 0)) >= not_before:
            break
        if cancelled():
            raise ChoiceCancelled("stopped while waiting for the resume checkpoint to be verified")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no resume choice in {path} after {timeout:.0f} s: the process that verifies the "
                "checkpoints on this disk (each node's local rank 0 when the run spans several nodes, "
                "else rank 0) did not finish; its log says why"
            )
        time.sleep(poll)
    if choice["checkpoint"] is None:
        return None
    folder = ckpt_root / choice["checkpoint"]
    mpath = folder / MANIFEST
    if not mpath.is_file() or sha256_file(mpath) != choice["manifest_sha256"]:
        raise RuntimeError(f"{folder} changed after it was verified for this launch (its manifest differs)")
    return Verified(folder, int(choice["step"]), json.loads(mpath.read_text()))


def choice_timeout(ckpt_root: Path, rate: float = 50e6, floor: float = 600.0) -> float:
    """How long a waiter gives the verifier: `floor`, then every complete checkpoint hashed at `rate` (bytes/s)."""
    total = 0
    for p in candidates(ckpt_root):
        try:
            total += sum(int(f["size"]) for f in json.loads((p / MANIFEST).read_text())["files"].values())
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return floor + total / rate


def newest_step_unverified(ckpt_root: Path) -> Optional[int]:
    """The newest step with a manifest present, without hashing (cheap, for `ftrun status`)."""
    for p in candidates(ckpt_root):
        if (p / MANIFEST).is_file():
            return int(p.name[len(PREFIX) :])
    return None


def remove_incomplete(ckpt_root: Path) -> list[str]:
    """Delete half-written saves (the trainer's temporary `checkpoint-N` folders, step folders without manifest)."""
    removed = []
    if not ckpt_root.is_dir():
        return removed
    for p in ckpt_root.iterdir():
        if p.is_dir() and (
            p.name.startswith("checkpoint-") or (p.name.startswith(PREFIX) and not (p / MANIFEST).is_file())
        ):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return removed


def retain(ckpt_root: Path, keep: int) -> list[str]:
    """Keep the newest `keep` complete checkpoints; delete older ones (never the newest complete one)."""
    complete = [p for p in candidates(ckpt_root) if (p / MANIFEST).is_file()]
    for p in complete[keep:]:
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in complete[keep:]]
