"""The task evaluation's base phase before training: launcher/worker/task_eval.py as one process, writing
RUN/task_eval.json."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Callable, Optional

from launcher.recipe import Recipe
from launcher.run import facts, task_eval_view
from launcher.store.checkpoint import newest_step_unverified
from launcher.store.rundir import RunDir
from launcher.store.state import RunSnapshot

WORKER_MODULE = "launcher.worker.task_eval"
EXIT_WORKER_BAD_INPUT = 2  # the worker's one-line refusal of its input (the module's contract)


def worker_argv(run: RunDir) -> list[str]:
    """The base phase of the task evaluation as an argument list (never a shell string)."""
    return [sys.executable, "-m", WORKER_MODULE, "--run-dir", str(run.root), "--phase", "base"]


def run_worker(
    run: RunDir, plan: dict[str, Any], say: Callable[[str], None], own_session: bool = False
) -> tuple[int, str]:
    """Run the worker's base phase in the foreground, each of its lines through `say`; (exit code, its last line).
    `own_session`: as the detached run's worker (launcher/run/smoke.py start_worker)."""
    import signal

    from launcher.worker.engines import launch_env, with_death_signal

    # one process, whatever the training's engine: its threads are not shared out with other ranks
    env = {**os.environ, **launch_env({**plan, "num_processes": 1})}
    last = ""
    proc = subprocess.Popen(
        with_death_signal(worker_argv(run), signal.SIGTERM) if own_session else worker_argv(run),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
        errors="replace",
        start_new_session=own_session,
    )
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.strip():
                last = line
            say(line)
        return proc.wait(), last
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        raise


def settled(run: RunDir) -> bool:
    """RUN/task_eval.json holds the base model's scores, or says why there are none (not applicable, too few)."""
    t = facts.task_eval(run, base_only=True) or {}
    scores = t.get("scores") or {}
    return (
        bool(t.get("not_applicable"))
        or t.get("too_few") is not None
        or any(scores.get(n) is not None for n in task_eval_view.BASE_SCORES)
    )


def training_began(run: RunDir, state: Optional[dict[str, Any]] = None) -> bool:
    """The run has trained (a checkpoint, or a past `running`): a resume never scores the base model again."""
    history = (RunSnapshot(run).state if state is None else state).get("history", [])
    return newest_step_unverified(run.checkpoints) is not None or any(h.get("state") == "running" for h in history)


def launch_baseline(
    run: RunDir,
    recipe: Recipe,
    plan: dict[str, Any],
    say: Callable[[str], None],
    state: Optional[dict] = None,
    own_session: bool = False,
) -> None:
    """The launch's baseline before its smoke test (eval.task.baseline: run): the verdict, or why there is none;
    never a stop."""
    task = recipe.eval.task
    if task.examples <= 0 or task.baseline != "run" or settled(run) or training_began(run, state):
        return
    if (plan.get("nodes") or {}).get("node_rank", 0) != 0:
        return  # the first node scores it; the others would answer the same prompts again
    say("task evaluation: scoring the base model before training (eval.task.baseline: run; skip turns it off)")
    try:
        rc, last = run_worker(run, plan, say, own_session)
        t = facts.task_eval(run, base_only=True)
        say(
            task_eval_view.format_task_eval(t)
            if rc == 0 and t
            else task_eval_view.baseline_failed(rc, last, launching=True)
        )
    except Exception as exc:  # announced, and the launch goes on: the verdict never stops a run
        say(task_eval_view.baseline_failed(None, f"{type(exc).__name__}: {exc}", launching=True))
