"""The `ftrun RECIPE` flow: recipe -> plan -> smoke test -> detached run; or the status / resume of a run that
exists."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import yaml

from launcher.store.checkpoint import atomic_write_json, newest_step_unverified
from launcher.engine_kinds import MULTI_NODE
from launcher.errors import BusyError, FtrunError, HardwareError, RecipeError, UsageError
from launcher.recipe import Recipe, check_trainer_fields, load_recipe
from launcher.run import weights
from launcher.store.rundir import RUNS, RunDir
from launcher.worker.trackers import check_installed as check_trackers_installed
from launcher.store.sync import kinds as sync_kinds
from launcher.store.state import (
    TRAINED,
    RunLock,
    busy_error,
    effective_state,
    is_locked,
    process_identity,
    read_state,
    run_holder,
    set_state,
)
from launcher.run import parent, progress, views
from launcher.run.commands import resume_command
from launcher.run.data_view import data_label, data_line, format_loss_view, wants_color
from launcher.run.facts import end_summary, run_status
from launcher.run.task_baseline import launch_baseline
from launcher.run.views import format_status
from launcher.run.adjustments import next_adjustment, shard_blocker, with_adjustments, with_plan_settings
from launcher.data.stats import data_record, data_stats


def _say(msg: str) -> None:
    print(msg, flush=True)


def hardware_for(gpus: Optional[str]):
    from launcher.plan import hardware
    from launcher.plan import this_box

    return hardware.from_spec(gpus) if gpus else this_box.detect()


def make_plan(
    recipe: Recipe, stats, gpus: Optional[str] = None, tokens: Optional[int] = None, smoke=None, nnodes: int = 1
):
    from launcher.plan.plan import make_plan as _make_plan

    return _make_plan(recipe, hardware_for(gpus), data_stats=stats, tokens=tokens, smoke=smoke, nnodes=nnodes)


def _diff_trajectory(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [
        f"- {k}: run has {old.get(k)!r}, recipe now says {new.get(k)!r}"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
    ]


def _flat(snap: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in snap.items():
        if isinstance(v, dict):  # each key by its dotted name (lora.r, trainer.lr_scheduler_type)
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


# Keys that only decide how a run starts (its smoke test and what an out of memory there may change, whether to
# resume) or what the plan assumes (box, tokens, price): nothing to a run in progress or finished, never a difference.
STARTING_ONLY = ("smoke", "auto_adjust", "resume", "box", "tokens", "price_per_hour_eur")


def _recipe_differences(run: RunDir, recipe: Recipe) -> dict[str, tuple[Any, Any]]:
    """Every setting (dotted key) in which `recipe` differs from the run's own recipe.yaml: (the run's, the recipe's);
    the STARTING_ONLY keys left out. The smoke test's recorded adjustments are applied first: they are the run's."""
    try:
        old = parent.as_given(run, load_recipe(run.recipe).snapshot())
    except FtrunError:  # a recipe.yaml this ftrun cannot read: the run's own views say so; nothing to compare
        return {}
    new = with_adjustments(run, recipe).snapshot()
    a, b = _flat(old), _flat(new)
    return {
        k: (a.get(k), b.get(k))
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) and k.split(".")[0] not in STARTING_ONLY
    }


def _listed(differs: dict[str, tuple[Any, Any]]) -> str:
    return "\n".join(f"- {k}: run has {old!r}, recipe now says {new!r}" for k, (old, new) in differs.items())


def _archive(run: RunDir) -> Path:
    dest = run.root.with_name(f"{run.root.name}.{time.strftime('%Y%m%d-%H%M%S')}")
    run.root.rename(dest)
    return dest


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
    if run.exists():
        _end_orphans(run, recipe)
    if run.exists() and not fresh:
        holder = run_holder(run)
        differs = _recipe_differences(run, recipe) if holder or effective_state(run) in TRAINED else {}
        if holder and differs:  # another recipe pointed at a busy run: never a second training, never silence
            raise BusyError(
                f"{run.root} is busy: a run is in progress there ({holder['role']} pid {holder['pid']}), and this "
                f"recipe differs from it:\n" + _listed(differs),
                fix=f"set another output_dir to train this recipe beside it (output_dir=runs/NAME, or in the "
                f"recipe), or wait for the run to end (`ftrun status {run.root}`), or stop it (`ftrun stop "
                f"{run.root}`).",
            )
        if holder:
            s = run_status(run)
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
        if state in TRAINED:
            _say(f"this run has finished: {run.root}")
            _say(format_status(run_status(run)))
            if state == "trained-not-exported":
                _say(f"Its export failed its check: `ftrun export {run.root}` retries it (see final/export.json).")
            _say("To train again from the start, add --fresh (the finished run is kept, renamed).")
            return 0
        if not restarts_after_failed_smoke(run):
            recipe = with_adjustments(run, recipe)
            _check_same_trajectory(run, recipe, allow_changes)
        if recipe.resume is False:
            raise RecipeError(
                f"{run.root} already holds a run and the recipe says resume: false",
                fix="add --fresh to start over (the old run is kept, renamed), or set resume: auto.",
            )
        resuming = True
    elif run.root.exists() and not run.exists() and any(run.root.iterdir()):
        raise UsageError(
            f"output_dir {run.root} exists and holds files that are not an ftrun run",
            fix="choose another output_dir (recipe or `output_dir=...`); ftrun never writes into a folder it did not "
            "create.",
        )
    if recipe.resume is True and not resuming:
        raise RecipeError(
            f"resume: true but {run.root} holds no run to resume",
            fix="set resume: auto to start a new run when there is none.",
        )
    found = weights.check(recipe.model)  # before the run directory is touched: a failure leaves nothing behind
    missed = weights.fetch_tokenizer(recipe.model, found)  # the data check renders with the model's chat template
    if missed:
        _say(f"note: {missed}")

    examples, lengths, stats, plan, plan_dict, lock, data_sha = _prepare(
        run, recipe, resuming=resuming, fresh=fresh, memory_limit=memory_limit, allow_changes=allow_changes, nodes=nodes
    )
    recipe = with_plan_settings(recipe, plan.to_dict())  # as _prepare wrote it into recipe.yaml (a new choice only)
    download = _download(run, recipe, found, plan_dict)
    ckpt_step = newest_step_unverified(run.checkpoints)
    smoke_ok = run.smoke.is_file()
    if resuming:
        where = (
            f"from checkpoint step-{ckpt_step:06d} (verified by the worker before use)"
            if ckpt_step is not None
            else "from the start: no checkpoint was written yet"
        )
        set_state(run, "planned", **_launcher(), data_sha256=data_sha, reason=f"continuing {where}")
        _say(f"continuing {run.root} {where}")
    else:
        set_state(run, "planned", **_launcher(), data_sha256=data_sha, reason="new run")
    # the base model's task score and the verdict (does fine-tuning pay?), before the smoke test; said, never a stop
    launch_baseline(run, recipe, plan_dict, _say)

    # a resume with a checkpoint, or after a passed smoke test, skips it: it was measured on this trajectory
    if recipe.smoke.enabled and not (resuming and (smoke_ok or ckpt_step is not None)):
        recipe, plan_dict = _smoke(run, recipe, plan_dict, examples, lengths, stats, download)

    from launcher.run.supervisor import start_detached, supervise

    resume = resume_command(recipe_path, overrides, memory_limit, nodes)  # stored: every view of it can say it
    if foreground:
        set_state(
            run, "running", supervisor_pid=_pid(), supervisor_proc=process_identity(_pid()), resume_command=resume
        )
        with progress.attached(run):  # a live progress bar on a terminal
            code = supervise(run.root, lock.fd)
        _say(format_status(run_status(run), ending_follows=True))
        _say(views.format_end_summary(end_summary(run)))
        return code
    pid = start_detached(run, lock.fd)
    # who holds the lock from now on, recorded before the launcher lets go of it (the supervisor records
    # itself too): pid and start time, so that no later process with the same pid passes for it
    set_state(run, "running", supervisor_pid=pid, supervisor_proc=process_identity(pid), resume_command=resume)
    lock.release()  # the supervisor holds the same lock through the inherited descriptor
    _say(views.format_background_start(run.root, pid, resume))
    return 0


def run_dir_of(recipe: Recipe) -> RunDir:
    """The recipe's run directory; an output_dir that names a file is a usage error, before anything runs."""
    root = Path(recipe.output_dir)
    if root.exists() and not root.is_dir():
        raise UsageError(
            f"output_dir {root} is a file, not a folder",
            fix="set output_dir to a folder (recipe or `output_dir=...`), e.g. runs/<name>; ftrun creates it.",
        )
    return RunDir(root)


def restarts_after_failed_smoke(run: RunDir) -> bool:
    """A run whose smoke test found nothing that fits trained nothing: it starts again from the recipe as it is
    now (no adjustments re-applied, no trajectory or data check, the smoke test run again)."""
    return read_state(run).get("state") == "failed-smoke" and newest_step_unverified(run.checkpoints) is None


def _prepare(
    run: RunDir,
    recipe: Recipe,
    *,
    resuming: bool,
    fresh: bool,
    memory_limit: Optional[float] = None,
    allow_changes: bool = False,
    nodes: Optional[dict[str, Any]] = None,
):
    """Check everything (trainer fields, data, plan) before touching the run directory; then lock and write."""
    check_trainer_fields(recipe)
    check_trackers_installed(recipe, launching=True)  # report_to: refused with the fix before any GPU time
    examples, lengths, stats = data_stats(recipe)
    data_sha = stats.sha256
    restart = resuming and restarts_after_failed_smoke(run)
    if restart:
        why = read_state(run).get("reason") or "it did not pass"
        _say(f"the last smoke test in {run.root} failed ({why}): starting again from the recipe")
    if resuming and not restart:
        old_sha = read_state(run).get("data_sha256")
        if old_sha and old_sha != data_sha and allow_changes:
            _say(f"--allow-changes: the data ({data_label(stats)}) changed since this run started; continuing anyway")
        elif old_sha and old_sha != data_sha:
            raise RecipeError(
                f"the data ({data_label(stats)}) changed since this run started (sha256 {old_sha[:12]}... -> "
                f"{data_sha[:12]}...)",
                fix="restore the original data, add --allow-changes to continue on the new data, or add --fresh to "
                "start "
                "a new run on it (the old run is kept).",
            )
    # a resume skips the smoke test: its passed measurements calibrate the plan again (memory, throughput)
    smoke = json.loads(run.smoke.read_text()) if resuming and not restart and run.smoke.is_file() else None
    plan = make_plan(recipe, stats, smoke=smoke, nnodes=(nodes or {}).get("nnodes", 1))
    recipe = with_plan_settings(recipe, plan.to_dict())  # recipe.yaml and the worker train with the plan's choice
    _check_shared_memory(plan.to_dict())
    # the repository the planned engine loads, when it is not the recipe's model (Unsloth's pre-quantized QLoRA):
    # checked here, before the run directory is touched, and downloaded before the smoke test in its place
    loads = worker_model(recipe, plan.to_dict())
    worker_weights = {"model": loads, **weights.check(loads)} if loads != recipe.model else None
    if nodes and plan.to_dict().get("engine") not in MULTI_NODE:
        raise UsageError(
            f"--nnodes {nodes['nnodes']}: the plan chose engine '{plan.to_dict().get('engine')}', which runs on one "
            f"box",
            fix="add engine=ddp (or engine=deepspeed) and num_processes=<processes per node> to train over several "
            "boxes.",
        )
    # a restart after a failed smoke test keeps none of its adjustments, nor its stale measurements
    previous = json.loads(run.plan.read_text()) if resuming and not restart and run.plan.is_file() else {}
    if fresh and run.exists():
        if is_locked(run):
            raise UsageError(
                f"--fresh: the run in {run.root} is still active", fix=f"stop it first with `ftrun stop {run.root}`."
            )
        _say(f"--fresh: the previous run was moved to {_archive(run)}")
    lock = RunLock(run).acquire()
    if restart:
        run.smoke.unlink(missing_ok=True)  # an older passed smoke test measured a configuration that ran out
    run.root.mkdir(parents=True, exist_ok=True)
    snapshot = recipe.snapshot()
    if recipe.init_from is not None:  # the run trains from its own copy of the parent (launcher/run/parent.py)
        snapshot["init_from"] = parent.pin(run, recipe.init_from)
    run.recipe.write_text(
        "# resolved by ftrun: defaults < recipe < command line\n" + yaml.safe_dump(snapshot, sort_keys=False)
    )
    plan_dict = _plan_record(plan, memory_limit, previous.get("adjustments"), nodes)
    if previous.get("speed") and not plan_dict.get("speed"):  # the run's own choice, kept by with_adjustments
        plan_dict["speed"] = previous["speed"]
    if previous:  # a resume: the forecast the user was shown first stays the plan's, the new one is labelled
        plan_dict["estimate_as_planned"] = previous.get("estimate_as_planned") or previous.get("estimate")
        plan_dict["estimate_at_resume"] = plan_dict.get("estimate")
    if worker_weights:
        plan_dict["weights"] = worker_weights
    atomic_write_json(run.plan, plan_dict)
    atomic_write_json(run.root / "data.json", data_record(stats))  # what this run trains on
    from launcher.plan.text import format_plan

    _say(f"data: {data_line(stats)}")
    if stats.loss_view:  # the example as the loss sees it, kept with plain brackets (ftrun data RECIPE shows it again)
        (run.root / "data_example.txt").write_text(format_loss_view(stats.loss_view, statistics=True) + "\n")
    _say(format_loss_view(stats.loss_view, color=wants_color()))
    _say(format_plan(plan))
    if memory_limit:
        _say(f"memory limited to {round(memory_limit, 2):g} GB per worker (--memory-limit)")
    return examples, lengths, stats, plan, plan_dict, lock, data_sha


def _check_shared_memory(plan: dict[str, Any]) -> None:
    """A multi-process CUDA run on a box whose /dev/shm is too small for NCCL is refused before any GPU time."""
    from launcher.plan.hardware import MIN_SHM_BYTES, SHM_PATH, shared_memory_bytes
    from launcher.worker.engines import MULTI_PROCESS

    if plan.get("device") != "cuda" or plan.get("engine") not in MULTI_PROCESS or int(plan.get("num_processes", 1)) < 2:
        return
    size = shared_memory_bytes()
    if size is None or size >= MIN_SHM_BYTES:
        return
    n = int(plan.get("num_processes", 1))
    raise HardwareError(
        f"{SHM_PATH} holds only {size / 2**20:.0f} MB: NCCL's shared-memory transport between the {n} processes of "
        f"engine {plan.get('engine')} needs at least {MIN_SHM_BYTES / 2**30:.0f} GB there and fails at the first "
        "collective (Docker gives a container 64 MB unless told otherwise)",
        fix="start the container with --ipc=host (or --shm-size=16g), e.g. `docker run --gpus all --ipc=host ...`; "
        "or train on one card: num_processes=1.",
    )


def _plan_record(
    plan, memory_limit: Optional[float], adjustments: Optional[list], nodes: Optional[dict[str, Any]] = None
) -> dict[str, Any]:
    """plan.json: the plan, plus what the launcher decided around it (a memory cap, OOM adjustments, nodes)."""
    record = plan.to_dict()
    if memory_limit:
        record["memory_limit_gb"] = memory_limit
    if nodes:
        record["nodes"] = nodes
        record.setdefault("reasons", []).append(
            f"{nodes['nnodes']} nodes x {record.get('num_processes', 1)} process(es); this is node "
            f"{nodes['node_rank']}, rendezvous at {nodes['master_addr']}:{nodes['master_port']}"
        )
    if adjustments:
        record["adjustments"] = adjustments
    return record


def worker_model(recipe: Recipe, plan: dict[str, Any]) -> str:
    """The model the worker loads: the recipe's, except where Unsloth trains QLoRA on its pre-quantized 4-bit
    copy (launcher/worker/engines/unsloth.py load_model_and_tokenizer), about a quarter of the download."""
    if plan.get("engine") == "unsloth":
        from launcher.plan.models import prequantized_repo

        return prequantized_repo(recipe.model, recipe.method) or recipe.model
    return recipe.model


def _download(run: RunDir, recipe: Recipe, found: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """The weights the worker loads into the cache before the smoke test, the progress on the console and in
    train.log. The recipe's own model, when another repository trains (plan["weights"]), is fetched by the export
    that merges onto it, if one does."""

    def say(line: str) -> None:
        _say(line)
        with run.log.open("a") as fh:
            fh.write(f"[ftrun {time.strftime('%H:%M:%S')}] {line}\n")

    if plan.get("weights"):
        return weights.fetch(plan["weights"]["model"], plan["weights"], say)
    return weights.fetch(recipe.model, found, say)


def _smoke(
    run: RunDir, recipe: Recipe, plan_dict, examples, lengths, stats, download: Optional[dict[str, Any]] = None
) -> tuple[Recipe, dict[str, Any]]:
    """The smoke test; after an out-of-memory, re-plan with the cheapest allowed change and try again.

    Returns the recipe as adjusted (the full run trains with it) and the calibrated plan record.
    """
    from launcher.errors import PlanError, SmokeError, SmokeOOM
    from launcher.run.smoke import run_smoke
    from launcher.run.views import format_smoke

    set_state(run, "smoking")
    attempts: list[str] = []
    adjustments = list(plan_dict.get("adjustments", []))
    while True:
        try:
            report = run_smoke(run, recipe, plan_dict, examples, lengths, stats)
            break
        except SmokeOOM as exc:
            peak = f"peak {exc.peak_memory_gb:.2f} GB" if exc.peak_memory_gb is not None else "peak unknown"
            limit = plan_dict.get("memory_limit_gb") or (plan_dict.get("memory") or {}).get("capacity_gb")
            where = f"{peak}" + (f" of {round(limit, 2):g} GB" if limit else "")
            if plan_dict.get("device") == "cpu" and plan_dict.get("memory_limit_gb"):
                where += " above the imports"  # what --memory-limit caps on CPU
            attempts.append(
                f"engine {plan_dict.get('engine')} x {plan_dict.get('num_processes', 1)}: "
                f"micro_batch_size={recipe.micro_batch_size} gradient_accumulation_steps="
                f"{recipe.gradient_accumulation_steps} gradient_checkpointing={recipe.gradient_checkpointing} "
                f"method={recipe.method}: out of memory ({where})"
            )
            step = next_adjustment(recipe, plan_dict)
            if step is None:
                blocked = shard_blocker(recipe, plan_dict) if "shard" in recipe.auto_adjust else ""
                reason = (
                    "the smoke test ran out of memory and nothing the recipe allows (auto_adjust: "
                    f"{recipe.auto_adjust}) is left to try"
                    + (f" (shard: {blocked})" if blocked else "")
                    + ". Attempts:\n"
                    + "\n".join(f"- {a}" for a in attempts)
                )
                set_state(run, "failed-smoke", reason=reason.splitlines()[0])
                raise SmokeError(
                    reason,
                    fix=f"lower max_length (now {recipe.max_length}), allow more in auto_adjust "
                    "(batch, checkpointing, optimizer, method, shard), or use a card with more memory "
                    "(`ftrun plan RECIPE --gpus ...` shows the options with time and cost).",
                ) from None
            update, text = step
            change = {"set": update, "reason": f"{text}: out of memory at {where} on the longest batch"}
            adjustments.append(change)
            _say(f"smoke test: out of memory ({where}); re-planning: {text}")
            recipe = recipe.model_copy(update=update)
            plan_dict = {**plan_dict, "adjustments": adjustments}
            if "engine" in update:  # another engine and process count: the plan is made again for them
                try:
                    replanned = make_plan(recipe, stats)
                except PlanError as exc:
                    set_state(run, "failed-smoke", reason=f"re-planning after out of memory failed: {exc.message}")
                    raise SmokeError(
                        f"the smoke test ran out of memory; re-planning for {text} failed: {exc.message}."
                        " Attempts:\n" + "\n".join(f"- {a}" for a in attempts),
                        fix=exc.fix,
                    ) from None
                plan_dict = _plan_record(
                    replanned, plan_dict.get("memory_limit_gb"), adjustments, plan_dict.get("nodes")
                )
                _say(f"re-planned: engine {replanned.engine}, {replanned.num_processes} processes")
                # one card's job sharded over the idle ones (FSDP, ZeRO-3) now needs NCCL between processes: the
                # first launch checked /dev/shm only for the job it planned then
                try:
                    _check_shared_memory(plan_dict)
                except HardwareError as exc:
                    set_state(run, "failed-smoke", reason=exc.message)
                    raise
            run.recipe.write_text(
                "# resolved by ftrun: defaults < recipe < command line < OOM adjustments (plan.json)\n"
                + yaml.safe_dump(recipe.snapshot(), sort_keys=False)
            )
            atomic_write_json(run.plan, plan_dict)
        except SmokeError as exc:
            set_state(run, "failed-smoke", reason=exc.message.splitlines()[0])
            raise
        except KeyboardInterrupt:
            set_state(run, "failed-smoke", reason="smoke test interrupted (Ctrl-C)")
            raise
    if download:  # the download's time beside the forecast's parts (already spent: the full run reads the cache)
        report = {**report, **download}
        atomic_write_json(run.smoke, report)
    _say(format_smoke(report))
    # Plan, then calibrate: the measured throughput and memory replace the estimates.
    calibrated = make_plan(recipe, stats, smoke=report, nnodes=(plan_dict.get("nodes") or {}).get("nnodes", 1))
    record = _plan_record(calibrated, plan_dict.get("memory_limit_gb"), adjustments, plan_dict.get("nodes"))
    record["speed"] = plan_dict.get("speed")  # the plan's choice and its reasons, which the recipe now holds
    # the forecast the user was shown before the smoke test ("Time:" of the printed plan): `ftrun status` compares
    # with that one as "plan forecast", the calibrated estimate being the smoke test's own forecast again
    record["estimate_as_planned"] = plan_dict.get("estimate_as_planned") or plan_dict.get("estimate")
    atomic_write_json(run.plan, record)
    return recipe, record


def prepare_only(recipe: Recipe, purpose: str, memory_limit: Optional[float] = None):
    """A step before the run (`ftrun smoke`, `ftrun baseline`): checks, plan, lock and recipe.yaml as the launch
    makes them, the model in the cache; state `planned` with `purpose` as its reason. Returns the recipe (with the
    run's adjustments), the run, _prepare's tuple and the download's record; the caller releases the lock."""
    run = run_dir_of(recipe)
    exists = run.exists()
    if exists:
        if is_locked(run):
            raise UsageError(f"a run is active in {run.root}", fix=f"watch it with `ftrun status {run.root}`.")
        if not restarts_after_failed_smoke(run):
            recipe = with_adjustments(run, recipe)
            _check_same_trajectory(run, recipe)
    elif run.root.exists() and any(run.root.iterdir()):
        raise UsageError(
            f"output_dir {run.root} exists and holds files that are not an ftrun run",
            fix="choose another output_dir; ftrun never writes into a folder it did not create.",
        )
    found = weights.check(recipe.model)  # before the run directory is touched: a failure leaves nothing behind
    missed = weights.fetch_tokenizer(recipe.model, found)  # the data check renders with the model's chat template
    if missed:
        _say(f"note: {missed}")
    prepared = _prepare(run, recipe, resuming=exists, fresh=False, memory_limit=memory_limit)
    recipe = with_plan_settings(recipe, prepared[3].to_dict())  # as _prepare wrote it into recipe.yaml
    lock = prepared[5]
    try:
        set_state(run, "planned", **_launcher(), data_sha256=prepared[6], reason=purpose)
        download = _download(run, recipe, found, prepared[4])
    except BaseException:
        lock.release()
        raise
    return recipe, run, prepared, download


def smoke_only(recipe_path: str, overrides: list[str], memory_limit: Optional[float] = None) -> int:
    """`ftrun smoke RECIPE`: plan and smoke-test without starting the run (a later `ftrun RECIPE` reuses it)."""
    recipe, run, prepared, download = prepare_only(load_recipe(recipe_path, overrides), "smoke test only", memory_limit)
    examples, lengths, stats, _plan, plan_dict, lock, _sha = prepared
    try:
        _smoke(run, recipe, plan_dict, examples, lengths, stats, download)
        set_state(run, "planned", reason="smoke test passed; `ftrun RECIPE` starts the run")
    finally:
        lock.release()
    return 0


def _pull_if_remote_run(run: RunDir, recipe: Recipe) -> bool:
    """A fresh box with an empty output_dir: fetch the run from `sync.to` when it holds one."""
    from launcher.errors import SyncError
    from launcher.store.sync import pull, remote_has_run

    try:
        found = remote_has_run(recipe.sync.to)
    except SyncError as exc:
        # A run that cannot reach its off-box copy must not start blind: it might overwrite nothing, or
        # it might be the resume of a lost box whose checkpoints sit there.
        raise SyncError(
            f"cannot look for an earlier copy of this run at sync.to={recipe.sync.to}: {exc.message}",
            fix="check that the destination is reachable from this box (for SSH: `ssh HOST true` with "
            "your ~/.ssh/config), or remove sync.to to train without an off-box copy.",
        ) from None
    if not found:
        return False
    if run.root.exists() and any(run.root.iterdir()):
        raise UsageError(
            f"{recipe.sync.to} holds this run, but output_dir {run.root} is not empty and is not an ftrun run",
            fix="empty that folder or choose another output_dir, then run the same command to fetch and resume.",
        )
    _say(f"{run.root} is empty on this box, {recipe.sync.to} holds the run: fetching the newest verified checkpoint")
    lock = RunLock(run).acquire()
    try:
        step = pull(recipe.sync.to, run, log=_say)
        # The pids in the fetched state belong to the lost box.
        data = read_state(run)
        if data:
            set_state(
                run,
                data.get("state", "planned"),
                supervisor_pid=None,
                worker_pid=None,
                supervisor_proc=None,
                worker_proc=None,
                launcher_proc=None,
                reason=f"fetched from {recipe.sync.to}" + (f" at step {step}" if step is not None else ""),
            )
    finally:
        lock.release()
    return True


def pull_command(recipe_path: str, overrides: list[str]) -> int:
    """`ftrun pull RECIPE`: fetch the run from sync.to without resuming it."""
    recipe = load_recipe(recipe_path, overrides)
    if not recipe.sync.to:
        raise RecipeError(
            "the recipe has no sync.to, so there is nothing to pull from",
            fix=f"set sync: {{to: ...}} in the recipe, one of: {sync_kinds.forms()}.",
        )
    run = run_dir_of(recipe)
    if run.exists():
        raise UsageError(
            f"{run.root} already holds a run; pulling would overwrite it",
            fix="choose an empty output_dir (output_dir=...) to fetch a copy.",
        )
    if not _pull_if_remote_run(run, recipe):
        raise UsageError(
            f"{recipe.sync.to} holds no ftrun run (no recipe.yaml there)",
            fix="check sync.to; a run copies itself there once its first checkpoint exists.",
        )
    _say(format_status(run_status(run)))
    return 0


def push_command(target: Optional[str]) -> int:
    """`ftrun push RUN`: copy the newest checkpoint, the final result and the metadata off the box now."""
    from launcher.store.sync import Syncer

    run = resolve_run(target)
    recipe = load_recipe(run.recipe)
    if not recipe.sync.to:
        raise RecipeError("the run's recipe has no sync.to", fix="set sync: {to: ...} in the recipe.")
    syncer = Syncer(run, recipe.sync.to, recipe.sync.keep, log=_say)
    if not syncer.sync_once(final=run.final.is_dir()):
        raise UsageError(f"the copy to {recipe.sync.to} failed (see above)", fix="check the destination and retry.")
    _say(f"{run.root}: copied to {recipe.sync.to} and verified")
    return 0


def _pid() -> int:
    import os

    return os.getpid()


def _launcher() -> dict[str, Any]:
    """state.json fields naming this launcher while it holds the run's lock (plan, smoke test)."""
    return {"launcher_pid": _pid(), "launcher_proc": process_identity(_pid())}


def _end_orphans(run: RunDir, recipe: Recipe) -> None:
    """Workers left training into the run by a supervisor or launcher killed hard are ended (after a checkpoint)
    before anything else starts: never two trainings in one directory. A live, verified run is left alone."""
    if run_holder(run) is not None:
        return
    from launcher.run.control import end_orphans

    if end_orphans(run, recipe.grace_seconds + 15, log=_say):
        # A worker counts as gone once its main thread is (a zombie); the kernel releases its descriptors, the
        # run's lock among them, only when its last thread has exited: give that a moment before the lock is read.
        deadline = time.monotonic() + 15
        while is_locked(run) and time.monotonic() < deadline:
            time.sleep(0.2)
        _say(f"{run.root}: the orphaned worker(s) have exited")


def _check_same_trajectory(run: RunDir, recipe: Recipe, allow_changes: bool = False) -> None:
    old = load_recipe(run.recipe)
    diffs = _diff_trajectory(old.trajectory(), recipe.trajectory())
    if diffs and not allow_changes:
        raise RecipeError(
            f"the recipe differs from the run in {run.root} in settings that change the training:\n" + "\n".join(diffs),
            fix="restore those values to resume, add --allow-changes to continue from the checkpoint anyway, add "
            "--fresh to start a new run (the old one is kept, renamed), or set another output_dir.",
        )
    if diffs:
        _say(
            "--allow-changes: continuing from the existing checkpoints with a changed recipe:\n"
            + "\n".join(diffs)
            + "\n(the optimizer and scheduler state come from the checkpoint; the trajectory is no longer the original "
            "one)"
        )
        accepted = read_state(run).get("accepted_recipe_hashes", [])
        set_state(
            run,
            read_state(run).get("state", "planned"),
            accepted_recipe_hashes=sorted(set(accepted) | {old.trajectory_hash()}),
        )


def resolve_run(target: Optional[str], overrides: list[str] | None = None, command: str = "status") -> RunDir:
    """A run directory from a recipe path or a run directory (default: the only run under ./RUNS)."""
    if target is None:
        folder = Path.cwd() / RUNS
        runs = sorted(p for p in folder.glob("*") if (p / "recipe.yaml").is_file()) if folder.is_dir() else []
        if len(runs) == 1:
            return RunDir(runs[0])
        if not runs:
            raise UsageError(
                f"no runs under ./{RUNS} (the folder ftrun looks in when no run is named)",
                fix=f"start one with `ftrun RECIPE`, or name a recipe or run directory: "
                f"`ftrun {command} recipes/tiny-cpu.yaml`.",
            )
        raise UsageError(
            f"no run given and {len(runs)} runs are under ./{RUNS}",
            fix=f"name the recipe or the run directory, e.g. `ftrun {command} {RUNS}/{runs[0].name}` "
            "(`ftrun status` lists them).",
        )
    p = Path(target)
    if p.is_dir():
        if not (p / "recipe.yaml").is_file():
            raise UsageError(
                f"{p} is not an ftrun run directory (no recipe.yaml)",
                fix="give the run's output_dir or its recipe file.",
            )
        return RunDir(p.resolve())
    if p.is_file():
        return run_dir_of(load_recipe(p, overrides))
    raise UsageError(
        f"'{target}' is neither a recipe file nor a run directory",
        fix="give the recipe you started the run with, or its output_dir.",
    )
