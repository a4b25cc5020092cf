"""The permission bits of a run's results: what the umask gives any new file, also to files a library wrote private.

safetensors 0.8 writes every file through a temporary file created 0600 (safetensors PR #764; issue #782), so the
weights are readable by their owner only, and a server running as another user could not read them.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable


def umask() -> int:
    """The process's umask: /proc/self/status (Linux 4.7+) reads it without changing it; else set and put back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def wanted_mode(current: int, is_dir: bool, mask: int) -> int:
    """The mode a path created now would have (0o777 for a folder or an executable, else 0o666, less the umask)."""
    if is_dir or current & 0o111:
        return 0o777 & ~mask
    return 0o666 & ~mask


def apply_umask(root: Path) -> list[str]:
    """`root` and all below it given `wanted_mode`; one line for each path whose mode could not be changed."""
    root = Path(root)
    if not root.exists():
        return []
    mask = umask()
    problems: list[str] = []
    paths = [root, *root.rglob("*")] if root.is_dir() else [root]
    for path in paths:
        try:
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                continue
            want = wanted_mode(stat.S_IMODE(st.st_mode), stat.S_ISDIR(st.st_mode), mask)
            if stat.S_IMODE(st.st_mode) != want:
                os.chmod(path, want)
        except FileNotFoundError:
            continue  # removed meanwhile (a checkpoint retired by retention): nothing to give a mode to
        except OSError as exc:
            problems.append(f"{path}: {exc.strerror or exc}")
    return problems


def share_results(final: Path, say: Callable[[str], None]) -> None:
    """A run's final/ as readable as every other file of the run (after the final save and each export)."""
    for problem in apply_umask(final):
        say(f"could not set the umask's mode on {problem}; a server running as another user may not read it")
