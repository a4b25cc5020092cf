"""launcher/run/build_locks.py: a lock left in a torch extension's build folder by a killed process is removed before
the next attempt; a build under way keeps its lock. Real processes and torch's own FileBaton."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from launcher.run import build_locks


def _lock(folder, age_s: float):
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    lock.write_bytes(b"")
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_a_killed_builders_lock_goes_and_a_build_under_way_keeps_its_own(tmp_path, monkeypatch):
    root = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    # the holder was killed mid-build: torch's own baton takes the lock, the process dies with it
    (root / "cpu_adam").mkdir(parents=True)
    holder = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, sys\nfrom torch.utils.file_baton import FileBaton\n"
            "FileBaton(sys.argv[1]).try_acquire() or sys.exit(3)\nos._exit(0)",
            str(root / "cpu_adam" / "lock"),
        ],
        timeout=120,
    )
    assert holder.returncode == 0 and (root / "cpu_adam" / "lock").exists()
    old = time.time() - 2 * build_locks.STALE_AFTER_S
    os.utime(root / "cpu_adam" / "lock", (old, old))
    building = _lock(root / "shm_comm", 2 * build_locks.STALE_AFTER_S)  # ninja is at work in its folder
    fresh = _lock(root / "fused_adam", 1)  # just taken: its holder is about to start ninja
    ninja = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=building.parent)
    try:
        said = []
        removed = build_locks.clear_stale(said.append)
    finally:
        ninja.kill()
        ninja.wait()
    assert removed == [root / "cpu_adam" / "lock"] and not removed[0].exists()
    assert building.exists() and fresh.exists()
    assert len(said) == 1 and "stale build lock" in said[0] and "cpu_adam" in said[0]
    # what the next attempt's build does with the folder now: torch's baton is free at once
    waited = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys\nfrom torch.utils.file_baton import FileBaton\n"
            "b = FileBaton(sys.argv[1]); b.wait(); sys.exit(0 if b.try_acquire() else 4)",
            str(root / "cpu_adam" / "lock"),
        ],
        timeout=60,
    )
    assert waited.returncode == 0


def test_the_default_root_is_torchs(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert build_locks.roots() == [tmp_path / "torch_extensions"]
    from torch.utils.cpp_extension import get_default_build_root

    assert build_locks.roots() == [Path(get_default_build_root())]  # torch's own answer (its _appdirs)
    _lock(tmp_path / "torch_extensions" / "py311_cpu" / "deepspeed_shm_comm", 3 * build_locks.STALE_AFTER_S)
    assert build_locks.clear_stale(lambda _: None) == [
        tmp_path / "torch_extensions" / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    ]
    assert build_locks.clear_stale(lambda _: None) == []
