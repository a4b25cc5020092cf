"""What a user types is honoured or refused by name, before anything runs (issue 33): a word on the command line
that is neither an option nor key=value, multi-node flags that contradict each other, a GGUF file as `model`; and
a command line's output_dir= resolved where the user stands."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from helpers import ftrun
from launcher import cli
from launcher.errors import UsageError
from launcher.recipe_loading import load_recipe, parse_overrides


def _recipe(folder: Path, **fields) -> Path:
    """A recipe that loads without a model or data on this machine (a Hub id, a data file that is not there)."""
    folder.mkdir(parents=True, exist_ok=True)
    base = {"model": "Qwen/Qwen3-8B", "method": "qlora", "data": "absent.jsonl", "output_dir": "run"}
    base.update(fields)
    path = folder / "r.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


def _refused(capsys, argv: list[str], code: int = 2) -> str:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc == code, text
    assert "Traceback" not in text and "internal error" not in text, text
    return text


# --- words that are neither options nor key=value ----------------------------------------------------------------


@pytest.mark.parametrize(
    "words, culprit, works",
    [
        (["learning_rate:1e-4"], "'learning_rate:1e-4'", "learning_rate=1e-4"),
        (["max_steps", "20"], "'max_steps 20'", "max_steps=20"),
        (["epochs", "=", "1"], "'epochs = 1'", "epochs=1"),
        (["epochs", "=1"], "'epochs =1'", "epochs=1"),
        (["epochs=", "1"], "'epochs= 1'", "epochs=1"),
        (["lora.r", "8", "max_steps=3"], "'lora.r 8'", "lora.r=8"),
        (["max_steps"], "'max_steps'", "max_steps=VALUE"),
        (["=3"], "'=3'", "no key before '='"),
        (["lora.=3"], "'lora.=3'", "'lora.' is not a key"),
        (["other.yaml"], "'other.yaml'", "one recipe per command"),
    ],
)
@pytest.mark.parametrize("command", ["plan", "data", "run"])
def test_a_stray_word_is_refused_by_name_with_the_form_that_works(tmp_path, capsys, command, words, culprit, works):
    recipe = _recipe(tmp_path)
    text = _refused(capsys, [command, str(recipe), *words])
    assert "usage error" in text and culprit in text and works in text, text
    assert not (tmp_path / "run").exists()  # nothing ran, nothing was written


def test_every_stray_word_is_named_at_once_wherever_it_stands(tmp_path, capsys):
    recipe = _recipe(tmp_path)
    text = _refused(
        capsys,
        [
            "plan",
            "--json",
            "max_steps",
            "20",
            str(recipe),
            "lora.r=8",
            "--gpus",
            "1xH100-80GB",
            "learning_rate:1e-4",
            "seed",
            "3",
        ],
    )
    # --json: the refusal is the plan's JSON error on stdout, each culprit named in it
    for named in ("max_steps=20", "learning_rate=1e-4", "seed=3", "3 parts of the command line"):
        assert named in text, text
    text = _refused(capsys, [str(recipe), "--foreground", "max_steps", "20"])  # `ftrun RECIPE`, words after an option
    assert "'max_steps 20'" in text and "write max_steps=20" in text


def test_overrides_keep_working_around_options(tmp_path, capsys):
    recipe = _recipe(tmp_path)
    assert cli.main(["plan", "--gpus", "1xH100-80GB", str(recipe), "max_steps=20", "lora.r=8", "--tokens", "1M"]) == 0
    out = capsys.readouterr().out
    assert "Plan: qlora of Qwen/Qwen3-8B on 1 x H100-80GB" in out
    assert parse_overrides(["max_steps=20", "lora.r=8", "seed="]) == {"max_steps": 20, "lora": {"r": 8}, "seed": None}


def test_a_stray_word_through_the_real_command_has_no_traceback(tmp_path):
    recipe = _recipe(tmp_path)
    res = ftrun("plan", recipe, "epochs", "=", "1", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stdout + res.stderr
    assert "'epochs = 1'" in res.stderr and "write epochs=1" in res.stderr


def test_parse_overrides_refuses_what_the_api_is_given_too():
    with pytest.raises(UsageError, match=r"'max_steps 20'.*write max_steps=20"):
        parse_overrides(["max_steps", "20"])


# --- multi-node flags --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, named, leave_out",
    [
        (
            ["--node-rank", "1", "--master-addr", "10.0.0.1"],
            "--node-rank 1 --master-addr 10.0.0.1",
            "--node-rank and --master-addr",
        ),
        (["--master-addr", "node0.example"], "--master-addr node0.example", "--master-addr"),
        (["--node-rank", "2"], "--node-rank 2", "--node-rank"),
        (["--master-port", "29600"], "--master-port 29600", "--master-port"),
        (["--nnodes", "1", "--node-rank", "1"], "--node-rank 1", "--node-rank"),
    ],
)
def test_multi_node_flags_without_a_node_count_are_refused(tmp_path, capsys, flags, named, leave_out):
    recipe = _recipe(tmp_path)
    text = _refused(capsys, [str(recipe), *flags])
    assert named in text and "--nnodes" in text and "would train alone" in text, text
    assert f"leave out {leave_out}" in text
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h"], "--nnodes 2 --node-rank 2"),
        (["--nnodes", "2", "--node-rank", "-1", "--master-addr", "h"], "--nnodes 2 --node-rank -1"),
        (["--nnodes", "2"], "--nnodes 2 needs --master-addr"),
        (["--nnodes", "2", "--master-addr", "h", "--master-port", "70000"], "--master-port 70000 is not a TCP port"),
    ],
)
def test_multi_node_flags_that_contradict_each_other_are_refused(tmp_path, capsys, flags, named):
    text = _refused(capsys, [str(_recipe(tmp_path)), *flags])
    assert named in text, text
    assert not (tmp_path / "run").exists()


def test_contradicting_node_flags_through_the_real_command(tmp_path):
    res = ftrun(_recipe(tmp_path), "--node-rank", "1", "--master-addr", "HOST", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stdout + res.stderr
    assert "--node-rank 1 --master-addr HOST" in res.stderr and "--nnodes" in res.stderr
    assert not (tmp_path / "run").exists()


# --- a GGUF file (or any file) as the model ----------------------------------------------------------------------


@pytest.mark.parametrize("name, exists", [("model-Q4_K_M.gguf", True), ("model.GGUF", True), ("gone.gguf", False)])
def test_a_gguf_as_model_says_what_ftrun_needs_and_why(tmp_path, capsys, name, exists):
    if exists:
        (tmp_path / name).write_bytes(b"GGUF\x03\x00\x00\x00")
    recipe = _recipe(tmp_path, model=name)
    for argv in (["plan", str(recipe)], [str(recipe)], ["plan", str(_recipe(tmp_path / "other")), f"model={name}"]):
        text = _refused(capsys, argv)
        assert "'model'" in text and name in text and "a GGUF file" in text, text
        assert "does not exist" not in text
        assert "Hugging Face model" in text and "Hub id" in text and "quantized" in text  # what it needs, and why
        assert "export: [gguf]" in text and "--gguf" in text  # train the original, then make the GGUF
    assert not (tmp_path / "run").exists()


def test_a_file_as_model_points_at_its_folder(tmp_path, capsys):
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    text = _refused(capsys, ["plan", str(_recipe(tmp_path, model="my-model/model.safetensors"))])
    assert "model.safetensors" in text and "is a file" not in text.split("'model'")[0]
    assert f"set model: to the folder that holds it, {model}" in text


def test_the_plan_names_a_gguf_too():
    from launcher.errors import ModelError
    from launcher.plan.models import load_architecture

    with pytest.raises(ModelError) as err:
        load_architecture("/nowhere/llama-3-8b.Q4_K_M.gguf", allow_network=False)
    assert "is a GGUF file" in err.value.message and "does not exist" not in err.value.message


def test_a_gguf_through_the_real_command(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    res = ftrun("plan", _recipe(tmp_path, model="m.gguf"), cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stdout + res.stderr
    assert "m.gguf" in res.stderr and "a GGUF file" in res.stderr


# --- output_dir= on the command line -----------------------------------------------------------------------------


def test_a_command_line_output_dir_resolves_where_the_user_stands(tmp_path, monkeypatch):
    recipe = _recipe(tmp_path / "recipes")
    here = tmp_path / "work"
    here.mkdir()
    monkeypatch.chdir(here)
    assert load_recipe(recipe).output_dir == str(tmp_path / "recipes" / "run")  # the recipe's own: its folder
    assert load_recipe(recipe, ["output_dir=out"]).output_dir == str(here / "out")
    assert load_recipe(recipe, ["output_dir=../elsewhere/x"]).output_dir == str(tmp_path / "elsewhere" / "x")
    assert load_recipe(recipe, [f"output_dir={tmp_path / 'abs'}"]).output_dir == str(tmp_path / "abs")
    assert load_recipe(recipe, ["output_dir="]).output_dir == str(here / "runs" / "r")  # null: the default
    # the other paths of the command line alike
    assert load_recipe(recipe, ["data=train.jsonl"]).data == str(here / "train.jsonl")
    assert load_recipe(recipe, ["model=./my-model"]).model == str(here / "my-model")
    assert load_recipe(recipe, ["model=Qwen/Qwen3-8B"]).model == "Qwen/Qwen3-8B"  # a Hub id stays one


def test_a_command_line_output_dir_through_the_real_command(tmp_path):
    recipe = _recipe(tmp_path / "recipes", model="m.gguf")  # refused at once: only where it would have gone matters
    here = tmp_path / "work"
    here.mkdir()
    res = ftrun("plan", recipe, "output_dir=out", "max_steps", "2", cwd=here)
    assert res.returncode == 2 and "Traceback" not in res.stderr and "'max_steps 2'" in res.stderr
    assert not (tmp_path / "recipes" / "out").exists() and not (here / "out").exists()
    assert os.listdir(here) == []
