"""A run is live only when its lock is held by the recorded process (pid, start time, boot); nothing else is
signalled. Workers left behind by a supervisor killed hard are ended before the next launch trains."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import RESUME_FIELDS, recipe_file
from helpers import (
    REPO,
    assert_same_run,
    freeze_worker,
    ftrun,
    has_checkpoint,
    read_state,
    status,
    wait_for,
    wait_until_ended,
)
from launcher.store.rundir import RunDir
from launcher.store.state import is_locked, process_identity, run_holder, run_processes, same_process, set_state


def _alive(proc: subprocess.Popen) -> bool:
    return proc.poll() is None


def _spawn(*argv: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw
    )


@pytest.fixture
def run_dir(tmp_path, tiny_model) -> Path:
    """A run directory with its recipe (no plan, nothing started): what status, logs and stop read."""
    run = tmp_path / "run"
    run.mkdir()
    recipe_file(run / "recipe.yaml", tiny_model, run)
    (run / "train.log").write_text("[ftrun supervisor] starting worker\n")
    return run


def _hold_lock(run: Path) -> int:
    """Take the run's lock as a supervisor does (exclusive flock); the caller closes the fd to release it."""
    fd = os.open(run / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_process_identity_tells_a_later_process_apart(procs):
    sleeper = _spawn("sleep", "60")
    procs.append(sleeper)
    ident = process_identity(sleeper.pid)
    assert ident["pid"] == sleeper.pid and ident["start"] > 0 and ident["ppid"] == os.getpid()
    assert same_process(ident)
    assert not same_process({**ident, "start": ident["start"] - 1})  # the same pid, started at another time
    assert not same_process({**ident, "boot": "another-boot"})  # the same pid and ticks after a reboot
    assert not same_process({"pid": sleeper.pid})  # a bare pid proves nothing
    sleeper.kill()
    wait_for(lambda: process_identity(sleeper.pid) is None, 5, "the killed process to read as gone")
    assert not same_process(ident)  # a zombie (killed, not yet reaped) is gone: it holds no lock
    sleeper.wait()
    assert process_identity(sleeper.pid) is None


@pytest.mark.parametrize(
    "case",
    [
        "bare pid (older state.json)",
        "identity matches, lock free (restarted box)",
        "lock held, start time differs (pid reused)",
    ],
)
def test_a_stale_pid_is_never_running_nor_signalled(run_dir, tmp_path, procs, case):
    """state.json names a live process that is not the run's supervisor: status says not running, logs -f
    returns, stop signals nothing (the process lives on)."""
    sleeper = _spawn("sleep", "60", start_new_session=True)
    procs.append(sleeper)
    ident = process_identity(sleeper.pid)
    fields = {"supervisor_pid": sleeper.pid, "worker_pid": sleeper.pid}
    fd = None
    if case.startswith("identity"):
        fields.update(supervisor_proc=ident, worker_proc=ident)
    elif case.startswith("lock held"):
        stale = {**ident, "start": ident["start"] - 100}
        fields.update(supervisor_proc=stale, worker_proc=stale)
        fd = _hold_lock(run_dir)  # some process holds the lock (an orphan, another container)
    set_state(RunDir(run_dir), "running", **fields)
    try:
        s = status(run_dir, tmp_path)
        assert s["state"] == "interrupted" and not s["pid_alive"] and not s["worker_alive"], s
        text = ftrun("status", run_dir, cwd=tmp_path).stdout
        assert f"supervisor pid {sleeper.pid} (not running)" in text and "running [" not in text
        logs = ftrun("logs", run_dir, "-f", cwd=tmp_path, timeout=30)
        assert logs.returncode == 0 and "starting worker" in logs.stdout
        stop = ftrun("stop", run_dir, cwd=tmp_path, timeout=60)
        assert stop.returncode == 0 and "not running" in stop.stdout, stop.stdout + stop.stderr
        time.sleep(0.3)
        assert _alive(sleeper)
        assert not read_state(run_dir).get("stop_requested")
    finally:
        if fd is not None:
            os.close(fd)


def test_the_verified_supervisor_is_running_and_stop_signals_it(run_dir, tmp_path, procs):
    """The other side of the check: lock held and the recorded process matching -> running; logs -f follows it
    until it ends; stop sends it SIGTERM."""
    sleeper = _spawn("sleep", "60", start_new_session=True)
    procs.append(sleeper)
    fd = _hold_lock(run_dir)
    try:
        set_state(RunDir(run_dir), "running", supervisor_pid=sleeper.pid, supervisor_proc=process_identity(sleeper.pid))
        s = status(run_dir, tmp_path)
        assert s["state"] == "running" and s["pid_alive"], s
        assert run_holder(RunDir(run_dir))["role"] == "supervisor"
        env = dict(os.environ, PYTHONPATH=str(REPO))
        follower = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", "logs", str(run_dir), "-f"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(2.0)
        assert follower.poll() is None  # follows a live run
        stop = ftrun("stop", run_dir, cwd=tmp_path, timeout=60)
        assert stop.returncode == 0 and "stopped" in stop.stdout and "not" not in stop.stdout, stop.stdout
        assert sleeper.wait(timeout=5) == -signal.SIGTERM
        assert read_state(run_dir)["stop_requested"] is True
    finally:
        os.close(fd)  # the holder is gone: the lock with it
    out, _ = follower.communicate(timeout=15)  # ends once nothing verified holds the run
    assert follower.returncode == 0 and "starting worker" in out


FAKE_WORKER = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a worker stuck in a long save: only SIGKILL ends it
subprocess.Popen(["sleep", "60"])  # a child of the worker (a data loader, the plot process): same group
print("ready", flush=True)
time.sleep(60)
"""

FAKE_SUPERVISOR = """
import subprocess, sys
w = subprocess.Popen([sys.executable, "-c", sys.argv[1], "launcher.worker.train", "--run-dir", sys.argv[2]],
                     stdout=subprocess.PIPE, text=True)
w.stdout.readline()
print(w.pid, flush=True)
import time; time.sleep(60)
"""


def test_orphans_are_found_by_run_dir_and_killed_with_their_group(run_dir, tmp_path, procs):
    """A supervisor (own session, as start_detached makes it) killed -9 leaves a worker that ignores SIGTERM:
    end_orphans finds it by `launcher.worker.train --run-dir <run>` (a relative path included), waits, then kills its
    supervisor's group (the worker's child with it); a worker of another run and an unrelated process live on."""
    from launcher.run.control import end_orphans

    other = tmp_path / "other-run"
    other.mkdir()
    sup = subprocess.Popen(
        [sys.executable, "-c", FAKE_SUPERVISOR, FAKE_WORKER, "run"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    procs.append(sup)
    worker_pid = int(sup.stdout.readline())
    bystander = _spawn(
        sys.executable,
        "-c",
        "import time; time.sleep(60)",
        "launcher.worker.train",
        "--run-dir",
        str(other),
        start_new_session=True,
    )
    unrelated = _spawn("sleep", "60", start_new_session=True)
    procs += [bystander, unrelated]
    run = RunDir(run_dir)
    set_state(run, "running", supervisor_pid=sup.pid, supervisor_proc=process_identity(sup.pid), worker_pid=worker_pid)
    worker = process_identity(worker_pid)
    import psutil

    children = psutil.Process(worker_pid).children()
    assert len(children) == 1
    child = process_identity(children[0].pid)
    assert worker["pgid"] == sup.pid == child["pgid"]

    os.kill(sup.pid, signal.SIGKILL)  # the supervisor alone
    sup.wait()
    assert [p["pid"] for p in run_processes(run)] == [worker_pid]
    assert run_holder(run) is None
    said: list[str] = []
    # no bound on the time: end_orphans itself waits on the processes (1 s for SIGTERM, then up to 10 s for the
    # SIGKILLed group), and a loaded box may take longer; what it must have done is checked below
    assert end_orphans(run, 1.0, log=said.append) == [worker_pid]
    assert not same_process(worker)
    # the group's SIGKILL reaches the worker's child too; the kernel delivers it on its own time (a loaded box)
    wait_for(lambda: not same_process(child), 30, "the worker's child to end with its group")
    assert _alive(bystander) and _alive(unrelated)
    assert "still train into this run without a supervisor" in said[0] and "killing" in said[1]
    assert end_orphans(run, 1.0, log=said.append) == []  # nothing left: nothing signalled


def test_a_lock_held_by_an_unidentified_process_refuses_a_second_training(write_recipe, tiny_model, tmp_path):
    """Another container on the same volume holds the lock (its processes are invisible here): `ftrun RECIPE`
    refuses, with the reason, and starts nothing."""
    recipe = write_recipe()
    run = tmp_path / "run"
    run.mkdir()
    recipe_file(run / "recipe.yaml", tiny_model, run)
    set_state(RunDir(run), "running", supervisor_pid=1, supervisor_proc={"pid": 1, "start": -1, "boot": "x"})
    fd = _hold_lock(run)
    try:
        assert is_locked(RunDir(run))
        res = ftrun(recipe, cwd=tmp_path)
        assert res.returncode != 0 and "held, but not by a live ftrun supervisor" in res.stderr, res.stdout + res.stderr
        assert "Traceback" not in res.stderr
        assert not (run / "plan.json").exists() and not run_processes(RunDir(run))
    finally:
        os.close(fd)


def _single_trainer_monitor(run: Path):
    """Samples the run's training processes every 50 ms in a thread; returns (stop, the largest count seen)."""
    seen = {"max": 0, "pids": set()}
    done = threading.Event()

    def watch():
        while not done.is_set():
            found = [p for p in run_processes(RunDir(run)) if "--mode" in p["argv"] and "full" in p["argv"]]
            # a worker starting a helper (the loss plot) forks first: for a moment the child has its command line
            found = [p for p in found if p["ppid"] not in {q["pid"] for q in found}]
            seen["max"] = max(seen["max"], len(found))
            seen["pids"].update(p["pid"] for p in found)
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()

    def stop():
        done.set()
        t.join()
        return seen

    return stop


@pytest.mark.slow
def test_kill9_of_the_supervisor_alone_then_the_same_command(write_recipe, tmp_path, reference_run):
    """The worker outlives nothing: it gets SIGTERM when its supervisor dies (saves, exits); the same command
    right after waits for it, resumes, and exactly one worker trains at any moment; the result is exact."""
    recipe = write_recipe(max_restarts=0, **RESUME_FIELDS)
    assert ftrun(recipe, "smoke.enabled=false", cwd=tmp_path).returncode == 0
    run = tmp_path / "run"
    monitor = _single_trainer_monitor(run)
    st = freeze_worker(run, has_checkpoint)
    old_worker = st["worker_proc"]
    os.kill(st["supervisor_pid"], signal.SIGKILL)  # not its group: the worker is left behind
    os.kill(st["worker_pid"], signal.SIGCONT)
    res = ftrun(recipe, cwd=tmp_path)
    assert res.returncode == 0 and "continuing" in res.stdout, res.stdout + res.stderr
    assert not same_process(old_worker)  # ended before anything new started
    wait_until_ended(run, tmp_path)
    seen = monitor()
    assert seen["max"] == 1 and len(seen["pids"]) == 2, seen  # the orphan, then the resumed worker; never both
    log = (run / "train.log").read_text()
    assert "SIGTERM received" in log and log.count("resuming from step-") == 1
    assert_same_run(reference_run, run)


@pytest.mark.slow
def test_an_orphaned_worker_is_ended_before_the_run_resumes(write_recipe, tmp_path, reference_run):
    """A worker training into the run with no supervisor and no parent-death signal (started by hand, holding
    the run's lock, in its own session): `ftrun RECIPE` asks it to checkpoint and exit, then resumes; one
    trainer at a time, and the final adapter and every logged loss equal the uninterrupted run's."""
    recipe = write_recipe(max_restarts=0, **RESUME_FIELDS)
    assert ftrun(recipe, "smoke.enabled=false", cwd=tmp_path).returncode == 0
    run = tmp_path / "run"
    st = freeze_worker(run, has_checkpoint)
    for pid in (st["supervisor_pid"], st["worker_pid"]):
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not is_locked(RunDir(run)), 20, "the lock to be released")

    fd = _hold_lock(run)
    with (run / "train.log").open("ab") as log:
        orphan = subprocess.Popen(
            [sys.executable, "-m", "launcher.worker.train", "--run-dir", str(run), "--mode", "full"],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=(fd,),
            start_new_session=True,
            env=dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1"),
        )
    os.close(fd)  # the orphan alone holds the lock now
    launch = None
    try:
        wait_for(lambda: (run / "train.log").read_text().count("resuming from step-") == 1, 120, "the orphan to train")
        os.kill(orphan.pid, signal.SIGSTOP)  # held mid-run whatever the machine's speed, until it is asked to stop
        s = status(run, tmp_path)
        assert s["state"] == "interrupted" and s["orphan_worker_pids"] == [orphan.pid], s
        assert (
            f"worker process(es) {orphan.pid} still train without a supervisor"
            in ftrun("status", run, cwd=tmp_path).stdout
        )
        monitor = _single_trainer_monitor(run)
        launch = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", str(recipe)],
            cwd=tmp_path,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1"),
        )
        said = launch.stdout.readline()
        assert f"worker process(es) {orphan.pid} still train into this run without a supervisor" in said, said
        os.kill(orphan.pid, signal.SIGCONT)
        assert orphan.wait(timeout=60) == 77  # train.EXIT_STOPPED: it saved a checkpoint first
        out = said + launch.communicate(timeout=120)[0]
        assert launch.returncode == 0 and "continuing" in out, out
        wait_until_ended(run, tmp_path)
        seen = monitor()
        assert seen["max"] == 1, seen
    finally:
        for p in (orphan, launch):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert_same_run(reference_run, run)
