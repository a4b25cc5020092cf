"""The resume-exact step: a detached run whose worker is killed with SIGKILL after its first verified checkpoint,
launched again with the same command, against an uninterrupted run: per-step losses and the final adapter."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from gpu_check.common import Context, read_json
from gpu_check.product import SFT_RECIPE, budget, cli, missing_packages, tiny_model, train_rows

# A checkpoint after every step (the cadence is wall-clock; as tests/worker/test_resume_metrics.py does), no smoke
# test, export, task evaluation or periodic eval pass (the start's and the end's remain): the trajectory alone.
# 30 steps on the loan, 10 in the dry run.
FIELDS = (
    "smoke.enabled=false",
    "export=[]",
    "eval.task.examples=0",
    "eval.samples=0",
    "eval.every_minutes=60",
    "logging_steps=1",
    "checkpoint_every_minutes=0.0001",
    "learning_rate=5e-3",
)
STEPS = {"cuda": 16, "cpu": 10}
# For the estimate (preflight.py): Python processes it starts (its own; the reference run's CLI and worker; the
# detached launch's CLI, supervisor and worker; the relaunch's the same), and the runs' steps in trained-step units
# (the reference's, the killed run's up to its checkpoint and the resumed rest). A second uninterrupted run, only
# where the resume is not exact, adds two processes and a run.
PROCESSES = 8
RUNS = 2
ENDED = ("succeeded", "failed", "stopped", "preempted", "interrupted", "smoke-failed")


def _state(run: Path) -> dict[str, Any]:
    return read_json(run / "state.json") or {}


def _checkpoints(run: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*/manifest.json"))


def _is_worker(pid: int) -> bool:
    """The training process itself (launcher.worker.train), not the supervisor or a wrapper around it."""
    try:
        return b"launcher.worker.train" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def freeze_at(run: Path, until: Callable[[Path], bool], timeout: float) -> dict[str, Any]:
    """SIGSTOP the worker at the first moment `until(run)` holds: the worker runs free to its start, then in
    10 ms slices, frozen between, so that a wall-clock checkpoint is not its final one on a fast card (the idea of
    tests/helpers.py freeze_worker and run_in_slices, which this package must not import). Returns state.json."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = _state(run)
        pid = st.get("worker_pid")
        if pid and _is_worker(pid):
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                time.sleep(0.05)
                continue
            if until(run):
                return st
            os.kill(pid, signal.SIGCONT)
            beat = read_json(run / "heartbeats" / "rank-0.json") or {}
            if beat.get("phase") not in (None, "", "start"):  # training: a slice, then frozen
                time.sleep(0.01)
                try:
                    os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    pass
        time.sleep(0.05)
    raise TimeoutError(
        f"no verified checkpoint before the run's end within {timeout:.0f} s (state {_state(run).get('state')!r})"
    )


def _wait_ended(run: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = _state(run)
        pid = st.get("supervisor_pid")
        alive = bool(pid) and Path(f"/proc/{pid}").exists() and b"Z" not in _proc_state(pid)
        if st.get("state") in ENDED and not alive:
            return st["state"]
        time.sleep(0.3)
    raise TimeoutError(f"the resumed run did not end within {timeout:.0f} s (state {_state(run).get('state')!r})")


def _runs_process(pid: Any, run: Path) -> bool:
    """A live process of this run's (its command line names a launcher module and the run's directory, as the
    supervisor's and the worker's `--run-dir` do): never a recycled pid of another program's or another run's."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes() if isinstance(pid, int) and pid > 0 else b""
    except OSError:
        return False
    return b"launcher." in cmdline and os.fsencode(str(run)) in cmdline


def end_detached(runs: list[Path]) -> list[int]:
    """SIGKILL the process groups of the runs' supervisors and workers (a detached run's supervisor leads a session
    of its own, which the step's timeout(1) does not reach): nothing of the step keeps the GPU after it. Returns the
    groups killed."""
    own = os.getpgid(0)
    groups: list[int] = []
    for run in runs:
        st = _state(run)
        for role in ("supervisor_pid", "worker_pid"):
            pid = st.get(role)
            if not _runs_process(pid, run):
                continue
            try:
                group = os.getpgid(pid)
            except ProcessLookupError:
                continue
            targets = [group] if group != own else []
            for target in targets:
                if target not in groups:
                    try:
                        os.killpg(target, signal.SIGKILL)
                        groups.append(target)
                    except ProcessLookupError:
                        pass
            if group == own:  # in the step's own group: the process alone (its group is the step's)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return groups


@contextlib.contextmanager
def detached_guard(runs: list[Path]) -> Iterator[None]:
    """Whatever ends the block (its end, an exception, the step's timeout: timeout(1) sends SIGTERM first), the
    runs' detached processes are ended with it."""

    def on_term(signum, frame):  # noqa: ARG001 - the signal handler's signature
        raise SystemExit(124)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        end_detached(runs)


def _proc_state(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().split(b")")[-1][:3]
    except OSError:
        return b"Z"


def compare(a: Path, b: Path) -> dict[str, Any]:
    """Per-step losses and grad norms (metrics.jsonl) and the final adapter's tensors of two runs: the largest
    differences, and whether every one is zero."""
    from safetensors.torch import load_file

    ra, rb = train_rows(a), train_rows(b)
    same_steps = [r["step"] for r in ra] == [r["step"] for r in rb]
    loss = [abs(x["loss"] - y["loss"]) for x, y in zip(ra, rb)]
    grad = [abs(x.get("grad_norm", 0) - y.get("grad_norm", 0)) for x, y in zip(ra, rb)]
    first = next((x["step"] for x, y in zip(ra, rb) if x["loss"] != y["loss"]), None)
    ta = load_file(str(a / "final" / "adapter" / "adapter_model.safetensors"))
    tb = load_file(str(b / "final" / "adapter" / "adapter_model.safetensors"))
    tensor = {k: float((ta[k].float() - tb[k].float()).abs().max()) for k in ta if k in tb}
    worst = max(tensor, key=tensor.get) if tensor else None
    return {
        "steps_equal": same_steps,
        "steps": len(ra),
        "max_loss_difference": max(loss, default=None),
        "max_grad_norm_difference": max(grad, default=None),
        "first_differing_step": first,
        "same_tensor_names": ta.keys() == tb.keys(),
        "max_adapter_difference": tensor.get(worst),
        "worst_tensor": worst,
        "exact": same_steps and ta.keys() == tb.keys() and not any(loss) and not any(tensor.values()),
    }


def _runs(ctx: Context, args, log: Path, killed_run: Path, steps: int, left) -> dict[str, Any]:
    """The reference, the killed and the relaunched run (and a second uninterrupted one where the resume differs):
    {"result", "at"}, or a failed step's result (with "line")."""
    runs = {}
    code, secs, _ = cli(args("resume-reference") + ["--foreground", "--fresh"], ctx.work, left(), log)
    runs["reference"] = {"exit": code, "seconds": round(secs, 1)}
    if code != 0:
        return {"ok": False, "runs": runs, "line": f"the uninterrupted run failed (exit {code}): {log.name}"}
    ctx.progress(runs=runs)
    code, secs, _ = cli(args("resume-killed") + ["--fresh"], ctx.work, left(), log)  # detached: returns at once
    if code != 0:
        return {"ok": False, "runs": runs, "line": f"the detached launch failed (exit {code}): {log.name}"}

    def past_first_checkpoint(run: Path) -> bool:
        done = _checkpoints(run)
        return bool(done) and done[-1] < steps

    st = freeze_at(killed_run, past_first_checkpoint, left())
    at = _checkpoints(killed_run)[-1]
    # the supervisor first, so it cannot restart the worker: the relaunch below is what resumes
    for role in ("supervisor_pid", "worker_pid"):
        try:
            os.kill(st[role], signal.SIGKILL)
        except (ProcessLookupError, KeyError):
            pass
    time.sleep(0.5)
    code, secs, out = cli(args("resume-killed"), ctx.work, left(), log)  # the same command, no --fresh
    resumed = "continuing" in out
    ended = _wait_ended(killed_run, left()) if code == 0 else f"relaunch exit {code}"
    runs["killed"] = {
        "killed_after_checkpoint": at,
        "worker_pid": st.get("worker_pid"),
        "relaunch_exit": code,
        "relaunch_said_continuing": resumed,
        "ended": ended,
        "resumed_from": (read_json(killed_run / "worker.json") or {}).get("resumed_from"),
    }
    ctx.progress(runs=runs)
    if ended != "succeeded":
        return {"ok": False, "runs": runs, "line": f"the relaunched run ended {ended!r}: {log.name}"}
    result = {"runs": runs, "resume": compare(ctx.work / "runs" / "resume-reference", killed_run)}
    # the kernels' own run-to-run difference, needed only to explain a resume that is not exact
    if ctx.device == "cuda" and not result["resume"]["exact"] and left() > 40:
        code, secs, _ = cli(args("resume-control") + ["--foreground", "--fresh"], ctx.work, left(), log)
        runs["control"] = {"exit": code, "seconds": round(secs, 1)}
        if code == 0:
            result["control"] = compare(ctx.work / "runs" / "resume-reference", ctx.work / "runs" / "resume-control")
    return {"result": result, "at": at}


def step_resume_exact(ctx: Context) -> dict[str, Any]:
    """Reference run (foreground, uninterrupted); the same run detached, its worker frozen after the first verified
    checkpoint, supervisor and worker killed with SIGKILL, launched again with the same command; on a GPU a second
    uninterrupted run too, which tells the kernels' own run-to-run difference from the resume's."""
    skipped = missing_packages()
    if skipped:
        return skipped
    total = budget(240)
    steps = STEPS[ctx.device]
    log = ctx.out / "resume-exact.cli.log"
    t_end = time.monotonic() + total - 10

    def args(name: str) -> list[str]:
        return [
            str(SFT_RECIPE),
            f"model={tiny_model(ctx)}",
            f"output_dir={ctx.work / 'runs' / name}",
            f"max_steps={steps}",
            *FIELDS,
        ]

    left = lambda: max(10.0, t_end - time.monotonic())  # noqa: E731
    killed_run = ctx.work / "runs" / "resume-killed"
    with detached_guard([killed_run]):
        outcome = _runs(ctx, args, log, killed_run, steps, left)
    if "line" in outcome:
        return outcome
    result, at = outcome["result"], outcome["at"]
    diff = result["resume"]
    control = result.get("control")
    if diff["exact"]:
        why = "bitwise equal"
    elif control is not None and not control["exact"]:
        why = (
            "two uninterrupted runs differ too (max loss difference "
            f"{control['max_loss_difference']:.3g}): nondeterministic CUDA kernels (atomic adds in attention and "
            "reduction backward passes, cuBLAS's split-K choices), not the resume"
        )
    elif control is not None:
        why = "two uninterrupted runs agree exactly, the resumed one does not: the resume itself differs"
    else:
        why = "not exact; no second uninterrupted run to tell the kernels' nondeterminism from the resume's"
    # on the CPU the resume is exact (tests/worker/test_resume_metrics.py): anything else is a failure there
    ok = diff["exact"] if ctx.device == "cpu" else diff["steps_equal"]
    line = (
        f"killed after step {at}, resumed: max loss difference {diff['max_loss_difference']:.3g}, max adapter "
        f"difference {diff['max_adapter_difference']:.3g} over {diff['steps']} steps; {why}"
    )
    decides = {
        "resume": {
            "value": {
                "exact": diff["exact"],
                "max_loss_difference": diff["max_loss_difference"],
                "max_adapter_difference": diff["max_adapter_difference"],
                "device": ctx.device,
            },
            "target": f"a killed and relaunched run bitwise equal to an uninterrupted one on {ctx.device}",
            "met": diff["exact"],
            "says": f"resume on {ctx.device}: {why} (killed after step {at} of {diff['steps']})",
        }
    }
    return {"ok": ok, **result, "why": why, "decides": decides, "line": line}
