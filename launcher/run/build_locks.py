"""Stale locks of torch's extension builds, which would make the next attempt wait forever.

DeepSpeed JIT-compiles its ops (deepspeed ops/op_builder/builder.py jit_load) under a lock file in the op's build
folder (torch 2.13 utils/cpp_extension.py _jit_compile: FileBaton(build_directory/"lock")); a process killed while it
holds it leaves the file, and every later one waits for it forever (utils/file_baton.py FileBaton.wait). Before each
attempt the supervisor removes a lock older than STALE_AFTER_S with no process working in its folder (ninja runs with
cwd=build_directory): a build under way keeps its lock.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Optional

# A holder starts ninja in the folder within seconds of taking the lock
STALE_AFTER_S = 60.0


def roots() -> list[Path]:
    """Where torch builds extensions: TORCH_EXTENSIONS_DIR, else the user cache's torch_extensions
    (cpp_extension.py get_default_build_root, torch/_appdirs.py user_cache_dir)."""
    own = os.environ.get("TORCH_EXTENSIONS_DIR")
    if own:
        return [Path(own)]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return [Path(cache) / "torch_extensions"]


def _locks(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(set(root.glob("*/lock")) | set(root.glob("*/*/lock")))


def _busy_folders() -> set[Path]:
    """The working folders of this box's processes that can be read (the user's own, whose cache holds the builds)."""
    import psutil

    folders: set[Path] = set()
    for p in psutil.process_iter():
        try:
            folders.add(Path(p.cwd()).resolve())
        except (psutil.Error, OSError):
            continue
    return folders


def clear_stale(say: Callable[[str], None], now: Optional[float] = None) -> list[Path]:
    """Remove the stale build locks (module docstring); each removal said through `say`. Returns the removed."""
    now = time.time() if now is None else now
    old = []
    for root in roots():
        for lock in _locks(root):
            try:
                if now - lock.stat().st_mtime >= STALE_AFTER_S:
                    old.append(lock)
            except OSError:
                continue
    if not old:
        return []
    busy = _busy_folders()
    removed = []
    for lock in old:
        if lock.parent.resolve() in busy:
            continue
        try:
            lock.unlink()
        except OSError:
            continue
        removed.append(lock)
        say(
            f"removed a stale build lock, {lock}: left by a process killed while it compiled "
            f"{lock.parent.name}, it would have made this attempt wait for that build forever"
        )
    return removed
