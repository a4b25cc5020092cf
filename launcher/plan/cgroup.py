"""The container's own limits: the memory and CPU a cgroup gives this process (inside a container psutil and
os.cpu_count() show the host's), and its OOM-kill count. Read from the kernel's files (Documentation/admin-guide/
cgroup-v2.rst, cgroup-v1/memory.rst) at every level from the process's cgroup (/proc/self/cgroup) up to the mount's
root (/proc/self/mountinfo); the smallest limit wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

# cgroup v1 writes PAGE_COUNTER_MAX (about 2**63) for "no limit"
_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class _Mount:
    point: Path  # where the hierarchy is mounted
    root: str  # the cgroup path that mount point shows (mountinfo's 4th field)
    version: int  # 1 or 2
    controllers: frozenset[str]


def _mounts(root: Path) -> list[_Mount]:
    try:
        lines = (root / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        # "36 25 0:31 / /sys/fs/cgroup/memory rw,relatime shared:14 - cgroup cgroup rw,memory"
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or not tail:
            continue
        if tail[0] == "cgroup2":
            found.append(_Mount(root / fields[4].lstrip("/"), fields[3], 2, frozenset()))
        elif tail[0] == "cgroup" and len(tail) >= 3:
            found.append(_Mount(root / fields[4].lstrip("/"), fields[3], 1, frozenset(tail[2].split(","))))
    return found


def _own_paths(root: Path) -> dict[str, str]:
    """controller ('' for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return {}
    paths: dict[str, str] = {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path
    return paths


def _levels(mount: _Mount, path: str) -> list[Path]:
    """The directories from this process's cgroup up to the mount's root (the mount's root alone when the path is
    not under it, as inside a cgroup namespace or a container that mounts only its own subtree)."""
    rel = path
    if mount.root not in ("", "/") and (path == mount.root or path.startswith(mount.root.rstrip("/") + "/")):
        rel = path[len(mount.root.rstrip("/")) :]
    parts = [p for p in rel.split("/") if p]
    levels = [mount.point.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    existing = [d for d in levels if d.is_dir()]
    return existing or [mount.point]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _hierarchy(root: Path, controller: str) -> tuple[int, list[Path]] | None:
    """(version, directories to read) for a controller: v2 when it is enabled there, else its v1 hierarchy."""
    own = _own_paths(root)
    mounts = _mounts(root)
    for m in mounts:
        if m.version == 2 and "" in own:
            dirs = _levels(m, own[""])
            enabled = _read(m.point / "cgroup.controllers") or ""
            if controller in enabled.split() or any((d / f"{controller}.max").exists() for d in dirs):
                return 2, dirs
    for m in mounts:
        if m.version == 1 and controller in m.controllers:
            return 1, _levels(m, own.get(controller, "/"))
    return None


def memory_limit_bytes(root: Path = Path("/")) -> int | None:
    """The smallest memory limit on this process's cgroup or its ancestors; None where none is set or readable."""
    version, dirs = _hierarchy(root, "memory") or (0, [])
    limits = []
    for d in dirs:
        text = _read(d / ("memory.max" if version == 2 else "memory.limit_in_bytes"))
        if text and text != "max":
            try:
                value = int(text)
            except ValueError:
                continue
            if 0 < value < _UNLIMITED:
                limits.append(value)
    return min(limits) if limits else None


def cpu_limit(root: Path = Path("/")) -> int | None:
    """The CPU quota as whole cores (rounded up), the smallest over the hierarchy; None where no quota is set."""
    version, dirs = _hierarchy(root, "cpu") or (0, [])
    cores = []
    for d in dirs:
        if version == 2:
            parts = (_read(d / "cpu.max") or "max").split()
            quota, period = (parts + ["100000"])[:2]
        else:
            quota, period = _read(d / "cpu.cfs_quota_us") or "-1", _read(d / "cpu.cfs_period_us") or "100000"
        try:
            q, p = int(quota), int(period)
        except ValueError:
            continue  # "max" on v2
        if q > 0 and p > 0:
            cores.append(max(1, math.ceil(q / p)))
    return min(cores) if cores else None


def oom_kills(root: Path = Path("/")) -> int | None:
    """How many processes the kernel has OOM-killed in this process's own cgroup; None where the kernel does not say."""
    version, dirs = _hierarchy(root, "memory") or (0, [])
    if not dirs:
        return None
    text = _read(dirs[0] / ("memory.events" if version == 2 else "memory.oom_control"))
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def memory_headroom_bytes(root: Path = Path("/")) -> int | None:
    """What the cgroup lets its processes still allocate: the limit less what they use now (page cache included: a
    floor); None where no limit is set."""
    limit = memory_limit_bytes(root)
    version, dirs = _hierarchy(root, "memory") or (0, [])
    if limit is None or not dirs:
        return None
    used = _read(dirs[0] / ("memory.current" if version == 2 else "memory.usage_in_bytes"))
    try:
        return max(0, limit - int(used or "0"))
    except ValueError:
        return limit
