"""A launch up to its smoke test: every check, the plan, the locked run directory written, the weights in the cache."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import yaml

from launcher.data.stats import data_record, data_stats, with_data_defaults
from launcher.engine_kinds import MULTI_NODE
from launcher.errors import HardwareError, RecipeError, UsageError
from launcher.recipe import Recipe
from launcher.recipe_trainer import check_trainer_fields
from launcher.run import parent, weights
from launcher.run.adjustments import with_loss_resolved, with_plan_settings
from launcher.run.data_view import data_label, data_line, format_loss_view, wants_color
from launcher.store.checkpoint import atomic_write_json, newest_step_unverified
from launcher.store.rundir import RunDir
from launcher.store.state import RunLock, RunSnapshot, is_locked
from launcher.worker.trackers import check_installed as check_trackers_installed


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


def as_written(run: RunDir, recipe: Recipe, stats: Any, plan: Any) -> Recipe:
    """The recipe as _prepare wrote it into recipe.yaml, for the rest of the launch: what the data sized or resolved,
    the plan's faster settings, and init_from as the run's pinned copy of its parent (launcher/run/parent.py)."""
    recipe = with_loss_resolved(with_data_defaults(recipe, stats), stats.loss_view)
    recipe = with_plan_settings(recipe, plan.to_dict())
    held = run.pinned_parent()
    if recipe.init_from is not None and held and recipe.init_from in (held["init_from"], held["copy"]):
        recipe = recipe.model_copy(update={"init_from": held["copy"]})
    return recipe


def _archive(run: RunDir) -> Path:
    dest = run.root.with_name(f"{run.root.name}.{time.strftime('%Y%m%d-%H%M%S')}")
    run.root.rename(dest)
    return dest


def restarts_after_failed_smoke(run: RunDir, state: dict[str, Any]) -> bool:
    """A run whose smoke test found nothing that fits trained nothing: it starts again from the recipe as it is now
    (no adjustments re-applied, no trajectory or data check)."""
    return state.get("state") == "failed-smoke" and newest_step_unverified(run.checkpoints) is None


def _prepare(
    run: RunDir,
    recipe: Recipe,
    *,
    resuming: bool,
    fresh: bool,
    memory_limit: Optional[float] = None,
    allow_changes: bool = False,
    nodes: Optional[dict[str, Any]] = None,
    state: Optional[dict[str, Any]] = None,
):
    """Check everything (trainer fields, data, plan) before touching the run directory; then lock and write. `state`:
    the run's, as the command read it (else read here)."""
    check_trainer_fields(recipe)
    check_trackers_installed(recipe, launching=True)  # report_to: refused with the fix before any GPU time
    examples, lengths, stats = data_stats(recipe)
    answers_only = "assistant_only_loss" not in recipe.objective_row.refuses  # sft: the objective could take it
    if recipe.assistant_only_loss is None and answers_only and not stats.loss_view:  # said, never a silent fallback
        _say(
            "assistant_only_loss left out: the whole conversation trains (the model's tokenizer is not on this machine "
            "to check whether its chat template can mark the answers)"
        )
    recipe = with_loss_resolved(recipe, stats.loss_view)  # recipe.yaml and the worker train what the data check said
    recipe = with_data_defaults(recipe, stats)  # what the data sized (GRPO's answer length): recipe.yaml records it
    data_sha = stats.sha256
    state = RunSnapshot(run).state if state is None else state
    restart = resuming and restarts_after_failed_smoke(run, state)
    if restart:
        why = state.get("reason") or "it did not pass"
        _say(f"the last smoke test in {run.root} failed ({why}): starting again from the recipe")
    if resuming and not restart:
        old_sha = state.get("data_sha256")
        if old_sha and old_sha != data_sha and allow_changes:
            _say(f"--allow-changes: the data ({data_label(stats)}) changed since this run started; continuing anyway")
        elif old_sha and old_sha != data_sha:
            raise RecipeError(
                f"the data ({data_label(stats)}) changed since this run started (sha256 {old_sha[:12]}... -> "
                f"{data_sha[:12]}...)",
                fix="restore the original data, add --allow-changes to continue on the new data, or add --fresh to "
                "start a new run on it (the old run is kept).",
            )
    # a resume skips the smoke test: its passed measurements calibrate the plan again (memory, throughput)
    smoke = json.loads(run.smoke.read_text()) if resuming and not restart and run.smoke.is_file() else None
    plan = make_plan(recipe, stats, smoke=smoke, nnodes=(nodes or {}).get("nnodes", 1))
    recipe = with_plan_settings(recipe, plan.to_dict())  # recipe.yaml and the worker train with the plan's choice
    _check_shared_memory(plan.to_dict())
    # the repository the planned engine loads where it is not the recipe's model (Unsloth's pre-quantized QLoRA)
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
    _say(format_loss_view(stats.loss_view, color=wants_color(), sampled=recipe.objective_row.generates))
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
    """The model the worker loads: the recipe's, or Unsloth's pre-quantized 4-bit copy for its QLoRA
    (launcher/worker/engines/unsloth.py load_model_and_tokenizer)."""
    if plan.get("engine") == "unsloth":
        from launcher.plan.models import prequantized_repo

        return prequantized_repo(recipe.model, recipe.method) or recipe.model
    return recipe.model


def _download(run: RunDir, recipe: Recipe, found: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """The weights the worker loads into the cache before the smoke test, progress on the console and in train.log
    (the recipe's own model, where another repository trains, is left to the export that merges onto it)."""

    def say(line: str) -> None:
        _say(line)
        with run.log.open("a") as fh:
            fh.write(f"[ftrun {time.strftime('%H:%M:%S')}] {line}\n")

    if plan.get("weights"):
        return weights.fetch(plan["weights"]["model"], plan["weights"], say)
    return weights.fetch(recipe.model, found, say)
