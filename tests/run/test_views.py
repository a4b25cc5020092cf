"""The run's views (launcher/run/facts.py read, views.py word, progress.py shows live): status, the list of runs, live
progress, the end-of-run summary; and the command line's argument order. Built on a real finished run (the shared
reference run) where numbers matter."""

from __future__ import annotations

import io
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from launcher.deliver import messages
from launcher.run import commands, facts, progress, summary_view, views
from launcher.cli import _parser, main, split_command_line
from launcher.store.rundir import RunDir
from launcher.store.state import RunLock, process_identity, set_state


def parse(line: str):
    argv, overrides = split_command_line(line.split())
    args = _parser().parse_args(argv)
    if hasattr(args, "overrides"):
        args.overrides = overrides
    return args


def test_options_stand_before_or_after_the_recipe():
    a = parse("plan --gpus 4xH100-80GB r.yaml lora.r=8")
    assert (a.command, a.recipe, a.gpus, a.overrides) == ("plan", "r.yaml", "4xH100-80GB", ["lora.r=8"])
    a = parse("--memory-limit 20GB r.yaml")
    assert (a.command, a.recipe, a.memory_limit, a.overrides) == ("run", "r.yaml", "20GB", [])
    a = parse("lora.r=8 r.yaml --fresh max_steps=3")
    assert (a.command, a.recipe, a.fresh, a.overrides) == ("run", "r.yaml", True, ["lora.r=8", "max_steps=3"])
    a = parse("plan r.yaml --tokens 15M lora.r=4 --json")
    assert (a.recipe, a.tokens, a.json, a.overrides) == ("r.yaml", "15M", True, ["lora.r=4"])
    a = parse("status runs/x --watch")
    assert (a.command, a.target, a.watch) == ("status", "runs/x", True)


def test_output_dir_naming_a_file_is_a_usage_error(write_recipe, tmp_path, capsys):
    (tmp_path / "taken").write_text("not a folder")
    recipe = write_recipe(output_dir=str(tmp_path / "taken"))
    assert main([str(recipe), "--foreground"]) == 2
    err = capsys.readouterr().err
    assert "output_dir" in err and "is a file, not a folder" in err and "internal error" not in err


def _copy(reference_run: Path, dest: Path) -> RunDir:
    shutil.copytree(reference_run, dest, ignore=shutil.ignore_patterns("*.lock", "lock"))
    return RunDir(dest)


def test_status_lists_every_run_under_runs(reference_run, tmp_path, monkeypatch, capsys):
    done = _copy(reference_run, tmp_path / "runs" / "done")
    other = RunDir(tmp_path / "runs" / "early")
    other.root.mkdir(parents=True)
    shutil.copy(done.recipe, other.recipe)
    set_state(other, "stopped", reason="stopped by `ftrun stop`")
    monkeypatch.chdir(tmp_path)

    assert main(["status"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in out[1:-1]}
    last = facts.metrics_rows(done.metrics)[-1]
    # the last logged figure, named: an SFT run's loss (GRPO's reward, DPO's margin: tests/run/test_reward_view.py)
    assert rows["done"][1:5] == ["succeeded", f"{last['step']}/{last['step']}", "loss", f"{last['loss']:.4f}"]
    assert rows["early"][1] == "stopped" and rows["early"][-1] == "ago"
    assert main(["status", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in listed] == ["done", "early"] and listed[0]["age_seconds"] >= 0


def test_end_summary_of_a_finished_run(reference_run, tmp_path):
    run = _copy(reference_run, tmp_path / "run")
    rows = facts.metrics_rows(run.metrics)
    e = facts.end_summary(run)
    assert (e["loss_first"], e["loss_last"]) == (rows[0]["loss"], rows[-1]["loss"])
    assert e["tokens"] == rows[-1]["tokens_seen"] > 0
    assert e["result"] == str(run.final / "adapter") and e["eval_loss_first"] is None
    (run.final / "samples.md").unlink(missing_ok=True)
    assert facts.end_summary(run)["samples"] is None
    assert e["wall_seconds"] > 0
    text = summary_view.format_end_summary(e)
    assert f"loss      {rows[0]['loss']:.4f} (step {rows[0]['step']}) -> {rows[-1]['loss']:.4f}" in text
    assert f"tokens    {rows[-1]['tokens_seen']:,}" in text
    assert (
        f"serve it  vllm serve {e['serve'].split()[2]} --enable-lora --lora-modules run={run.final / 'adapter'}" in text
    )

    # with an eval split (eval_loss rows) and the before/after samples
    with run.metrics.open("a") as fh:
        fh.write(json.dumps({"step": 10, "eval_loss": 5.5}) + "\n" + json.dumps({"step": 30, "eval_loss": 4.25}) + "\n")
    (run.final / "samples.md").write_text("# samples\n")
    text = summary_view.format_end_summary(facts.end_summary(run))
    assert "eval loss 5.5000 -> 4.2500" in text and f"samples   {run.final / 'samples.md'}" in text


def test_step_count_after_launch_is_the_full_runs(tmp_path):
    """Right after the launch, worker.json still holds an older worker's (or the smoke test's) count: the
    plan's total stands until the full run's worker has started."""
    run = RunDir(tmp_path)
    (tmp_path / "recipe.yaml").write_text("{}")
    (tmp_path / "plan.json").write_text(json.dumps({"total_steps": 250}))
    (tmp_path / "worker.json").write_text(json.dumps({"start_step": 0, "total_steps": 6}))  # the smoke test's
    set_state(run, "smoking")
    set_state(run, "running")
    assert (facts.run_status(run)["step"], facts.run_status(run)["total_steps"]) == (0, 250)
    (tmp_path / "worker.json").write_text(
        json.dumps({"mode": "full", "start_step": 0, "total_steps": 6, "started": time.time() - 3600})
    )  # a launch before this one
    assert facts.run_status(run)["total_steps"] == 250
    (tmp_path / "worker.json").write_text(
        json.dumps({"mode": "full", "start_step": 0, "total_steps": 240, "started": time.time() + 1})
    )
    assert facts.run_status(run)["total_steps"] == 240


def test_time_and_money_beside_the_forecasts(tmp_path):
    now = time.time()
    history = [{"state": "smoking", "at": now - 4000}, {"state": "running", "at": now - 3600}]
    s = {
        "state": "running",
        "run_dir": str(tmp_path),
        "step": 50,
        "total_steps": 100,
        "eta_seconds": 1800.0,
        "loss": 1.5,
        "tokens_per_second": 1000,
        "smoke_estimated_seconds": 5400,
    }
    s.update(
        facts.time_and_money(
            s,
            history,
            {"price_per_hour_eur": 3.6, "estimate": {"hours": 2.0, "cost_eur": 7.2}},
            {"estimated_seconds": 5400, "estimated_cost": 5.4},
        )
    )
    assert s["cost_so_far_eur"] == pytest.approx(4.0, abs=0.01) and s["cost_to_go_eur"] == 1.8
    text = views.format_status(s)
    assert "cost 4.00 EUR so far, 1.80 EUR to go at 3.60 EUR/h" in text
    assert "smoke test forecast 1.5 h / 5.40 EUR" in text and "plan forecast 2.0 h / 7.20 EUR" in text
    assert "resume re-plan" not in text
    # after a resume the plan was made again with the smoke test's speed: the first forecast stays, the new is labelled
    resumed = {
        "price_per_hour_eur": 3.6,
        "estimate_as_planned": {"hours": 2.0, "cost_eur": 7.2},
        "estimate": {"hours": 1.25, "cost_eur": 4.5},
        "estimate_at_resume": {"hours": 1.25, "cost_eur": 4.5},
    }
    s.update(facts.time_and_money(s, history, resumed, {"estimated_seconds": 5400, "estimated_cost": 5.4}))
    text = views.format_status(s)
    assert "plan forecast 2.0 h / 7.20 EUR; resume re-plan forecast 1.2 h / 4.50 EUR" in text, text


@pytest.mark.parametrize("live", [False, True])
def test_watch_follows_a_live_run_to_its_summary(reference_run, tmp_path, live):
    """A run held by this process (its lock and identity, as a supervisor holds them): `status --watch` shows
    step, loss, tokens/s and ETA as metrics arrive, then the end summary once the state is final."""
    run = _copy(reference_run, tmp_path / "run")
    shutil.rmtree(run.checkpoints)  # a run in its first steps: no checkpoint yet (one would count as progress)
    rows = facts.metrics_rows(run.metrics)
    run.metrics.write_text(json.dumps(rows[0]) + "\n")
    lock = RunLock(run).acquire()
    (run.root / "worker.json").write_text(
        json.dumps({"mode": "full", "start_step": 0, "total_steps": 30, "started": time.time() + 1})
    )
    set_state(run, "planned")  # the copied run is trained: resumed as the launch does (store/state.py STATES)
    set_state(run, "running", supervisor_pid=os.getpid(), supervisor_proc=process_identity(os.getpid()))
    (run.root / "worker.json").write_text(
        json.dumps({"mode": "full", "start_step": 0, "total_steps": 30, "started": time.time()})
    )
    ticks = iter(range(len(rows) + 5))  # a row appears per tick, then the state turns final

    def sleep(_seconds):
        i = next(ticks)
        if i < len(rows) - 1:
            with run.metrics.open("a") as fh:
                fh.write(json.dumps(rows[i + 1]) + "\n")
        else:
            set_state(run, "succeeded", reason="training finished")

    out = io.StringIO()
    try:
        s = progress.watch(run, out=out, live=live, sleep=sleep)
    finally:
        lock.release()
    text = out.getvalue()
    assert s["state"] == "succeeded"
    assert "== run finished" in text and f"{rows[-1]['loss']:.4f}" in text
    if live:  # rich's bar: drawn with terminal codes, the numbers inside
        assert "\x1b[" in text and "30/30" in text and "tok/s" in text
    else:  # one plain line per change, no terminal codes
        plain = [line for line in text.splitlines() if line.startswith("[")]
        assert "\x1b[" not in text
        assert len(plain) == len(rows) + 1  # a line per logged step, and one for the final state
        assert (
            f"running  step {rows[0]['step']}/30  loss {rows[0]['loss']:.4f}" in plain[0]
            and "tokens/s  ETA" in plain[0]
        )


def test_after_a_resume_the_memory_line_keeps_the_passed_smoke_tests_measurement(reference_run, tmp_path):
    """A resume skips the smoke test; the plan made for it is calibrated by the smoke test that passed, so
    `status` does not say 'no passed smoke test'."""
    from launcher.run.prepare import _prepare
    from launcher.recipe_loading import load_recipe

    run = _copy(reference_run, tmp_path / "run")
    plan = json.loads(run.plan.read_text())
    (run.root / "smoke.json").write_text(
        json.dumps({"engine": plan["engine"], "num_processes": 1, "tokens_per_second": 900.0, "peak_memory_gb": 0.61})
    )
    for state in ("planned", "running"):  # the copied run is trained: it ends stopped by the table's path
        set_state(run, state)
    set_state(run, "stopped", reason="stopped by `ftrun stop`")
    recipe = load_recipe(run.recipe)
    *_, lock, _sha = _prepare(run, recipe, resuming=True, fresh=False)
    lock.release()
    s = facts.run_status(run)
    assert s["memory_source"] == "measured"
    assert "measured by the smoke test" in views.format_status(s) and "no passed smoke test" not in views.format_status(
        s
    )


def test_a_stopped_run_says_how_it_ended_once_with_the_exact_resume_command(tmp_path):
    """The supervisor stores the facts of an ending (state.json "ending") and the launch's exact command; the views
    word them: the preempted run's reason names the command, and status + summary print that reason once."""
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.recipe.write_text("model: x\n")
    resume = commands.resume_command("recipes/my run.yaml", ["lora.r=8"], 20.0)
    assert resume == "ftrun 'recipes/my run.yaml' lora.r=8 --memory-limit 20GB"
    ending = {
        "by": "signal",
        "signal": "SIGTERM",
        "step": 40,
        "checkpoint": "step-000040",
        "saved": True,
        "grace_seconds": 120.0,
        "resume_command": resume,
    }
    reason = views.ending_reason(ending)
    assert reason == (f"preempted (SIGTERM) at step 40 after a checkpoint (step-000040); run `{resume}` to resume")
    late = views.ending_reason({**ending, "by": "stop", "checkpoint": None, "saved": False, "resume_command": None})
    assert late.startswith("stopped by `ftrun stop` at step 40; the worker did not finish its checkpoint within 120s")
    assert late.endswith("run the same command to resume")
    set_state(run, "preempted", reason=reason, ending=ending, resume_command=resume)
    s = facts.run_status(run)
    assert s["resume_command"] == resume and reason in views.format_status(s)
    both = views.format_status(s, ending_follows=True) + "\n" + summary_view.format_end_summary(facts.end_summary(run))
    assert both.count(reason) == 1
    # a run whose processes are gone says the same command
    set_state(run, "planned", reason="continuing")  # a resume: planned first (store/state.py STATES)
    set_state(run, "running", reason="continuing", resume_command=resume)
    s = facts.run_status(run)
    assert s["state"] == "interrupted" and f"`{resume}` to resume" in views.format_status(s)


def test_mfu_beside_a_gpus_tokens_per_second_and_silent_on_a_cpu(tmp_path):
    """Model FLOPs utilization from the plan's basis (docs/BENCHMARKS.md, "MFU"): a 1 x RTX 4090 plan of Qwen3-8B
    QLoRA, 1,000 tokens/s measured; the status line and the smoke test's line show it on a GPU only."""
    from launcher.plan.hardware import from_spec
    from launcher.plan.mfu import model_flops_utilization
    from launcher.plan.plan import make_plan
    from launcher.recipe_loading import validate_recipe

    recipe = validate_recipe(
        {"model": "Qwen/Qwen3-8B", "method": "qlora", "data": "d.jsonl", "tokens": "15M", "max_length": 2048},
        tmp_path,
        "r",
    )
    plan = make_plan(
        recipe, from_spec("1xRTX4090"), tokens=recipe.tokens, unsloth_available=True, allow_network=False
    ).to_dict()
    basis = plan["tokens"]
    assert basis["peak_tflops_per_gpu"] == 165 and basis["gpus_used"] == 1
    # LoRA: forward 2N + input gradients 2N, no recomputation counted (model FLOPs, not hardware FLOPs)
    assert 4 * 7e9 < basis["model_flops_per_token"] < 4 * 8.2e9
    mfu = model_flops_utilization(plan, 1000.0)
    assert mfu == pytest.approx(1000.0 * basis["model_flops_per_token"] / 165e12)
    s = {
        "state": "running",
        "run_dir": str(tmp_path),
        "step": 5,
        "total_steps": 10,
        "loss": 1.5,
        "tokens_per_second": 1000.0,
        "mfu": mfu,
    }
    assert f"1,000 tokens/s (MFU {mfu:.0%})" in views.format_status(s)
    cpu = make_plan(
        validate_recipe({"model": "Qwen/Qwen3-8B", "method": "qlora", "data": "d.jsonl"}, tmp_path, "r"),
        from_spec("1xRTX4090"),
        tokens=1e6,
        unsloth_available=True,
        allow_network=False,
    ).to_dict()
    cpu.update(device="cpu", tokens={})
    assert model_flops_utilization(cpu, 1000.0) is None
    assert "MFU" not in views.format_status({**s, "mfu": None})


def test_help_names_every_option_and_every_argument_says_what_it_is():
    """The top-level help's command list names every option of every command, and no argument is left without help
    (issue 23: --watch, --memory-limit and --price were missing; status --json, logs -f and the positionals bare)."""
    import argparse

    from launcher import gguf_types

    parser = _parser()
    epilog = parser.epilog
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"ftrun {name}: {action.dest} has no help"
            if action.option_strings and name != "llamacpp":
                assert any(o in epilog for o in action.option_strings), (
                    f"ftrun {name} {action.option_strings} is not in the top-level help"
                )
    export = commands.choices["export"].format_help().replace("\n", " ")
    assert all(t in export for t in gguf_types.TYPES) and gguf_types.DEFAULT_TYPE in export


def test_commands_with_no_runs_say_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["status"]) == 0
    assert "no runs under ./runs" in capsys.readouterr().out
    for command in ("logs", "stop"):
        assert main([command]) == 2
        err = capsys.readouterr().err
        assert "no runs under ./runs" in err and f"`ftrun {command} " in err


def test_stop_of_a_finished_run_says_it_ended(tmp_path, capsys):
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    (run.root / "recipe.yaml").write_text("{}")
    set_state(run, "succeeded", reason="training finished")
    assert main(["stop", str(run.root)]) == 0
    assert "already ended (succeeded)" in capsys.readouterr().out
    s = facts.run_status(run)
    assert "pid None" not in views.format_status(s)


def test_a_finished_training_whose_export_runs_is_not_called_finished(tmp_path):
    """Run vs export (issue 23): state succeeded while the supervisor still exports reads as trained, export running."""
    e = {
        "state": "succeeded",
        "step": 12,
        "total_steps": 12,
        "run_dir": str(tmp_path),
        "pid_alive": True,
        "export": {"state": "running", "formats": ["adapter"]},
    }
    head = summary_view.format_end_summary(e).splitlines()[0]
    assert head.startswith("== run trained (its export is still running)")
    e["export"] = {"state": "succeeded", "formats": ["adapter"]}
    assert summary_view.format_end_summary(e).startswith("== run finished at step 12/12")
    e.update(export={"state": "running"}, pid_alive=False)  # a killed supervisor's export is not waited for
    assert summary_view.format_end_summary(e).startswith("== run finished")


def test_the_status_loss_says_its_step_when_the_run_is_past_it():
    """logging_steps 5 and 48 steps: the last loss row is step 45's; status says so beside 48/48."""
    s = {
        "state": "succeeded",
        "run_dir": "/r",
        "step": 48,
        "total_steps": 48,
        "loss": 4.2243,
        "loss_step": 45,
        "tokens_per_second": 5694,
    }
    assert "  loss 4.2243 (step 45)   5,694 tokens/s" in views.format_status(s)
    s["loss_step"] = 48
    assert "  loss 4.2243   5,694 tokens/s" in views.format_status(s)


def test_the_stops_last_word_is_the_states():
    """`ftrun stop` words its outcome from the state the supervisor wrote (issue 46): a stop after training says
    what is left; one during the export, or one that came too late, does not say "stopped" over another state."""
    after = {
        "by": "stop",
        "signal": "SIGTERM",
        "step": 12,
        "checkpoint": "step-000012",
        "saved": True,
        "after_training": True,
        "left": ["the samples and the task evaluation", "the export"],
        "resume_command": "ftrun r.yaml",
    }
    reason = views.ending_reason(after)
    assert reason == (
        "stopped by `ftrun stop` after training: the final result and its checkpoint (step-000012) are "
        "saved; not done yet: the samples and the task evaluation, then the export; run `ftrun r.yaml` "
        "to finish (no step is trained again)"
    )
    assert views.stop_outcome({"state": "stopped", "ending": after, "reason": reason}).startswith(
        "stopped after training: stopped by"
    )
    assert views.stop_outcome({"state": "stopped", "reason": "x"}) == "stopped"
    late = views.stop_outcome({"state": "succeeded", "reason": "training finished"})
    assert late == "the run ended succeeded before the stop took effect: training finished"
    export = views.stop_outcome({"state": "trained-not-exported", "reason": "trained, not exported: killed"})
    assert export.startswith("stopped during the export: training is complete")
    said = views.stop_waits_for({"phase": "after training", "step": 12}, 120)
    assert said.startswith("training is complete (step 12)")
    assert "at the end of its step" in views.stop_waits_for({"phase": "training", "step": 3}, 120)


def test_a_dpo_summary_says_ties_as_ties_and_the_chosen_answers_reward(tmp_path):
    """Issue 46: at step 0 the policy is its reference and every held-out margin is 0 (trl counts chosen > rejected
    only): the summary and status say "tied", not an accuracy of 0; the chosen answers' reward beside the margin."""
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.recipe.write_text("model: x\n")
    set_state(run, "succeeded", reason="training finished")
    rows = [
        {
            "step": 0,
            "eval_loss": 0.6931,
            "eval_rewards/margins": 0.0,
            "eval_rewards/accuracies": 0.0,
            "eval_rewards/chosen": 0.0,
            "eval_rewards/rejected": 0.0,
        },
        {"step": 5, "loss": 0.3, "rewards/margins": 1.7, "rewards/accuracies": 0.8},
        {
            "step": 48,
            "eval_loss": 0.01,
            "eval_rewards/margins": 10.2,
            "eval_rewards/accuracies": 1.0,
            "eval_rewards/chosen": -1.42,
            "eval_rewards/rejected": -11.62,
        },
    ]
    run.metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = summary_view.format_end_summary(facts.end_summary(run))
    assert (
        "rewards   held-out margin 0.000 (step 0) -> 10.200 (step 48); preference accuracy tied (margin 0: the "
        "policy is its reference) -> 1.00"
    ) in text, text
    assert "chosen answers' reward 0.000 -> -1.420, rejected 0.000 -> -11.620; the chosen answers fell too" in text
    assert "accuracy 0.00" not in text
    first = views.format_status({**facts.run_status(run), "eval_margin": 0.0, "eval_accuracy": 0.0, "eval_step": 0})
    assert "preference accuracy tied (margin 0" in first


def test_the_exports_sizes_say_what_each_counts():
    """Issue 46: the adapter's size is its weights file, the merged model's its whole folder; status says which."""
    outs = messages.export_outputs(
        {
            "adapter": {"size": "65.2 KB", "bytes": 66764},
            "merged": {"size": "1.1 MB", "bytes": 1153433},
            "gguf": {"size": "0.6 MB"},
        }
    )
    assert outs == "adapter 65.2 KB weights file, merged 1.1 MB folder, gguf 0.6 MB file"
    s = {
        "state": "succeeded",
        "run_dir": "r",
        "export": {"state": "succeeded", "formats": ["adapter", "merged"], "outputs": outs, "serving": "SERVING.md"},
    }
    assert (
        "export (adapter, merged): succeeded - adapter 65.2 KB weights file, merged 1.1 MB folder"
        in views.format_status(s)
    )
