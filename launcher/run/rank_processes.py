"""A launcher's ranks as processes: found, signalled, waited for, each described by its pid, its state, its GPU."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from typing import Any, Callable, Optional


RANK_GONE_POLL_S = 0.1  # how often the ranks of an ended attempt are looked at while the supervisor waits for them
# /proc/PID/environ takes the memory map's lock (Linux fs/proc/base.c environ_read), which a stuck process may hold
ENVIRON_READ_S = 2.0


def _process_state(pid: int) -> Optional[str]:
    import psutil

    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return None


def _end_attempt(proc: subprocess.Popen, multi: bool, grace: float) -> list:
    """SIGTERM to the ranks (or the single worker), SIGKILL to them and the launcher after `grace` seconds (psutil
    handles: a reused pid is never signalled). Returns the ranks' handles ([] for a single worker)."""
    import psutil

    try:
        top = psutil.Process(proc.pid)
        procs = (top.children() if multi else []) + [top]
    except psutil.Error:
        return []
    for p in procs[:-1] if multi else procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass

    def kill() -> None:
        for p in procs:
            try:
                if p.is_running():
                    p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass

    timer = threading.Timer(grace, kill)
    timer.daemon = True
    timer.start()
    return procs[:-1]


def _ranks_left(procs: list, bound_s: float, interrupted: Callable[[], bool] = lambda: False) -> list[dict[str, Any]]:
    """The processes among `procs` (psutil handles) still alive after up to `bound_s` seconds, with _rank_facts; []
    when all are gone or once `interrupted()`. A zombie is gone: its memory and files are released first (Linux
    kernel/exit.c do_exit); is_running compares the start time (psutil Process.is_running)."""
    import psutil

    def alive(p) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + bound_s
    left = [p for p in procs if alive(p)]
    while left and time.monotonic() < deadline:
        if interrupted():
            return []
        time.sleep(RANK_GONE_POLL_S)
        left = [p for p in left if alive(p)]
    return [_rank_facts(p) for p in left]


def _rank_facts(p) -> dict[str, Any]:
    """pid, psutil's process state and, where its starting environment is readable, RANK, LOCAL_RANK,
    CUDA_VISIBLE_DEVICES and the GPU they name."""
    import psutil

    facts: dict[str, Any] = {"pid": p.pid}
    try:
        facts["process_state"] = p.status()
    except psutil.Error:
        pass
    env: dict[str, str] = {}

    def read() -> None:
        try:
            env.update(p.environ())
        except psutil.Error:  # gone, or another user's
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(ENVIRON_READ_S)
    got = {} if reader.is_alive() else env
    for key in ("RANK", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"):
        if key in got:
            facts[key.lower()] = got[key]
    gpu = _rank_gpu(got)
    if gpu is not None:
        facts["gpu"] = gpu
    return facts


def _rank_gpu(env: dict[str, str]) -> Optional[str]:
    """The GPU a rank uses (cuda:LOCAL_RANK, loading.select_device) as CUDA_VISIBLE_DEVICES names it; None unsaid."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in visible.split(",")] if visible else []
    try:
        local: Optional[int] = int(env["LOCAL_RANK"])
    except (KeyError, ValueError):
        local = None
    if local is None:
        return entries[0] if len(entries) == 1 else None
    if visible is None:
        return str(local)
    return entries[local] if 0 <= local < len(entries) else None


def _ranks(launcher: subprocess.Popen) -> list[int]:
    """The pids of a launcher's ranks: its direct children (torch 2.13 subprocess_handler.py
    SubprocessHandler._popen; accelerate launch runs the agent in-process; numactl execs into the rank)."""
    return [p.pid for p in _rank_handles(launcher)]


def _rank_handles(launcher: subprocess.Popen) -> list:
    """psutil handles of a launcher's ranks; [] once it has exited."""
    import psutil

    try:
        return psutil.Process(launcher.pid).children()
    except psutil.Error:
        return []
