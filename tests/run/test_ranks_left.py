"""A restart waits until every rank of the ended attempt is gone; a rank that stays (stuck in the GPU driver, where
SIGKILL cannot end it, and its GPU memory with it) stops the run, named by pid, state and GPU.

Real processes. A CPU cannot make a process SIGKILL does not end, so the wait is tested with a rank that ignores
SIGTERM and ends later on its own, and one the test keeps alive; the supervisor's whole path (the watchdog ends a
silent attempt, the wait, the stop) with the one thing a CPU cannot do modelled: SIGKILL withheld from one rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from launcher.run import rank_processes, supervisor, views

# A rank that ignores SIGTERM, says it is ready, and ends when the test writes a line to it.
RANK = """
import signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
sys.stdin.readline()
"""


def _rank(procs: list, **env: str) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", RANK],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={
            k: v
            for k, v in {**os.environ, **env}.items()
            if k not in ("LOCAL_RANK", "RANK", "CUDA_VISIBLE_DEVICES") or k in env
        },
    )
    procs.append(p)
    assert p.stdout.readline() == b"ready\n"  # SIGTERM is ignored from here on
    return p


def test_a_rank_that_ends_late_is_waited_for(procs):
    rank = _rank(procs)
    rank.send_signal(signal.SIGTERM)  # ignored: it ends on its own, later
    looked: list[float] = []

    def interrupted() -> bool:  # called between looks while a rank is alive: the first one lets it end
        looked.append(time.monotonic())
        if len(looked) == 1:
            rank.stdin.write(b"go\n")
            rank.stdin.flush()
        return False

    started = time.monotonic()
    assert rank_processes._ranks_left([psutil.Process(rank.pid)], 60, interrupted) == []
    assert looked, "the wait returned while the rank was alive"
    assert time.monotonic() - started < 30  # it returned when the rank ended, not at the bound
    # the rank is a zombie until this test reaps it: gone for the wait (its memory and files are released)
    assert rank.poll() == 0


def test_a_rank_that_stays_is_named_with_its_state_and_gpu(procs):
    rank = _rank(procs, RANK="3", LOCAL_RANK="1", CUDA_VISIBLE_DEVICES="4,5")
    started = time.monotonic()
    left = rank_processes._ranks_left([psutil.Process(rank.pid)], 0.5)
    assert time.monotonic() - started >= 0.5
    assert left == [
        {
            "pid": rank.pid,
            "process_state": "sleeping",
            "rank": "3",
            "local_rank": "1",
            "cuda_visible_devices": "4,5",
            "gpu": "5",
        }
    ]
    assert rank.poll() is None  # only waited for: never signalled


def test_the_wait_ends_at_a_stop_and_skips_ranks_already_gone(procs):
    rank = _rank(procs)
    started = time.monotonic()
    assert rank_processes._ranks_left([psutil.Process(rank.pid)], 60, lambda: True) == []
    assert time.monotonic() - started < 30
    gone = psutil.Process(rank.pid)
    rank.kill()
    rank.wait()  # reaped: its pid may be anyone's now, the handle (pid and start time) is not
    started = time.monotonic()
    assert rank_processes._ranks_left([gone], 60) == []
    assert time.monotonic() - started < 30


def test_the_gpu_a_rank_uses_from_its_environment():
    gpu = rank_processes._rank_gpu
    assert gpu({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,5"}) == "5"
    assert gpu({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "GPU-aaa, GPU-bbb"}) == "GPU-bbb"
    assert gpu({"LOCAL_RANK": "2"}) == "2"  # every card visible: the index itself
    assert gpu({"CUDA_VISIBLE_DEVICES": "3"}) == "3"  # one process on one card
    assert gpu({"LOCAL_RANK": "2", "CUDA_VISIBLE_DEVICES": "0,1"}) is None
    assert gpu({"CUDA_VISIBLE_DEVICES": "0,1"}) is None and gpu({}) is None
    assert gpu({"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": ""}) is None  # no card visible


def test_the_stop_names_pid_state_gpu_and_the_way_out():
    ended = {
        "kind": "hang",
        "rank": 1,
        "world": 2,
        "step": 120,
        "phase": "step",
        "silent_seconds": 400,
        "expected_seconds": 0.5,
    }
    left = [
        {
            "pid": 4242,
            "process_state": "disk-sleep",
            "rank": "1",
            "local_rank": "1",
            "cuda_visible_devices": "0,1",
            "gpu": "1",
        },
        {"pid": 4243, "process_state": "disk-sleep"},
    ]
    text = views.ranks_left_reason(ended, left, 32.4)
    assert text.startswith("rank 1 silent for ")
    assert "not restarted: 2 process(es) of that attempt still alive 32 s after it ended: " in text
    assert "pid 4242 (rank 1, GPU 1: LOCAL_RANK=1, CUDA_VISIBLE_DEVICES=0,1) in state disk-sleep" in text
    assert "pid 4243 (its GPU unknown: no LOCAL_RANK or CUDA_VISIBLE_DEVICES readable in its environment)" in text
    assert "SIGKILL cannot end it" in text and "out of memory while loading" in text
    assert "nvidia-smi" in text and "run the same command to resume" in text
    assert "disk-sleep is" not in views.ranks_left_reason(ended, [{**left[0], "process_state": "sleeping"}], 5)


# --- the supervisor: a silent attempt ended, one rank outlives its SIGKILL ----------------------------------------

# torchrun standing in: two ranks on GPUs 6 and 7, each writing its pid; rank 0 ends on SIGTERM, rank 1 ignores it.
# Neither writes a heartbeat: the watchdog finds them silent past the start's deadline.
LAUNCHER = r'''
import os, subprocess, sys
rank = """
import os, signal, sys
if os.environ["RANK"] == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
path = sys.argv[1] + "/rank-" + os.environ["RANK"] + ".pid"
open(path + ".tmp", "w").write(str(os.getpid()))
os.replace(path + ".tmp", path)
while True:
    signal.pause()
"""
ranks = [subprocess.Popen([sys.executable, "-c", rank, sys.argv[1]],
                          env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), CUDA_VISIBLE_DEVICES="6,7"))
         for r in (0, 1)]
for p in ranks:
    p.wait()
'''


@pytest.mark.slow
def test_a_rank_that_outlives_its_sigkill_stops_the_run_before_a_relaunch(tmp_path, tiny_model, monkeypatch):
    from conftest import recipe_file

    run = tmp_path / "run"
    run.mkdir()
    recipe_file(run / "recipe.yaml", tiny_model, run, grace_seconds=1, max_restarts=3)
    (run / "plan.json").write_text(json.dumps({"engine": "ddp", "num_processes": 2, "device": "cpu"}))
    monkeypatch.setenv("FTRUN_WATCHDOG_FLOOR_S", "1")  # the start's deadline: 3 floors and a heartbeat, 5 s
    launches = []

    def launch_command(plan, run_dir, mode):
        launches.append(mode)
        return [sys.executable, "-c", LAUNCHER, str(tmp_path)]

    monkeypatch.setattr(supervisor, "launch_command", launch_command)
    stuck = tmp_path / "rank-1.pid"
    withheld = []
    send = psutil.Process.send_signal

    def send_signal(self, sig):  # a rank in the GPU driver: SIGKILL does not end it
        if sig == signal.SIGKILL and stuck.is_file() and self.pid == int(stuck.read_text()):
            withheld.append(self.pid)
            return
        send(self, sig)

    monkeypatch.setattr(psutil.Process, "send_signal", send_signal)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        assert supervisor.supervise(run) == 5
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        if stuck.is_file():
            try:
                os.kill(int(stuck.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    pid = int(stuck.read_text())
    assert withheld == [pid]
    assert launches == ["full"]  # never relaunched onto the GPU the rank holds
    state = json.loads((run / "state.json").read_text())
    assert state["state"] == "failed", state
    assert state["last_end"]["kind"] == "hang"
    assert state["ranks_left"] == [
        {
            "pid": pid,
            "process_state": "sleeping",
            "rank": "1",
            "local_rank": "1",
            "cuda_visible_devices": "6,7",
            "gpu": "7",
        }
    ]
    reason = state["reason"]
    assert "not restarted: 1 process(es) of that attempt still alive" in reason, reason
    assert f"pid {pid} (rank 1, GPU 7: LOCAL_RANK=1, CUDA_VISIBLE_DEVICES=6,7) in state sleeping" in reason
