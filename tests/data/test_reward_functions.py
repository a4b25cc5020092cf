"""GRPO's reward functions as people write them (launcher/data/rewards.py): every column of the data passed by name as
TRL's GRPOTrainer passes it, module paths and files of installed packages, and the plan-time probe that refuses a
reward TRL would train on to no effect (NaN advantages, no signal), each as `ftrun plan` shows it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import ftrun
from launcher.errors import DataError

# An arithmetic task as a newcomer writes it: conversational prompts and an `answer` column (Unsloth's GSM8K
# notebook maps its data so), no reference
QUESTIONS = [(f"What is {a} plus {b}?", str(a + b)) for a, b in [(2, 3), (4, 4), (7, 5), (9, 1), (6, 8), (3, 3)] * 4]


def _data(tmp_path: Path, rows: list[dict], name: str = "math.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _answers(tmp_path: Path, **extra) -> Path:
    return _data(tmp_path, [{"prompt": [{"role": "user", "content": q}], "answer": a, **extra} for q, a in QUESTIONS])


def _plan(write_recipe, tmp_path, data: Path, reward, **fields):
    recipe = write_recipe(
        objective="grpo",
        data=str(data),
        reward=reward,
        grpo={"num_generations": 4, "max_completion_length": 16},
        **fields,
    )
    return ftrun("plan", recipe, cwd=tmp_path)


def _recipe(write_recipe, data: Path, reward):
    from launcher.recipe_loading import load_recipe

    return load_recipe(
        write_recipe(
            objective="grpo", data=str(data), reward=reward, grpo={"num_generations": 4, "max_completion_length": 16}
        )
    )


def _probed(write_recipe, data: Path, reward) -> str:
    """The plan's data check in this process: its probe lines, as the plan's Why lines show them (`ftrun plan`
    prints them: the CLI tests here)."""
    from launcher.data.stats import data_stats

    return " ".join(" ".join(data_stats(_recipe(write_recipe, data, reward))[2].rewards).split())


def _refusal(write_recipe, data: Path, reward) -> str:
    """The plan's data check's RecipeError in this process, its message and fix as one paragraph."""
    from launcher.data.stats import data_stats
    from launcher.errors import RecipeError

    with pytest.raises(RecipeError) as refused:
        data_stats(_recipe(write_recipe, data, reward))
    return " ".join(f"{refused.value.message} Fix: {refused.value.fix}".split())


def _ok(res) -> str:
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def _refused(res) -> str:
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    return " ".join(res.stderr.split())


# Unsloth's GRPO notebook, as written there (extract_xml_answer and correctness_reward_func)
UNSLOTH = """
def extract_xml_answer(text: str) -> str:
    answer = text.split("<answer>")[-1]
    answer = answer.split("</answer>")[0]
    return answer.strip()


def correctness_reward_func(prompts, completions, answer, **kwargs) -> list[float]:
    responses = [completion[0]["content"] for completion in completions]
    extracted_responses = [extract_xml_answer(r) for r in responses]
    return [2.0 if r == a else 0.0 for r, a in zip(extracted_responses, answer)]
"""


def test_an_unsloth_reward_gets_the_datas_answer_column_and_is_probed_with_it(write_recipe, tmp_path):
    (tmp_path / "rewards.py").write_text(UNSLOTH)
    out = _ok(_plan(write_recipe, tmp_path, _answers(tmp_path), {"function": "rewards.py:correctness_reward_func"}))
    assert (
        "probed reward function rewards.py:correctness_reward_func: tells the right answer (the column 'answer') "
        "from a wrong one" in " ".join(out.split())
    )


def test_the_workers_rows_carry_every_column_through_the_smoke_sample_and_the_dataset(tmp_path):
    from launcher.data import rewards
    from launcher.data.dataset import load_data, to_dataset, write_jsonl

    data = _answers(tmp_path, id=7)
    loaded = load_data(data, columns=True)
    sample = tmp_path / "smoke.jsonl"
    write_jsonl(sample, loaded.examples[:3])  # the launcher's smoke sample, read again by the worker
    rows = rewards.prompt_rows(load_data(sample, columns=True).examples)
    dataset = to_dataset(rows)
    assert dataset[0]["answer"] == "5" and dataset[0]["id"] == 7 and dataset[0]["reference"] is None
    assert set(dataset.column_names) == {"prompt", "reference", "answer", "id"}
    # an objective that does not sample refuses the other columns (a key that is not honoured is never dropped in
    # silence) and trains on its form's keys alone where ignore: leaves them out
    with pytest.raises(DataError, match="'answer', 'id' at the top of the record"):
        load_data(data)
    assert set(load_data({"path": str(data), "ignore": ["answer", "id"]}).examples[0]) == {"prompt"}


def test_chat_data_keeps_its_other_columns_for_the_rewards_and_splits_as_before(tmp_path):
    from launcher.data import rewards
    from launcher.data.dataset import load_data
    from launcher.data.split import for_recipe

    chats = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}], "answer": a, "n": k}
        for k, (q, a) in enumerate(QUESTIONS)
    ]
    data = _data(tmp_path, chats)
    row = rewards.prompt_rows(load_data(data, columns=True).examples)[0]
    assert row["reference"] == "5" and row["answer"] == "5" and row["n"] == 0
    recipe = SimpleNamespace(eval=SimpleNamespace(fraction=0.2), seed=42)
    # the copies of a question are held out together whatever their other columns say (n differs)
    plain = load_data({"path": str(data), "ignore": ["answer", "n"]}).examples  # as an objective that does not sample
    assert for_recipe(load_data(data, columns=True).examples, recipe) == for_recipe(plain, recipe)


def test_a_column_the_data_lacks_is_named_with_the_columns_it_has_and_the_fix_works(write_recipe, tmp_path):
    (tmp_path / "rewards.py").write_text(UNSLOTH)
    data = _data(tmp_path, [{"prompt": [{"role": "user", "content": q}], "solution": a} for q, a in QUESTIONS])
    said = _refused(_plan(write_recipe, tmp_path, data, {"function": "rewards.py:correctness_reward_func"}))
    assert "takes 'answer', which the data has no column of" in said
    assert "this data's are reference, solution" in said
    assert 'add a "answer" to each record of the data beside its prompt' in said
    # the fix as said: each record gets an "answer"
    _ok(_plan(write_recipe, tmp_path, _answers(tmp_path), {"function": "rewards.py:correctness_reward_func"}))


def test_trls_form_reward_is_refused_alone_and_plans_as_a_form_reward_beside_an_answer_reward(write_recipe, tmp_path):
    """The no-signal rule: trl.rewards:think_format_reward scores a right answer and a wrong one of the same form alike
    (1.0 after a <think> block, 0.0 otherwise): refused with the probe's scores and the recipe key that says it scores
    the form; said so beside a reward that checks the answer, it plans. Every reward a form reward is refused."""
    data = _data(tmp_path, [{"prompt": [{"role": "user", "content": q}], "reference": a} for q, a in QUESTIONS])
    said = _refusal(write_recipe, data, {"function": "trl.rewards:think_format_reward"})
    assert "think_format_reward scores the right answer (the reference) like a wrong one of the same form" in said
    assert "(line 1: '5' 0.2 and '6' 0.2; line 2: '8' 0.2 and '9' 0.2; line 3: '12' 0.2 and '23' 0.2;" in said
    assert "it has no signal" in said and "say so: scores: form under reward" in said
    # the fix as said, beside a reward that checks the answer
    form = {"function": "trl.rewards:think_format_reward", "scores": "form"}
    out = _probed(write_recipe, data, [{"metric": "exact"}, form])
    assert "reward[1] function trl.rewards:think_format_reward: it scores the answers' form (scores: form)" in out
    assert "reward[0] (the task metric exact): tells the right answer (the reference) from a wrong one" in out
    said = _refusal(write_recipe, data, [form])
    assert "every reward of the recipe says scores: form (reward): nothing rewards a right answer" in said


def test_a_reward_that_reads_only_the_answers_form_is_refused_unless_it_says_so(write_recipe, tmp_path):
    """A length reward varies, so the rule of 'it varies at all' let it pass as a check of the answer: the right sum
    and a wrong one of its length score alike."""
    (tmp_path / "rewards.py").write_text(
        "def brevity(prompts, completions, **kw):\n    return [-len(c[0]['content']) / 100 for c in completions]\n"
    )
    data = _data(tmp_path, [{"prompt": [{"role": "user", "content": q}], "reference": a} for q, a in QUESTIONS])
    said = _refusal(write_recipe, data, {"function": "rewards.py:brevity"})
    assert "rewards.py:brevity scores the right answer (the reference) like a wrong one of the same form" in said
    assert "(line 1: '5' -0.294 and '6' -0.294;" in said
    out = _probed(write_recipe, data, [{"metric": "exact"}, {"function": "rewards.py:brevity", "scores": "form"}])
    assert "rewards.py:brevity: it scores the answers' form (scores: form)" in out


def test_a_file_inside_an_installed_package_is_imported_as_its_module(write_recipe, tmp_path):
    """TRL's accuracy_rewards.py imports relatively (from ..import_utils): as a file it cannot be loaded; as its
    module it is, and it takes `solution`, which a data column of that name fills."""
    from launcher.data.tokenizer import _installed

    data = _data(tmp_path, [{"prompt": [{"role": "user", "content": q}], "solution": a} for q, a in QUESTIONS])
    reward = {"function": "trl/rewards/accuracy_rewards.py:accuracy_reward"}
    if _installed("math_verify"):
        assert "accuracy_reward: tells the right answer (the column 'solution')" in _probed(write_recipe, data, reward)
    else:  # TRL's own ImportError, and the install that fixes it
        said = _refusal(write_recipe, data, reward)
        assert "relative import" not in said and "math_verify" in said
        assert "pip install math-verify" in said


def test_a_reward_factory_is_told_to_be_called_and_the_fix_it_gives_works(write_recipe, tmp_path):
    said = _refusal(write_recipe, _answers(tmp_path), {"function": "trl.rewards:get_repetition_penalty_reward"})
    assert "makes a reward function rather than being one" in said
    assert "from trl.rewards import get_repetition_penalty_reward" in said
    # the fix as given: a file of the user's names the function the factory makes
    (tmp_path / "my_rewards.py").write_text(
        "from trl.rewards import get_repetition_penalty_reward\npenalty = get_repetition_penalty_reward()\n"
    )
    assert "my_rewards.py:penalty: " in _probed(write_recipe, _answers(tmp_path), {"function": "my_rewards.py:penalty"})


@pytest.mark.parametrize(
    "body, said",
    [
        # an empty answer: log(0) is -inf in numpy, which makes TRL's group advantages NaN
        (
            "import numpy as np\n"
            "def score(prompts, completions, **kw):\n"
            "    return [float(np.log(len(c[0]['content']))) for c in completions]\n",
            "returned -inf for the empty answer '' to the prompt of math.jsonl line 1",
        ),
        ("def score(prompts, completions, **kw):\n    return [float('nan')] * len(completions)\n", "returned nan"),
        (
            "def score(prompts, completions, answer, **kw):\n    return [0.0 for _ in completions]\n",
            "returned 0.0 for every answer on 4 prompts of the data",
        ),
        (
            "def score(prompts, completions, **kw):\n    return [None for _ in completions]\n",
            "returned None (TRL leaves the answer out) for every answer",
        ),
        (
            "import math\ndef score(prompts, completions, **kw):\n"
            "    return [math.log(len(c[0]['content'])) for c in completions]\n",
            "raised ValueError: math domain error for the empty answer ''",
        ),
    ],
)
def test_a_reward_that_trl_would_train_on_to_no_effect_is_refused_at_plan_time(write_recipe, tmp_path, body, said):
    (tmp_path / "rewards.py").write_text(body)
    got = _refusal(write_recipe, _answers(tmp_path), {"function": "rewards.py:score"})
    assert said in got and "rewards.py:score" in got, got


def test_a_numpy_array_of_floats_is_taken_as_trl_takes_it(write_recipe, tmp_path):
    (tmp_path / "rewards.py").write_text(
        "import numpy as np\n"
        "def score(prompts, completions, answer, **kw):\n"
        "    return np.array([float(c[0]['content'].strip() == a) for c, a in zip(completions, answer)])\n"
    )
    out = _probed(write_recipe, _answers(tmp_path), {"function": "rewards.py:score"})
    assert "score: tells the right answer (the column 'answer') from a wrong one" in out


def test_a_metric_that_cannot_tell_a_right_answer_from_a_wrong_one_is_refused(write_recipe, tmp_path):
    data = _data(tmp_path, [{"prompt": [{"role": "user", "content": q}], "reference": a} for q, a in QUESTIONS])
    said = _refused(_plan(write_recipe, tmp_path, data, {"metric": "json"}))
    assert "reward (the task metric json) returned 0.0 for every answer on 4 prompts of the data" in said
    assert "(line 1: '5' 0 and '6' 0; line 2: '8' 0 and '9' 0;" in said
    assert "gives GRPO nothing to learn from" in said
    out = _ok(_plan(write_recipe, tmp_path, data, {"metric": "exact"}))
    assert "probed reward (the task metric exact): tells the right answer (the reference) from a wrong one" in out


def test_without_a_right_answer_the_plan_says_what_was_not_probed(write_recipe, tmp_path):
    (tmp_path / "rewards.py").write_text(
        "def brevity(prompts, completions, **kw):\n    return [-len(c[0]['content']) / 100 for c in completions]\n"
    )
    data = _data(tmp_path, [{"prompt": [{"role": "user", "content": q}]} for q, _ in QUESTIONS])
    out = _probed(write_recipe, data, {"function": "rewards.py:brevity"})
    assert "brevity: runs and returns finite numbers that vary on 4 prompts of the data" in out
    assert "whether it tells a right answer from a wrong one was not probed: the data has no reference" in out


def test_a_data_column_named_like_an_argument_trl_passes_is_refused(write_recipe, tmp_path):
    data = _answers(tmp_path, trainer_state="x")
    said = _refusal(write_recipe, data, {"function": "trl.rewards:think_format_reward"})
    assert "the data has a column 'trainer_state'" in said and "rename the column" in said


@pytest.mark.slow
def test_a_newcomers_arithmetic_task_trains_with_its_own_and_trls_rewards(write_recipe, tmp_path):
    """The issue's newcomer: prompts with an `answer` and a `solution` column, an Unsloth-notebook reward and TRL's
    own accuracy_reward (where math_verify is installed, as TRL's extra installs it), trained on the tiny model; the
    worker's rewards get the columns (the Unsloth one writes what it was given)."""
    from launcher.data.tokenizer import _installed

    seen = tmp_path / "seen.txt"
    (tmp_path / "rewards.py").write_text(
        UNSLOTH
        + "\n\ndef logged_correctness(prompts, completions, answer, **kwargs):\n"
        + f"    with open({str(seen)!r}, 'a') as fh:\n"
        + "        fh.write(' '.join(answer) + '\\n')\n"
        + "    return correctness_reward_func(prompts, completions, answer, **kwargs)\n"
        # a shaping reward: the random tiny model's answers are never right, and groups that all score the same
        # train nothing (every lora_B stays zero)
        + "\n\ndef brevity(completions, **kwargs):\n"
        + "    return [-len(c[0]['content']) / 10 for c in completions]\n"
    )
    data = _data(
        tmp_path, [{"prompt": [{"role": "user", "content": q}], "answer": a, "solution": a} for q, a in QUESTIONS * 2]
    )
    rewards = [
        {"function": "rewards.py:logged_correctness"},
        {"function": "rewards.py:brevity", "weight": 0.1, "scores": "form"},
    ]
    names = ["logged_correctness", "brevity"]
    if _installed("math_verify"):
        rewards.append({"function": "trl.rewards:accuracy_reward", "weight": 0.5})
        names.append("accuracy_reward")
    else:  # what the newcomer sees without it: the plan names the package and the install line
        plan = ftrun(
            "plan",
            write_recipe(
                name="acc.yaml", objective="grpo", data=str(data), reward={"function": "trl.rewards:accuracy_reward"}
            ),
            cwd=tmp_path,
        )
        said = " ".join(plan.stderr.split())
        assert plan.returncode == 2 and "Traceback" not in plan.stderr, plan.stdout + plan.stderr
        assert "math_verify" in said and "pip install math-verify" in said, said
    recipe = write_recipe(
        objective="grpo",
        data=str(data),
        reward=rewards,
        grpo={"num_generations": 4, "max_completion_length": 8},
        micro_batch_size=8,
        max_steps=2,
    )
    res = ftrun(recipe, "--foreground", "smoke.enabled=false", cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = seen.read_text().split()
    assert got and set(got) <= {a for _, a in QUESTIONS}, got  # the data's answers, as TRL passed them
    # each reward shown apart: metrics.jsonl, train.log's step lines and `ftrun status`
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    steps = [line for line in (run / "train.log").read_text().splitlines() if "] step " in line and " reward " in line]
    status = ftrun("status", run, cwd=tmp_path).stdout
    for name in names:
        assert all(f"rewards/{name}/mean" in r for r in rows), (name, rows)
        assert steps and all(f"{name} " in line for line in steps), (name, steps)
        assert f"            {name} " in status, (name, status)
