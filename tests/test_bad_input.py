"""Every key, value and word a user gives is honoured or refused before anything runs (issue 33): a corpus of
realistic mistakes, each through `ftrun plan` and the launch (`ftrun RECIPE`). For every case: a non-zero exit, no
Python frames, the culprit named, and the run folder the user had left as it was. docs/data.md and docs/recipes.md
list the classes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from launcher.cli import main

CHAT = {"messages": [{"role": "user", "content": "The capital of France?"}, {"role": "assistant", "content": "Paris."}]}


def _data(folder: Path, turn: dict | None = None) -> Path:
    rows = [CHAT] * 40 + ([{"messages": [CHAT["messages"][0], turn]}] if turn else [])
    path = folder / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# (id, what the recipe changes, what the error must name): each a mistake a user makes
CASES = [
    (
        "scheduler name",
        {"trainer": {"lr_scheduler_type": "cosine_warmup"}},
        ["trainer.lr_scheduler_type", "cosine_warmup"],
    ),
    ("optimizer name", {"trainer": {"optim": "adam_w"}}, ["trainer.optim", "adam_w", "adamw_torch"]),
    (
        "scheduler typo",
        {"trainer": {"lr_scheduler_type": "cosin"}},
        ["trainer.lr_scheduler_type", "did you mean 'cosine'"],
    ),
    ("bool as a word", {"trainer": {"torch_compile": "yes"}}, ["trainer.torch_compile", "'yes' is not true or false"]),
    ("number as a word", {"trainer": {"neftune_noise_alpha": "high"}}, ["trainer.neftune_noise_alpha", "'high'"]),
    # TRL fields ftrun sets itself (issue 58): one table, the recipe key named
    (
        "trl field ftrun sets",
        {"objective": "grpo", "reward": {"metric": "text"}, "trainer": {"num_generations": 8}},
        ["trainer.num_generations -> grpo.num_generations"],
    ),
    (
        "alias of an owned field",
        {"trainer": {"activation_checkpointing": False}},
        ["trainer.activation_checkpointing -> gradient_checkpointing"],
    ),
    ("sync scheme", {"sync": {"to": "s4://bucket/runs"}}, ["sync.to", "'s4://' is not a destination"]),
    ("sync without bucket", {"sync": {"to": "s3:///runs"}}, ["sync.to", "names no bucket"]),
    ("sync read-only", {"sync": {"to": "https://example.com/runs"}}, ["sync.to", "'https://'"]),
    ("sync no repo", {"sync": {"to": "hf://me"}}, ["sync.to", "names no repo"]),
    ("empty target_modules", {"lora": {"target_modules": []}}, ["lora.target_modules", "adapts nothing"]),
    ("split on a local file", {"data": "DATA_ENTRY"}, ["split: validation", "applies to Hub datasets"]),
    ("per-turn weight 0", {"data": "WEIGHTED"}, ["line 41", "weight is 0", "cannot honour"]),
    ("unknown message key", {"data": "EXTRA_KEY"}, ["line 41", "'loss_mask'", "does not read"]),
    ("cut share", {"max_length_may_cut": 2}, ["max_length_may_cut"]),
    # issue 59: a KTO label under SFT, trained on as a target before; a max_length past the model's positions
    ("label on a chat record", {"data": "LABELLED"}, ["line 41", "'label' (False)", "set objective: kto"]),
    ("max_length past the positions", {"max_length": 6500}, ["max_length 6,500", "max_position_embeddings 4,096"]),
    # task settings the data cannot honour (issue 46): the key, the value, the largest that fits
    (
        "task metric json on labels",
        {"data": "DISTINCT", "eval": {"fraction": 0.3, "samples": 0, "task": {"metric": "json", "examples": 10}}},
        ["eval.task.metric json", "none of the 10 held-out references parses", "set eval.task.metric: text"],
    ),
    (
        "task examples, none held out",
        {"eval": {"samples": 0, "task": {"examples": 10}}},
        ["eval.task.examples 10", "holds no examples out", "eval.fraction"],
    ),
    (
        "task examples over the held out",
        {"data": "DISTINCT", "eval": {"fraction": 0.3, "samples": 0, "task": {"examples": 30}}},
        ["eval.task.examples 30", "the largest that fits is 12"],
    ),
    (
        "task shots over the training",
        {"data": "DISTINCT", "eval": {"fraction": 0.3, "samples": 0, "task": {"shots": 100}}},
        ["eval.task.shots 100", "hold 28 with an answer", "the largest that fits is 5 (more run the longest task"],
    ),
    (
        "task shots over max_length",
        {"data": "DISTINCT", "eval": {"fraction": 0.3, "samples": 0, "task": {"shots": 20}}},
        ["eval.task.shots 20", "over max_length 128", "the largest that fits is 5 "],
    ),
]


@pytest.fixture
def case_recipe(tmp_path, tiny_model):
    def write(change: dict) -> tuple[Path, Path]:
        data = _data(tmp_path)
        base = {
            "model": str(tiny_model),
            "method": "lora",
            "data": str(data),
            "max_steps": 2,
            "max_length": 128,
            "output_dir": str(tmp_path / "run"),
            "eval": {"samples": 0, "task": {"examples": 0}},
        }
        change = dict(change)
        if change.get("data") == "DATA_ENTRY":
            change["data"] = {"path": str(data), "split": "validation"}
        elif change.get("data") == "WEIGHTED":
            change["data"] = str(_data(tmp_path, {"role": "assistant", "content": "Paris.", "weight": 0}))
        elif change.get("data") == "DISTINCT":  # forty questions with their answers: the eval split holds some out
            rows = [
                {
                    "messages": [
                        {"role": "user", "content": f"Question {i}?"},
                        {"role": "assistant", "content": f"Answer number {i}."},
                    ]
                }
                for i in range(40)
            ]
            change["data"] = str(tmp_path / "distinct.jsonl")
            Path(change["data"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
        elif change.get("data") == "LABELLED":  # KTO's mark on a chat record
            change["data"] = str(tmp_path / "labelled.jsonl")
            Path(change["data"]).write_text(
                "".join(json.dumps(r) + "\n" for r in [CHAT] * 40 + [{**CHAT, "label": False}])
            )
        elif change.get("data") == "EXTRA_KEY":
            change["data"] = str(_data(tmp_path, {"role": "assistant", "content": "Paris.", "loss_mask": [1]}))
        path = tmp_path / "r.yaml"
        path.write_text(yaml.safe_dump({**base, **change}))
        return path, tmp_path / "run"

    return write


@pytest.mark.parametrize("change, culprits", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("command", ["plan", "launch"])
def test_a_mistake_is_refused_before_anything_runs_naming_the_culprit(case_recipe, capsys, change, culprits, command):
    recipe, run = case_recipe(change)
    if command == "plan":  # an earlier run in the folder: a plan leaves it as it was
        run.mkdir()
        (run / "notes.txt").write_text("mine")
    files = {p: p.read_bytes() for p in recipe.parent.rglob("*") if p.is_file()}
    code = main(["plan", str(recipe)] if command == "plan" else [str(recipe), "--foreground"])
    out = capsys.readouterr()
    said = out.out + out.err
    assert code != 0, said
    assert "Traceback" not in said and 'File "' not in said, said
    for culprit in culprits:
        assert culprit in said, (culprit, said)
    # every file the user had is as it was; the launch refused before it made a run folder
    assert {p: p.read_bytes() for p in files} == files
    assert (command == "plan") == run.exists() and (command == "launch" or sorted(run.iterdir()) == [run / "notes.txt"])


def test_the_largest_shots_that_fit_is_a_value_the_plan_accepts(case_recipe, capsys):
    """Issue 46: shots 999 was advised "the largest that fits is 379" (the training examples' count), and 379 was then
    refused for max_length: the advice is the largest count whose own draw fits, and the plan takes it."""
    distinct = {"data": "DISTINCT", "eval": {"fraction": 0.3, "samples": 0}}
    for shots, code in ((6, 2), (5, 0), (999, 2)):
        recipe, _ = case_recipe({**distinct, "eval": {**distinct["eval"], "task": {"shots": shots}}})
        assert main(["plan", str(recipe)]) == code, capsys.readouterr()
        said = capsys.readouterr()
        assert code == 0 or "the largest that fits is 5" in said.out + said.err


def test_a_key_written_twice_is_refused_with_both_lines(tmp_path, capsys, tiny_model):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {tiny_model}\nmethod: lora\ndata: {_data(tmp_path)}\nlearning_rate: 1e-4\n"
        "lora:\n  r: 8\nlearning_rate: 2e-4\n"
    )
    for argv in (["plan", str(recipe)], [str(recipe), "--foreground"]):
        assert main(argv) == 2
        said = capsys.readouterr().err
        assert "the key 'learning_rate' is written twice (lines 4 and 7)" in said and "Traceback" not in said
    nested = tmp_path / "n.yaml"
    nested.write_text(
        f"model: {tiny_model}\nmethod: lora\ndata: {_data(tmp_path)}\nlora:\n  r: 8\n  alpha: 16\n  r: 16\n"
    )
    assert main(["plan", str(nested)]) == 2
    assert "the key 'r' is written twice (lines 5 and 7)" in capsys.readouterr().err
    # YAML's merge keys are not duplicates
    merged = tmp_path / "m.yaml"
    merged.write_text(f"base: &b {{r: 8}}\nmodel: {tiny_model}\nmethod: lora\ndata: {_data(tmp_path)}\n")
    from launcher.recipe_loading import _RecipeLoader

    assert yaml.load("a: &x {k: 1}\nb:\n  <<: *x\n  j: 2\n", Loader=_RecipeLoader)["b"] == {"k": 1, "j": 2}
