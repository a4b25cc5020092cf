"""Runs the full training detached from the terminal, restarts a crashed worker within limits, stops it on request.

The supervisor is light (no torch): it starts the worker (one process, or a launcher of several),
waits, classifies the exit, and writes the state. Started by `ftrun RECIPE` in its own session
(`start_new_session`), stdin from /dev/null and output to train.log, so an SSH logout (SIGHUP to
the terminal's session) never reaches it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from . import train
from .backends import launch_command
from .rundir import RunDir
from .state import set_state

# Worker exits that a restart cannot fix: report them instead of looping.
FATAL = {
    train.EXIT_NAN: "the loss became NaN/inf (lower learning_rate, check the data)",
    train.EXIT_OOM: "out of GPU memory (run `ftrun smoke` again: a smaller micro_batch_size or max_length)",
    train.EXIT_BAD_WORLD: "the worker saw a different device or process count than planned (see train.log)",
    2: "the worker rejected its input (see train.log)",
}


def _log(msg: str) -> None:
    print(f"[ftrun supervisor {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _last_logged_step(run: RunDir) -> int:
    from .state import _last_metrics

    return int(_last_metrics(run.metrics).get("step", 0))


def supervise(run_dir: Path, lock_fd: Optional[int] = None) -> int:
    """The restart loop; returns the exit code of the run (0 succeeded)."""
    run = RunDir(run_dir)
    from .recipe import load_recipe

    recipe = load_recipe(run.recipe)
    plan = json.loads(run.plan.read_text())
    child: dict[str, Optional[subprocess.Popen]] = {"proc": None}
    stopping = {"signal": None}

    def forward(signum, _frame):
        stopping["signal"] = signal.Signals(signum).name
        proc = child["proc"]
        if proc and proc.poll() is None:
            _log(f"{stopping['signal']}: asking the worker to checkpoint and stop")
            proc.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

    restarts = 0
    crash_steps: list[int] = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    while True:
        cmd = launch_command(plan, run.root, "full")
        _log("starting worker: " + " ".join(cmd))
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env,
                                pass_fds=(lock_fd,) if lock_fd is not None else ())
        child["proc"] = proc
        set_state(run, "running", supervisor_pid=os.getpid(), worker_pid=proc.pid, restarts=restarts)
        rc = proc.wait()
        child["proc"] = None
        if rc == 0:
            set_state(run, "succeeded", worker_pid=None, reason="training finished")
            _log("training finished")
            return 0
        if rc == train.EXIT_STOPPED or (stopping["signal"] and rc in (-signal.SIGTERM, 128 + signal.SIGTERM)):
            why = f"stopped by {stopping['signal'] or 'SIGTERM'} after a checkpoint; run the same command to resume"
            set_state(run, "stopped", worker_pid=None, reason=why)
            _log(why)
            return train.EXIT_STOPPED
        if rc in FATAL:
            set_state(run, "failed", worker_pid=None, reason=f"worker exit {rc}: {FATAL[rc]}")
            _log(f"worker failed (exit {rc}): {FATAL[rc]}")
            return 5
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        step = _last_logged_step(run)
        if crash_steps and crash_steps[-1] == step:
            why = f"worker crashed twice at step {step} ({how}); not retrying a crash that repeats"
            set_state(run, "failed", worker_pid=None, reason=why)
            _log(why)
            return 5
        crash_steps.append(step)
        if restarts >= recipe.max_restarts:
            why = f"worker crashed ({how}) after {restarts} restart(s), the limit (max_restarts={recipe.max_restarts})"
            set_state(run, "failed", worker_pid=None, reason=why)
            _log(why)
            return 5
        restarts += 1
        delay = min(2 ** restarts, 60)
        set_state(run, "recovering", worker_pid=None, restarts=restarts,
                  reason=f"worker crashed ({how}) near step {step}; restart {restarts}/{recipe.max_restarts} in {delay}s")
        _log(f"worker crashed ({how}) near step {step}; restarting from the newest verified checkpoint in {delay}s")
        for _ in range(delay * 10):
            if stopping["signal"]:
                set_state(run, "stopped", reason=f"stopped by {stopping['signal']} while recovering")
                return train.EXIT_STOPPED
            time.sleep(0.1)


def start_detached(run: RunDir, lock_fd: int) -> int:
    """Start the supervisor in its own session with output to train.log; returns its pid."""
    log = open(run.log, "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.supervisor", "--run-dir", str(run.root), "--lock-fd", str(lock_fd)],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,  # own session: no controlling terminal, no SIGHUP at logout
        pass_fds=(lock_fd,), cwd=str(Path(__file__).resolve().parent.parent),
    )
    log.close()
    return proc.pid


def stop(run: RunDir, timeout: float = 120.0) -> str:
    """SIGTERM the supervisor (which forwards to the worker) and wait until it exits."""
    from .state import pid_alive, read_state

    data = read_state(run)
    pid = data.get("supervisor_pid")
    if not pid_alive(pid):
        return "not running"
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return "stopped" if not pid_alive(pid) else "still stopping"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.supervisor")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--lock-fd", type=int, default=None)
    ns = parser.parse_args(argv)
    return supervise(ns.run_dir.resolve(), ns.lock_fd)


if __name__ == "__main__":
    sys.exit(main())
