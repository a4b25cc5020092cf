"""The smoke worker is scheduled as the run's worker will be (launcher/run/smoke.py start_worker): in a session of its
own where the run is detached, so that Linux's autogroup scheduling gives it a CPU share of its own, as the detached
run's worker gets one, rather than a part of the launching shell's; in the launcher's session under `--foreground`;
and it ends with its launcher, whichever way the launcher ends."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from launcher.run import smoke, smoke_replan, task_baseline
from launcher.store.rundir import RunDir

AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")
# what the child reports: its pid, session and autogroup (/proc/PID/autogroup, "/autogroup-N nice 0"; None where the
# file is missing or empty, as in sandboxed kernels such as gVisor, where CI's checks run)
PROBE = (
    "import json, os, sys\n"
    "ag = '/proc/self/autogroup'\n"
    "group = (open(ag).read().split() or [None])[0] if os.path.exists(ag) else None\n"
    "json.dump({'pid': os.getpid(), 'sid': os.getsid(0), 'autogroup': group}, open(sys.argv[1], 'w'))\n"
)


def _own_autogroup() -> str | None:
    path = Path("/proc/self/autogroup")
    return (path.read_text().split() or [None])[0] if path.is_file() else None


def _probe(tmp_path: Path, own_session: bool) -> dict:
    out = tmp_path / "child.json"
    with (tmp_path / "smoke.log").open("wb") as log:
        proc = smoke.start_worker(
            [sys.executable, "-c", PROBE, str(out)], {"engine": "trl"}, log, dict(os.environ), own_session
        )
        assert proc.wait(timeout=60) == 0, (tmp_path / "smoke.log").read_text()
    child = json.loads(out.read_text())
    assert child["pid"] == proc.pid  # the worker itself, not a shell or launcher in between
    return child


def test_the_smoke_worker_of_a_detached_run_has_a_session_and_cpu_share_of_its_own(tmp_path):
    child = _probe(tmp_path, own_session=True)
    assert child["sid"] == child["pid"] != os.getsid(0)
    if AUTOGROUP.is_file() and AUTOGROUP.read_text().strip() == "1" and child["autogroup"] is not None:
        # the kernel shares the cores between these groups first: the launching shell's busy processes are not its
        assert child["autogroup"] != _own_autogroup()


def test_under_foreground_the_smoke_worker_shares_the_launchers_session_as_the_run_will(tmp_path):
    child = _probe(tmp_path, own_session=False)
    assert child["sid"] == os.getsid(0)
    assert child["autogroup"] == _own_autogroup()


@pytest.mark.parametrize("own_session", [True, False])
def test_the_base_models_task_evaluation_runs_in_the_session_the_smoke_worker_gets(tmp_path, monkeypatch, own_session):
    # the launch's baseline (launcher/run/task_baseline.py run_worker) before the smoke test: its answers are timed
    # where the run's task evaluation will run, as the smoke worker's steps are
    out = tmp_path / "child.json"
    monkeypatch.setattr(task_baseline, "worker_argv", lambda run: [sys.executable, "-c", PROBE, str(out)])
    said: list[str] = []
    rc, _ = task_baseline.run_worker(RunDir(tmp_path / "run"), {"num_processes": 1}, said.append, own_session)
    assert rc == 0, said
    child = json.loads(out.read_text())
    assert (child["sid"] == child["pid"] != os.getsid(0)) if own_session else child["sid"] == os.getsid(0)


def test_the_launch_passes_the_runs_session_to_the_smoke_test(tmp_path, monkeypatch):
    seen = []

    def measured(run, recipe, plan_dict, examples, lengths, stats, own_session=True):
        seen.append(own_session)
        raise KeyboardInterrupt  # the smoke's end is not this test's concern

    monkeypatch.setattr(smoke, "run_smoke", measured)
    monkeypatch.setattr(smoke_replan, "leave", lambda *a, **k: None)
    monkeypatch.setattr(smoke_replan, "move", lambda *a, **k: None)
    for own in (True, False):
        with pytest.raises(KeyboardInterrupt):
            smoke_replan._smoke(RunDir(tmp_path / "run"), None, {}, [], [], None, own_session=own)
    assert seen == [True, False]


LAUNCHER = (
    "import os, sys\n"
    "from launcher.run import smoke\n"
    "log = open(sys.argv[1], 'wb')\n"
    "cmd = [sys.executable, '-c', 'import time\\nwhile True: time.sleep(0.1)']\n"
    "proc = smoke.start_worker(cmd, {'engine': 'trl'}, log, dict(os.environ), True)\n"
    "print(proc.pid, flush=True)\n"
    "proc.wait()\n"
)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the death signal is Linux's (PR_SET_PDEATHSIG)")
def test_a_smoke_worker_in_its_own_session_ends_when_its_launcher_is_killed(tmp_path):
    # out of the terminal's process group, a closed terminal or a kill -9 of `ftrun` no longer reaches the worker
    # directly: it must not train on unwatched into a run nobody holds
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path / "smoke.log")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    worker = psutil.Process(int(launcher.stdout.readline()))
    try:
        assert worker.is_running() and os.getsid(worker.pid) == worker.pid
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(worker):
            time.sleep(0.1)
        assert not _alive(worker)
    finally:  # nothing left behind when an assertion failed
        for p in (launcher, worker):
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                p.kill()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
