"""What a run looks like to its user: its status (text and JSON), the list of runs, live progress, the end-of-run summary.

Every text a user reads about a run is composed here from stored facts: how a run ended (stopped, preempted by the
provider's SIGTERM, failed), the exact resume command, the smoke test's forecast and memory note.

Everything here reads the run directory's files (state.json, plan.json, smoke.json, worker.json, metrics.jsonl,
sync.json, checkpoints/, final/) and never imports torch: `ftrun status` answers in a fraction of a second on a
box that is busy training. The numbers come from one reading (`run_status`), so the text, the JSON, the live bar
and the summary never disagree with each other.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TextIO

from launcher.plan.plan import model_flops_utilization
from launcher.run.watchdog import heartbeat_rows
from launcher.store.checkpoint import newest_step_unverified, step_dir_name
from launcher.store.heartbeat import read_all as read_heartbeats
from launcher.store.rundir import RunDir
from launcher.store.state import (ACTIVE, ENDED, is_locked, last_metrics, read_state, run_holder, run_processes,
                                   same_process)



def format_duration(seconds: Optional[float]) -> str:
    """12 s, 4.5 min, 2.1 h; '-' when unknown (status lines, the smoke test's forecast)."""
    if seconds is None:
        return "-"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):  # a file being replaced right now reads as absent; the next refresh has it
        return {}


def metrics_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of metrics.jsonl (a half-written last line is skipped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _box_seconds(history: list[dict[str, Any]], live: bool, states: tuple[str, ...] = ACTIVE) -> float:
    """Box time the run has used: the intervals spent smoking, running or recovering (resumes included);
    with `states`, only those (the full run's own time: running, recovering)."""
    used = 0.0
    for i, h in enumerate(history):
        if h.get("state") in states:
            end = history[i + 1]["at"] if i + 1 < len(history) else (time.time() if live else h["at"])
            used += max(end - h["at"], 0.0)
    return used


def run_status(run: RunDir) -> dict[str, Any]:
    """What `ftrun status --json` prints: one reading of the run's files (no torch)."""
    from launcher.store.sync import status_fields as sync_status_fields

    data = read_state(run)
    holder = run_holder(run, data)
    # workers still training into the run with no supervisor over them (it was killed hard)
    orphans = [] if holder else [p["pid"] for p in run_processes(run)]
    worker = _json(run.worker)
    plan = _json(run.plan)
    smoke = _json(run.smoke)
    last = last_metrics(run.metrics, "loss")  # the training rows; eval passes have rows of their own
    last_eval = last_metrics(run.metrics, "eval_loss")
    ckpt_step = newest_step_unverified(run.checkpoints)
    state = data.get("state", "none")
    if state in ACTIVE and holder is None:
        state = "interrupted"  # state.effective_state, from the same reading
    # worker.json describes the full run's worker; one written by another mode (an older smoke test's) or before
    # the full run's worker has started says nothing about this run's steps: the plan's count stands then
    full_worker = worker.get("mode") == "full" and (worker.get("started") or 0) >= _started_at(data)
    start_step = worker.get("start_step", 0) if full_worker else 0
    # a checkpoint is progress too (a run shorter than logging_steps logs no step)
    step = max(last.get("step", start_step), ckpt_step or 0)
    total = (worker.get("total_steps") if full_worker else None) or plan.get("total_steps")
    ckpt_age = None
    if ckpt_step is not None:
        manifest = run.checkpoints / step_dir_name(ckpt_step) / "manifest.json"
        ckpt_age = round(time.time() - manifest.stat().st_mtime, 1) if manifest.is_file() else None
    eta = None
    if total and step and state == "running" and full_worker:
        started, done_since = worker.get("started"), step - start_step
        if started and done_since > 0:
            eta = round((time.time() - started) / done_since * (total - step), 1)
    final = None
    for name in ("adapter", "model"):
        if (run.final / name).is_dir():
            final = str(run.final / name)
    memory = plan.get("memory") or {}
    s = {
        "run_dir": str(run.root),
        "state": state,
        "step": step,
        "total_steps": total,
        "loss": last.get("loss"),
        "eval_loss": last_eval.get("eval_loss"),
        "eval_step": last_eval.get("step"),
        "tokens_per_second": last.get("tokens_per_second"),
        "mfu": (model_flops_utilization(plan, last.get("tokens_per_second"))
                if plan.get("device") == "cuda" else None),
        "tokens_seen": last.get("tokens_seen"),
        "eta_seconds": eta,
        "updated_at": data.get("updated_at"),
        "pid": data.get("supervisor_pid"),
        # alive: the run's lock is held and this pid is the process recorded with it (start time, boot)
        "pid_alive": bool(holder) and holder["role"] == "supervisor",
        "launcher_pid": holder["pid"] if holder and holder["role"] == "launcher" else None,
        "worker_pid": data.get("worker_pid"),
        # the worker holds the run's lock too (inherited): the same test as the supervisor's
        "worker_alive": same_process(data.get("worker_proc")) and is_locked(run),
        "orphan_worker_pids": orphans,
        "restarts": data.get("restarts", 0),
        "last_checkpoint": f"step-{ckpt_step:06d}" if ckpt_step is not None else None,
        "last_checkpoint_age_seconds": ckpt_age,
        "smoke_estimated_seconds": smoke.get("estimated_seconds"),
        "reason": data.get("reason"),
        "resume_command": data.get("resume_command"),
        "final": final,
        "log": str(run.log),
        # the engine as planned, how it was launched, and what the worker verified (launcher/backends)
        "engine": plan.get("engine"),
        "num_processes": plan.get("num_processes"),
        "launch_argv": data.get("launch_argv"),
        "world_size": (worker.get("verification") or {}).get("world_size", worker.get("world_size")),
        "verification": worker.get("verification") or data.get("verification"),
        "export": data.get("export"),
        "loss_plot": str(run.root / "loss.png") if (run.root / "loss.png").is_file() else None,
        # the plan's memory, calibrated by the smoke test's measured peak once it passed
        "device": plan.get("device"),
        "memory_gb": memory.get("per_gpu_gb"),
        "memory_source": memory.get("source"),
        "estimated_memory_gb": memory.get("estimated_per_gpu_gb"),
        "adjustments": [a.get("reason") for a in plan.get("adjustments", [])],
        # the watchdog's view (launcher/run/watchdog.py): each rank's last heartbeat while a multi-process run trains,
        # and how the last attempt that was restarted ended
        "heartbeats": (heartbeat_rows(read_heartbeats(run), time.time())
                       if state in ("running", "recovering") and (plan.get("num_processes") or 1) > 1 else []),
        "last_restart": rank_end_text(data["last_end"]) if data.get("last_end") else None,
        **sync_status_fields(run),
    }
    s.update(time_and_money(s, data.get("history", []), plan, smoke))
    return s


def time_and_money(s: dict[str, Any], history: list[dict[str, Any]], plan: dict[str, Any],
                   smoke: dict[str, Any]) -> dict[str, Any]:
    """Box time and euros so far and to go, beside what the smoke test and the plan forecast."""
    used = _box_seconds(history, s["state"] in ACTIVE)
    price = plan.get("price_per_hour_eur")
    eta = s.get("eta_seconds")
    estimate = plan.get("estimate_as_planned") or plan.get("estimate") or {}  # what the printed plan said
    return {
        "elapsed_seconds": round(used, 1),
        # what the forecasts are for: the full run after the smoke test (its restarts included)
        "run_seconds": round(_box_seconds(history, s["state"] in ACTIVE, ("running", "recovering")), 1),
        "price_per_hour_eur": price,
        "cost_so_far_eur": round(used / 3600 * price, 2) if price is not None else None,
        "cost_to_go_eur": round(eta / 3600 * price, 2) if price is not None and eta is not None else None,
        "plan_estimated_seconds": round(estimate["hours"] * 3600, 1) if estimate.get("hours") is not None else None,
        "plan_estimated_cost_eur": estimate.get("cost_eur"),
        "smoke_estimated_cost_eur": smoke.get("estimated_cost"),
    }


def _started_at(data: dict[str, Any]) -> float:
    """When the newest launch of the full run began (its last move into `running` from another state)."""
    history = data.get("history", [])
    for h in reversed(history):
        if h.get("state") == "running":
            return float(h.get("at") or 0.0)
    return 0.0


def _bar(step: int, total: Optional[int], width: int = 30) -> str:
    if not total:
        return ""
    done = int(width * min(step / total, 1.0))
    return f" [{'#' * done}{'.' * (width - done)}] {step}/{total}"


def _mfu(value: Optional[float]) -> str:
    """" (MFU 31%)" beside a GPU's tokens/s (docs/BENCHMARKS.md, "MFU"); nothing on a CPU."""
    return f" (MFU {value:.0%})" if value is not None else ""


def format_status(s: dict[str, Any], ending_follows: bool = False) -> str:
    """`ftrun status`: the run in a dozen lines."""
    step = s.get("step") or 0
    lines = [f"{s['state']}{_bar(step, s.get('total_steps'))}  ({s['run_dir']})"]
    if s.get("loss") is not None:
        lines.append(f"  loss {s['loss']:.4f}   {s.get('tokens_per_second') or 0:,.0f} tokens/s{_mfu(s.get('mfu'))}"
                     f"   ETA {format_duration(s.get('eta_seconds'))}"
                     + (f"   (smoke test forecast for the whole run: {format_duration(s['smoke_estimated_seconds'])})"
                        if s.get("smoke_estimated_seconds") else ""))
    if s.get("eval_loss") is not None:
        lines.append(f"  eval loss {s['eval_loss']:.4f} (step {s.get('eval_step')}, held-out examples)")
    supervisor = (f"supervisor pid {s['pid']} ({'alive' if s.get('pid_alive') else 'not running'})" if s.get("pid")
                  else "no supervisor started yet" if s["state"] not in ENDED else "supervisor ended")
    lines.append(f"  {supervisor}, restarts {s.get('restarts', 0)}"
                 + (f"; launcher pid {s['launcher_pid']} is planning / smoke-testing" if s.get("launcher_pid") else ""))
    if s.get("elapsed_seconds"):
        # the actual beside the forecasts: time used + time to go, against what the smoke test and the plan said
        eta = s.get("eta_seconds")
        actual = f"{format_duration(s['elapsed_seconds'])} {'in all' if s.get('state') in ENDED else 'so far'}" \
            + (f" + {format_duration(eta)} to go" if eta is not None else "")
        fc = [f"{name} forecast {format_duration(sec)}" + (f" / {cost:.2f} EUR" if cost is not None else "")
              for name, sec, cost in (("smoke test", s.get("smoke_estimated_seconds"), s.get("smoke_estimated_cost_eur")),
                                      ("plan", s.get("plan_estimated_seconds"), s.get("plan_estimated_cost_eur")))
              if sec is not None]
        lines.append(f"  time {actual}" + (f"   ({'; '.join(fc)})" if fc else ""))
        if s.get("price_per_hour_eur"):
            lines.append(f"  cost {s['cost_so_far_eur']:.2f} EUR so far"
                         + (f", {s['cost_to_go_eur']:.2f} EUR to go" if s.get("cost_to_go_eur") is not None else "")
                         + f" at {s['price_per_hour_eur']:.2f} EUR/h")
    if s.get("engine"):
        v = s.get("verification")
        checked = ("not yet verified" if not v else
                   ("verified: " if v["ok"] else "NOT verified: ")
                   + "; ".join(f"{c['check']} {c['seen']}" for c in v["checks"] if v["ok"] or not c["ok"]))
        lines.append(f"  engine {s['engine']} x {s.get('num_processes') or 1} process(es), {checked}")
        if s.get("launch_argv"):
            lines.append("  launched: " + " ".join(s["launch_argv"]))
    if s.get("memory_gb") is not None:
        where = "per GPU" if s.get("device") == "cuda" else "per process"
        lines.append(f"  memory {s['memory_gb']:g} GB {where}, " + (
            f"measured by the smoke test (the sizer estimated {s['estimated_memory_gb']:g} GB)"
            if s.get("memory_source") == "measured" else "estimated by the sizer (no passed smoke test)"))
    for reason in s.get("adjustments") or []:
        lines.append(f"  adjusted after out of memory: {reason}")
    lines.extend(heartbeat_lines(s.get("heartbeats") or []))
    if s.get("last_restart") and s["state"] in ("running", "succeeded", "trained-not-exported"):
        lines.append(f"  last restart: {s['last_restart']}; restarted")
    if s.get("last_checkpoint"):
        lines.append(f"  last checkpoint {s['last_checkpoint']} ({format_duration(s.get('last_checkpoint_age_seconds'))} ago)")
    if s.get("sync_to"):
        off = s.get("offbox_checkpoint")
        lines.append(f"  off the box: {off or 'nothing yet'}"
                     + (f" ({format_duration(s.get('offbox_age_seconds'))} ago)" if off and s.get("offbox_age_seconds") is not None else "")
                     + f" at {s['sync_to']}" + (f"   last error: {s['sync_error']}" if s.get("sync_error") else ""))
        if s.get("sync_backoff"):  # the destination asked to wait (a 429 or 5xx): launcher/store/sync/transfer.py backoff_fields
            lines.append(f"  waiting for {s['sync_to']}: {s['sync_backoff']}")
    # the end summary printed after it (ending_follows) says why a run ended other than by succeeding: not twice
    if s.get("reason") and s["state"] not in ("running",) and not (ending_follows and _summary_says_reason(s)):
        lines.append(f"  {s['reason']}")
    if s.get("orphan_worker_pids"):
        lines.append(f"  worker process(es) {', '.join(map(str, s['orphan_worker_pids']))} still train without a supervisor "
                     f"(it was killed): `ftrun stop` ends them after a checkpoint; `{s.get('resume_command') or 'ftrun RECIPE'}` "
                     "ends them and resumes")
    elif s["state"] == "interrupted":
        lines.append("  the run's processes are gone (crash, kill, machine loss, a restarted box): run the same "
                     f"`{s.get('resume_command') or 'ftrun RECIPE'}` to resume")
    if s.get("final"):
        lines.append(f"  result: {s['final']}")
    ex = s.get("export")
    if ex:
        lines.append(f"  export ({', '.join(ex.get('formats', []))}): {ex.get('state')}"
                     + (f" - {ex['outputs']}; serving commands in {ex['serving']}" if ex.get("state") == "succeeded" else "")
                     + (f" - {ex['reason']}" if ex.get("state") == "failed" else ""))
    if s.get("loss_plot"):
        lines.append(f"  loss plot: {s['loss_plot']}")
    return "\n".join(lines)


def format_smoke(report: dict[str, Any]) -> str:
    """The smoke test's measurements and the full run's forecast in parts; the model's download, when there was one."""
    parts = [(name, report.get(key)) for name, key in (("start", "startup_seconds"),
                                                      ("training", "train_seconds"), ("checkpoints", "saves_seconds"),
                                                      ("evaluation", "eval_seconds"), ("samples", "samples_seconds"),
                                                      ("export", "export_seconds"))]
    note = memory_note(report)
    split = ", ".join(f"{name} {format_duration(sec)}" for name, sec in parts if sec and sec >= 0.5)
    return (
        f"smoke test: {report['measured_steps']} measured steps, {report['tokens_per_second']:,.0f} tokens/s"
        f"{_mfu(report.get('mfu'))}, "
        f"peak memory {report['peak_memory_gb']:.2f} GB ({report['device']})\n"
        f"full run: {report['training_tokens']:,} tokens -> about {format_duration(report['estimated_seconds'])}"
        + (f" ({split})" if split else "")
        + (f", about {report['estimated_cost']:.2f} EUR at {report['price_per_hour_eur']:.2f} EUR/h"
           if report["price_per_hour_eur"] else "")
        # already spent, before the smoke test: the full run reads the model from the cache
        + (f"; before it, the model's download took {format_duration(report['download_seconds'])}"
           if report.get("download_bytes") else "")
        + (f"\nnote: {note}" if note else "")
    )


def memory_note(report: dict[str, Any]) -> Optional[str]:
    """The smoke test's warning where its peak understates the full run's (smoke.py memory_growth); a smoke.json
    written before 2026-12-02 carries the note's text itself."""
    growth = report.get("memory_growth")
    if growth and growth.get("cause") == "bitsandbytes-cpu-qlora":
        return ("on CPU, QLoRA's process memory grows during the run (bitsandbytes' CPU path; measured: about "
                f"{growth['factor']:g}x the peak of the first steps, where this smoke test measured): allow for it in "
                "--memory-limit")
    return report.get("memory_note")


# ---------------------------------------------------------------------------------------------
# Several runs

def find_runs(root: Path) -> list[RunDir]:
    """The run directories directly under `root` (./runs), by name."""
    if not root.is_dir():
        return []
    return [RunDir(p) for p in sorted(root.iterdir()) if p.is_dir() and (p / "recipe.yaml").is_file()]


def run_row(run: RunDir) -> dict[str, Any]:
    """One line's worth of a run: name, state, step/total, loss, age (since its state or its last logged step)."""
    s = run_status(run)
    times = [t for t in (s.get("updated_at"), last_metrics(run.metrics).get("time")) if t]
    return {"run_dir": s["run_dir"], "name": run.root.name, "state": s["state"], "step": s["step"],
            "total_steps": s["total_steps"], "loss": s["loss"],
            "age_seconds": round(time.time() - max(times), 1) if times else None}


def format_runs(rows: list[dict[str, Any]]) -> str:
    """`ftrun status` with several runs under ./runs: one line each."""
    width = max([len(r["name"]) for r in rows] + [3])
    lines = [f"{'run':<{width}}  {'state':<12}  {'step':>13}  {'loss':>8}  {'age':>9}"]
    for r in rows:
        step = f"{r['step']}/{r['total_steps']}" if r.get("total_steps") else str(r.get("step") or 0)
        loss = f"{r['loss']:.4f}" if r.get("loss") is not None else "-"
        age = format_duration(r["age_seconds"]) + " ago" if r.get("age_seconds") is not None else "-"
        lines.append(f"{r['name']:<{width}}  {r['state']:<12}  {step:>13}  {loss:>8}  {age:>9}")
    lines.append("details: ftrun status RUN_DIR (e.g. ftrun status runs/" + rows[0]["name"] + ")")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The end of a run

def end_summary(run: RunDir) -> dict[str, Any]:
    """The finished run in numbers: loss first -> last (eval loss too when logged), tokens, wall time against
    the forecasts, cost at the box's price, the result and how to serve it."""
    s = run_status(run)
    rows = metrics_rows(run.metrics)
    train = [r for r in rows if r.get("loss") is not None]
    evals = [r for r in rows if r.get("eval_loss") is not None]
    tokens = max((int(r.get("tokens_seen") or 0) for r in rows), default=0) or None
    forecast = s.get("smoke_estimated_seconds") or s.get("plan_estimated_seconds")
    samples = run.final / "samples.md"
    out = {
        "run_dir": s["run_dir"],
        "state": s["state"],
        "reason": s.get("reason"),
        "step": s["step"],
        "total_steps": s["total_steps"],
        "loss_first": train[0]["loss"] if train else None,
        "loss_last": train[-1]["loss"] if train else None,
        "loss_first_step": train[0]["step"] if train else None,
        "loss_last_step": train[-1]["step"] if train else None,
        "eval_loss_first": evals[0]["eval_loss"] if evals else None,
        "eval_loss_last": evals[-1]["eval_loss"] if evals else None,
        "tokens": tokens,
        "wall_seconds": s.get("run_seconds"),
        "box_seconds": s.get("elapsed_seconds"),
        "forecast_seconds": forecast,
        "forecast_source": "smoke test" if s.get("smoke_estimated_seconds") else "plan" if forecast else None,
        "price_per_hour_eur": s.get("price_per_hour_eur"),
        "cost_eur": s.get("cost_so_far_eur"),
        "result": s.get("final"),
        "samples": str(samples) if samples.is_file() else None,
        "serve": serve_command(run, s.get("final")),
        "export": s.get("export"),
        "pid_alive": s.get("pid_alive"),
    }
    return out


def serve_command(run: RunDir, final: Optional[str]) -> Optional[str]:
    """The one command that serves the result (vLLM's OpenAI-compatible server); SERVING.md has the rest."""
    if not final:
        return None
    from launcher.recipe import load_recipe
    from launcher.deliver.serving import served_name, vllm_lora_rank

    try:
        recipe = load_recipe(run.recipe)
    except Exception:  # a recipe that no longer loads (a package upgrade): the summary still shows the rest
        return None
    q = shlex.quote
    name = served_name(run.root)
    if Path(final).name == "adapter":
        return (f"vllm serve {q(recipe.model)} --enable-lora --lora-modules {q(name + '=' + final)} "
                f"--max-lora-rank {vllm_lora_rank(recipe.lora.r)} --max-model-len {recipe.max_length}")
    return f"vllm serve {q(final)} --served-model-name {q(name)} --max-model-len {recipe.max_length}"


def resume_command(recipe_path: str, overrides: list[str], memory_limit: Optional[float] = None,
                   nodes: Optional[dict[str, Any]] = None) -> str:
    """The exact command that resumes a run (stored in state.json at launch): the launch's recipe, overrides, memory
    cap and node settings; not --fresh or --foreground, which are about that one launch."""
    words = [recipe_path, *overrides]
    if memory_limit:
        words += ["--memory-limit", f"{memory_limit:g}GB"]
    if nodes:
        words += ["--nnodes", str(nodes["nnodes"]), "--node-rank", str(nodes["node_rank"]),
                  "--master-addr", str(nodes["master_addr"]), "--master-port", str(nodes["master_port"])]
    return " ".join(["ftrun", *(shlex.quote(x) for x in words)])


def format_started(run_dir: Path, pid: int, resume: str) -> str:
    """What the launch prints when the training goes to the background."""
    return (f"training started in the background (pid {pid}); it keeps running after you log out.\n"
            f"  watch:  ftrun status {run_dir}   |   ftrun logs -f {run_dir}\n"
            f"  stop:   ftrun stop {run_dir}      (saves a checkpoint first)\n"
            f"  resume: {resume}   (after a crash or on a new box)")


def ending_reason(e: dict[str, Any]) -> str:
    """Why a run stopped or was preempted, from the facts the supervisor stores (state.json "ending")."""
    head = "stopped by `ftrun stop`" if e["by"] == "stop" else f"preempted ({e['signal']})"
    where = (f" at step {e['step']} after a checkpoint ({e['checkpoint']})" if e.get("checkpoint")
             else f" at step {e['step']}" + (" after a checkpoint" if e["saved"] else ""))
    late = "" if e["saved"] else f"; the worker did not finish its checkpoint within {e['grace_seconds']:g}s"
    resume = f"run `{e['resume_command']}` to resume" if e.get("resume_command") else "run the same command to resume"
    return head + where + late + "; " + resume


def host_oom_reason(e: dict[str, Any]) -> str:
    """Why a run failed when the kernel OOM-killed its worker, from the supervisor's facts (state.json "ending")."""
    box = (f"the container's limit of {e['limit_gb']:g} GB" if e.get("limit_gb")
           else f"this box's {e['ram_gb']:.0f} GB" if e.get("ram_gb") else "this box's RAM")
    need = (f"the plan expected {e['ram_needed_gb']:g} GB of RAM while loading" if e.get("ram_needed_gb")
            else "the plan counted no RAM beyond the weights' own files while loading")
    return (f"out of host memory: the kernel killed {e['oom_kills']} process(es) of the run for RAM near step "
            f"{e['step']} (cgroup OOM kill); {need}, against {box}. Not restarted: a restart loads into the same RAM. "
            "Rent a box with more RAM (`ftrun plan --gpus ...` names what a job needs), raise the container's memory "
            "limit (docker run --memory), or make the job smaller (fewer processes, a smaller model)")


def _short_seconds(seconds: Optional[float]) -> str:
    """0.4 s, 12 s, 4.5 min: an expected phase time, which is often under a second."""
    if seconds is None:
        return "unknown"
    return f"{seconds:.1f} s" if seconds < 10 else format_duration(seconds)


def rank_end_text(e: dict[str, Any]) -> str:
    """How one attempt of a run ended, from the supervisor's facts (state.json "last_end"; launcher/run/rank_ends.py,
    launcher/run/watchdog.py): which rank, how, at which step."""
    from launcher.store.heartbeat import PHASES

    who = f"rank {e['rank']}" if e.get("rank") is not None and e.get("world", 2) > 1 else "the worker"
    step = e.get("step")
    at = f" at step {step}" if step is not None else ""
    kind = e.get("kind")
    if kind == "hang":
        return (f"{who} silent for {format_duration(e.get('silent_seconds'))}{at} "
                f"({PHASES.get(e.get('phase'), e.get('phase'))}; expected {_short_seconds(e.get('expected_seconds'))})")
    if kind == "signal":
        return f"{who} was killed by {e.get('signal')}{at} (an interruption from outside, not a crash)"
    if kind == "stopped":
        return f"{who} was stopped by a signal{at} after saving a checkpoint (an interruption)"
    if kind == "cuda":
        return f"CUDA/NCCL error on {who}{at}: {e.get('message')}"
    if kind == "exception":
        return f"{who} raised{at}: {e.get('message')}"
    how = f"signal {e['signal']}" if e.get("signal") else f"exit code {e.get('exit_code')}"
    return f"{who} crashed{at} ({how}, no traceback)"


def restarted_reason(e: dict[str, Any], used: int, limit: int, delay: float) -> str:
    return (f"{rank_end_text(e)}; restarted from the newest verified checkpoint in {delay:g}s "
            f"(restart {used} of max_restarts={limit} per hour)")


def repeated_crash_reason(e: dict[str, Any]) -> str:
    return f"{rank_end_text(e)}, the same error at the same step as the attempt before; not restarting a crash that repeats"


def restart_budget_reason(e: dict[str, Any], used: int, limit: int) -> str:
    return (f"{rank_end_text(e)}; not restarted: {used} restart(s) in the last hour, the limit (max_restarts={limit} "
            "per hour); run the same command to resume from the newest verified checkpoint")


def heartbeat_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The watchdog's view while a multi-process run trains: each rank's last heartbeat."""
    from launcher.store.heartbeat import PHASES

    return [f"  rank {r['rank']}: step {r['step']}, {PHASES.get(r['phase'], r['phase'])}, heartbeat "
            f"{format_duration(r['seconds_ago'])} ago" for r in rows]


# How the end of a run is headed, for every state that ends one (store/state.py ENDED; tests/test_tables.py).
ENDING = {"succeeded": "finished", "trained-not-exported": "finished (its export failed)", "stopped": "stopped",
          "preempted": "preempted", "failed": "FAILED", "failed-smoke": "smoke test FAILED"}


def _summary_says_reason(s: dict[str, Any]) -> bool:
    return s["state"] != "succeeded"


def _exporting(s: dict[str, Any]) -> bool:
    """The training finished and the supervisor is still exporting (state.json's export says running, and a live
    supervisor holds the run: an export left running by a killed supervisor is not waited for)."""
    return (s.get("export") or {}).get("state") == "running" and bool(s.get("pid_alive", True))


def format_end_summary(e: dict[str, Any]) -> str:
    """The lines a run's end prints (the foreground run, `ftrun status --watch`, `ftrun status` of a finished run)."""
    head = ENDING.get(e["state"], e["state"])
    if e["state"] == "succeeded" and _exporting(e):
        head = "trained (its export is still running)"  # not "finished" beside an export line that says running
    step = f"step {e['step']}/{e['total_steps']}" if e.get("total_steps") else f"step {e.get('step') or 0}"
    lines = [f"== run {head} at {step}: {e['run_dir']}"]
    if _summary_says_reason(e) and e.get("reason"):
        lines.append(f"  {e['reason']}")
    if e.get("loss_first") is not None:
        lines.append(f"  loss      {e['loss_first']:.4f} (step {e['loss_first_step']}) -> {e['loss_last']:.4f} "
                     f"(step {e['loss_last_step']})")
    if e.get("eval_loss_first") is not None:
        lines.append(f"  eval loss {e['eval_loss_first']:.4f} -> {e['eval_loss_last']:.4f}")
    if e.get("tokens"):
        lines.append(f"  tokens    {e['tokens']:,}")
    if e.get("wall_seconds"):
        fc, what = e.get("forecast_seconds"), ""
        step, total = e.get("step") or 0, e.get("total_steps") or 0
        if fc and total and step < total:
            # a run that ended early is compared with the forecast for the steps it ran, not the whole run's
            fc, what = (fc * step / total if step else None), f" for {step} of {total} steps"
        lines.append(f"  time      {format_duration(e['wall_seconds'])} running"
                     + (f" (the {e['forecast_source']} forecast{what} {format_duration(fc)}, "
                        f"{(e['wall_seconds'] - fc) / fc:+.0%})" if fc else "")
                     + (f"; {format_duration(e['box_seconds'])} on the box with the smoke test"
                        if (e.get("box_seconds") or 0) > e["wall_seconds"] + 1 else ""))
    if e.get("price_per_hour_eur") is not None and e.get("cost_eur") is not None:
        lines.append(f"  cost      {e['cost_eur']:.2f} EUR at {e['price_per_hour_eur']:.2f} EUR/h (the box time above)")
    if e.get("result"):
        lines.append(f"  result    {e['result']}")
    if e.get("samples"):
        lines.append(f"  samples   {e['samples']} (answers before and after the training)")
    ex = e.get("export") or {}
    if ex.get("state") == "succeeded" and ex.get("serving"):
        lines.append(f"  serving   {ex['serving']}")
    elif ex.get("state") == "failed":
        lines.append(f"  export    failed: {ex.get('reason')}")
    if e.get("serve"):
        lines.append(f"  serve it  {e['serve']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Live progress

def progress_fields(s: dict[str, Any]) -> str:
    """step, loss, tokens/s and ETA on one line (the live bar's text and the plain line when not a terminal)."""
    step = f"step {s.get('step') or 0}/{s['total_steps']}" if s.get("total_steps") else f"step {s.get('step') or 0}"
    loss = f"loss {s['loss']:.4f}" if s.get("loss") is not None else "loss -"
    tps = f"{s['tokens_per_second']:,.0f} tokens/s" if s.get("tokens_per_second") else "- tokens/s"
    return f"{s['state']}  {step}  {loss}  {tps}  ETA {format_duration(s.get('eta_seconds'))}"


class Progress:
    """A live progress bar for a run (rich) on a terminal; plain lines, one per change, when not a terminal."""

    def __init__(self, out: TextIO = sys.stdout, live: Optional[bool] = None):
        self.out = out
        self.live = out.isatty() if live is None else live
        self._last = None
        self._rich = None

    def __enter__(self) -> "Progress":
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn

            self._rich = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[info]}"),
                                      console=Console(file=self.out, force_terminal=True), refresh_per_second=2,
                                      transient=False)
            self._rich.start()
            self._task = self._rich.add_task("", total=None, info="")
        return self

    def update(self, s: dict[str, Any]) -> None:
        if self._rich is not None:
            loss = f"loss {s['loss']:.4f}" if s.get("loss") is not None else "loss -"
            tps = f"{s['tokens_per_second']:,.0f} tok/s" if s.get("tokens_per_second") else "- tok/s"
            self._rich.update(self._task, description=s["state"], completed=s.get("step") or 0,
                              total=s.get("total_steps"),
                              info=f"{loss}  {tps}  ETA {format_duration(s.get('eta_seconds'))}")
            return
        key = (s["state"], s.get("step"), s.get("loss"))
        if key != self._last:
            self._last = key
            print(f"[{time.strftime('%H:%M:%S')}] {progress_fields(s)}", file=self.out, flush=True)

    def print(self, text: str) -> None:
        """A line above the bar (the bar stays at the bottom)."""
        if self._rich is not None:
            self._rich.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, file=self.out, flush=True)

    def __exit__(self, *exc) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None


def watch(run: RunDir, *, interval: float = 2.0, out: TextIO = sys.stdout, live: Optional[bool] = None,
          sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """`ftrun status --watch`: the live bar until the run leaves the active states; then its summary."""
    with Progress(out, live) as bar:
        while True:
            s = run_status(run)
            bar.update(s)
            if s["state"] not in ACTIVE + ("planned",) or (s["state"] == "planned" and not run_holder(run)):
                if not (s["state"] == "succeeded" and _exporting(s)):  # the export is part of the run's end
                    break
            sleep(interval)
    print(format_end_summary(end_summary(run)) if s["state"] in ENDED else format_status(s), file=out, flush=True)
    return s


@contextmanager
def attached(run: RunDir, out: TextIO = sys.stdout, interval: float = 2.0) -> Iterator[None]:
    """The foreground run (`ftrun RECIPE --foreground`) on a terminal: the output of this process and of its
    children (supervisor, worker) scrolls above a live progress bar. The children write to file descriptors 1 and 2,
    which they inherit: those point at a pipe for the while, and its lines are printed above the bar. Not a
    terminal: nothing changes, the worker's own lines (step, loss, tokens/s) are the plain progress."""
    if not out.isatty():
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)
    terminal = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    stop = threading.Event()
    with Progress(terminal, live=True) as bar:
        def pump() -> None:
            with os.fdopen(read_end, "r", errors="replace") as fh:
                for line in fh:
                    bar.print(line.rstrip("\n"))

        def refresh() -> None:
            while True:
                bar.update(run_status(run))
                if stop.wait(interval):
                    return

        threads = [threading.Thread(target=pump, daemon=True), threading.Thread(target=refresh, daemon=True)]
        for th in threads:
            th.start()
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)  # the pipe's last writers here: the children have exited
            os.dup2(saved[1], 2)
            stop.set()
            for th in threads:
                th.join(timeout=5)
            bar.update(run_status(run))
    terminal.close()
    for fd in saved:
        os.close(fd)


def data_label(stats) -> str:
    return ", ".join(str(s.get("source")) for s in stats.sources) or "data"


def data_line(stats) -> str:
    """'Alpaca (instruction/input/output) format, 10,000 examples, converted to chat; 1,234,567 tokens (tokenizer)'"""
    return (f"{stats.description}; {stats.total_tokens:,} tokens per epoch ({stats.tokens_source}"
            + (f", {stats.over_max_length} over max_length {stats.max_length}: truncated" if stats.over_max_length else "")
            + ")")


def wants_color(stream: Optional[TextIO] = None) -> bool:
    """Highlighting on a terminal, plain text on a pipe or a file, none where NO_COLOR is set (no-color.org)."""
    stream = stream or sys.stdout
    return bool(getattr(stream, "isatty", lambda: False)()) and not os.environ.get("NO_COLOR")


def format_loss_view(record: Optional[dict[str, Any]], color: bool = False, statistics: bool = False) -> str:
    """What the loss sees (data.json "loss_view", launcher/data/loss_view.py): one example per source with its
    trained tokens marked (highlighted on a terminal, in [[...]] elsewhere); `statistics`: the dataset's figures."""
    from launcher.data.loss_view import CLOSE, OPEN, TRAINED_STYLE, RESET, render_segments

    if not record:
        return "what the loss sees: not shown (the model's tokenizer is not on this machine)"
    s = record["stats"]
    mark = f"{TRAINED_STYLE}highlighted{RESET}" if color else f"{OPEN}in brackets{CLOSE}"
    lines = [f"what the loss sees: {s['trained_share']:.1%} of {s['tokens']:,} tokens trained, loss on {record['mode']}, "
             f"end of turn {record.get('end_of_turn')}; trained tokens {mark}:"]
    for ex in record["examples"]:
        where = ex["where"] + (f" ({ex['source']})" if ex.get("source") and len(record["examples"]) > 1 else "")
        lines.append(f"--- {where}: {ex['trained']} of {ex['tokens']} tokens trained")
        lines.append(render_segments(ex["segments"], color=color).rstrip("\n"))
    lines.append("---")
    if statistics:
        cap = s.get("max_length")
        lines.append(f"examples {s['examples']:,}; tokens {s['tokens']:,} (after max_length {cap}); trained "
                     f"{s['trained_tokens']:,} ({s['trained_share']:.1%})")
        lines.append(f"length in tokens: p50 {s['p50']:,}, p90 {s['p90']:,}, p99 {s['p99']:,}, max {s['max']:,}")
        n = max(s["examples"], 1)
        lines.append(f"truncated by max_length {cap}: {s['truncated']:,} ({s['truncated'] / n:.1%}); trained part cut: "
                     f"{s['cut']:,} ({s['cut'] / n:.1%}); nothing trained: {s['empty']:,} ({s['empty'] / n:.1%})")
    return "\n".join(lines)
