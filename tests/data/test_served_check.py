"""Tool calling checked before GPU time (issue 59): ShareGPT function_call turns render with Qwen2.5's template, and the
served prompt is compared with the trained one at plan time (launcher/data/served_check.py) on multi-turn tool data,
with TRL's copies of the real Qwen2.5, Qwen3 and Llama 3.1 templates (tests/chat_templates.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from chat_templates import build_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lights",
            "description": "Switch the lights",
            "parameters": {"type": "object", "properties": {"room": {"type": "string"}}},
        },
    }
]


def _sharegpt(turns: int = 1) -> dict:
    """A LLaMA-Factory-style tool conversation: function_call and observation turns, the tools as JSON text."""
    conv = [{"from": "system", "value": "Be brief."}]
    for k in range(turns):
        room = ("kitchen", "hall", "garden")[k]
        conv += [
            {"from": "human", "value": f"Lights on in the {room}, please."},
            {"from": "function_call", "value": json.dumps({"name": "lights", "arguments": {"room": room}})},
            {"from": "observation", "value": "ok"},
            {"from": "gpt", "value": f"The {room} lights are on."},
        ]
    return {"conversations": conv, "tools": json.dumps(TOOLS)}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tool-templates")
    return {name: build_tokenizer(root / name, name) for name in ("qwen2_5", "qwen3", "llama3")}


def _model(tmp_path: Path, tiny_model: Path, tokenizer: Path) -> Path:
    """The tiny model with another family's tokenizer and template (its ids fit the model's 1,024 entries)."""
    folder = tmp_path / f"model-{tokenizer.name}"
    shutil.copytree(tiny_model, folder, ignore=shutil.ignore_patterns("tokenizer*", "chat_template*", "special_*"))
    for f in tokenizer.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def test_a_function_call_turn_renders_with_qwen25s_template(tokenizers):
    """Issue 59: "could not render ... record 1: can only concatenate str (not "NoneType") to str". The data check
    renders each record again without its tool calls; a function_call turn's content is None, which Qwen2.5's
    template concatenates: without its calls it is an empty answer."""
    from launcher.data import formats
    from launcher.data.dataset import example_lengths

    example = formats.convert(_sharegpt(), "sharegpt")
    assert example["messages"][2]["content"] is None and example["messages"][2]["tool_calls"]
    for name, folder in tokenizers.items():
        lengths, source = example_lengths([example, example], str(folder))
        assert source == "tokenizer" and lengths[0] == lengths[1] > 50, name


def _check(folder: Path, examples: list, assistant_only_loss: bool):
    from launcher.data import loss_view

    settings = loss_view.Settings(max_length=2048, assistant_only_loss=assistant_only_loss)
    return loss_view.check(str(folder), settings, examples, [f"tools.jsonl line {i + 1}" for i in range(len(examples))])


def test_multi_turn_tool_data_serves_the_trained_prompt_with_qwen25_and_qwen3(tokenizers):
    from launcher.data import formats

    multi = formats.convert(_sharegpt(turns=2), "sharegpt")
    # Qwen2.5: the model's own template and TRL's training template (assistant_only_loss) serve what trained
    for aol in (False, True):
        seen = _check(tokenizers["qwen2_5"], [multi] * 2, aol)["served_prompt"]
        assert seen["identical"] == "1/1", seen
    assert (
        "TRL's training template" in _check(tokenizers["qwen2_5"], [multi], True)["served_prompt"]["training_template"]
    )
    # Qwen3 with its own template: served with enable_thinking=false, the switch the export finds too
    seen = _check(tokenizers["qwen3"], [multi], False)["served_prompt"]
    assert seen["identical"] == "1/1" and seen["chat_template_kwargs"] == {"enable_thinking": False}
    # Qwen3 as prompt/completion (the turns before the last answer as the prompt): the completion trains alone with
    # the model's own template, and the served prompt is the trained one
    pc = {"prompt": multi["messages"][:-1], "completion": multi["messages"][-1:], "tools": multi["tools"]}
    assert _check(tokenizers["qwen3"], [pc], False)["served_prompt"]["identical"] == "1/1"


def test_qwen3s_training_template_on_multi_turn_tool_data_is_refused_before_training(tokenizers):
    """Issue 59: Qwen3 with assistant_only_loss trained, then the export failed ("serves another prompt than the
    training saw ... identical 0/15"): TRL's training template writes an empty think block into earlier assistant
    turns, the served template does not. The plan refuses it, with the fix pointing to the served template."""
    from launcher.data import formats
    from launcher.errors import DataError

    multi = formats.convert(_sharegpt(turns=2), "sharegpt")
    single = formats.convert(_sharegpt(turns=1), "sharegpt")
    with pytest.raises(DataError) as err:
        _check(tokenizers["qwen3"], [single, multi, multi], True)
    text = str(err.value)
    assert "the served prompt would differ from the trained one: tools.jsonl line" in text
    assert (
        "'<think>' in front of the answer" in text and "assistant_only_loss trains with TRL's training template" in text
    )
    assert "identical 0/2 shapes" in text and "the export would refuse the result after training" in text
    assert "set assistant_only_loss: false" in err.value.fix and "prompt/completion" in err.value.fix


def test_the_plan_refuses_qwen3_tool_data_with_assistant_only_loss(tmp_path, tiny_model, tokenizers):
    """What the user sees: `ftrun plan` on the recipe exits 2 with the one-paragraph error, before any training."""
    from helpers import ftrun
    from conftest import recipe_file

    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(_sharegpt(turns=2)) + "\n" for _ in range(20)))
    model = _model(tmp_path, tiny_model, tokenizers["qwen3"])
    recipe = recipe_file(
        tmp_path / "r.yaml", model, tmp_path / "run", data=str(data), assistant_only_loss=True, max_length=1024
    )
    res = ftrun("plan", recipe, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "data error: the served prompt would differ from the trained one" in res.stderr
    assert "Fix: train with the template that serves" in res.stderr and "Traceback" not in res.stderr
    # the model's own template (no assistant_only_loss): the same data passes the check, served with the switch
    from launcher.data.stats import data_stats
    from launcher.recipe_loading import load_recipe

    ok = load_recipe(recipe_file(tmp_path / "ok.yaml", model, tmp_path / "run", data=str(data), max_length=1024))
    seen = data_stats(ok)[2].loss_view
    assert seen["served_prompt"]["chat_template_kwargs"] == {"enable_thinking": False}
    from launcher.run.data_view import format_loss_view

    assert (
        "served prompt = trained prompt: 1/1 conversation shapes, trained with the model's own template, served with "
        "enable_thinking=False" in format_loss_view(seen)
    )


def test_a_foreground_run_whose_export_failed_exits_5(tmp_path):
    """Issue 59: an export whose served prompt differs left `--foreground` exiting 0. The supervisor's exit after
    training (what the foreground launch returns) says the README's exit 5 for trained-not-exported, 77 for an export
    `ftrun stop` ended, 0 when the outputs passed."""
    from launcher.run.supervisor import _exported_code
    from launcher.store.rundir import RunDir
    from launcher.store.state import set_state

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    set_state(run, "trained-not-exported", export={"state": "failed", "reason": "vLLM serves another prompt"})
    assert _exported_code(run, "trained-not-exported") == 5
    set_state(run, "trained-not-exported", export={"state": "stopped"})
    assert _exported_code(run, "trained-not-exported") == 77
    assert _exported_code(run, "succeeded") == 0


def test_the_exports_refusal_points_to_training_with_the_served_template():
    """The export's refusal of a differing served prompt said to re-export and report it, which renders the same
    template again: its fix now names the training's template as what has to change."""
    from launcher.deliver.messages import ExportError
    from launcher.deliver.served_prompt import ServedPrompt

    served = ServedPrompt.__new__(ServedPrompt)  # the comparison alone: its prompts and report, no tokenizer loaded
    served.tokenizer = type("T", (), {"convert_ids_to_tokens": lambda self, i: f"t{i}", "decode": lambda *a, **k: ""})()
    served.kwargs = {}
    served.prompts = [{"ids": [1, 2, 3], "from": "held out", "shape": "user,assistant,user"}]
    for report, said in (
        ({"training_template": "TRL's training template (assistant_only_loss)"}, "assistant_only_loss: false"),
        ({}, "change the template (chat_template.jinja in the model folder)"),
    ):
        served.report = {"runtimes": {}, "ok": True, **report}
        with pytest.raises(ExportError) as err:
            served.compare("vllm", "vLLM", [[1, 2, 4]])
        assert said in err.value.fix and "report it if it repeats" not in err.value.fix
        assert "identical 0/1" in str(err.value)


@pytest.mark.slow
def test_qwen25_tool_data_trains_answers_only_and_serves_the_trained_prompt(tmp_path, tiny_model, tokenizers):
    """Done when of issue 59: the tool-calling set trains on Qwen2.5's template with answers-only loss, and its
    export's served prompt equals the trained one; the plan's check and the export's agree."""
    from helpers import ftrun
    from conftest import recipe_file

    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(_sharegpt(turns=1 + i % 2)) + "\n" for i in range(24)))
    model = _model(tmp_path, tiny_model, tokenizers["qwen2_5"])
    recipe = recipe_file(
        tmp_path / "r.yaml",
        model,
        tmp_path / "run",
        data=str(data),
        assistant_only_loss=True,
        max_length=1024,
        micro_batch_size=4,
        max_steps=4,
        export=["adapter"],
    )
    res = ftrun(recipe, "--foreground", "smoke.enabled=false", cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    planned = json.loads((tmp_path / "run" / "data.json").read_text())["loss_view"]["served_prompt"]
    assert planned["identical"] == "2/2" and "TRL's training template" in planned["training_template"]
    served = json.loads((tmp_path / "run" / "final" / "export.json").read_text())["served_prompt"]
    assert served["ok"] and all(r["ok"] for r in served["runtimes"].values()), served


@pytest.mark.slow
def test_the_foreground_launch_exits_5_when_the_export_fails(write_recipe, monkeypatch, capsys):
    """The whole foreground path (the CLI, the launch, the supervisor in this process, a real worker): an export that
    fails leaves the run trained-not-exported and the command exits 5, not 0. The export is replaced by one that
    fails as a differing served prompt does (its state and reason), the training is real."""
    from launcher.cli import main
    from launcher.run import supervisor
    from launcher.store.state import read_state, set_state

    def failing_export(recipe, run, child):
        reason = "vLLM serves another prompt than the training saw; retry with `ftrun export`"
        set_state(run, "trained-not-exported", export={"state": "failed", "reason": reason})
        return "trained-not-exported"

    monkeypatch.setattr(supervisor, "_export", failing_export)
    recipe = write_recipe(max_steps=2, export=["adapter"])
    assert main([str(recipe), "--foreground", "smoke.enabled=false"]) == 5, capsys.readouterr()
    from launcher.store.rundir import RunDir

    assert read_state(RunDir(recipe.parent / "run"))["state"] == "trained-not-exported"
