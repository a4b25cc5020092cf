"""The `ftrun RECIPE` flow: recipe -> plan -> smoke test -> detached run; or the status / resume of a run that
exists."""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from launcher.store.checkpoint import newest_step_unverified
from launcher.errors import BusyError, FtrunError, RecipeError, UsageError
from launcher.recipe import Recipe, has_adapter
from launcher.recipe_loading import load_recipe
from launcher.run import weights
from launcher.store.rundir import RunDir
from launcher.store.state import (
    TRAINED,
    RunSnapshot,
    busy_error,
    effective_state,
    is_locked,
    process_identity,
    move,
    run_holder,
)
from launcher.run import parent, progress, summary_view, views
from launcher.run.commands import resume_command
from launcher.run.facts import end_summary, run_status
from launcher.run.prepare import _download, _prepare, _say, as_written, restarts_after_failed_smoke
from launcher.run.run_dirs import run_dir_of
from launcher.run.smoke_replan import _smoke
from launcher.run.sync_commands import _pull_if_remote_run
from launcher.run.task_baseline import launch_baseline
from launcher.run.views import format_status
from launcher.run.adjustments import with_adjustments


def _flat(snap: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in snap.items():
        if isinstance(v, dict):  # each key by its dotted name (lora.r, trainer.lr_scheduler_type)
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


# Keys that only decide how a run starts or what the plan assumes: never a difference to a run that exists
STARTING_ONLY = ("smoke", "auto_adjust", "resume", "box", "tokens", "price_per_hour_eur")


def _recipe_differences(run: RunDir, recipe: Recipe) -> dict[str, tuple[Any, Any]]:
    """Every setting (dotted key) in which `recipe` differs from the run's own recipe.yaml: (the run's, the recipe's);
    the STARTING_ONLY keys left out. The smoke test's recorded adjustments are applied first: they are the run's."""
    try:
        old = parent.as_given(run, load_recipe(run.recipe).snapshot())
    except FtrunError:  # a recipe.yaml this ftrun cannot read: the run's own views say so; nothing to compare
        return {}
    new = parent.as_given(run, with_adjustments(run, recipe).snapshot())  # either may hold the pinned copy
    return {k: v for k, v in _differences(_flat(old), _flat(new)).items() if k.split(".")[0] not in STARTING_ONLY}


def _differences(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def _listed(differs: dict[str, tuple[Any, Any]]) -> str:
    return "\n".join(f"- {k}: run has {old!r}, recipe now says {new!r}" for k, (old, new) in differs.items())


def launch(
    recipe_path: str,
    overrides: list[str],
    *,
    foreground: bool = False,
    fresh: bool = False,
    memory_limit: Optional[float] = None,
    allow_changes: bool = False,
    nodes: Optional[dict[str, Any]] = None,
) -> int:
    """`ftrun RECIPE`: start a new run, show a live one, or resume an interrupted one."""
    recipe = load_recipe(recipe_path, overrides)
    run = run_dir_of(recipe)
    resuming = False
    if not run.exists() and not fresh and recipe.sync.to and recipe.resume is not False:
        _pull_if_remote_run(run, recipe)
    snap = RunSnapshot(run)  # the run as this launch found it, passed down (a new run: empty)
    if run.exists():
        _end_orphans(run, recipe, snap.state)
        held = run.pinned_parent()
        if held and recipe.init_from == held["copy"] and not has_adapter(held["init_from"]):  # said, never silent
            _say(
                f"init_from: {held['init_from']} holds no adapter any more; this run trains on from the copy it "
                f"took at its launch, {held['copy']}"
            )
    if run.exists() and not fresh:
        holder = run_holder(run)
        differs = _recipe_differences(run, recipe) if holder or effective_state(run) in TRAINED else {}
        if holder and differs:  # another recipe pointed at a busy run: never a second training, never silence
            raise BusyError(
                f"{run.root} is busy: a run is in progress there ({holder['role']} pid {holder['pid']}), and this "
                f"recipe differs from it:\n" + _listed(differs),
                fix=f"set another output_dir to train this recipe beside it (output_dir=runs/NAME, or in the recipe), "
                f"or wait for the run to end (`ftrun status {run.root}`), or stop it (`ftrun stop {run.root}`).",
            )
        if holder:
            s = run_status(run, snap)
            _say(
                f"a run is already active in {run.root} ({holder['role']} pid {holder['pid']}); "
                "not starting a second one:"
            )
            _say(format_status(s))
            _say(f"  watch: ftrun status {run.root} | ftrun logs -f {run.root}    stop: ftrun stop {run.root}")
            return 0
        if is_locked(run):
            raise busy_error(run)  # held, but by no process ftrun can vouch for: never a second training
        state = effective_state(run)
        if state in TRAINED and differs:  # the finished run stays as it is; this recipe would be dropped in silence
            exports = {k.split(".")[0] for k in differs} <= {"export", "gguf_type"}
            raise RecipeError(
                f"{run.root} holds a finished run, and this recipe differs from it:\n" + _listed(differs),
                fix=(
                    f"`ftrun export {run.root} --merged` or `--gguf TYPE` makes another export of the finished run; "
                    if exports
                    else ""
                )
                + "add --fresh to train this recipe from the start (the finished run is "
                "kept, renamed), or set another output_dir (output_dir=runs/NAME, or in the recipe) to keep both.",
            )
        if state == "trained-not-exported" and (snap.state.get("export") or {}).get("state") == "stopped":
            _say(f"this run has finished training, and `ftrun stop` ended its export: making it now ({run.root})")
            from launcher.run.after_training import export_command

            return export_command(run)
        if state in TRAINED:
            _say(f"this run has finished: {run.root}")
            _say(format_status(run_status(run, snap)))
            if state == "trained-not-exported":
                _say(f"Its export failed its check: `ftrun export {run.root}` retries it (see final/export.json).")
            _say("To train again from the start, add --fresh (the finished run is kept, renamed).")
            return 0
        if not restarts_after_failed_smoke(run, snap.state):
            recipe = with_adjustments(run, recipe)
            _check_same_trajectory(run, recipe, allow_changes, snap.state)
        if recipe.resume is False:
            raise RecipeError(
                f"{run.root} already holds a run and the recipe says resume: false",
                fix="add --fresh to start over (the old run is kept, renamed), or set resume: auto.",
            )
        resuming = True
    elif run.root.exists() and not run.exists() and any(run.root.iterdir()):
        raise _not_a_run(run)
    if recipe.resume is True and not resuming:
        raise RecipeError(
            f"resume: true but {run.root} holds no run to resume",
            fix="set resume: auto to start a new run when there is none.",
        )
    found = _model_found(recipe)
    examples, lengths, stats, plan, plan_dict, lock, data_sha = _prepare(
        run,
        recipe,
        resuming=resuming,
        fresh=fresh,
        memory_limit=memory_limit,
        allow_changes=allow_changes,
        nodes=nodes,
        state=snap.state,
    )
    recipe = as_written(run, recipe, stats, plan)  # as _prepare wrote it into recipe.yaml: its parent the pinned copy
    download = _download(run, recipe, found, plan_dict)
    ckpt_step = newest_step_unverified(run.checkpoints)
    smoke_ok = run.smoke.is_file()
    if resuming:
        where = (
            f"from checkpoint step-{ckpt_step:06d} (verified by the worker before use)"
            if ckpt_step is not None
            else "from the start: no checkpoint was written yet"
        )
        move(run, "plan", **_launcher(), data_sha256=data_sha, reason=f"continuing {where}")
        _say(f"continuing {run.root} {where}")
    else:
        move(run, "plan", **_launcher(), data_sha256=data_sha, reason="new run")
    # the base model's task score and the verdict, before the smoke test; said, never a stop (--fresh: no history)
    launch_baseline(run, recipe, plan_dict, _say, None if fresh else snap.state, not foreground)

    # a resume with a checkpoint, or after a passed smoke test, skips it: it was measured on this trajectory
    if recipe.smoke.enabled and not (resuming and (smoke_ok or ckpt_step is not None)):
        # measured in the session the run's worker will have: its own (detached), or this one (--foreground)
        recipe, plan_dict = _smoke(run, recipe, plan_dict, examples, lengths, stats, download, not foreground)

    from launcher.run.supervisor import start_detached, supervise

    resume = resume_command(recipe_path, overrides, memory_limit, nodes)  # stored: every view of it can say it
    if foreground:
        move(
            run, "run", supervisor_pid=os.getpid(), supervisor_proc=process_identity(os.getpid()), resume_command=resume
        )
        with progress.attached(run):
            code = supervise(run.root, lock.fd)
        _say(format_status(run_status(run), ending_follows=True))
        _say(summary_view.format_end_summary(end_summary(run)))
        return code
    pid = start_detached(run, lock.fd)
    # who holds the lock from now on, recorded (pid and start time) before the launcher lets go of it
    move(run, "run", supervisor_pid=pid, supervisor_proc=process_identity(pid), resume_command=resume)
    lock.release()  # the supervisor holds the same lock through the inherited descriptor
    _say(views.format_background_start(run.root, pid, resume))
    return 0


def prepare_only(recipe: Recipe, purpose: str, memory_limit: Optional[float] = None):
    """A step before the run (`ftrun smoke`, `ftrun baseline`): everything the launch does before its smoke test.
    Returns the recipe, the run, _prepare's tuple and the download's record; the caller releases the lock."""
    run = run_dir_of(recipe)
    exists, state = run.exists(), RunSnapshot(run).state
    if exists:
        if is_locked(run):
            raise UsageError(f"a run is active in {run.root}", fix=f"watch it with `ftrun status {run.root}`.")
        if not restarts_after_failed_smoke(run, state):
            recipe = with_adjustments(run, recipe)
            _check_same_trajectory(run, recipe, state=state)
    elif run.root.exists() and any(run.root.iterdir()):
        raise _not_a_run(run)
    found = _model_found(recipe)
    prepared = _prepare(run, recipe, resuming=exists, fresh=False, memory_limit=memory_limit, state=state)
    recipe = as_written(run, recipe, prepared[2], prepared[3])  # as _prepare wrote it into recipe.yaml
    lock = prepared[5]
    try:
        move(run, "plan", **_launcher(), data_sha256=prepared[6], reason=purpose)
        download = _download(run, recipe, found, prepared[4])
    except BaseException:
        lock.release()
        raise
    return recipe, run, prepared, download


def _not_a_run(run: RunDir) -> UsageError:
    return UsageError(
        f"output_dir {run.root} exists and holds files that are not an ftrun run",
        fix="choose another output_dir (recipe or `output_dir=...`); ftrun never writes into a folder it did not "
        "create.",
    )


def _model_found(recipe: Recipe) -> dict[str, Any]:
    """The model's weights found (before the run directory is touched) and its tokenizer fetched for the data check."""
    found = weights.check(recipe.model)
    missed = weights.fetch_tokenizer(recipe.model, found)
    if missed:
        _say(f"note: {missed}")
    return found


def smoke_only(recipe_path: str, overrides: list[str], memory_limit: Optional[float] = None) -> int:
    """`ftrun smoke RECIPE`: plan and smoke-test without starting the run (a later `ftrun RECIPE` reuses it)."""
    recipe, run, prepared, download = prepare_only(load_recipe(recipe_path, overrides), "smoke test only", memory_limit)
    examples, lengths, stats, _plan, plan_dict, lock, _sha = prepared
    try:
        _smoke(run, recipe, plan_dict, examples, lengths, stats, download)
        move(run, "plan", reason="smoke test passed; `ftrun RECIPE` starts the run")
    finally:
        lock.release()
    return 0


def _launcher() -> dict[str, Any]:
    """state.json fields naming this launcher while it holds the run's lock (plan, smoke test)."""
    return {"launcher_pid": os.getpid(), "launcher_proc": process_identity(os.getpid())}


def _end_orphans(run: RunDir, recipe: Recipe, state: dict[str, Any]) -> None:
    """Workers left training into the run without a supervisor are ended before anything else starts."""
    if run_holder(run, state) is not None:
        return
    from launcher.run.control import end_orphans

    if end_orphans(run, recipe.grace_seconds + 15, log=_say, data=state):
        # the kernel releases a zombie's descriptors (the run's lock) only when its last thread exits: a moment
        deadline = time.monotonic() + 15
        while is_locked(run) and time.monotonic() < deadline:
            time.sleep(0.2)
        _say(f"{run.root}: the orphaned worker(s) have exited")


def _check_same_trajectory(
    run: RunDir, recipe: Recipe, allow_changes: bool = False, state: Optional[dict[str, Any]] = None
) -> None:
    """Refuse a recipe that changes the run's trajectory, or record the change allowed; `state`: as the command read
    it (else read here)."""
    old = load_recipe(run.recipe)
    diffs = _listed(_differences(old.trajectory(), recipe.trajectory()))
    if diffs and not allow_changes:
        raise RecipeError(
            f"the recipe differs from the run in {run.root} in settings that change the training:\n" + diffs,
            fix="restore those values to resume, add --allow-changes to continue from the checkpoint anyway, add "
            "--fresh to start a new run (the old one is kept, renamed), or set another output_dir.",
        )
    if diffs:
        _say(
            "--allow-changes: continuing from the existing checkpoints with a changed recipe:\n"
            + diffs
            + "\n(the optimizer and scheduler state come from the checkpoint; the trajectory is no longer the original "
            "one)"
        )
        state = RunSnapshot(run).state if state is None else state
        hashes = set(state.get("accepted_recipe_hashes", [])) | {old.trajectory_hash()}
        move(run, "note", accepted_recipe_hashes=sorted(hashes))
