"""GRPO (objective grpo): prompts as data, rewards from the task metric or a function of the user's, the plan's
sampling, the refusals before any GPU time, and end to end on the tiny model: GRPO from an SFT run's adapter whose
task reward rises, kill -9 + resume equal to the uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from conftest import REPO
from helpers import (
    adapter_tensors,
    article_plan,
    freeze_worker,
    ftrun,
    metrics,
    polled_status,
    wait_for,
    wait_until_ended,
)

PROMPTS = REPO / "recipes" / "data" / "tiny-prompts.jsonl"
SAID = ("time", "tokens_per_second", "peak_memory_gb", "eval_seconds")  # wall-clock values


def _lines(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _prompt(question: str, answer: str | None = None) -> dict:
    row: dict = {"prompt": [{"role": "user", "content": question}]}
    if answer is not None:
        row["reference"] = answer
    return row


GRPO = dict(
    objective="grpo",
    data=str(PROMPTS),
    grpo={"num_generations": 4, "max_completion_length": 12},
    reward={"metric": "text"},
    max_length=256,
    micro_batch_size=8,
    learning_rate=5e-3,
)


def _plan(write_recipe, tmp_path, **fields):
    recipe = write_recipe(**{**GRPO, **fields})
    return ftrun("plan", recipe, cwd=tmp_path)


# ---------------------------------------------------------------------------------------------
# Data and rewards (launcher/data/rewards.py)


def test_prompts_chats_and_pairs_become_grpo_rows_with_their_references(tmp_path):
    from launcher.data import rewards
    from launcher.data.dataset import load_data

    rows = load_data(_lines(tmp_path / "p.jsonl", [_prompt("2+2?", "4"), {"prompt": "3+3?"}])).examples
    assert [rewards.prompt_and_reference(r) for r in rows] == [
        {"prompt": [{"role": "user", "content": "2+2?"}], "reference": "4"},
        {"prompt": "3+3?", "reference": None},
    ]
    chat = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    assert rewards.prompt_and_reference(chat) == {"prompt": chat["messages"][:1], "reference": "4"}
    assert rewards.prompt_and_reference({"prompt": "2+2?", "completion": "4"}) == {"prompt": "2+2?", "reference": "4"}


def test_a_metric_reward_scores_each_answer_with_the_task_evaluations_scorer():
    from launcher.data import rewards, task_metrics

    exact = rewards.metric_reward("exact")
    answers = [[{"role": "assistant", "content": " Paris "}], [{"role": "assistant", "content": "Rome"}]]
    assert exact(prompts=[[], []], completions=answers, reference=["paris", "Paris"]) == [1.0, 0.0]
    assert exact(prompts=[[]], completions=["x"], reference=[None]) == [None]  # no reference: NaN to TRL
    text = rewards.metric_reward("text")
    got = text(prompts=[""], completions=["The capital is Rome."], reference=["The capital is Rome."])
    assert got == task_metrics.score("text", ["The capital is Rome."], ["The capital is Rome."])["per_example"]
    assert exact.__name__ == "metric_exact"  # TRL logs rewards/metric_exact/mean


# ---------------------------------------------------------------------------------------------
# Refused before any GPU time, with the field, the value and the fix


@pytest.mark.parametrize(
    "fields, said",
    [
        (dict(objective="sft", grpo=None), "reward: applies to objective grpo"),
        (dict(grpo={"num_generations": 1}), "grpo.num_generations"),
        (dict(reward={"metric": "exact", "function": "r.py:f"}), "either a metric"),
        (dict(reward={"function": "rewards"}), "is neither FILE.py:NAME nor MODULE:NAME"),
        (dict(reward=[{"metric": "bleu"}]), "reward.0.metric"),
        (dict(preference={"beta": 0.3}), "preference.beta does not apply to objective grpo"),
        (dict(packing=True), "packing apply to objective sft"),
    ],
)
def test_a_bad_grpo_recipe_is_refused(write_recipe, tmp_path, fields, said):
    res = _plan(write_recipe, tmp_path, **fields)
    assert res.returncode == 2 and said in res.stderr, res.stdout + res.stderr
    assert "Traceback" not in res.stderr


def test_grpo_keys_under_another_objective_are_refused(write_recipe, tmp_path):
    recipe = write_recipe(grpo={"beta": 0.1})
    res = ftrun("plan", recipe, cwd=tmp_path)
    assert res.returncode == 2 and "grpo.beta does not apply to objective sft" in res.stderr, res.stderr


def test_num_generations_that_does_not_divide_the_batch_is_refused_with_the_numbers(write_recipe, tmp_path):
    res = _plan(write_recipe, tmp_path, micro_batch_size=6)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "grpo.num_generations 4 does not divide" in res.stderr and "= 6" in res.stderr
    assert "gradient_accumulation_steps to a multiple of 2" in res.stderr


def test_a_metric_reward_on_prompts_without_references_is_refused_with_the_line(write_recipe, tmp_path):
    data = _lines(tmp_path / "p.jsonl", [_prompt(f"{k}+1?", str(k + 1)) for k in range(30)] + [_prompt("no answer")])
    res = _plan(write_recipe, tmp_path, data=str(data))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "line 31" in res.stderr and "has none (1 of" in res.stderr and "reference" in res.stderr


@pytest.mark.parametrize(
    "body, said",
    [
        ("def score(prompts, completions, **kw):\n    raise KeyError('answer')\n", "raised KeyError: 'answer'"),
        ("def score(prompts, completions, **kw):\n    return [1.0]\n", "returned 1 values for "),
        ("def score(prompts, completions, **kw):\n    return ['good'] * len(completions)\n", "returned 'good' (str)"),
        ("def score(prompts, completions):\n    return [0.0, 0.0]\n", "takes no completion_ids, trainer_state"),
        ("import not_a_module\n", "importing rewards.py raised ModuleNotFoundError"),
        (
            "def other(prompts, completions, **kw):\n    return [0.0, 0.0]\n",
            "has no function 'score' (it defines other)",
        ),
    ],
)
def test_a_reward_function_is_called_once_at_plan_time_and_refused_with_what_it_did(write_recipe, tmp_path, body, said):
    (tmp_path / "rewards.py").write_text(body)
    res = _plan(write_recipe, tmp_path, reward={"function": "rewards.py:score"})
    assert res.returncode == 2, res.stdout + res.stderr
    assert said in res.stderr and "rewards.py:score" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_a_reward_function_that_works_plans_beside_a_weighted_metric(write_recipe, tmp_path):
    (tmp_path / "rewards.py").write_text(
        "def short(prompts, completions, reference=None, **kw):\n"
        "    return [1.0 / (1 + len(c[0]['content'])) for c in completions]\n"
    )
    res = _plan(
        write_recipe,
        tmp_path,
        reward=[{"metric": "text"}, {"function": "rewards.py:short", "weight": 0.5, "scores": "form"}],
        max_steps=None,
        epochs=1,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rewarded by the task metric text + 0.5 x rewards.py:short" in res.stdout
    assert "283 prompts x 4 sampled answers" in res.stdout
    assert "generation: transformers' generate in the training process" in res.stdout


def test_a_prompt_that_leaves_no_room_for_the_answer_is_refused(write_recipe, tmp_path):
    data = _lines(tmp_path / "p.jsonl", [_prompt("word " * 200, "x")] + [_prompt(f"{k}?", "y") for k in range(30)])
    res = _plan(write_recipe, tmp_path, data=str(data), max_length=128, grpo={"max_completion_length": 64})
    assert res.returncode == 2, res.stdout + res.stderr
    assert "line 1 is a prompt of" in res.stderr and "grpo.max_completion_length 64" in res.stderr
    assert "TRL's GRPOTrainer does not cut prompts" in res.stderr


def test_the_plan_of_an_8b_grpo_job_names_the_sampling_in_memory_and_time(tmp_path):
    plan = article_plan(
        tmp_path, "1xH100-80GB", objective="grpo", method="lora", grpo={"num_generations": 8}, reward=None
    )
    breakdown, why = plan.memory["breakdown_gb"], "\n".join(plan.reasons)
    assert "generation" in breakdown and "KV cache" in plan.memory["explanations"]["generation"]
    assert "sampling time:" in why and "+ sampling" in why
    # Llama-3.1-8B's eager decode with 7 unmerged LoRA modules a layer: bound by its launches, not the memory roofline
    line = next(r for r in plan.reasons if r.startswith("sampling time:"))
    assert "kernels a step from Python at 10 us each, transformers' eager generate with 7 unmerged LoRA" in line
    step_ms = float(re.search(r"([\d.]+) ms a decode step", line).group(1))
    # 2,760 kernels: near the review's ~30-50 ms for HF's eager decode at 8B on an H100 (issue 55), far above the
    # memory roofline's 9.8 ms the plan used to price
    assert 25 <= step_ms <= 50
    # vLLM replays CUDA graphs: its step is the memory roofline's
    vllm = article_plan(
        tmp_path, "1xH100-80GB", objective="grpo", method="lora", grpo={"num_generations": 8, "generation": "vllm"}
    )
    line = next(r for r in vllm.reasons if r.startswith("sampling time:"))
    assert "bound by reading the weights and the KV cache once a step" in line
    assert float(re.search(r"([\d.]+) ms a decode step", line).group(1)) < step_ms / 2
    assert "each prompt is answered 8 times" in why
    kl = article_plan(
        tmp_path, "1xH100-80GB", objective="grpo", method="full", model="Qwen/Qwen3-0.6B", grpo={"beta": 0.04}
    )
    assert kl.memory["breakdown_gb"]["reference model"] > 0  # the KL term keeps a frozen copy of the model
    vllm = article_plan(tmp_path, "1xH100-80GB", objective="grpo", grpo={"generation": "vllm"})
    assert "the vllm package must be installed" in "\n".join(vllm.reasons)


def test_the_loss_plot_draws_the_sampled_rewards(tmp_path):
    from launcher.deliver.plots import plot_loss

    rows = [{"step": s, "loss": 0.1, "learning_rate": 1e-3, "reward": s / 10, "reward_std": 0.1} for s in range(1, 6)]
    _lines(tmp_path / "metrics.jsonl", rows)
    assert plot_loss(tmp_path / "metrics.jsonl", tmp_path / "loss.png").stat().st_size > 0


# ---------------------------------------------------------------------------------------------
# End to end on the tiny model

QUICK = ("smoke.enabled=false",)
# The demo's settings (recipes/tiny-cpu-grpo.yaml: temperature 0.7, 4 prompts x 4 answers a step, 1e-3), fewer steps
TRAIN = dict(
    GRPO,
    grpo={"num_generations": 4, "max_completion_length": 12, "temperature": 0.7},
    micro_batch_size=16,
    learning_rate=1e-3,
    max_steps=24,
    logging_steps=4,
    checkpoint_every_minutes=10,
    eval={"fraction": 0.05, "samples": 0, "max_new_tokens": 16},
)


@pytest.fixture(scope="module")
def sft_run(sft_parent) -> Path:
    """The parent: LoRA SFT on the demo's chat data, shared with the other preference and GRPO tests (conftest
    sft_parent: one run for both files)."""
    return sft_parent


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, tiny_model, sft_run) -> Path:
    from conftest import uninterrupted_run

    return uninterrupted_run(tmp_path_factory, tiny_model, "grpo", dict(TRAIN, init_from=str(sft_run)), *QUICK)


@pytest.mark.slow
def test_grpo_from_an_sft_runs_adapter_raises_the_task_reward(grpo_run, sft_run, tmp_path):
    rows = [r for r in metrics(grpo_run) if "reward" in r]
    assert [r["step"] for r in rows] == [4, 8, 12, 16, 20, 24]
    first, last = [r["reward"] for r in rows[:2]], [r["reward"] for r in rows[-2:]]
    assert sum(last) > sum(first), rows  # the sampled answers' mean chrF against their references
    assert {"reward_std", "frac_reward_zero_std", "completions/mean_length", "entropy"} <= set(rows[-1])
    parent, child = adapter_tensors(sft_run), adapter_tensors(grpo_run)
    assert parent.keys() == child.keys() and any(not (parent[k] == child[k]).all() for k in parent)
    # the task evaluation of the result against its parent, on the held-out prompts
    scores = json.loads((grpo_run / "final" / "task_eval.json").read_text())["scores"]
    # the parent (where GRPO starts), the bare base without any adapter, and the result
    assert {"parent_zero_shot", "parent_few_shot", "bare_base_zero_shot", "fine_tuned"} <= set(scores)
    text = ftrun("status", grpo_run, cwd=tmp_path).stdout
    assert "reward " in text and "sampled answers' mean and spread" in text
    assert "base model without the adapter, zero-shot" in text and "parent adapter, zero-shot" in text
    assert (grpo_run / "loss.png").stat().st_size > 0


@pytest.mark.slow
def test_grpo_kill9_then_resume_matches_the_uninterrupted_run(write_recipe, tmp_path, grpo_run, sft_run):
    recipe = write_recipe(**dict(TRAIN, init_from=str(sft_run), max_restarts=0, checkpoint_every_minutes=0.0001))
    assert ftrun(recipe, *QUICK, cwd=tmp_path).returncode == 0
    run = tmp_path / "run"

    def past_a_checkpoint(r: Path) -> bool:
        steps = [int(p.parent.name.split("-")[1]) for p in (r / "checkpoints").glob("step-*/manifest.json")]
        return bool(steps) and 5 <= max(steps) < 20 and max(steps) % 4 != 0  # inside a logging window

    st = freeze_worker(run, past_a_checkpoint, timeout=300)
    os.kill(st["supervisor_pid"], signal.SIGKILL)
    os.kill(st["worker_pid"], signal.SIGKILL)
    wait_for(lambda: polled_status(run)["state"] == "interrupted", 30, "state interrupted")
    res = ftrun(recipe, *QUICK, cwd=tmp_path)
    assert res.returncode == 0 and "continuing" in res.stdout, res.stdout + res.stderr
    wait_until_ended(run, tmp_path, timeout=400)
    assert "resuming from step-" in (run / "train.log").read_text()
    # rewards, losses, the answers' lengths: the sampling is seeded and its RNG state is in the checkpoint
    strip = lambda rows: [{k: v for k, v in r.items() if k not in SAID} for r in rows]  # noqa: E731
    assert strip(metrics(run)) == strip(metrics(grpo_run))
    a, b = adapter_tensors(grpo_run), adapter_tensors(run)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
