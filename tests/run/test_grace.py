"""Preemption under a multi-process launcher: the ranks get grace_seconds to finish their checkpoint.

torchrun (and accelerate launch, which runs the same elastic agent) SIGKILLs its ranks a fixed time
after it forwards a SIGTERM: 30 s unless told otherwise. A checkpoint that takes longer to save was
cut off although the recipe's grace_seconds allowed more. Two real 2-process DDP runs on CPU, whose
save after the signal is made to take longer than 30 s, are preempted: one by a SIGTERM to the
supervisor alone (`docker stop`, `ftrun stop`), one by a SIGTERM to the supervisor and the launcher
at once (a box shutting down signals every process). Both must finish the checkpoint, end
`preempted`, and resume to the same losses and adapter as a run never interrupted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, assert_same_run, logged_steps, metrics, read_state, wait_for, wait_until_ended

SLOW_SAVE_S = 35  # longer than torchrun's default shutdown timeout (30 s)
GRACE_S = 90  # above 30 s, with room for a loaded machine (the default is 60)
FIELDS = dict(max_steps=30, checkpoint_every_minutes=10, grace_seconds=GRACE_S)  # no periodic save: only the stop's
DDP2 = ("engine=ddp", "num_processes=2", "smoke.enabled=false", "export=[]")

# Prepended to PYTHONPATH for the interrupted runs only: every process of the run imports it at start.
# Once transformers.trainer is imported, the Trainer's checkpoint save sleeps after writing its files
# (before ftrun seals the checkpoint with its manifest), once, in a worker that received SIGTERM.
SITECUSTOMIZE = """
import os
import sys

_DELAY = float(os.environ.get("FTRUN_TEST_SLOW_SAVE_S") or 0)

if _DELAY:
    import importlib.abc
    import importlib.machinery
    import time

    def _stop_requested():
        for name in ("__main__", "launcher.worker.train"):
            stop = getattr(sys.modules.get(name), "_Stop", None)
            if stop is not None:
                return stop.requested
        raise RuntimeError("slow-save hook: launcher.worker.train._Stop not found; the test cannot slow the save")

    def _patch(module):
        original = module.Trainer._save_checkpoint
        slowed = []

        def slow_save_checkpoint(self, model, trial):
            original(self, model, trial)
            if not slowed and _stop_requested():
                slowed.append(True)
                print(f"[slow-save hook] rank {os.environ.get('RANK')}: save after SIGTERM slowed by {_DELAY:g}s "
                      f"from {time.strftime('%H:%M:%S')}", flush=True)
                time.sleep(_DELAY)

        module.Trainer._save_checkpoint = slow_save_checkpoint

    class _PatchAfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "transformers.trainer":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None:
                return None
            exec_module = spec.loader.exec_module

            def exec_then_patch(module):
                exec_module(module)
                _patch(module)

            spec.loader.exec_module = exec_then_patch
            return spec

    sys.meta_path.insert(0, _PatchAfterImport())
"""


def _ftrun(*args, cwd: Path, hook: Path | None = None, wait: bool = True):
    path = [str(hook)] if hook else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*path, str(REPO)]), HF_HUB_OFFLINE="1")
    if hook:
        env["FTRUN_TEST_SLOW_SAVE_S"] = str(SLOW_SAVE_S)
    cmd = [sys.executable, "-m", "launcher.cli", *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


def _ranks(launcher_pid: int) -> list[int]:
    import psutil

    return wait_for(
        lambda: (lambda c: len(c) == 2 and [p.pid for p in c])(psutil.Process(launcher_pid).children()),
        120,
        "torchrun to start 2 ranks",
    )


def _freeze_ranks(run: Path, until) -> tuple[dict, list[int]]:
    """SIGSTOP both ranks at the first moment `until(run)` holds: the run cannot end before the signal."""
    st = wait_for(
        lambda: (lambda s: s.get("worker_pid") and s)(read_state(run) if (run / "state.json").is_file() else {}),
        120,
        "the launcher to start",
    )
    ranks = _ranks(st["worker_pid"])
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        if until(run):
            assert not (run / "final").exists() and metrics(run)[-1]["step"] < FIELDS["max_steps"]
            return st, ranks
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError("timed out waiting to freeze the ranks")


@pytest.mark.slow
def test_ddp_preemption_gets_grace_seconds_not_torchruns_30s(write_recipe, tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    t0 = time.monotonic()
    recipes = {
        name: write_recipe(f"{name}.yaml", output_dir=str(tmp_path / name), **FIELDS) for name in ("ref", "sup", "box")
    }
    for name in ("sup", "box"):
        _ftrun(recipes[name], *DDP2, cwd=tmp_path, hook=hook)

    # The provider's notice: to the supervisor alone (sup), or to every process of the box (box).
    signalled = {}
    for name in ("sup", "box"):
        run = tmp_path / name
        st, ranks = _freeze_ranks(run, logged_steps(3))
        os.kill(st["supervisor_pid"], signal.SIGTERM)
        if name == "box":
            os.kill(st["worker_pid"], signal.SIGTERM)  # torchrun itself: it forwards and starts its own timer
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
        signalled[name] = (time.monotonic(), st["supervisor_pid"])

    # The uninterrupted reference trains while the interrupted runs sit in their slow saves.
    ref = _ftrun(recipes["ref"], "--foreground", *DDP2, cwd=tmp_path, wait=False)

    stopped_at = {}
    for name, (t_signal, sup_pid) in signalled.items():
        run = tmp_path / name
        from launcher.store.state import pid_alive

        wait_for(lambda: not pid_alive(sup_pid), GRACE_S + 60, f"{name}: the supervisor to end")
        took = time.monotonic() - t_signal
        log = (run / "train.log").read_text()
        assert log.count("save after SIGTERM slowed by") == 2, log[-6000:]  # both ranks' saves were slow
        assert took > SLOW_SAVE_S, (took, log[-6000:])
        assert "forcefully exiting via" not in log and "SIGKILL" not in log, log[-6000:]
        # sup: the supervisor signalled the ranks, the launcher was never signalled (its timer never ran);
        # box: the launcher got the signal too, forwarded it, and waited past 30 s
        assert ("Received 15 death signal, shutting down workers" in log) == (name == "box"), log[-6000:]
        st = read_state(run)
        assert st["state"] == "preempted" and "after a checkpoint" in st["reason"], (st, log[-6000:])
        from launcher.store.checkpoint import candidates, verify

        newest = candidates(run / "checkpoints")[0]
        ok, why = verify(newest)
        assert ok, why
        stopped_at[name] = ok.step
        assert 3 <= ok.step < FIELDS["max_steps"]
        print(
            f"{name}: SIGTERM to checkpoint step-{ok.step:06d} and exit in {took:.1f}s (save slowed by "
            f"{SLOW_SAVE_S}s, grace {GRACE_S}s)"
        )

    # The same command resumes from the checkpoint the preemption left, to the same result (one run
    # resumed: the checkpoints of both were verified above, the resume path is the same).
    run = tmp_path / "sup"
    _ftrun(recipes["sup"], *DDP2, cwd=tmp_path)
    out, _ = ref.communicate(timeout=300)
    assert ref.returncode == 0, out
    wait_until_ended(run, tmp_path)
    assert f"resuming from step-{stopped_at['sup']:06d}" in (run / "train.log").read_text()
    assert_same_run(tmp_path / "ref", run)
    print(f"test wall time {time.monotonic() - t0:.0f}s")


@pytest.mark.parametrize("engine", ["ddp", "deepspeed", "fsdp", "trl"])
def test_launcher_waits_grace_seconds_plus_a_margin(engine, monkeypatch):
    """The variable reaches torch's launch config through torchrun's arguments and accelerate launch's."""
    from launcher.worker.engines import LAUNCHER_SHUTDOWN_MARGIN_S, launch_env

    env = launch_env({"engine": engine, "num_processes": 2, "device": "cpu"}, grace_seconds=44.5)
    if engine == "trl":  # one process, no launcher: the supervisor signals it and waits grace_seconds itself
        assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in env
        return
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == str(45 + LAUNCHER_SHUTDOWN_MARGIN_S)
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in launch_env({"engine": engine, "num_processes": 2})
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    import torch.distributed.run as distrib_run

    if engine == "fsdp":
        # accelerate launch (multi_gpu_launcher, which the FSDP config takes) turns its own arguments into
        # torchrun's with _filter_args and runs torch.distributed.run.run with them
        from accelerate.commands.launch import launch_command_parser
        from accelerate.utils.launch import _filter_args

        args = launch_command_parser().parse_args(
            ["--multi_gpu", "--num_processes", "2", "-m", "launcher.worker.train"]
        )
        args = _filter_args(
            args,
            distrib_run.get_args_parser(),
            ["--training_script", args.training_script, "--training_script_args", args.training_script_args],
        )
    else:
        args = distrib_run.get_args_parser().parse_args(
            ["--standalone", "--nproc_per_node=2", "-m", "launcher.worker.train"]
        )
    config, _, _ = distrib_run.config_from_args(args)
    assert config.shutdown_timeout == 45 + LAUNCHER_SHUTDOWN_MARGIN_S
