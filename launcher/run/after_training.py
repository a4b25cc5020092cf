"""The supervisor's steps once training ended: the final result checked, the exports made (on_finish: ending.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from launcher.deliver import messages
from launcher.run import views
from launcher.run.ending import Ending
from launcher.run.supervisor_log import _log
from launcher.store.checkpoint import newest_step_unverified, step_dir_name
from launcher.store.modes import share_results
from launcher.store.rundir import RunDir
from launcher.store.state import read_state, set_state
from launcher.worker import train


def _verify_final(recipe, run: RunDir, plan: dict[str, Any]):
    """The final adapter or model checked from its files (launcher/store/final.py), or None on a node other than the
    first of a multi-node run: its rank 0 is the one that writes final/."""
    from launcher.store import final

    if int((plan.get("nodes") or {}).get("node_rank", 0)) != 0:
        return None
    share_results(run.final, _log)  # the weights readable as the rest of the run (safetensors writes them 0600)
    return final.verify(run.final, recipe.method, recipe.lora.target_modules, recipe.model)


def _stopped_after_training(run: RunDir, recipe, signal_name: str, left: list[str]) -> Ending:
    """A stop (or a provider's signal) after the final result and the last checkpoint were saved: the run is stopped,
    not succeeded, and a resume lands at the end, doing only what `left` names."""
    requested = read_state(run).get("stop_requested")
    newest = newest_step_unverified(run.checkpoints)
    ending = {
        "by": "stop" if requested else "signal",
        "signal": signal_name,
        "step": newest,
        "checkpoint": step_dir_name(newest) if newest is not None else None,
        "saved": True,
        "after_training": True,
        "left": left,
        "grace_seconds": recipe.grace_seconds,
        "resume_command": read_state(run).get("resume_command"),
    }
    return Ending(
        "stopped" if requested else "preempted",
        views.ending_reason(ending),
        train.EXIT_STOPPED,
        {"stop_requested": False, "ending": ending},
    )


def _export(recipe, run: RunDir, child: dict) -> str:
    """The recipe's exports in their own process (torch stays out of the supervisor); returns the run's state.

    A failed export never undoes the training: the state says trained-not-exported (not succeeded), with
    export.state failed and the reason; `ftrun export RUN_DIR` retries.
    """
    if not recipe.export:
        return "succeeded"
    _log("exporting: " + ", ".join(recipe.export))
    started = time.time()
    set_state(run, "succeeded", export={"state": "running", "formats": list(recipe.export), "started": started})
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
    info.update(formats=list(recipe.export), seconds=round(time.time() - started, 1))
    state = "succeeded" if info["state"] == "succeeded" else "trained-not-exported"
    set_state(
        run,
        state,
        export=info,
        **({} if state == "succeeded" else {"reason": f"trained, not exported: {info['reason']}"}),
        **({"stop_requested": False} if info["state"] == "stopped" else {}),
    )
    return state
