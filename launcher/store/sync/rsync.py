"""Copies over SSH with rsync (sync.to: user@host:/path, alias:/path): every remote operation is an rsync call."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Optional

from launcher.errors import SyncError
from launcher.store import checkpoint as ckpt
from launcher.store.sync.base import Destination


class RsyncDestination(Destination):
    """rsync over SSH; every remote operation is an rsync call, so RSYNC_RSH or ~/.ssh/config decide how to connect."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        if shutil.which("rsync") is None:
            raise SyncError(
                "sync.to is an SSH destination but rsync is not installed on this box",
                fix="apt-get install -y rsync openssh-client (both ends need rsync).",
            )

    def _rsync(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        cmd = ["rsync"]
        if "RSYNC_RSH" not in os.environ:
            # Detached runs cannot answer a prompt: fail fast instead of hanging.
            cmd += ["-e", "ssh -o BatchMode=yes -o ConnectTimeout=20"]
        return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout)

    def _remote(self, rel: str) -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def put_file(self, local: Path, rel: str) -> None:
        # --mkpath (rsync >= 3.2.3) creates the missing folders on the remote side.
        res = self._rsync("-a", "--mkpath", str(local), self._remote(rel))
        if res.returncode != 0:
            raise SyncError(f"rsync to {self._remote(rel)} failed: {res.stderr.strip()[-300:]}")

    def put_dir(self, local: Path, rel: str, last: str = ckpt.MANIFEST) -> None:
        # One rsync for the data (fast, resumable), then the manifest alone.
        res = self._rsync("-a", "--mkpath", "--partial", f"--exclude={last}", f"{local}/", self._remote(rel) + "/")
        if res.returncode != 0:
            raise SyncError(f"rsync to {self._remote(rel)} failed: {res.stderr.strip()[-300:]}")
        if (local / last).is_file():
            self.put_file(local / last, f"{rel}/{last}")

    def get_file(self, rel: str, local: Path) -> bool:
        local.parent.mkdir(parents=True, exist_ok=True)
        res = self._rsync("-a", self._remote(rel), str(local))
        if res.returncode == 23 and ("No such file" in res.stderr or "link_stat" in res.stderr):
            return False
        if res.returncode != 0:
            raise SyncError(f"rsync from {self._remote(rel)} failed: {res.stderr.strip()[-300:]}")
        return True

    def get_dir(self, rel: str, local: Path, files: list[str]) -> None:
        local.mkdir(parents=True, exist_ok=True)
        res = self._rsync("-a", self._remote(rel) + "/", f"{local}/")
        if res.returncode != 0:
            raise SyncError(f"rsync from {self._remote(rel)} failed: {res.stderr.strip()[-300:]}")

    def list_dirs(self, rel: str) -> list[str]:
        res = self._rsync("--list-only", self._remote(rel) + "/")
        if res.returncode != 0:
            if "No such file" in res.stderr or "change_dir" in res.stderr:
                return []
            raise SyncError(f"cannot list {self._remote(rel)}: {res.stderr.strip()[-300:]}")
        rows = [line.split(None, 4) for line in res.stdout.splitlines() if line.startswith("d")]
        return [parts[4] for parts in rows if len(parts) == 5 and parts[4] not in (".", "..")]

    def remove_dir(self, rel: str) -> None:
        parent, _, name = rel.rpartition("/")
        with tempfile.TemporaryDirectory() as empty:
            # Delete exactly one folder: sync an empty folder with a filter that only sees `name`.
            res = self._rsync(
                "-r", "--delete", f"--include=/{name}/***", "--exclude=*", f"{empty}/", self._remote(parent) + "/"
            )
        if res.returncode != 0:
            raise SyncError(f"cannot remove {self._remote(rel)}: {res.stderr.strip()[-300:]}")

    def verify_dir(self, rel: str, manifest: dict[str, Any], local: Optional[Path] = None) -> tuple[bool, str]:
        if local is None:
            return super().verify_dir(rel, manifest)
        # rsync compares checksums on both ends; any itemized change means the copy differs.
        res = self._rsync("-a", "--checksum", "--dry-run", "--itemize-changes", f"{local}/", self._remote(rel) + "/")
        if res.returncode != 0:
            return False, res.stderr.strip()[-300:]
        changed = [l for l in res.stdout.splitlines() if l and not l.startswith(".d")]
        return (not changed), ("differs off the box: " + "; ".join(changed[:3]) if changed else "")
