"""The interface every copy destination implements (launcher/store/sync/__init__.py lists the kinds): put and get
files, list and remove folders, and prove a copied folder against its manifest."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Optional

from launcher.errors import SyncError
from launcher.store import checkpoint as ckpt


class Destination:
    """One off-box location; paths below it are relative, '/'-separated."""

    url: str

    def put_file(self, local: Path, rel: str) -> None: ...
    def get_file(self, rel: str, local: Path) -> bool: ...
    def list_dirs(self, rel: str) -> list[str]: ...
    def remove_dir(self, rel: str) -> None: ...

    def read_bytes_sha256(self, rel: str) -> Optional[str]:
        """The sha256 of the copy's file at `rel` (None where there is none), downloaded to hash it."""
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / "f"
            return ckpt.sha256_file(target) if self.get_file(rel, target) else None

    def put_dir(self, local: Path, rel: str, last: str = ckpt.MANIFEST) -> None:
        """Every file of `local`, the `last` one at the end: its presence marks the copy complete."""
        files = sorted(p for p in local.rglob("*") if p.is_file())
        for p in files:
            if p.name != last:
                self.put_file(p, f"{rel}/{p.relative_to(local).as_posix()}")
        if (local / last).is_file():
            self.put_file(local / last, f"{rel}/{last}")

    def put_files(self, files: list[tuple[Path, str]], message: str = "") -> None:
        """Several files ((local, rel) pairs) in order; a destination with commits makes them one."""
        for local, rel in files:
            self.put_file(local, rel)

    def remove_dirs(self, rels: list[str]) -> None:
        for rel in rels:
            self.remove_dir(rel)

    def get_dir(self, rel: str, local: Path, files: list[str]) -> None:
        for name in files:
            if not self.get_file(f"{rel}/{name}", local / name):
                raise SyncError(f"{self.url}/{rel}/{name} disappeared while fetching it")

    def verify_dir(self, rel: str, manifest: dict[str, Any], local: Optional[Path] = None) -> tuple[bool, str]:
        """Whether the copy at `rel` holds the manifest's files (`local`: the folder sent, to compare against)."""
        for name, info in manifest["files"].items():
            digest = self.read_bytes_sha256(f"{rel}/{name}")
            if digest is None:
                return False, f"{rel}/{name} is missing off the box"
            if digest != info["sha256"]:
                return False, f"{rel}/{name} differs from the manifest off the box"
        return True, ""
