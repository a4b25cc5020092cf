"""The wording of what a user reads about a run: its status, the list of runs, the smoke test's report, why it ended.
Composed from facts (launcher/run/facts.py, and those the supervisor stores); nothing here reads a file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from launcher.store.state import ENDED


def format_duration(seconds: Optional[float]) -> str:
    """12 s, 4.5 min, 2.1 h; '-' when unknown (status lines, the smoke test's forecast)."""
    if seconds is None:
        return "-"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _bar(step: int, total: Optional[int], width: int = 30) -> str:
    if not total:
        return ""
    done = int(width * min(step / total, 1.0))
    return f" [{'#' * done}{'.' * (width - done)}] {step}/{total}"


def _mfu(value: Optional[float]) -> str:
    """ " (MFU 31%)" beside a GPU's tokens/s (docs/BENCHMARKS.md, "MFU"); nothing on a CPU."""
    return f" (MFU {value:.0%})" if value is not None else ""


def format_status(s: dict[str, Any], ending_follows: bool = False) -> str:
    """`ftrun status`: the run in a dozen lines."""
    step = s.get("step") or 0
    lines = [f"{s['state']}{_bar(step, s.get('total_steps'))}  ({s['run_dir']})"]
    if s.get("loss") is not None:
        # the last logged step's values: say which step where the run is past it (logging_steps)
        at = f" (step {s['loss_step']})" if s.get("loss_step") is not None and s["loss_step"] < step else ""
        # a finished run: its average speed, not the last logging window's (facts.run_status)
        speed = (
            f"{s['average_tokens_per_second']:,.0f} tokens/s on average"
            if s.get("average_tokens_per_second")
            else f"{s.get('tokens_per_second') or 0:,.0f} tokens/s{_mfu(s.get('mfu'))}"
        )
        lines.append(
            f"  loss {s['loss']:.4f}{at}   {speed}"
            # an ended run has nothing left to wait for: no "ETA -"
            + (f"   ETA {format_duration(s.get('eta_seconds'))}" if s["state"] not in ENDED else "")
            + (
                f"   (smoke test forecast for the whole run: {format_duration(s['smoke_estimated_seconds'])})"
                if s.get("smoke_estimated_seconds")
                else ""
            )
        )
    if s.get("eval_loss") is not None:
        lines.append(f"  eval loss {s['eval_loss']:.4f} (step {s.get('eval_step')}, held-out examples)")
    if s.get("margin") is not None or s.get("eval_margin") is not None:
        # a preference objective: reward margin chosen - rejected, and the share of pairs the model ranks right
        parts = []
        # KTO's unpaired answers: the margin is desirable minus undesirable, no accuracy, its KL estimate instead
        unpaired = s.get("kl") is not None and s.get("accuracy") is None
        if s.get("margin") is not None:
            parts.append(
                f"margin {s['margin']:.3f}, "
                + (f"KL {s['kl']:.3f}" if unpaired else f"accuracy {s.get('accuracy') or 0:.2f}")
                + f" (step {s.get('loss_step')}, training {'answers' if unpaired else 'pairs'})"
            )
        if s.get("eval_margin") is not None:
            parts.append(
                f"margin {s['eval_margin']:.3f}"
                + (
                    " (held-out answers, desirable minus undesirable"
                    if unpaired
                    else f", preference accuracy {preference_accuracy(s.get('eval_accuracy'), s['eval_margin'])} "
                    "(held-out pairs"
                )
                + f", step {s.get('eval_step')})"
            )
        lines.append("  rewards   " + "; ".join(parts))
    if s.get("reward") is not None:
        parts = s.get("reward_parts") or []
        lines.append(
            f"  reward    {s['reward']:.3f} +- {s.get('reward_std') or 0:.3f} (step {s.get('loss_step')}: the "
            "sampled answers' mean and spread" + (", the weighted sum of:" if len(parts) > 1 else "") + ")"
        )
        if len(parts) > 1:
            width = max(len(p["name"]) for p in parts)
            lines.extend(f"            {p['name']:<{width}}  {_mean_spread(p['mean'], p['std'])}" for p in parts)
        lines.extend(reward_warnings(s.get("flat_rewards") or [], s.get("no_reward_variance")))
    supervisor = (
        f"supervisor pid {s['pid']} ({'alive' if s.get('pid_alive') else 'not running'})"
        if s.get("pid")
        else "no supervisor started yet"
        if s["state"] not in ENDED
        else "supervisor ended"
    )
    lines.append(
        f"  {supervisor}, restarts {s.get('restarts', 0)}"
        + (f"; launcher pid {s['launcher_pid']} is planning / smoke-testing" if s.get("launcher_pid") else "")
    )
    if s.get("elapsed_seconds"):
        eta = s.get("eta_seconds")
        actual = f"{format_duration(s['elapsed_seconds'])} {'in all' if s.get('state') in ENDED else 'so far'}" + (
            f" + {format_duration(eta)} to go" if eta is not None else ""
        )
        phases = s.get("phase_seconds")
        if phases:  # an ended run: every phase the command spent, each said (the plan's own check excepted)
            actual = f"{format_duration(sum(phases.values()))} in all: " + ", ".join(
                f"{name} {_short_seconds(sec)}" for name, sec in phases.items()
            )
        fc = [
            f"{name} forecast {format_duration(sec)}" + (f" / {cost:.2f} EUR" if cost is not None else "")
            for name, sec, cost in (
                ("smoke test", s.get("smoke_estimated_seconds"), s.get("smoke_estimated_cost_eur")),
                ("plan", s.get("plan_estimated_seconds"), s.get("plan_estimated_cost_eur")),
                ("resume re-plan", s.get("resume_estimated_seconds"), s.get("resume_estimated_cost_eur")),
            )
            if sec is not None
        ]
        lines.append(f"  time {actual}" + (f"   ({'; '.join(fc)})" if fc else ""))
        if s.get("price_per_hour_eur"):
            lines.append(
                f"  cost {s['cost_so_far_eur']:.2f} EUR so far"
                + (f", {s['cost_to_go_eur']:.2f} EUR to go" if s.get("cost_to_go_eur") is not None else "")
                + f" at {s['price_per_hour_eur']:.2f} EUR/h"
            )
    if s.get("engine"):
        v = s.get("verification")
        checked = (
            "not yet verified"
            if not v
            else ("verified: " if v["ok"] else "NOT verified: ")
            + "; ".join(f"{c['check']} {c['seen']}" for c in v["checks"] if v["ok"] or not c["ok"])
        )
        lines.append(f"  engine {s['engine']} x {s.get('num_processes') or 1} process(es), {checked}")
        if s.get("launch_argv"):
            lines.append("  launched: " + " ".join(s["launch_argv"]))
    if s.get("memory_gb") is not None:
        where = "per GPU" if s.get("device") == "cuda" else "per process"
        lines.append(
            f"  memory {s['memory_gb']:g} GB {where}, "
            + (
                f"measured by the smoke test (the sizer estimated {s['estimated_memory_gb']:g} GB)"
                if s.get("memory_source") == "measured"
                else "estimated by the sizer (no passed smoke test)"
            )
        )
    for reason in s.get("adjustments") or []:
        lines.append(f"  adjusted after out of memory: {reason}")
    for fact in s.get("oom_restarts") or []:
        lines.append(f"  {oom_restart_line(fact)}")
    lines.extend(heartbeat_lines(s.get("heartbeats") or []))
    if s.get("last_restart") and s["state"] in ("running", "succeeded", "trained-not-exported"):
        lines.append(f"  last restart: {s['last_restart']}; restarted")
    if s.get("last_checkpoint"):
        lines.append(
            f"  last checkpoint {s['last_checkpoint']} ({format_duration(s.get('last_checkpoint_age_seconds'))} ago)"
        )
    if s.get("sync_to"):
        off = s.get("offbox_checkpoint")
        lines.append(
            f"  off the box: {off or 'nothing yet'}"
            + (
                f" ({format_duration(s.get('offbox_age_seconds'))} ago)"
                if off and s.get("offbox_age_seconds") is not None
                else ""
            )
            + f" at {s['sync_to']}"
            + (f"   last error: {s['sync_error']}" if s.get("sync_error") else "")
        )
        if s.get("sync_backoff"):  # the destination asked to wait: store/sync/transfer.py backoff_fields
            lines.append(f"  waiting for {s['sync_to']}: {s['sync_backoff']}")
    # the end summary printed after it (ending_follows) says why a run ended other than by succeeding: not twice
    if s.get("reason") and s["state"] not in ("running",) and not (ending_follows and _summary_says_reason(s)):
        lines.append(f"  {s['reason']}")
    if s.get("orphan_worker_pids"):
        lines.append(
            f"  worker process(es) {', '.join(map(str, s['orphan_worker_pids']))} still train without a supervisor "
            f"(it was killed): `ftrun stop` ends them after a checkpoint; "
            f"`{s.get('resume_command') or 'ftrun RECIPE'}` "
            "ends them and resumes"
        )
    elif s["state"] == "interrupted":
        lines.append(
            "  the run's processes are gone (crash, kill, machine loss, a restarted box): run the same "
            f"`{s.get('resume_command') or 'ftrun RECIPE'}` to resume"
        )
    if s.get("final"):
        lines.append(f"  result: {s['final']}")
    ex = s.get("export")
    if ex:
        lines.append(
            f"  export ({', '.join(ex.get('formats', []))}): {ex.get('state')}"
            + (f" - {ex['outputs']}; serving commands in {ex['serving']}" if ex.get("state") == "succeeded" else "")
            + (f" - {ex['reason']}" if ex.get("state") == "failed" else "")
        )
    if s.get("loss_plot"):
        lines.append(f"  loss plot: {s['loss_plot']}")
    return "\n".join(lines)


def _mean_spread(mean: Optional[float], std: Optional[float]) -> str:
    """ "0.182 +- 0.050"; a reward that scored no answer of the window (TRL logs None) says so."""
    return "no answer scored" if mean is None else f"{mean:.3f} +- {std or 0:.3f}"


# What gives GRPO something to learn from, said where a reward stopped varying
REWARD_SIGNAL_FIX = (
    "a reward with signal on these prompts (partial credit: metric: text, or a function that scores closeness or "
    "format), more answers per prompt (grpo.num_generations) or a higher grpo.temperature, so that a prompt's "
    "answers differ"
)


def reward_warnings(flat: list[dict[str, Any]], no_variance: Optional[dict[str, Any]]) -> list[str]:
    """GRPO: each reward that stopped varying (facts.reward_facts), and prompts whose answers all scored the same."""
    lines = []
    for f in flat:
        value = "no answer scored" if f.get("value") is None else f"{f['value']:.3f}"
        who = "the reward (the sum)" if f["name"] == "reward" else f"reward {f['name']}"
        when = (
            f"never varied: {value} for every answer at all {f['rows']} logged step{'s' if f['rows'] != 1 else ''}"
            if f["whole_run"]
            else f"has not varied since step {f['since_step']}: {value} for every answer at the last {f['rows']} "
            "logged steps"
        )
        lines.append(
            f"  warning   {who} {when}; it gives GRPO nothing to learn from"
            # the other rewards still vary: this one adds only a constant to every answer's
            + (
                ""
                if no_variance
                else " (check that it can score the answers this model gives, give it partial credit, or remove it)"
            )
        )
    nv = no_variance
    if nv:
        lines.append(
            "  warning   no prompt's answers differed in reward (frac_reward_zero_std 1.0) "
            + (
                "at any logged step: every advantage was 0, so nothing was learned"
                if nv["whole_run"]
                else f"since step {nv['since_step']}: every advantage is 0, nothing is learned"
            )
            + f"; fix: {REWARD_SIGNAL_FIX}"
        )
    return lines


def nothing_learned_reason(f: dict[str, Any]) -> str:
    """Why a GRPO run that trained to its end failed: its rewards never varied (state.json "ending")."""
    scored = ", ".join(
        f"{r['name']} {'scored no answer' if r['mean'] is None else format(r['mean'], '.3f')}" for r in f["rewards"]
    )
    return (
        f"nothing was learned: at all {f['logged_steps']} logged steps up to step {f['step']} no prompt's sampled "
        f"answers differed in reward (frac_reward_zero_std 1.0; {scored} on average), so every advantage was 0, the "
        "loss 0, and the adapter is still its untrained initialisation (every lora_B zero). The save is not at fault "
        "and resuming will not help: the same rewards score the same. Fix: "
        + REWARD_SIGNAL_FIX
        + "; then start afresh (`--fresh`)"
    )


def format_smoke(report: dict[str, Any]) -> str:
    """The smoke test's measurements and the full run's forecast in parts; the model's download, when there was one."""
    parts = [
        (name, report.get(key))
        for name, key in (
            ("start", "startup_seconds"),
            ("training", "train_seconds"),
            ("checkpoints", "saves_seconds"),
            ("evaluation", "eval_seconds"),
            ("samples", "samples_seconds"),
            ("task eval", "task_eval_seconds"),
            ("export", "export_seconds"),
        )
    ]
    note = "\nnote: ".join(n for n in (memory_note(report), load_note(report)) if n) or None
    tied = report.get("frac_reward_zero_std") or []
    if tied and all(v >= 1 - 1e-9 for v in tied):  # GRPO: said before the full run, not a stop (sparse rewards start)
        said = (
            f"in all {len(tied)} steps of the smoke test no prompt's answers differed in reward (frac_reward_zero_std "
            "1.0): every advantage was 0 and nothing was learned; a sparse reward may start to vary later, but if it "
            f"does not, the full run learns nothing. Fix: {REWARD_SIGNAL_FIX}"
        )
        note = f"{note}\nnote: {said}" if note else said
    split = ", ".join(f"{name} {format_duration(sec)}" for name, sec in parts if sec and sec >= 0.5)
    return (
        f"smoke test: {report['measured_steps']} measured steps, {report['tokens_per_second']:,.0f} tokens/s"
        f"{_mfu(report.get('mfu'))}, peak memory {report['peak_memory_gb']:.2f} GB ({report['device']})"
        + (
            f", answers generated at {report['generation_tokens_per_second']:,.0f} tokens/s (a batch of "
            f"{report['generation_prompts']} task prompts)"
            if report.get("generation_tokens_per_second")
            else ""
        )
        + (
            f", {report['sampling_share']:.0%} of the steps' time sampling answers (GRPO)"
            if report.get("sampling_share") is not None
            else ""
        )
        + "\n"
        f"full run: {report['training_tokens']:,} tokens -> about {format_duration(report['estimated_seconds'])}"
        + (f" ({split})" if split else "")
        + (
            f", about {report['estimated_cost']:.2f} EUR at {report['price_per_hour_eur']:.2f} EUR/h"
            if report["price_per_hour_eur"]
            else ""
        )
        # already spent, before the smoke test: the full run reads the model from the cache
        + (
            f"; before it, the model's download took {format_duration(report['download_seconds'])}"
            if report.get("download_bytes")
            else ""
        )
        + (f"\nnote: {note}" if note else "")
    )


def load_note(report: dict[str, Any]) -> Optional[str]:
    """Where other processes kept the CPU box's cores busy while the smoke test measured (load above the cores)."""
    load, cores = report.get("load_average"), report.get("cpu_cores")
    if load is None or not cores or load <= cores:
        return None
    return (
        f"other processes kept this box busy while the smoke test measured (load {load:.1f} on {cores} cores): "
        "its steps' time, and so the forecast, holds while the load stays as it was; a quieter box runs faster, "
        "a busier one slower"
    )


def memory_note(report: dict[str, Any]) -> Optional[str]:
    """The smoke test's warning where its peak understates the full run's (smoke.py memory_growth); an older
    smoke.json carries the note's text itself."""
    growth = report.get("memory_growth")
    if growth and growth.get("cause") == "bitsandbytes-cpu-qlora":
        return (
            "on CPU, QLoRA's process memory grows during the run (bitsandbytes' CPU path; measured: about "
            f"{growth['factor']:g}x the peak of the first steps, where this smoke test measured): allow for it in "
            "--memory-limit"
        )
    return report.get("memory_note")


def format_runs(rows: list[dict[str, Any]]) -> str:
    """`ftrun status` with several runs under ./runs: one line each."""
    width = max([len(r["name"]) for r in rows] + [3])
    # the last logged figure that tells each run's progress: SFT's loss, GRPO's reward, DPO's margin (facts.run_row)
    lines = [f"{'run':<{width}}  {'state':<12}  {'step':>13}  {'last logged':>14}  {'age':>9}"]
    for r in rows:
        step = f"{r['step']}/{r['total_steps']}" if r.get("total_steps") else str(r.get("step") or 0)
        figure = r.get("figure") or (("loss", r["loss"]) if r.get("loss") is not None else None)
        said = (
            "-"
            if figure is None
            else f"{figure[0]} {figure[1]:.4f}"
            if figure[0] == "loss"
            else f"{figure[0]} {figure[1]:.3f}"
        )
        age = format_duration(r["age_seconds"]) + " ago" if r.get("age_seconds") is not None else "-"
        lines.append(f"{r['name']:<{width}}  {r['state']:<12}  {step:>13}  {said:>14}  {age:>9}")
    lines.append("details: ftrun status RUN_DIR (e.g. ftrun status runs/" + rows[0]["name"] + ")")
    return "\n".join(lines)


def format_background_start(run_dir: Path, pid: int, resume: str) -> str:
    return (
        f"training started in the background (pid {pid}); it keeps running after you log out.\n"
        f"  watch:  ftrun status {run_dir}   |   ftrun logs -f {run_dir}\n"
        f"  stop:   ftrun stop {run_dir}      (saves a checkpoint first)\n"
        f"  resume: {resume}   (after a crash or on a new box)"
    )


def ending_reason(e: dict[str, Any]) -> str:
    """Why a run stopped or was preempted, from the facts the supervisor stores (state.json "ending")."""
    head = "stopped by `ftrun stop`" if e["by"] == "stop" else f"preempted ({e['signal']})"
    resume = f"run `{e['resume_command']}`" if e.get("resume_command") else "run the same command"
    if e.get("after_training"):  # nothing left to train: the resume lands at the end and does the rest
        return (
            f"{head} after training: the final result and its checkpoint ({e.get('checkpoint')}) are saved; "
            f"not done yet: {', then '.join(e.get('left') or ['the end of the run'])}; {resume} to finish "
            "(no step is trained again)"
        )
    where = (
        f" at step {e['step']} after a checkpoint ({e['checkpoint']})"
        if e.get("checkpoint")
        else f" at step {e['step']}" + (" after a checkpoint" if e["saved"] else "")
    )
    late = "" if e["saved"] else f"; the worker did not finish its checkpoint within {e['grace_seconds']:g}s"
    return head + where + late + "; " + resume + " to resume"


def preference_accuracy(accuracy: Optional[float], margin: Optional[float]) -> str:
    """The share of held-out pairs ranked right; all tied (margin 0) said as ties, not 0.00 (trl 1.16 dpo_trainer.py
    counts a pair right only when chosen > rejected)."""
    if not accuracy and margin is not None and abs(margin) < 1e-9:
        return "tied (margin 0: the policy is its reference)"
    return f"{accuracy or 0:.2f}"


def stop_waits_for(p: dict[str, Any], grace_seconds: float) -> str:
    """What `ftrun stop` waits for, said before it waits (launcher/run/control.py `_phase`)."""
    if p["phase"] == "export":
        return (
            "training is complete and the export is running: ending the export; the trained result stays, "
            "and the same command (or `ftrun export`) makes the export later"
        )
    if p["phase"] == "after training":
        return (
            f"training is complete (step {p.get('step')}): the worker saves the final result and its checkpoint "
            "if still saving them, then ends before the rest of the samples and the task evaluation (answers "
            "kept); the same command finishes them"
        )
    return (
        f"asking the worker to save a checkpoint at the end of its step, then stop (it has up to {grace_seconds:g} s)"
    )


# the stop's outcome when the run ended stopped but left work for the resume (stop_outcome): the summary follows
STOPPED_PREFIXES = ("stopped after training", "stopped during the export")


def stop_outcome(state: dict[str, Any]) -> str:
    """`ftrun stop`'s last word, from the state the supervisor wrote once it ended: the word `ftrun status` says."""
    name = state.get("state")
    if name == "stopped" and (state.get("ending") or {}).get("after_training"):
        return "stopped after training: " + state.get("reason", "")
    if name == "trained-not-exported":
        return f"stopped during the export: training is complete and its result verified; {state.get('reason', '')}"
    if name in ("succeeded", "failed"):
        return f"the run ended {name} before the stop took effect: {state.get('reason', '')}"
    return "stopped"


def host_oom_reason(e: dict[str, Any]) -> str:
    """Why a run failed when the kernel OOM-killed its worker, from the supervisor's facts (state.json "ending")."""
    box = (
        f"the container's limit of {e['limit_gb']:g} GB"
        if e.get("limit_gb")
        else f"this box's {e['ram_gb']:.0f} GB"
        if e.get("ram_gb")
        else "this box's RAM"
    )
    need = (
        f"the plan expected {e['ram_needed_gb']:g} GB of RAM while loading"
        if e.get("ram_needed_gb")
        else "the plan counted no RAM beyond the weights' own files while loading"
    )
    return (
        f"out of host memory: the kernel killed {e['oom_kills']} process(es) of the run for RAM near step "
        f"{e['step']} (cgroup OOM kill); {need}, against {box}. Not restarted: a restart loads into the same RAM. "
        "Rent a box with more RAM (`ftrun plan --gpus ...` names what a job needs), raise the container's memory "
        "limit (docker run --memory), or make the job smaller (fewer processes, a smaller model)"
    )


def _short_seconds(seconds: Optional[float]) -> str:
    """0.4 s, 12 s, 4.5 min: an expected phase time, which is often under a second."""
    if seconds is None:
        return "unknown"
    return f"{seconds:.1f} s" if seconds < 10 else format_duration(seconds)


def rank_end_text(e: dict[str, Any]) -> str:
    """How one attempt of a run ended (state.json "last_end"): which rank, how, at which step."""
    from launcher.store.heartbeat_files import PHASES

    who = f"rank {e['rank']}" if e.get("rank") is not None and e.get("world", 2) > 1 else "the worker"
    step = e.get("step")
    at = f" at step {step}" if step is not None else ""
    kind = e.get("kind")
    if kind == "hang":
        behind = e.get("behind") or []
        if e.get("all_silent"):  # a hang in a collective or on a GPU: no rank can be told from the others
            who, at = f"all {len(behind)} ranks", f" since step {step}" if step is not None else ""
        elif len(behind) > 1:
            who = "ranks " + ", ".join(str(r) for r in behind)
        return (
            f"{who} silent for {format_duration(e.get('silent_seconds'))}{at} "
            f"({PHASES.get(e.get('phase'), e.get('phase'))}; expected {_short_seconds(e.get('expected_seconds'))})"
        )
    if kind == "signal":
        return f"{who} was killed by {e.get('signal')}{at} (an interruption from outside, not a crash)"
    if kind == "stopped":
        return f"{who} was stopped by a signal{at} after saving a checkpoint (an interruption)"
    if kind == "cuda":
        return f"CUDA/NCCL error on {who}{at}: {e.get('message')}"
    if kind == "out-of-memory":  # the plan's faster setting undone (launcher/run/oom_restart.py)
        return f"{who} ran out of memory{at}"
    if kind == "exception":
        return f"{who} raised{at}: {e.get('message')}"
    how = f"signal {e['signal']}" if e.get("signal") else f"exit code {e.get('exit_code')}"
    return f"{who} crashed{at} ({how}, no traceback)"


def restarted_reason(e: dict[str, Any], used: int, limit: int, delay: float) -> str:
    return (
        f"{rank_end_text(e)}; restarted from the newest verified checkpoint in {delay:g}s "
        f"(restart {used} of max_restarts={limit} per hour)"
    )


def _undone_words(fact: dict[str, Any]) -> tuple[str, str]:
    """(what the run trains with now, what the plan had chosen) after oom_restart.py undid the plan's setting."""
    now, was = fact["set"], fact["from"]
    if "gradient_checkpointing" in now:
        return "activation checkpointing on", "checkpointing off"
    return (
        f"the recipe's micro-batch {now['micro_batch_size']} x accumulation {now['gradient_accumulation_steps']}",
        f"micro-batch {was['micro_batch_size']} x accumulation {was['gradient_accumulation_steps']}",
    )


def oom_restart_line(fact: dict[str, Any]) -> str:
    """`ftrun status`'s line for an out of memory mid-run that the plan's own setting caused."""
    now, was = _undone_words(fact)
    where = fact.get("resumes_from_step")
    return (
        f"restarted at step {where} with {now}" if where is not None else f"restarted from the start with {now}"
    ) + (
        f" after an out-of-memory at step {fact.get('oom_step')} (the plan had chosen {was} for speed; the same "
        "trajectory, the recipe unchanged)"
    )


def oom_restart_reason(fact: dict[str, Any]) -> str:
    """The state's reason and the log's line while the supervisor restarts after such an out of memory."""
    now, was = _undone_words(fact)
    peak = f" (peak {fact['peak_memory_gb']:g} GB)" if fact.get("peak_memory_gb") is not None else ""
    where = fact.get("resumes_from_step")
    return (
        f"out of memory at step {fact.get('oom_step')}{peak} with {was}, the plan's choice for speed: restarting "
        + (f"from step {where}" if where is not None else "from the start")
        + f" with {now} (the same trajectory; not counted against max_restarts)"
    )


def oom_fatal_reason(error: str, fix: str, undone: list[dict[str, Any]]) -> str:
    """Why an out of memory stopped the run: the worker's error, the fix, and what of the plan's was undone before."""
    before = "; ".join(oom_restart_line(f) for f in undone)
    return f"{error}; {fix}" + (f". The plan's faster settings were already undone: {before}" if before else "")


def repeated_crash_reason(e: dict[str, Any]) -> str:
    return (
        f"{rank_end_text(e)}, the same error at the same step as the attempt before; "
        "not restarting a crash that repeats"
    )


def restart_budget_reason(e: dict[str, Any], used: int, limit: int) -> str:
    return (
        f"{rank_end_text(e)}; not restarted: {used} restart(s) in the last hour, the limit (max_restarts={limit} "
        "per hour); run the same command to resume from the newest verified checkpoint"
    )


def ranks_left_reason(e: dict[str, Any], left: list[dict[str, Any]], waited_s: float) -> str:
    """Why a run stopped instead of restarting: processes of the ended attempt outlived it (rank_processes.py)."""

    def one(r: dict[str, Any]) -> str:
        said = [f"rank {r['rank']}"] if r.get("rank") is not None else []
        said.append(
            f"GPU {r['gpu']}: LOCAL_RANK={r.get('local_rank', 'unset')}, CUDA_VISIBLE_DEVICES="
            f"{r.get('cuda_visible_devices', 'unset')}"
            if r.get("gpu") is not None
            else "its GPU unknown: no LOCAL_RANK or CUDA_VISIBLE_DEVICES readable in its environment"
        )
        return f"pid {r['pid']} ({', '.join(said)}) in state {r.get('process_state', 'unknown')}"

    stuck = any(r.get("process_state") == "disk-sleep" for r in left)
    return (
        f"{rank_end_text(e)}; not restarted: {len(left)} process(es) of that attempt still alive "
        f"{waited_s:.0f} s after it ended: "
        + "; ".join(one(r) for r in left)
        + ". "
        + (
            "disk-sleep is uninterruptible sleep in the kernel, most often inside the GPU driver: SIGKILL cannot "
            "end it until the driver returns, "
            if stuck
            else ""
        )
        + "while it lives it keeps its GPU memory, so a new attempt would run out of memory while loading. Look "
        "at the GPU with `nvidia-smi` (and `dmesg` for the driver's Xid errors); once the process is gone (one "
        "stuck in the driver often needs `nvidia-smi --gpu-reset` or a reboot), run the same command to resume "
        "from the newest verified checkpoint"
    )


def heartbeat_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The watchdog's view while a multi-process run trains: each rank's last heartbeat."""
    from launcher.store.heartbeat_files import PHASES

    return [
        f"  rank {r['rank']}: step {r['step']}, {PHASES.get(r['phase'], r['phase'])}, heartbeat "
        f"{format_duration(r['seconds_ago'])} ago"
        for r in rows
    ]


def _summary_says_reason(s: dict[str, Any]) -> bool:
    return s["state"] != "succeeded"
