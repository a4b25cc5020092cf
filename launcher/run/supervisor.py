"""Runs the full training detached from the terminal, restarts a crashed worker within limits, stops it on request.

No torch: it starts the worker (or a launcher of several), waits, classifies the exit, writes the state. Started in
its own session with output to train.log, so an SSH logout's SIGHUP never reaches it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from launcher.errors import EXIT_NOTHING_LEARNED, EXIT_RUN_FAILED, WORKER_EXITS
from launcher.plan.cgroup import oom_kills
from launcher.plan.sampling import uses_vllm
from launcher.run import build_locks, oom_restart, rank_ends, views
from launcher.run.after_training import _export, _stop_ending, _stopped_after_training, _verify_final
from launcher.run.ending import Ending, _record, leave
from launcher.run.attempt import WATCHDOG_GRACE_S, _host_oom, _rank_ends, _Tail, _wait_watching
from launcher.run.rank_processes import _ranks, _ranks_left
from launcher.run.supervisor_log import _log
from launcher.run.worker_outcome import _forget_worker_outcome, _worker_error, _worker_exit_code, _worker_fact
from launcher.store import heartbeat_files
from launcher.worker import train
from launcher.worker.engines import MULTI_PROCESS, failed_verification, launch_command, launch_env, with_death_signal
from launcher.store.checkpoint import atomic_write_json, newest_step_unverified
from launcher.store.rundir import RunDir
from launcher.store.state import last_metrics, process_identity, read_state

# Worker exits that a restart cannot fix: report them instead of looping (launcher/errors.py WORKER_EXITS).
FATAL = {code: e.reason for code, e in WORKER_EXITS.items() if not e.restart}


def _last_logged_step(run: RunDir) -> int:
    return int(last_metrics(run.metrics).get("step", 0))


def _exported_code(run: RunDir, state: str) -> int:
    """The run's exit after training: 0 when its outputs passed the export's checks (or it has none), the stop's code
    when `ftrun stop` ended the export, else 5 (trained-not-exported: an output failed them)."""
    if state != "trained-not-exported":
        return 0
    return train.EXIT_STOPPED if (read_state(run).get("export") or {}).get("state") == "stopped" else EXIT_RUN_FAILED


def _learned_nothing(recipe, run: RunDir) -> Optional[dict[str, Any]]:
    """The facts of a GRPO run whose prompts' answers never differed in reward at any logged step (nothing to learn
    from), with each reward's value; None otherwise."""
    from launcher.run.facts import metrics_rows, reward_facts

    if not recipe.objective_row.generates:
        return None
    train_rows = [r for r in metrics_rows(run.metrics) if r.get("loss") is not None]
    facts = reward_facts(train_rows)
    nv = facts.get("no_variance")
    if not nv or not nv["whole_run"]:
        return None
    return {
        "logged_steps": nv["rows"],
        "step": train_rows[-1]["step"],
        "rewards": [{"name": p["name"], "mean": p["mean"]} for p in facts["parts"]]
        or [{"name": "reward", "mean": train_rows[-1].get("reward")}],
    }


def supervise(run_dir: Path, lock_fd: Optional[int] = None) -> int:
    """The detached run from its first attempt to its end; returns the exit code of the run (0 succeeded). Every
    ending leaves through one door (launcher/run/ending.py), the copy off the box made there."""
    run = RunDir(run_dir)
    from launcher.recipe_loading import load_recipe

    recipe = load_recipe(run.recipe)
    syncer = None
    if recipe.sync.to:
        from launcher.store.sync import Syncer

        syncer = Syncer(run, recipe.sync.to, recipe.sync.keep, log=_log).start(recipe.sync.every_seconds)
    return leave(run, recipe, _attempts(run, recipe, lock_fd), syncer)


def _attempts(run: RunDir, recipe, lock_fd: Optional[int]) -> Ending:
    """The restart loop: the worker started again after each end a restart can fix; returns how the run ended."""
    from launcher.recipe_loading import load_recipe

    plan = json.loads(run.plan.read_text())
    # proc: the process running now (worker, launcher or export); launcher: proc when it starts ranks.
    child: dict[str, Optional[subprocess.Popen]] = {"proc": None, "launcher": None}
    # killed: grace_seconds ran out; checkpoint_before: the newest sealed step when the signal came.
    stopping: dict[str, Any] = {"signal": None, "killed": False, "checkpoint_before": None}

    def forward(signum, _frame):
        first = stopping["signal"] is None
        stopping["signal"] = signal.Signals(signum).name
        proc = child["proc"]
        if proc and proc.poll() is None:
            _log(f"{stopping['signal']}: asking the worker to checkpoint and stop")
            if first:
                stopping["checkpoint_before"] = newest_step_unverified(run.checkpoints)
            # Under a launcher the ranks are signalled, not the launcher: torchrun and accelerate launch SIGKILL
            # their ranks 30 s after forwarding a signal, configurable only since torch 2.12 (pytorch PR #172596;
            # launch_env sets it there). The ranks save and exit together; the launcher then ends on its own.
            for pid in (_ranks(proc) if proc is child["launcher"] else []) or [proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)

    def forward_then_enforce_grace(signum, frame):
        forward(signum, frame)
        proc = child["proc"]
        if proc is not None:
            # a worker still busy after grace_seconds is killed; the newest periodic checkpoint remains
            def enforce():
                if proc.poll() is None:
                    stopping["killed"] = True
                    # the ranks die with their launcher (PR_SET_PDEATHSIG), but not only through it
                    for pid in (_ranks(proc) if proc is child["launcher"] else []) + [proc.pid]:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)

            timer = threading.Timer(recipe.grace_seconds, enforce)
            timer.daemon = True
            timer.start()

    signal.signal(signal.SIGTERM, forward_then_enforce_grace)
    signal.signal(signal.SIGINT, forward_then_enforce_grace)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def ranks_gone(ended: dict[str, Any], ended_at: float, ranks, facts: dict[str, Any]) -> Optional[Ending]:
        """The ended attempt's ranks given time to go before a restart: a rank still alive keeps its GPU memory, and
        the next attempt would run out of memory loading. One stuck in the GPU driver (disk-sleep) survives SIGKILL
        and torchrun abandons it (torch 2.13 distributed/elastic/multiprocessing/api.py SubprocessContext._close):
        after min(grace_seconds, WATCHDOG_GRACE_S), _wait_watching's grace, it is stuck, and the run fails."""
        left = _ranks_left(ranks, min(recipe.grace_seconds, WATCHDOG_GRACE_S), lambda: stopping["signal"] is not None)
        if stopping["signal"]:
            return _stopped_recovering()
        if left:
            why = views.ranks_left_reason(ended, left, time.monotonic() - ended_at)
            return Ending("failed", why, 5, {**facts, "ranks_left": left})
        return None

    def _stopped_recovering() -> Ending:
        return Ending("stopped", f"stopped by {stopping['signal']} while recovering", train.EXIT_STOPPED)

    restarts = 0
    crash_steps: list[int] = []
    restart_times: list[float] = []  # the restart budget: max_restarts within any RESTART_WINDOW_S
    last_exception: Optional[tuple[Optional[str], Optional[int]]] = None  # (signature, step) of the last traceback
    multi = plan.get("engine") in MULTI_PROCESS
    env = dict(os.environ, PYTHONUNBUFFERED="1", **launch_env(plan, recipe.grace_seconds, vllm=uses_vllm(recipe)))
    error_file = run.heartbeats / "error-rank-0.json"  # a single worker's traceback (worker/train.py _recorded)
    if not multi:
        env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    while True:
        cmd = launch_command(plan, run.root, "full")
        _log("starting worker: " + " ".join(cmd))
        if plan.get("launch_argv") != cmd:
            plan["launch_argv"] = cmd  # plan.json records how the plan was launched (an argument list)
            atomic_write_json(run.plan, plan)
        _forget_worker_outcome(run)
        heartbeat_files.clear(run)  # the last attempt's heartbeats and error file must not speak for this one
        run.heartbeats.mkdir(parents=True, exist_ok=True)
        build_locks.clear_stale(_log)  # a lock left by a rank killed mid-build would hold this attempt forever
        launched_at = time.time()
        # when the supervisor dies, a launcher is killed with it; a single worker gets SIGTERM and saves a checkpoint
        death = signal.SIGKILL if plan.get("engine") in MULTI_PROCESS else signal.SIGTERM
        proc = subprocess.Popen(
            with_death_signal(cmd, death),
            stdin=subprocess.DEVNULL,
            env=env,
            # torchrun's report of how each rank ended is read from its stderr (rank_ends.py)
            stderr=subprocess.PIPE if multi else None,
            # the worker keeps the run locked while it lives, even without its supervisor
            pass_fds=(lock_fd,) if lock_fd is not None else (),
        )
        tail = _Tail(proc.stderr) if multi else None  # read from the start: a full pipe would block the ranks
        child["proc"] = proc
        child["launcher"] = proc if plan.get("engine") in MULTI_PROCESS else None
        _record(
            run,
            "run",
            supervisor_pid=os.getpid(),
            supervisor_proc=process_identity(os.getpid()),
            worker_pid=proc.pid,
            worker_proc=process_identity(proc.pid),
            restarts=restarts,
            engine=plan.get("engine"),
            num_processes=plan.get("num_processes"),
            launch_argv=cmd,
        )
        kills_before = oom_kills()  # the kernel's OOM-kill count of this cgroup, where it says one
        rc, hang, ranks = _wait_watching(proc, run, plan, launched_at, stopping, multi, recipe.grace_seconds)
        ended_at = time.monotonic()
        child["proc"] = child["launcher"] = None
        if tail is not None:
            tail.join()
        ends = _rank_ends(run, rc, tail, error_file, multi)
        host_oom = _host_oom(kills_before) if rc != 0 and not stopping["signal"] else None
        if host_oom is not None:
            # killed by the kernel for host memory: a restart loads the same model into the same RAM
            facts = {
                **host_oom,
                "step": _last_logged_step(run),
                "ram_needed_gb": (plan.get("memory") or {}).get("load_ram_gb") or None,
                "ram_gb": (plan.get("hardware") or {}).get("ram_gb"),
            }
            return Ending("failed", views.host_oom_reason(facts), 5, {"ending": {"by": "host-oom", **facts}})
        if rc != 0 and failed_verification(run.worker):
            rc = train.EXIT_BAD_WORLD  # torchrun reports any failed worker as 1; the worker said why
        if rc not in (0, *FATAL) and _worker_exit_code(run) in FATAL:
            rc = _worker_exit_code(run)  # a rank's out of memory arrives from torchrun as 1: not a crash to restart
        if run.worker.is_file() and "verification" in json.loads(run.worker.read_text()):
            _record(run, "note", verification=json.loads(run.worker.read_text())["verification"])
        if rc == 0 and stopping["signal"] and recipe.export and getattr(_verify_final(recipe, run, plan), "ok", 0):
            # the stop came as the worker finished: what training made is whole; the export waits for the resume
            return _stopped_after_training(run, recipe, stopping["signal"], ["the export"])
        if rc == 0:
            checked = _verify_final(recipe, run, plan)
            if checked is not None and not checked.ok:
                learned_nothing = _learned_nothing(recipe, run) if checked.details.get("untrained") else None
                if learned_nothing is not None:
                    # the untrained adapter is what training made, not a save that lost it: GRPO had no reward
                    # variance to learn from, and a resume would do the same
                    return Ending(
                        "failed",
                        views.nothing_learned_reason(learned_nothing),
                        EXIT_NOTHING_LEARNED,
                        {
                            "final_check": {"ok": False, "reason": checked.reason},
                            "ending": {"by": "no-reward-variance", **learned_nothing},
                        },
                    )
                # exit 0 without a usable result (a save that wrote nothing) is a failure, and nothing is exported
                return Ending(
                    "failed",
                    f"training finished but the final result is not usable: {checked.reason}; "
                    "the checkpoints are intact: run the same command to resume from the newest one, which "
                    "saves the final result again",
                    5,
                    {"final_check": {"ok": False, "reason": checked.reason}},
                )
            _record(
                run,
                "trained",
                worker_pid=None,
                reason="training finished",
                final_check={"ok": True, "reason": checked.reason, **checked.details}
                if checked
                else {"ok": None, "reason": "written and verified by node 0"},
            )
            _log("training finished" + (f"; {checked.reason}" if checked else ""))
            done = _export(recipe, run, child)  # succeeded, or trained-not-exported when an export failed
            # after the export's checks, before on_finish (which may stop the box); a failed export publishes nothing
            from launcher.deliver.publish import after_export

            after_export(recipe, run, _log)
            return Ending(done, None, _exported_code(run, done))
        if (stopping["signal"] or rc == train.EXIT_STOPPED) and _worker_fact(run, "stopped_after_training"):
            return _stopped_after_training(
                run,
                recipe,
                stopping["signal"] or "SIGTERM",
                # the samples are written before the task evaluation: done when the stop came after them
                [
                    "the task evaluation"
                    if (run.final / "samples.md").is_file()
                    else "the samples and the task evaluation"
                ]
                + (["the export"] if recipe.export else []),
            )
        if stopping["signal"] or rc == train.EXIT_STOPPED:
            # a launcher exits 1 when its ranks exit EXIT_STOPPED: a checkpoint sealed after the signal says the same
            newest = newest_step_unverified(run.checkpoints)
            saved = rc == train.EXIT_STOPPED or (
                not stopping["killed"]
                and newest is not None
                and (stopping["checkpoint_before"] is None or newest > stopping["checkpoint_before"])
            )
            # the step of the checkpoint it wrote: the last logged step may be a few steps older
            step = newest if saved and newest is not None else _last_logged_step(run)
            return _stop_ending(run, recipe, stopping["signal"] or "SIGTERM", step, saved)
        if rc == train.EXIT_OOM:
            # the plan's own faster setting is undone and the run goes on; one of the recipe's settings stops it
            undone = oom_restart.undo_after_oom(run, _worker_fact(run, "out_of_memory") or {})
            if undone is None:
                error = _worker_error(run) or WORKER_EXITS[rc].what
                done = oom_restart.mid_run_undos(json.loads(run.plan.read_text()))
                return Ending("failed", views.oom_fatal_reason(error, WORKER_EXITS[rc].fix, done), 5)
            recipe, plan = load_recipe(run.recipe), json.loads(run.plan.read_text())
            restarts += 1
            why = views.oom_restart_reason(undone)
            ended = {"kind": "out-of-memory", "step": undone["oom_step"], "world": int(plan.get("num_processes") or 1)}
            _record(
                run,
                "recover",
                worker_pid=None,
                restarts=restarts,
                last_end=ended,
                reason=why,
                accepted_recipe_hashes=oom_restart.accepted_hashes(read_state(run), undone),
            )
            _log(why)
            ending = ranks_gone(ended, ended_at, ranks, {})
            if ending is not None:
                return ending
            continue
        if rc in FATAL:
            return Ending("failed", _worker_error(run) or FATAL[rc], 5)
        # How the attempt ended, by rank (docs/engines.md, "One rank down"): a hang, else the cause among the ranks'
        # ends; a crash (with or without a traceback) that repeats at the same step is not restarted
        root = rank_ends.cause(ends)
        ended = (
            {"kind": "hang", **hang}
            if hang
            else rank_ends.facts(root, ends)
            if root is not None
            else {"kind": "crash", "exit_code": rc}
        )
        ended["world"] = int(plan.get("num_processes") or 1)
        if ended.get("step") is None:
            ended["step"] = _last_logged_step(run)
        step = ended["step"]
        if ended["kind"] == "exception" and root is not None:
            if last_exception == (root.signature(), step):
                return Ending("failed", views.repeated_crash_reason(ended), 5, {"last_end": ended})
            last_exception = (root.signature(), step)
        if ended["kind"] == "crash":
            if crash_steps and crash_steps[-1] == step:
                return Ending("failed", views.repeated_crash_reason(ended), 5, {"last_end": ended})
            crash_steps.append(step)
        now = time.time()
        restart_times = [t for t in restart_times if now - t < RESTART_WINDOW_S]
        if len(restart_times) >= recipe.max_restarts:
            why = views.restart_budget_reason(ended, len(restart_times), recipe.max_restarts)
            return Ending("failed", why, 5, {"last_end": ended})
        restart_times.append(now)
        restarts += 1
        delay = min(2 ** len(restart_times), 60)
        why = views.restarted_reason(ended, len(restart_times), recipe.max_restarts, delay)
        _record(run, "recover", worker_pid=None, restarts=restarts, last_end=ended, reason=why)
        _log(why)
        for _ in range(delay * 10):
            if stopping["signal"]:
                return _stopped_recovering()
            time.sleep(0.1)
        ending = ranks_gone(ended, ended_at, ranks, {"last_end": ended})
        if ending is not None:
            return ending


RESTART_WINDOW_S = 3600.0  # recipe.max_restarts counts the restarts within any hour


def start_detached(run: RunDir, lock_fd: int) -> int:
    """Start the supervisor in its own session with output to train.log; returns its pid."""
    log = open(run.log, "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.run.supervisor", "--run-dir", str(run.root), "--lock-fd", str(lock_fd)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        pass_fds=(lock_fd,),
        cwd=str(Path(__file__).resolve().parents[2]),
    )
    log.close()
    return proc.pid


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.run.supervisor")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--lock-fd", type=int, default=None)
    ns = parser.parse_args(argv)
    return supervise(ns.run_dir.resolve(), ns.lock_fd)


if __name__ == "__main__":
    sys.exit(main())
