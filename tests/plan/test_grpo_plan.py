"""GRPO's plan-time gaps, as `ftrun plan` shows them: vLLM generation without vLLM, an answer length longer than a
whole sequence, and the answer length sized from the references where the recipe leaves it out."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from helpers import ftrun

LABELS = ["billing", "account", "outage", "feature"]


def _tickets(tmp_path: Path, n: int = 24) -> Path:
    path = tmp_path / "tickets.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": f"Ticket {k}: sort it."}], "reference": LABELS[k % len(LABELS)]}
        for k in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _plan(write_recipe, tmp_path, *overrides, **fields):
    fields.setdefault("reward", {"metric": "exact"})
    recipe = write_recipe(objective="grpo", data=str(_tickets(tmp_path)), **fields)
    return ftrun("plan", recipe, *overrides, cwd=tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_generation_without_vllm_is_blocked_at_plan_time(write_recipe, tmp_path):
    res = _plan(write_recipe, tmp_path, grpo={"generation": "vllm", "max_completion_length": 16})
    assert res.returncode != 0, res.stdout + res.stderr
    said = " ".join((res.stdout + res.stderr).split())
    assert "grpo.generation: vllm needs the vllm package on this box, and it is not installed" in said
    assert "grpo.generation: generate" in said and "Traceback" not in said


def test_an_answer_length_beyond_max_length_is_blamed_on_itself(write_recipe, tmp_path):
    res = _plan(write_recipe, tmp_path, grpo={"max_completion_length": 512}, max_length=256)
    assert res.returncode == 2, res.stdout + res.stderr
    said = " ".join(res.stderr.split())
    assert "grpo.max_completion_length 512 is not below max_length 256" in said
    assert "is a prompt of" not in said  # not a prompt's fault
    assert "lower grpo.max_completion_length below 256" in said


def test_the_answer_length_left_out_is_sized_from_the_references_and_said(write_recipe, tmp_path):
    res = _plan(write_recipe, tmp_path, "--json", grpo={"num_generations": 4})
    assert res.returncode == 0, res.stdout + res.stderr
    why = "\n".join(json.loads(res.stdout)["reasons"])
    assert "at most 16 tokens" in why  # not the default 256: the labels are a token or two
    assert "grpo.max_completion_length 16: sized from the references: the longest is" in why
    # set in the recipe, it is the recipe's
    res = _plan(write_recipe, tmp_path, "--json", grpo={"max_completion_length": 40})
    why = "\n".join(json.loads(res.stdout)["reasons"])
    assert "at most 40 tokens" in why and "sized from the references" not in why


def test_with_a_reward_function_the_default_answer_length_stays_and_the_plan_says_why(write_recipe, tmp_path):
    (tmp_path / "rewards.py").write_text(
        "def short(prompts, completions, **kw):\n    return [-len(c[0]['content']) / 50 for c in completions]\n"
    )
    # a length reward scores the answers' form (scores: form), beside the labels' own metric
    rewards = [{"metric": "exact"}, {"function": "rewards.py:short", "scores": "form"}]
    res = _plan(write_recipe, tmp_path, "--json", reward=rewards, max_length=512)
    assert res.returncode == 0, res.stdout + res.stderr
    why = "\n".join(json.loads(res.stdout)["reasons"])
    assert "at most 256 tokens" in why and "a reward function of yours may want answers longer" in why


def test_the_launch_records_the_sized_answer_length_and_the_same_command_resumes(write_recipe, tmp_path):
    from launcher.recipe_loading import load_recipe
    from launcher.run import pipeline
    from launcher.run.adjustments import with_adjustments
    from launcher.run.prepare import _prepare, as_written
    from launcher.store.rundir import RunDir

    path = write_recipe(objective="grpo", data=str(_tickets(tmp_path)), reward={"metric": "exact"})
    recipe = load_recipe(path)
    run = RunDir(tmp_path / "run")
    _, _, stats, plan, _, lock, _ = _prepare(run, recipe, resuming=False, fresh=False)
    lock.release()
    assert yaml.safe_load(run.recipe.read_text())["grpo"]["max_completion_length"] == 16  # what the worker reads
    assert as_written(run, recipe, stats, plan).grpo.max_completion_length == 16  # the smoke test's replan
    # the same command again (a resume): the run's sized length, no "the recipe differs"
    again = with_adjustments(run, load_recipe(path))
    assert again.grpo.max_completion_length == 16
    assert pipeline._recipe_differences(run, load_recipe(path)) == {}
    pipeline._check_same_trajectory(run, again)


def test_what_the_loss_sees_under_grpo_is_the_sampled_answers_not_a_missing_tokenizer(write_recipe, tmp_path):
    """The launch and `ftrun data` print it with one function (launcher/run/data_view.py format_loss_view): the
    tokenizer is on this machine (the tiny model's folder), and GRPO's data holds no answer that trains."""
    recipe = write_recipe(objective="grpo", data=str(_tickets(tmp_path)), reward={"metric": "exact"})
    res = ftrun("data", recipe, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "what the loss sees: the answers GRPO samples for each prompt while it trains" in res.stdout
    assert "tokenizer is not on this machine" not in res.stdout
