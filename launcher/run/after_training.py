"""The steps once training ended: the final result checked, the exports made by the supervisor or by `ftrun export`
(each ending through launcher/run/ending.py, where on_finish runs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from launcher.deliver import messages
from launcher.run import views
from launcher.run.ending import Ending, leave
from launcher.run.supervisor_log import _log
from launcher.store.checkpoint import newest_step_unverified, step_dir_name
from launcher.store.modes import share_results
from launcher.store.rundir import RunDir
from launcher.store.state import TRAINED, RunLock, RunSnapshot, move, read_state
from launcher.worker import train


def _verify_final(recipe, run: RunDir, plan: dict[str, Any]):
    """The final adapter or model checked from its files (store/final.py); None on a node other than the first."""
    from launcher.store import final

    if int((plan.get("nodes") or {}).get("node_rank", 0)) != 0:
        return None
    share_results(run.final, _log)  # the weights readable as the rest of the run (safetensors writes them 0600)
    return final.verify(run.final, recipe.method, recipe.lora.target_modules, recipe.model)


def _stopped_after_training(run: RunDir, recipe, signal_name: str, left: list[str]) -> Ending:
    """A stop after the final result and checkpoint were saved: stopped, and a resume does only what `left` names."""
    newest = newest_step_unverified(run.checkpoints)
    return _stop_ending(run, recipe, signal_name, newest, True, after_training=True, left=left)


def _stop_ending(run: RunDir, recipe, signal_name: str, step, saved: bool, **facts) -> Ending:
    """`ftrun stop`'s end (stopped) or an outside signal's (preempted): facts into state.json's `ending`."""
    state = read_state(run)
    requested = state.get("stop_requested")
    ending = {
        "by": "stop" if requested else "signal",
        "signal": signal_name,
        "step": step,
        "checkpoint": step_dir_name(step) if saved and step is not None else None,
        "saved": bool(saved),
        **facts,
        "grace_seconds": recipe.grace_seconds,
        "resume_command": state.get("resume_command"),
    }
    reason = views.ending_reason(ending)
    return Ending(
        "stopped" if requested else "preempted", reason, train.EXIT_STOPPED, {"stop_requested": False, "ending": ending}
    )


def _export(recipe, run: RunDir, child: dict) -> str:
    """The recipe's exports in their own process (no torch in the supervisor); returns the run's state. A failed
    export leaves the run trained-not-exported, for `ftrun export RUN_DIR` to retry."""
    if not recipe.export:
        return "succeeded"
    _log("exporting: " + ", ".join(recipe.export))
    started = time.time()
    move(run, "export", "succeeded", export={"state": "running", "formats": list(recipe.export), "started": started})
    cmd = [sys.executable, "-m", "launcher.deliver.export", "--run-dir", str(run.root)]
    report_path = run.final / "export.json"
    report_path.unlink(missing_ok=True)  # a stale report must not speak for this export
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            cwd=str(Path(__file__).resolve().parents[2]),
        )
        child["proc"] = proc  # `ftrun stop` reaches the export too
        rc = proc.wait()
        child["proc"] = None
    except OSError as exc:
        rc, err = None, f"could not start the export: {exc}"
    share_results(run.final, _log)  # what the export wrote, as readable as the rest of the run
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    if rc == 0 and report.get("ok"):
        outs = messages.export_outputs(report.get("outputs", {}))
        info = {"state": "succeeded", "outputs": outs, "serving": report.get("serving")}
        _log(f"export finished: {outs}; serving commands in {report.get('serving')}")
    elif rc is not None and rc != 0 and read_state(run).get("stop_requested"):  # the user's stop, not a failure
        info = {
            "state": "stopped",
            "reason": f"stopped by `ftrun stop` before it finished; the same command or `ftrun export {run.root}` "
            "makes it",
        }
        _log("export stopped by `ftrun stop`; the trained result is intact")
    else:
        if rc is not None:
            err = report.get("error") or (
                f"killed by signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
            )
        info = {"state": "failed", "reason": f"{err.splitlines()[0]}; retry with `ftrun export {run.root}`"}
        _log(f"export failed: {err}; the trained result is intact")
    return _record_export(run, recipe.export, started, info)


def _record_export(run: RunDir, formats: list[str], started: float, info: dict[str, Any]) -> str:
    """The export's outcome in state.json (succeeded, else trained-not-exported); returns the state."""
    info.update(formats=list(formats), seconds=round(time.time() - started, 1))
    state = "succeeded" if info["state"] == "succeeded" else "trained-not-exported"
    move(
        run,
        "export",
        state,
        export=info,
        reason="training finished" if state == "succeeded" else f"trained, not exported: {info['reason']}",
        **({"stop_requested": False} if info["state"] == "stopped" else {}),
    )
    return state


def export_command(run: RunDir, merged: bool = False, gguf: Optional[str] = None) -> int:
    """`ftrun export`: the recipe's export list, or adapter plus what the flags ask for; prints where things went. A
    trained run's new outcome leaves through ending.leave (without on_finish, which ran when the supervisor ended)."""
    from launcher.deliver.export import export_run
    from launcher.deliver.export_inputs import check_inputs
    from launcher.errors import FtrunError
    from launcher.recipe_loading import load_recipe

    formats = ["adapter", "merged"] + (["gguf"] if gguf else []) if merged or gguf else None
    check_inputs(run.root, formats, gguf)  # bad input fails here, before the lock and the heavy imports
    recipe = load_recipe(run.recipe)
    lock = RunLock(run).acquire()  # the supervisor holds it while training or exporting
    started, trained = time.time(), RunSnapshot(run).state.get("state") in TRAINED  # no other writer under the lock

    def end(info: dict[str, Any], code: int) -> None:  # under the lock; the copier: the export's files go off the box
        if trained:
            from launcher.store.sync import Syncer

            syncer = Syncer(run, recipe.sync.to, recipe.sync.keep, log=print) if recipe.sync.to else None
            state = _record_export(run, formats or recipe.export, started, info)
            leave(run, recipe, Ending(state, None, code), syncer, print, on_finish=False)

    try:
        report = export_run(run.root, formats, gguf)
    except FtrunError as exc:
        end(
            {"state": "failed", "reason": f"{exc.message.splitlines()[0]}; retry with `ftrun export {run.root}`"},
            exc.exit_code,
        )
        raise
    else:
        outs = messages.export_outputs(report["outputs"])
        end({"state": "succeeded", "outputs": outs, "serving": report.get("serving")}, 0)
    finally:
        lock.release()
    for key, out in report["outputs"].items():
        print(f"{key:8} {out['size']:>9}  {out['path']} ({messages.SIZE_COVERS.get(key, 'file')})")
    print(f"checks   {run.final / 'export.json'}\nserving  {report.get('serving')}")
    return 0
