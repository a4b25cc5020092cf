"""engines.with_death_signal: the worker gets its signal when the process that started it dies, asked for after the
fork's exec (no Python in the forked child of a process with threads, where a preexec_fn can deadlock)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import wait_for
from launcher.worker.engines import with_death_signal

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_child_keeps_its_pid_runs_its_command_and_gets_the_signal_when_its_starter_dies(tmp_path):
    # the starter has a busy second thread while it starts the child, as the supervisor's copier is
    starter = textwrap.dedent(f"""
        import signal, subprocess, sys, threading
        sys.path.insert(0, {str(REPO)!r})
        from launcher.worker.engines import with_death_signal
        threading.Thread(target=lambda: [__import__("json").dumps(list(range(1000))) for _ in iter(int, 1)],
                         daemon=True).start()
        child = subprocess.Popen(with_death_signal([sys.executable, "-c",
                                 "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(7)); "
                                 "print('ready', flush=True); time.sleep(120)"], signal.SIGTERM),
                                 stdout=open({str(tmp_path / "child.out")!r}, "w"))
        print(child.pid, flush=True)
        child.wait()
    """)
    proc = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    wait_for(lambda: "ready" in (tmp_path / "child.out").read_text(), 30, "the child to run its command", 0.05)
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"-S" not in cmdline and b"time.sleep(120)" in cmdline[-2]  # the command itself, same pid: exec'd
    proc.kill()  # the starter dies (kill -9): the child gets SIGTERM
    proc.wait()
    wait_for(lambda: not _alive(pid), 30, "the child to end on its death signal", 0.05)


def test_a_starter_gone_before_the_signal_was_asked_for_still_ends_the_child():
    # the parent the wrapper checks is not its parent: it ends itself with the signal instead of running unwatched
    cmd = with_death_signal([sys.executable, "-c", "print('ran')"], signal.SIGTERM)
    cmd[cmd.index("-c") + 3] = "1"  # [python, -S, -c, code, sig, parent, *cmd]: a parent that is not ours
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert res.returncode == -signal.SIGTERM and "ran" not in res.stdout
