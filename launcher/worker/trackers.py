"""Experiment trackers (the recipe's `report_to:`; docs/tracking.md): installed or refused with the install line, and
one tracked run per ftrun run, which a restarted or resumed worker continues.

The trainer's integrations report (transformers 5.24 integrations/integration_utils.py); this module sets what they
read before they start, and keeps the ids in the run directory: wandb's run id drawn here (WANDB_RUN_ID,
WANDB_RESUME=allow), MLflow's recorded after start_run and passed back (MLFLOW_RUN_ID), Trackio's run name made
unique once (it resumes by name). Only the full run's main process reports.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any, Optional

from launcher.errors import RecipeError
from launcher.tracker_kinds import TRACKERS

TRACKERS_FILE = "trackers.json"  # in the run directory, and carried by every checkpoint
PROJECT = "ftrun"  # wandb project, MLflow experiment, Trackio project, unless the environment or recipe names one


def _installed(tracker: str) -> bool:
    if tracker == "tensorboard":  # TensorBoardCallback takes either writer
        return any(importlib.util.find_spec(m) is not None for m in ("tensorboard", "tensorboardX"))
    return importlib.util.find_spec(TRACKERS[tracker].module) is not None


def missing(report_to: list[str]) -> list[str]:
    """The trackers of `report_to` whose package is not installed, tensorboard aside (the worker goes on without it)."""
    return [t for t in report_to if t != "tensorboard" and not _installed(t)]


def _wandb_has_credentials() -> bool:
    """Any sign of a W&B login where wandb looks (sdk/lib/wbauth: WANDB_API_KEY, netrc, settings); a wrong key is
    wandb's own error."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrcs = [os.environ["NETRC"]] if os.environ.get("NETRC") else ["~/.netrc", "~/_netrc"]
    settings = Path(os.environ.get("WANDB_CONFIG_DIR") or "~/.config/wandb").expanduser() / "settings"
    for path, sign in [*((Path(n).expanduser(), "wandb") for n in netrcs), (settings, "api_key")]:
        try:
            if sign in path.read_text(errors="replace"):
                return True
        except OSError:
            continue
    return False


def check_installed(recipe, launching: bool = False) -> None:
    """A RecipeError with the install line when a tracker the recipe names is not installed (`ftrun plan`, the launch);
    at the launch also wandb without a login, which would fail in the detached worker at every restart."""
    absent = missing(list(recipe.report_to))
    if (
        launching
        and "wandb" in recipe.report_to
        and "wandb" not in absent
        and os.environ.get("WANDB_MODE", "online") not in ("offline", "disabled", "dryrun")
        and not _wandb_has_credentials()
    ):
        raise RecipeError(
            "report_to names wandb, but this box has no W&B login (no WANDB_API_KEY, no `wandb login`)",
            fix="run `wandb login` or set WANDB_API_KEY; or set WANDB_MODE=offline to keep the run in "
            "RUN/wandb and send it later with `wandb sync`.",
        )
    if not absent:
        return
    packages = " ".join(TRACKERS[t].package for t in absent)
    names = ", ".join(absent)
    raise RecipeError(
        f"report_to names {names}, but {'it is' if len(absent) == 1 else 'they are'} not installed in this Python "
        f"environment",
        fix=f"pip install {packages}   (or pip install 'ftrun[trackers]' for all of them), or remove "
        f"{names} from report_to.",
    )


# ---------------------------------------------------------------------------------------------
# In the worker (main process of the full run)


def load_ids(run_root: Path) -> dict[str, Any]:
    path = run_root / TRACKERS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def _save_ids(run_root: Path, ids: dict[str, Any]) -> None:
    from launcher.store.checkpoint import atomic_write_json

    atomic_write_json(run_root / TRACKERS_FILE, ids)


def restore_from_checkpoint(run_root: Path, checkpoint: Path) -> None:
    """A run fetched onto a new box has its checkpoints but not this file: the checkpoint's copy names the runs."""
    if not (run_root / TRACKERS_FILE).is_file() and (checkpoint / TRACKERS_FILE).is_file():
        _save_ids(run_root, json.loads((checkpoint / TRACKERS_FILE).read_text()))


def into_checkpoint(run_root: Path, checkpoint: Path) -> None:
    """Before the manifest: the checkpoint carries the tracked runs' ids, so a resume elsewhere continues them."""
    if (run_root / TRACKERS_FILE).is_file():
        (checkpoint / TRACKERS_FILE).write_bytes((run_root / TRACKERS_FILE).read_bytes())


def prepare(run_root: Path, recipe, mode: str, rank: int) -> tuple[list[str], dict[str, Any]]:
    """(report_to for SFTConfig, other SFTConfig fields), the integrations' environment set; called in every process
    before SFTConfig."""
    report_to = list(recipe.report_to)
    if mode != "full" or rank != 0 or not report_to:
        return ["none"], {}
    absent = missing(report_to)
    if absent:  # refused at the launch already; a package removed since then
        raise RecipeError(
            f"report_to names {', '.join(absent)}, not installed where the worker runs",
            fix=f"pip install {' '.join(TRACKERS[t].package for t in absent)}",
        )
    if "tensorboard" in report_to and not _installed("tensorboard"):
        print(
            "[ftrun worker] tensorboard is not installed: no event files (metrics.jsonl and loss.png still are)",
            flush=True,
        )
        report_to.remove("tensorboard")
    ids = load_ids(run_root)
    trainer = dict(recipe.trainer)
    fields: dict[str, Any] = {}
    if "run_name" not in trainer:
        # unique per ftrun run: Trackio continues a run of the same name
        ids.setdefault("name", f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        fields["run_name"] = ids["name"]
    if "tensorboard" in report_to:
        os.environ["TENSORBOARD_LOGGING_DIR"] = str(run_root / "tensorboard")
    if "wandb" in report_to:
        wandb = ids.setdefault("wandb", {})
        # the user's id, else one drawn once (as wandb's: 8 of [a-z0-9])
        wandb.setdefault("id", os.environ.get("WANDB_RUN_ID") or secrets.token_hex(4))
        os.environ["WANDB_RUN_ID"] = wandb["id"]
        os.environ.setdefault("WANDB_RESUME", "allow")
        os.environ.setdefault("WANDB_PROJECT", PROJECT)
        os.environ.setdefault("WANDB_DIR", str(run_root))  # wandb writes WANDB_DIR/wandb/
        wandb.update(project=os.environ["WANDB_PROJECT"], mode=os.environ.get("WANDB_MODE", "online"))
    if "mlflow" in report_to:
        mlflow = ids.setdefault("mlflow", {})
        os.environ.setdefault("MLFLOW_TRACKING_URI", (run_root / "mlruns").resolve().as_uri())
        os.environ.setdefault("MLFLOW_EXPERIMENT_NAME", PROJECT)
        if os.environ["MLFLOW_TRACKING_URI"].startswith(("file:", "/", ".")):
            # MLflow 3.17 refuses its file store unless told (file_store.py: "maintenance mode")
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        if mlflow.get("run_id") and mlflow.get("tracking_uri") == os.environ["MLFLOW_TRACKING_URI"]:
            os.environ["MLFLOW_RUN_ID"] = mlflow["run_id"]  # MLflowCallback: start_run reattaches to it
    if "trackio" in report_to:
        if "project" not in trainer:
            fields["project"] = PROJECT
        ids["trackio"] = {"project": trainer.get("project", PROJECT), "name": trainer.get("run_name", ids.get("name"))}
    _save_ids(run_root, ids)  # before any tracker starts: a worker killed during its start comes back as this run
    return report_to, fields


def recipe_callback(run_root: Path, recipe):
    """A callback after the integrations': the recipe without secrets into each tracked run's config, MLflow's run id
    into trackers.json, a line each."""
    from transformers import TrainerCallback

    snapshot = recipe.public_snapshot()

    class TrackedRecipe(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            if not state.is_world_process_zero:
                return
            report_to = args.report_to if isinstance(args.report_to, list) else [args.report_to]
            for tracker in report_to:
                where = _describe(tracker, run_root, snapshot)
                if where:
                    print(f"[ftrun worker] {tracker}: {where}", flush=True)

    return TrackedRecipe()


def _describe(tracker: str, run_root: Path, snapshot: dict[str, Any]) -> Optional[str]:
    """Add the recipe to the tracker's run; where the run is, for the log."""
    ids = load_ids(run_root)
    if tracker == "wandb":
        import wandb

        if wandb.run is None:
            return None
        wandb.config.update({"ftrun_recipe": snapshot}, allow_val_change=True)
        mode = ids.get("wandb", {}).get("mode")
        where = f"run {wandb.run.id} ({ids.get('name', wandb.run.name)}) in project {wandb.run.project}"
        if mode == "offline":
            return f"{where}, offline in {wandb.run.dir.rsplit('/files', 1)[0]} (send it with `wandb sync`)"
        return f"{where}: {wandb.run.url}"
    if tracker == "mlflow":
        import mlflow

        run = mlflow.active_run()
        if run is None:
            return None
        resumed = ids.get("mlflow", {}).get("run_id") == run.info.run_id
        ids["mlflow"] = {
            "run_id": run.info.run_id,
            "tracking_uri": os.environ.get("MLFLOW_TRACKING_URI"),
            "experiment_id": run.info.experiment_id,
        }
        _save_ids(run_root, ids)
        mlflow.log_dict(snapshot, "ftrun/recipe.json")  # the whole recipe, nested, replaced at each start
        params = [(f"ftrun.{k}", v) for k, v in _flat(snapshot).items()]
        try:  # params cannot change once logged: a resume with a changed recipe keeps the first values
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per call
                mlflow.log_params(dict(params[i : i + 100]))
        except mlflow.exceptions.MlflowException:
            print(
                "[ftrun worker] mlflow: the recipe changed since this run started; its params keep the first "
                "values, ftrun/recipe.json holds the current recipe",
                flush=True,
            )
        return (
            f"{'continuing' if resumed else 'started'} run {run.info.run_id} ({run.info.run_name}) in "
            f"{mlflow.get_tracking_uri()}"
        )
    if tracker == "trackio":
        import trackio

        if not isinstance(getattr(trackio, "config", None), dict):
            return None
        trackio.config["ftrun_recipe"] = snapshot  # sent with the run's first logged values
        info = ids.get("trackio", {})
        from trackio.utils import TRACKIO_DIR

        return f"run {info.get('name')} in project {info.get('project')} ({TRACKIO_DIR}; `trackio show`)"
    if tracker == "tensorboard":
        return f"event files in {run_root / 'tensorboard'} (`tensorboard --logdir {run_root / 'tensorboard'}`)"
    return None


def log_scores(
    run_root: Path,
    report_to: list[str],
    scores: dict[str, float],
    step: int,
    say=lambda line: print(f"[ftrun worker] {line}", flush=True),
) -> list[str]:
    """The task evaluation's scores as task/<name> metrics of the tracked runs, reopened by trackers.json's ids (the
    integrations ended theirs), so the export adds to the same runs. A tracker that fails is said and skipped.
    Returns those logged to."""
    ids = load_ids(run_root)
    metrics = {f"task/{name}": float(value) for name, value in scores.items() if value is not None}
    done: list[str] = []
    if not metrics:
        return done
    for tracker in report_to:
        try:
            if tracker == "wandb" and ids.get("wandb"):
                import wandb

                info = ids["wandb"]
                live = wandb.run is not None and wandb.run.id == info["id"]
                run = (
                    wandb.run
                    if live
                    else wandb.init(
                        id=info["id"],
                        project=info.get("project", PROJECT),
                        resume="allow",
                        dir=os.environ.get("WANDB_DIR", str(run_root)),
                        mode=info.get("mode", "online"),
                    )
                )
                run.summary.update(metrics)
                if not live:
                    run.finish()
            elif tracker == "mlflow" and ids.get("mlflow", {}).get("run_id"):
                import mlflow

                info = ids["mlflow"]
                if info.get("tracking_uri"):
                    mlflow.set_tracking_uri(info["tracking_uri"])
                    if info["tracking_uri"].startswith(("file:", "/", ".")):
                        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # as prepare() allows it
                with mlflow.start_run(run_id=info["run_id"]):
                    mlflow.log_metrics(metrics, step=step)
            elif tracker == "trackio" and ids.get("trackio"):
                import trackio

                info = ids["trackio"]
                trackio.init(project=info["project"], name=info["name"], resume="must")
                trackio.log(metrics, step=step)
                trackio.finish()
            elif tracker == "tensorboard" and _installed("tensorboard"):
                from torch.utils.tensorboard import SummaryWriter

                writer = SummaryWriter(str(run_root / "tensorboard"))
                for key, value in metrics.items():
                    writer.add_scalar(key, value, step)
                writer.close()
            else:
                continue
            done.append(tracker)
        except Exception as exc:  # evidence, not training: the scores are in task_eval.json whatever a tracker does
            say(f"{tracker}: the task scores could not be logged ({type(exc).__name__}: {str(exc)[:200]})")
    return done


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as dotted keys, each value a short string (MLflow params hold up to 6,000 characters)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, (list, dict)) else value
    return out
