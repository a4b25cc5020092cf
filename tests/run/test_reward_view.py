"""Each GRPO reward visible: the rows the worker writes from TRL's logs (each reward's rewards/<name>/mean and /std),
read back as `ftrun status`, the step line of train.log (what `ftrun logs -f` prints), the end summary, the runs list
and loss.png's reward panel; a reward that never varies named; a run whose rewards never varied told apart from a
failed save."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher import methods
from launcher.run import facts, views
from launcher.run.summary_view import format_end_summary
from launcher.store.rundir import RunDir
from launcher.store.state import set_state

STEPS = (5, 10, 15, 20, 25, 30)


def _trl_logs(step: int, parts: dict[str, tuple[float, float]], weights: dict[str, float], zero_std: float) -> dict:
    """What trl 1.16 GRPOTrainer.log hands the callbacks for a logging window (grpo_trainer.py: each reward's mean
    and std, their weighted sum's, the share of prompts whose answers all scored the same, beside the Trainer's)."""
    logs = {
        "loss": 0.0 if zero_std == 1.0 else 0.02,
        "grad_norm": 0.0 if zero_std == 1.0 else 0.4,
        "learning_rate": 1e-3,
        "num_tokens": 1200.0 * step,
        "completions/mean_length": 9.5,
        "completions/clipped_ratio": 0.1,
        "entropy": 2.1,
        "epoch": step / 100,
    }
    for name, (mean, std) in parts.items():
        logs[f"rewards/{name}/mean"] = mean
        logs[f"rewards/{name}/std"] = std
    logs["reward"] = sum(weights[n] * m for n, (m, _) in parts.items())
    logs["reward_std"] = sum(weights[n] * s for n, (_, s) in parts.items())
    logs["frac_reward_zero_std"] = zero_std
    return logs


def _write_rows(run: RunDir, windows: list[dict], capsys) -> list[str]:
    """The rows and step lines as the worker's Metrics callback writes them from TRL's logs (launcher/worker/
    callbacks.py); returns the step lines it printed (train.log's, which `ftrun logs -f` follows)."""
    from launcher.worker.callbacks import build_callbacks

    recipe = SimpleNamespace(
        checkpoint_every_minutes=10.0,
        eval=SimpleNamespace(every_minutes=10.0),
        objective_row=methods.OBJECTIVES["grpo"],
    )
    _, metrics_cb = build_callbacks(run, recipe, "full", "cpu", {}, None)
    metrics_cb.t_last = time.monotonic()
    for step, logs in zip(STEPS, windows):
        state = SimpleNamespace(
            global_step=step,
            max_steps=STEPS[-1],
            num_input_tokens_seen=int(logs["num_tokens"]),
            epoch=logs["epoch"],
            is_world_process_zero=True,
        )
        metrics_cb.on_log(None, state, None, logs=dict(logs))
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("[ftrun worker] step ")]


def _ended_run(root: Path) -> RunDir:
    run = RunDir(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "recipe.yaml").write_text("objective: grpo\n")
    set_state(run, "running")
    set_state(run, "succeeded", reason="training finished")
    return run


# four weighted rewards as the user had them: two rise, two never leave 0
WEIGHTS = {"brevity": 1.0, "number": 1.0, "metric_exact": 1.0, "think_format_reward": 0.5}


def _four_rewards(k: int) -> dict[str, tuple[float, float]]:
    return {
        "brevity": (0.70 + 0.036 * k, 0.2),
        "number": (0.075 + 0.023 * k, 0.15),
        "metric_exact": (0.0, 0.0),
        "think_format_reward": (0.0, 0.0),
    }


def test_each_reward_is_kept_and_shown_in_the_step_line_status_and_summary(tmp_path, capsys):
    run = _ended_run(tmp_path / "grpo")
    windows = [_trl_logs(s, _four_rewards(k), WEIGHTS, 0.25) for k, s in enumerate(STEPS)]
    lines = _write_rows(run, windows, capsys)

    rows = facts.metrics_rows(run.metrics)
    assert rows[-1]["rewards/brevity/mean"] == pytest.approx(0.88) and rows[-1]["rewards/number/std"] == 0.15
    assert "rewards/think_format_reward/std" in rows[-1]

    # train.log's step line: the sum and each reward's mean +- spread
    assert lines[-1].startswith("[ftrun worker] step 30/30 loss 0.0200") and "reward 1.070 +- 0.350" in lines[-1]
    assert "brevity 0.880 +- 0.200, number 0.190 +- 0.150, metric_exact 0.000 +- 0.000" in lines[-1], lines[-1]
    assert "25% of prompts without reward variance" in lines[-1]

    status = views.format_status(facts.run_status(run))
    assert "reward    1.070 +- 0.350 (step 30: the sampled answers' mean and spread, the weighted sum of:)" in status
    assert "            brevity              0.880 +- 0.200" in status, status
    assert "            think_format_reward  0.000 +- 0.000" in status
    for name in ("metric_exact", "think_format_reward"):
        assert (
            f"warning   reward {name} never varied: 0.000 for every answer at all 6 logged steps; it gives GRPO "
            "nothing to learn from" in status
        ), status
    assert "warning   reward brevity" not in status and "warning   reward number" not in status

    summary = format_end_summary(facts.end_summary(run))
    assert "brevity              0.700 +- 0.200 -> 0.880 +- 0.200" in summary, summary
    assert "number               0.075 +- 0.150 -> 0.190 +- 0.150" in summary
    assert "warning   reward metric_exact never varied" in summary
    assert "warning   reward think_format_reward never varied" in summary
    assert "no prompt's answers differed" not in summary  # 75% of the prompts had something to learn from


def test_a_reward_that_stopped_varying_is_named_with_the_step_since(tmp_path, capsys):
    run = _ended_run(tmp_path / "grpo")
    # one reward: varies for the first window, then every answer scores 1.0 (saturated), and every group is tied
    windows = [_trl_logs(STEPS[0], {"metric_text": (0.4, 0.2)}, {"metric_text": 1.0}, 0.5)] + [
        _trl_logs(s, {"metric_text": (1.0, 0.0)}, {"metric_text": 1.0}, 1.0) for s in STEPS[1:]
    ]
    lines = _write_rows(run, windows, capsys)
    assert "reward 1.000 +- 0.000, 100% of prompts without reward variance" in lines[-1]
    assert "(metric_text" not in lines[-1]  # one reward: the sum is it
    status = views.format_status(facts.run_status(run))
    assert (
        "reward metric_text has not varied since step 10: 1.000 for every answer at the last 5 logged steps" in status
    )
    assert "no prompt's answers differed in reward (frac_reward_zero_std 1.0) since step 10" in status
    assert "more answers per prompt (grpo.num_generations) or a higher grpo.temperature" in status


def test_the_runs_list_shows_grpos_reward_and_dpos_margin_rather_than_their_loss(tmp_path, capsys):
    grpo = _ended_run(tmp_path / "runs" / "a-grpo")
    _write_rows(grpo, [_trl_logs(s, {"metric_text": (0.18, 0.05)}, {"metric_text": 1.0}, 0.0) for s in STEPS], capsys)
    dpo = _ended_run(tmp_path / "runs" / "b-dpo")
    dpo.metrics.write_text(
        json.dumps({"step": 4, "loss": 0.61, "rewards/margins": 0.352, "rewards/accuracies": 0.75, "time": 1.0}) + "\n"
    )
    sft = _ended_run(tmp_path / "runs" / "c-sft")
    sft.metrics.write_text(json.dumps({"step": 4, "loss": 1.2345, "time": 1.0}) + "\n")
    text = views.format_runs([facts.run_row(r) for r in facts.find_runs(tmp_path / "runs")])
    lines = {line.split()[0]: line for line in text.splitlines()[1:-1]}
    assert "reward 0.180" in lines["a-grpo"] and "loss" not in lines["a-grpo"], text
    assert "margin 0.352" in lines["b-dpo"] and "0.61" not in lines["b-dpo"]
    assert "loss 1.2345" in lines["c-sft"]


def test_the_plots_reward_panel_draws_each_reward_and_marks_the_one_that_never_varied(tmp_path, capsys):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from launcher.deliver.plots import _sampled_rewards, plot_loss

    run = _ended_run(tmp_path / "grpo")
    _write_rows(run, [_trl_logs(s, _four_rewards(k), WEIGHTS, 0.25) for k, s in enumerate(STEPS)], capsys)
    rows = facts.metrics_rows(run.metrics)
    fig, ax = plt.subplots()
    _sampled_rewards(ax, rows)
    labels = ax.get_legend_handles_labels()[1]
    plt.close(fig)
    assert labels[0] == "reward of the sampled answers (mean, weighted sum)"
    assert {"brevity", "number", "metric_exact (never varied)", "think_format_reward (never varied)"} <= set(labels)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["number"].get_ydata()) == pytest.approx([r["rewards/number/mean"] for r in rows])
    assert plot_loss(run.metrics, run.root / "loss.png").stat().st_size > 0


def test_a_run_whose_rewards_never_varied_ends_as_nothing_learned_not_as_a_failed_save(tmp_path, capsys):
    from launcher.errors import EXIT_NOTHING_LEARNED
    from launcher.run.supervisor import _learned_nothing

    run = _ended_run(tmp_path / "grpo")
    _write_rows(run, [_trl_logs(s, {"metric_exact": (0.0, 0.0)}, {"metric_exact": 1.0}, 1.0) for s in STEPS], capsys)
    grpo = SimpleNamespace(objective_row=methods.OBJECTIVES["grpo"])
    found = _learned_nothing(grpo, run)
    assert (
        found["logged_steps"] == 6
        and found["step"] == 30
        and found["rewards"] == [{"name": "metric_exact", "mean": 0.0}]
    )
    reason = views.nothing_learned_reason(found)
    assert reason.startswith(
        "nothing was learned: at all 6 logged steps up to step 30 no prompt's sampled answers differed in reward "
        "(frac_reward_zero_std 1.0; metric_exact 0.000 on average), so every advantage was 0"
    ), reason
    assert "resuming will not help" in reason and "run the same command to resume" not in reason
    assert "a higher grpo.temperature" in reason
    assert EXIT_NOTHING_LEARNED not in (0, 1, 2, 3, 4, 5, 6)
    # an SFT run, or a GRPO run in which some prompt's answers differed, is not "nothing learned"
    assert _learned_nothing(SimpleNamespace(objective_row=methods.OBJECTIVES["sft"]), run) is None
    run.metrics.write_text("")
    _write_rows(run, [_trl_logs(s, {"metric_exact": (0.1, 0.3)}, {"metric_exact": 1.0}, 0.9) for s in STEPS], capsys)
    assert _learned_nothing(grpo, run) is None


@pytest.mark.slow
def test_grpo_whose_rewards_never_vary_ends_nothing_learned_with_exit_7(write_recipe, tmp_path):
    """End to end on the random tiny model: exact match on the demo's sentence references scores every sampled answer
    0, so no prompt's answers differ, every advantage is 0 and every lora_B stays at its initial zero. The smoke test
    notes it first; the run ends failed with exit 7 and why, not exit 5 with "run the same command to resume"; status
    and the summary say it."""
    from helpers import ftrun, read_state

    from launcher.errors import EXIT_NOTHING_LEARNED

    recipe = write_recipe(
        objective="grpo",
        data=str(Path(__file__).resolve().parents[2] / "recipes" / "data" / "tiny-prompts.jsonl"),
        grpo={"num_generations": 4, "max_completion_length": 8},
        reward={"metric": "exact"},
        micro_batch_size=8,
        max_steps=4,
        logging_steps=2,
        checkpoint_every_minutes=10,
    )
    res = ftrun(recipe, "--foreground", cwd=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == EXIT_NOTHING_LEARNED, out[-3000:]
    # said first by the smoke test, before the full run (a note: a sparse reward may start to vary later)
    assert "note: in all 3 steps of the smoke test no prompt's answers differed in reward" in out, out[-3000:]
    st = read_state(tmp_path / "run")
    assert st["state"] == "failed" and st["ending"]["by"] == "no-reward-variance", st
    assert st["reason"].startswith(
        "nothing was learned: at all 2 logged steps up to step 4 no prompt's sampled answers"
    )
    assert "metric_exact 0.000 on average" in st["reason"] and "resuming will not help" in st["reason"]
    assert "run the same command to resume" not in out
    assert "== run FAILED at step 4/4" in out and "warning   reward metric_exact never varied" in out
    assert "no prompt's answers differed in reward (frac_reward_zero_std 1.0) at any logged step" in out
    status = ftrun("status", tmp_path / "run", cwd=tmp_path).stdout
    assert "nothing was learned" in status and "reward metric_exact never varied" in status


def test_status_time_after_a_kill_9_counts_up_to_the_runs_last_sign_of_life(tmp_path):
    """A supervisor killed by kill -9 leaves state.json saying running; status reads it as interrupted and counted
    the last interval (44 s of running) as nothing: 51 s became 7 s. It now ends where the run last did something:
    its log's, its metrics' or its state's last write, however long after the crash status is asked."""
    import os

    from launcher.store.checkpoint import atomic_write_json

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    now = time.time()
    history = [
        {"state": "planned", "at": now - 60},
        {"state": "smoking", "at": now - 58},
        {"state": "running", "at": now - 51},
    ]
    atomic_write_json(
        run.state, {"state": "running", "history": history, "updated_at": now - 51, "supervisor_pid": 999999}
    )
    run.log.write_text("[ftrun worker] step 40/120 ...\n")
    os.utime(run.log, (now - 7, now - 7))  # the worker's last line, 7 s ago: then it died with its supervisor
    s = facts.run_status(run)
    assert s["state"] == "interrupted"
    assert s["elapsed_seconds"] == pytest.approx(51, abs=1.5) and s["run_seconds"] == pytest.approx(44, abs=1.5), s
    assert "time 51 s so far" in views.format_status(s)  # before: 7 s, the smoke test's alone
