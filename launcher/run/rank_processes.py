"""A launcher's ranks as processes: found, signalled, waited for, each described by its pid, its state, its GPU."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from typing import Any, Callable, Optional


RANK_GONE_POLL_S = 0.1  # how often the ranks of an ended attempt are looked at while the supervisor waits for them
# Reading a process's environment (/proc/PID/environ) takes its memory map's lock (Linux fs/proc/base.c environ_read,
# access_remote_vm), which a process stuck in the kernel may hold: the supervisor reads it aside, this long at most.
ENVIRON_READ_S = 2.0


def _process_state(pid: int) -> Optional[str]:
    import psutil

    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return None


def _end_attempt(proc: subprocess.Popen, multi: bool, grace: float) -> list:
    """SIGTERM to the ranks (or the single worker), then SIGKILL to them and the launcher after `grace` seconds in a
    timer thread. A hung rank cannot save (its peers wait for it in the save's collectives), so what remains is
    the newest verified checkpoint; psutil's handles make sure a pid reused meanwhile is never signalled. Returns
    the launcher's ranks' handles ([] for a single worker: the supervisor's wait reaps it)."""
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
    """The processes among `procs` (psutil handles) still alive after up to `bound_s` seconds, each with its facts
    (_rank_facts); [] when every one is gone, or as soon as `interrupted()` holds.

    A zombie counts as gone: the kernel unmapped its memory and closed its files, the GPU's device files included,
    before it became one (Linux kernel/exit.c do_exit: exit_mm and exit_files before exit_notify). is_running
    compares the start time too (psutil/__init__.py Process.is_running): a pid reused meanwhile is not the rank."""
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
    """pid, psutil's process state ("disk-sleep": uninterruptible, in the kernel) and, where its environment is
    readable, its RANK, LOCAL_RANK, CUDA_VISIBLE_DEVICES and the GPU they name (_rank_gpu). The environment is the
    one the process started with (psutil environ(), /proc/PID/environ): torchrun sets LOCAL_RANK there."""
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
    """The GPU a rank uses, as CUDA_VISIBLE_DEVICES names it: its entry LOCAL_RANK (loading.select_device makes
    cuda:LOCAL_RANK current), LOCAL_RANK itself where nothing hides cards, the one entry of a one-card list; None
    where the environment does not say."""
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
    """The pids of a launcher's ranks: its direct children.

    torch 2.13 elastic/multiprocessing/subprocess_handler/subprocess_handler.py SubprocessHandler._popen
    starts each rank as a child of the agent, which is torchrun itself or, for accelerate launch, the
    launch process (commands/launch.py multi_gpu_launcher runs torch.distributed.run in-process); a
    numactl wrapper (NUMA binding on GPU boxes) execs into the rank and keeps its pid.
    """
    return [p.pid for p in _rank_handles(launcher)]


def _rank_handles(launcher: subprocess.Popen) -> list:
    """psutil handles of a launcher's ranks (_ranks); [] once it has exited."""
    import psutil

    try:
        return psutil.Process(launcher.pid).children()
    except psutil.Error:
        return []
