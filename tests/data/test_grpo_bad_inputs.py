"""GRPO's bad inputs, as a user makes them (issue 58's kind): each through `ftrun plan` in this process (the CLI's
main, no training), refused before any GPU time with exit 2, no Python frames, and the culprit named (the field or
line, the value, the fix); the inputs TRL takes (a numpy array of rewards, a form reward beside an answer reward)
plan. docs/bad_input.md lists the classes; tests/data/test_reward_functions.py has the probe's wording in detail."""

from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from launcher.cli import main

# An arithmetic task as a newcomer writes it: conversational prompts, the sum as `answer` (Unsloth's notebook maps
# GSM8K so) and as `reference` (what a metric scores against)
SUMS = [(a, b) for a in range(2, 8) for b in range(1, 5)]


def _rows(reference: bool = True, answer: bool = True) -> list[dict]:
    rows = []
    for a, b in SUMS:
        row: dict = {"prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}]}
        if reference:
            row["reference"] = str(a + b)
        if answer:
            row["answer"] = str(a + b)
        rows.append(row)
    return rows


# Reward files, each as a user writes it (rewards.py beside the recipe)
UNSLOTH = """
def extract_xml_answer(text):
    return text.split("<answer>")[-1].split("</answer>")[0].strip()


def correctness_reward_func(prompts, completions, answer, **kwargs):
    responses = [completion[0]["content"] for completion in completions]
    return [2.0 if extract_xml_answer(r) == a else 0.0 for r, a in zip(responses, answer)]
"""
FILES = {
    "name_error": "def score(prompts, completions, **kw):\n    return [undefined_helper(c) for c in completions]\n",
    "one_float": "def score(prompts, completions, **kw):\n    return 1.0\n",
    "neg_inf": "import numpy as np\n\ndef score(prompts, completions, **kw):\n"
    "    return [float(np.log(len(c[0]['content']))) for c in completions]\n",
    "numpy": "import numpy as np\n\ndef score(prompts, completions, answer, **kw):\n"
    "    return np.array([float(c[0]['content'].strip() == a) for c, a in zip(completions, answer)])\n",
    "zero": "def score(prompts, completions, **kw):\n    return [0.0] * len(completions)\n",
    # varies with the answer's length and nothing else: the right sum and a wrong one of its length score alike
    "length": "def score(prompts, completions, **kw):\n    return [-len(c[0]['content']) / 100 for c in completions]\n",
    # a distance to the answer, not turned into a reward: the right answer scores lowest
    "backward": "def score(prompts, completions, answer, **kw):\n"
    "    return [float(c[0]['content'].strip() != a) for c, a in zip(completions, answer)]\n",
    "no_kwargs": "def score(prompts, completions):\n    return [0.0] * len(completions)\n",
    "unsloth": UNSLOTH,
    "factory": "def make_reward(scale=1.0):\n"
    "    def reward(completions, **kw):\n        return [scale] * len(completions)\n    return reward\n",
}

# (id, the recipe's change, the reward file's key or None, the data's rows, the exit code, what the message names)
CASES = [
    ("NameError in a reward", {"reward": {"function": "rewards.py:score"}}, "name_error", None, 2,
     ["rewards.py:score raised NameError", "undefined_helper", "math.jsonl line 1"]),
    ("a single float", {"reward": {"function": "rewards.py:score"}}, "one_float", None, 2,
     ["rewards.py:score returned float 1.0, not a list", "one float per completion"]),
    ("num_generations does not divide", {"grpo": {"num_generations": 3, "max_completion_length": 16}}, None, None, 2,
     ["grpo.num_generations 3 does not divide", "micro_batch_size 8",
      "set gradient_accumulation_steps to a multiple of 3"]),
    ("references missing", {"reward": {"metric": "exact"}}, None, _rows(reference=False), 2,
     ["reward is the task metric exact", "math.jsonl line 1 has none", "give those rows a reference"]),
    ("misspelled grpo key", {"grpo": {"num_generation": 4}}, None, None, 2,
     ["num_generation", "num_generations"]),
    ("misspelled reward key", {"reward": {"metrc": "exact"}}, None, None, 2, ["metrc"]),
    ("num_generations under trainer", {"trainer": {"num_generations": 8}}, None, None, 2,
     ["trainer.num_generations -> grpo.num_generations"]),
    ("max_completion_length under trainer", {"trainer": {"max_completion_length": 64}}, None, None, 2,
     ["trainer.max_completion_length -> grpo.max_completion_length"]),
    ("temperature under trainer", {"trainer": {"temperature": 0.5}}, None, None, 2,
     ["trainer.temperature -> grpo.temperature"]),
    ("beta under trainer", {"trainer": {"beta": 0.04}}, None, None, 2, ["trainer.beta -> grpo.beta"]),
    ("use_vllm under trainer", {"trainer": {"use_vllm": True}}, None, None, 2,
     ["trainer.use_vllm -> grpo.generation"]),
    ("reward_weights of the wrong length", {"trainer": {"reward_weights": [1.0, 0.5]}}, None, None, 2,
     ["trainer.reward_weights -> reward:", "weight"]),
    ("alias of an owned key", {"trainer": {"activation_checkpointing": False}}, None, None, 2,
     ["trainer.activation_checkpointing -> gradient_checkpointing"]),
    ("-inf for an empty answer", {"reward": {"function": "rewards.py:score"}}, "neg_inf", None, 2,
     ["rewards.py:score returned -inf for the empty answer", "advantage of its group NaN", "finite"]),
    ("json metric on numbers", {"reward": {"metric": "json"}}, None, None, 2,
     ["reward (the task metric json) returned 0.0 for every answer", "line 1: '3' 0 and '4' 0",
      "choose a metric that fits the references"]),
    ("max_completion_length over max_length", {"grpo": {"max_completion_length": 512}, "max_length": 256}, None,
     None, 2, ["grpo.max_completion_length 512 is not below max_length 256"]),
    ("a factory", {"reward": {"function": "rewards.py:make_reward"}}, "factory", None, 2,
     ["makes a reward function rather than being one", "make_reward(scale=1.0)", "penalty = make_reward()"]),
    ("a factory of TRL's", {"reward": {"function": "trl.rewards:get_repetition_penalty_reward"}}, None, None, 2,
     ["makes a reward function rather than being one", "from trl.rewards import get_repetition_penalty_reward"]),
    ("a relative import in a module file", {"reward": {"function": "mypkg/scoring.py:score"}}, None, None, 2,
     ["mypkg/scoring.py:score", "relative import", "import from the package by name instead"]),
    ("a module that is not installed", {"reward": {"function": "trl.reward:think_format_reward"}}, None, None, 2,
     ["no module 'trl.reward' is installed"]),
    ("a module's misspelled function", {"reward": {"function": "trl.rewards:think_format"}}, None, None, 2,
     ["module trl.rewards has no function 'think_format'", "did you mean 'think_format_reward'"]),
    ("a reward that always returns 0", {"reward": {"function": "rewards.py:score"}}, "zero", None, 2,
     ["rewards.py:score returned 0.0 for every answer", "advantages are all 0"]),
    ("a reward with no signal", {"reward": {"function": "rewards.py:score"}}, "length", None, 2,
     ["rewards.py:score scores the right answer (the reference) like a wrong one of the same form",
      "line 1: '3' -0.", "scores: form under reward"]),
    ("a reward with its sign turned round", {"reward": {"function": "rewards.py:score"}}, "backward", None, 2,
     ["rewards.py:score scores the wrong answers above the right ones (the column 'answer')", "negate"]),
    ("TRL's form reward alone", {"reward": {"function": "trl.rewards:think_format_reward"}}, None, None, 2,
     ["think_format_reward scores the right answer (the reference) like a wrong one", "scores: form under reward"]),
    ("every reward a form reward",
     {"reward": [{"function": "trl.rewards:think_format_reward", "scores": "form"}]}, None, None, 2,
     ["every reward of the recipe says scores: form", "add a reward that checks the answer"]),
    ("scores: form on a metric", {"reward": {"metric": "exact", "scores": "form"}}, None, None, 2,
     ["metric: exact scores each answer against its reference", "remove scores: form"]),
    ("a misspelled scores value", {"reward": {"function": "rewards.py:score", "scores": "format"}}, "length", None,
     2, ["scores", "'answer' or 'form'"]),
    ("a column the data lacks", {"reward": {"function": "rewards.py:correctness_reward_func"}}, "unsloth",
     _rows(answer=False), 2,
     ["takes 'answer', which the data has no column of", "this data's are reference", 'add a "answer"']),
    ("no **kwargs", {"reward": {"function": "rewards.py:score"}}, "no_kwargs", None, 2,
     ["rewards.py:score takes no completion_ids", "add **kwargs"]),
    # what TRL takes is taken
    ("numpy array (accepted)", {"reward": {"function": "rewards.py:score"}}, "numpy", None, 0,
     ["probed reward function rewards.py:score: tells the right answer (the column 'answer') from a wrong one"]),
    ("a form reward beside an answer reward (accepted)",
     {"reward": [{"function": "rewards.py:correctness_reward_func"},
                 {"function": "trl.rewards:think_format_reward", "scores": "form", "weight": 0.5}]}, "unsloth", None,
     0, ["think_format_reward: it scores the answers' form (scores: form): a right answer (the reference) and a "
         "wrong one of the same form score alike",
         "correctness_reward_func: tells the right answer (the column 'answer')"]),
    ("a metric that is 0 on the base model's answers (accepted)", {"reward": {"metric": "exact"}}, None, None, 0,
     ["probed reward (the task metric exact): tells the right answer (the reference) from a wrong one"]),
]  # fmt: skip

if importlib.util.find_spec("vllm") is None:
    CASES.append(
        ("vllm without vLLM", {"grpo": {"generation": "vllm", "max_completion_length": 16}}, None, None, 2,
         ["grpo.generation: vllm needs the vllm package", "pip install vllm", "grpo.generation: generate"])
    )  # fmt: skip
if importlib.util.find_spec("math_verify") is None:
    CASES.append(
        ("accuracy_reward without math_verify", {"reward": {"function": "trl.rewards:accuracy_reward"}}, None,
         [{**r, "solution": r["answer"]} for r in _rows()], 2,
         ["accuracy_reward raised ImportError", "math_verify", "pip install math-verify"])
    )  # fmt: skip


@pytest.mark.parametrize("change, reward_file, rows, code, said", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_grpo_input_is_refused_at_plan_time_naming_the_culprit_or_planned(
    tmp_path, tiny_model, capsys, change, reward_file, rows, code, said
):
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (rows or _rows())))
    if reward_file:
        (tmp_path / "rewards.py").write_text(FILES[reward_file])
    package = tmp_path / "mypkg"  # a folder of the user's with a relative import, named as a file
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text("def parse(text):\n    return text.strip()\n")
    (package / "scoring.py").write_text(
        "from .helpers import parse\n\ndef score(prompts, completions, **kw):\n"
        "    return [float(parse(c[0]['content']) == '5') for c in completions]\n"
    )
    recipe = {
        "model": str(tiny_model),
        "method": "lora",
        "objective": "grpo",
        "data": str(data),
        "max_length": 256,
        "micro_batch_size": 8,
        "max_steps": 2,
        "output_dir": str(tmp_path / "run"),
        "grpo": {"num_generations": 4, "max_completion_length": 16},
        "eval": {"samples": 0, "task": {"examples": 0}},
        "export": [],
        **change,
    }
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    got = main(["plan", str(path)])
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())
    assert got == code, text
    assert "Traceback" not in text and 'File "' not in text, text
    for part in said:
        assert part in text, (part, text)
    if code:  # one paragraph: the message and its fix, no stack of lines
        assert out.err.strip().count("\n\n") == 0, out.err
