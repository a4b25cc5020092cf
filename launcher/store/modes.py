"""The permission bits of a run's results: what the umask gives any new file, also to files a library wrote private.

safetensors 0.8 writes every file into a temporary file of the `tempfile` crate, created 0600, and renames it into
place (safetensors PR #764; issue #782), so `save_file` and every `save_pretrained` leave adapter_model.safetensors
and model.safetensors readable by their owner only, while the JSON beside them is 0644 under umask 022. A vLLM or
Ollama server that runs as another user could then not read the model it serves.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable


def umask() -> int:
    """The process's umask. Linux reports it in /proc/self/status (since 4.7), which reads it without changing it;
    elsewhere it is set and put back at once (os.umask is the only other way to read it)."""
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
    """The mode a file or folder created now would have: 0o666 less the umask, or 0o777 less the umask for a folder
    and for a file that is executable (a script stays one)."""
    if is_dir or current & 0o111:
        return 0o777 & ~mask
    return 0o666 & ~mask


def apply_umask(root: Path) -> list[str]:
    """`root` and everything below it given the mode `wanted_mode` says (symbolic links are left as they are).
    Returns one line for each path whose mode could not be changed (a file system without chmod, such as an object
    store mount, or a file of another user), for the caller to say; the files themselves are intact either way."""
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
    """A run's final/ as readable as every other file of the run, each path that keeps its mode said once. Called
    after the worker's final save (the supervisor) and after each export (the supervisor's, `ftrun export`)."""
    for problem in apply_umask(final):
        say(f"could not set the umask's mode on {problem}; a server running as another user may not read it")
