"""Stale locks of torch's extension builds, which would make the next attempt wait forever.

DeepSpeed compiles its ops the first time a process needs them (DeepSpeedCPUAdam for an offloaded optimizer, the
shared-memory communication op on a CPU): deepspeed/ops/op_builder/builder.py jit_load calls torch's
cpp_extension.load, which takes a lock file in the op's build folder for the build (torch 2.13
utils/cpp_extension.py _jit_compile: FileBaton(build_directory/"lock")) and removes it after. A process killed
while it holds it (a kill -9, the watchdog's SIGKILL, a preemption) leaves the file, and every later process that
needs the op waits for it without end (utils/file_baton.py FileBaton.wait: it polls for the file to vanish). The
attempt then looks silent at start-up to the watchdog, is restarted, and waits again.

Before each attempt the supervisor removes a lock that nothing can still hold (clear_stale): older than
STALE_AFTER_S, and no process working in its folder (the build's ninja and compiler run there, torch's
_run_ninja_build: cwd=build_directory). A build under way, of this run or of another job on the box, keeps its lock.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Optional

# A holder writes its build file and starts ninja in the folder within a second or two of taking the lock; a lock
# older than this with nothing working in its folder is left by a process that is gone.
STALE_AFTER_S = 60.0


def roots() -> list[Path]:
    """Where torch builds extensions: TORCH_EXTENSIONS_DIR (each op's folder right below it), else the user cache's
    torch_extensions (a folder per Python and accelerator, then the op's: cpp_extension.py _get_build_directory,
    get_default_build_root with torch/_appdirs.py user_cache_dir: XDG_CACHE_HOME or ~/.cache)."""
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
    """The working folders of this box's processes that can be read: the user's own (a build folder is in the
    user's cache, written by the user's processes; another user's cwd is not readable without privileges)."""
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
