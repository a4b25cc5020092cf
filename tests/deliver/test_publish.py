"""publish: the checked export and a model card pushed to the Hub stand-in (tests/fake_hub.py), after the export's
checks and never before; the recipe's publish: refused when it asks for what the export does not make."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from launcher.errors import RecipeError
from launcher.deliver.publish import PublishError, after_export, publish_run
from launcher.recipe_loading import validate_recipe
from launcher.store.rundir import RunDir

hf = pytest.importorskip("huggingface_hub")
from fake_hub import FakeHub  # noqa: E402  (tests/fake_hub.py, the stand-in the sync tests use)


class RecordingHub(FakeHub):
    """The stand-in, keeping create_repo's arguments (visibility is what a card cannot show)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.repos: list[dict] = []

    def create_repo(self, *args, **kwargs):
        super().create_repo(*args, **kwargs)
        self.repos.append({"repo_id": args[0] if args else kwargs.get("repo_id"), **kwargs})


@pytest.fixture
def hub(monkeypatch):
    fake = RecordingHub()
    monkeypatch.setattr(hf, "HfApi", lambda *a, **k: fake)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token_for_the_stand_in")
    return fake


def _file(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def finished_run(root: Path, what=("adapter",), export_ok: bool = True, base: str = "Qwen/Qwen3-0.6B") -> RunDir:
    """A run directory as a finished, exported run leaves it (the files' contents do not matter to publishing;
    tests/deliver/test_publish.py's slow test publishes a real one)."""
    run = RunDir(root)
    root.mkdir(parents=True)
    recipe = {
        "model": base,
        "method": "lora",
        "data": "/data/support.jsonl",
        "output_dir": str(root),
        "max_steps": 12,
        "lora": {"r": 8, "alpha": 16},
        "export": list(what),
        "publish": {"to": "hf://me/support-bot", "what": list(what)},
    }
    run.recipe.write_text(yaml.safe_dump(recipe))
    outputs = {}
    adapter = root / "final" / "adapter"
    _file(adapter / "adapter_model.safetensors", os.urandom(4096))
    _file(adapter / "adapter_config.json", json.dumps({"base_model_name_or_path": base, "r": 8}).encode())
    _file(adapter / "tokenizer.json", b"{}")
    outputs["adapter"] = {
        "path": str(adapter),
        "bytes": 4096,
        "size": "4.1 KB",
        "rank": 8,
        "changes_base_logits": {"mean_kl": 0.3, "top1_agreement_with_base": 0.41},
    }
    if "merged" in what:
        merged = root / "final" / "merged"
        _file(merged / "model.safetensors", os.urandom(8192))
        _file(merged / "config.json", b'{"model_type": "qwen3"}')
        outputs["merged"] = {
            "path": str(merged),
            "bytes": 8192 + 23,
            "size": "8.2 KB",
            "parity": {"top1_agreement": 0.995, "max_rel": 0.01},
        }
    report = {"ok": export_ok, "outputs": outputs if export_ok else {}, "method": "lora"}
    if not export_ok:
        report["error"] = "merged: top-1 agreement 0.91 with the adapter model (needs >= 0.98)"
    _file(run.final / "export.json", json.dumps(report).encode())
    _file(
        run.final / "samples.md",
        b"# Before and after: run\n\n## 1. example 3\n\n**After** (step 12)\n\n> Hello there\n",
    )
    run.metrics.write_text(
        "\n".join(
            json.dumps(r)
            for r in (
                {"step": 1, "loss": 6.5},
                {"step": 6, "eval_loss": 5.25},
                {"step": 12, "loss": 3.25},
                {"step": 12, "eval_loss": 4.125},
            )
        )
        + "\n"
    )
    (root / "data.json").write_text(
        json.dumps(
            {
                "description": "Alpaca format, 400 examples",
                "examples": 400,
                "total_tokens": 31793,
                "mean_tokens": 79.5,
                "max_tokens": 475,
                "sources": [
                    {
                        "source": "/data/support.jsonl",
                        "format": "alpaca",
                        "examples": 400,
                        "weight": 1.0,
                        "sha256": "ab" * 32,
                    }
                ],
            }
        )
    )
    run.state.write_text(json.dumps({"state": "succeeded", "final_check": {"ok": True}}))
    return run


def test_publish_pushes_the_checked_adapter_and_a_card_in_one_private_commit(tmp_path, hub):
    run = finished_run(tmp_path / "run")
    record = publish_run(run.root, say=lambda line: None)
    assert record["state"] == "published" and record["repo"] == "me/support-bot" and record["what"] == ["adapter"]
    assert hub.repos == [{"repo_id": "me/support-bot", "private": True, "exist_ok": True}]
    assert len(hub.made) == 1  # one commit: all of it or nothing
    # the adapter at the root (PEFT and vLLM load the repo as it is), the card, the samples, the records
    assert set(hub.head) == {
        "adapter_model.safetensors",
        "adapter_config.json",
        "tokenizer.json",
        "README.md",
        "samples.md",
        "ftrun/recipe.yaml",
        "ftrun/data.json",
        "ftrun/export.json",
    }
    assert hub.read("adapter_model.safetensors") == (run.final / "adapter" / "adapter_model.safetensors").read_bytes()
    card = hf.ModelCard(hub.read("README.md").decode())
    assert card.data.base_model == "Qwen/Qwen3-0.6B" and card.data.library_name == "peft"
    text = card.text
    for expected in (
        "LoRA (r=8, alpha=16",
        "400 examples, 31793 tokens",
        "format alpaca",
        "training loss 6.5000 (step 1) -> 3.2500 (step 12)",
        "eval loss 4.1250 at step 12",
        "top-1 agreement with the base 0.410",
        "> Hello there",
        "vllm serve Qwen/Qwen3-0.6B --enable-lora --lora-modules support-bot=me/support-bot --max-lora-rank 8",
        "method: lora",
    ):
        assert expected in text, expected
    assert "/data/" not in hub.read("ftrun/recipe.yaml").decode()  # the box's folders are not published


def test_merged_goes_to_the_root_and_the_adapter_beside_it(tmp_path, hub):
    run = finished_run(tmp_path / "run", what=("adapter", "merged"))
    publish_run(run.root, say=lambda line: None)
    assert {
        "model.safetensors",
        "config.json",
        "adapter/adapter_model.safetensors",
        "adapter/adapter_config.json",
    } <= set(hub.head)
    assert "adapter_config.json" not in hub.head  # at the root it would make transformers load an adapter
    card = hf.ModelCard(hub.read("README.md").decode())
    assert card.data.library_name == "transformers"
    assert "vllm serve me/support-bot" in card.text and "top-1 agreement with base + adapter 0.995" in card.text


def test_the_card_serves_with_the_chat_template_switch_the_export_found(tmp_path, hub):
    """A Qwen3 run trained without reasoning: the export found the trained prompt under enable_thinking=false
    (export.json served_prompt), and every serve command on the card passes it."""
    run = finished_run(tmp_path / "run", what=("adapter", "merged"))
    report = json.loads((run.final / "export.json").read_text())
    report["served_prompt"] = {"ok": True, "chat_template_kwargs": {"enable_thinking": False}}
    (run.final / "export.json").write_text(json.dumps(report))
    publish_run(run.root, say=lambda line: None)
    text = hf.ModelCard(hub.read("README.md").decode()).text
    assert "vllm serve me/support-bot --default-chat-template-kwargs '{\"enable_thinking\": false}'" in text
    assert text.count("""--default-chat-template-kwargs '{"enable_thinking": false}'""") == 2  # merged, adapter
    assert 'chat-template switch `{"enable_thinking": false}`' in text


def test_a_failed_export_publishes_nothing_and_says_so(tmp_path, hub):
    run = finished_run(tmp_path / "run", what=("adapter", "merged"), export_ok=False)
    with pytest.raises(
        PublishError, match="the export did not pass its checks .merged: top-1 agreement 0.91.*nothing was published"
    ) as err:
        publish_run(run.root, say=lambda line: None)
    assert "ftrun export" in err.value.render()
    lines = []
    recipe = validate_recipe(yaml.safe_load(run.recipe.read_text()), run.root, "run")
    after_export(recipe, run, lines.append)  # the supervisor's step: recorded, the run's state untouched
    state = json.loads(run.state.read_text())
    assert state["state"] == "succeeded" and state["publish"]["state"] == "failed"
    assert "nothing was published" in state["publish"]["reason"] and state["publish"]["retry"].startswith(
        "ftrun publish"
    )
    assert any("nothing was published" in line for line in lines)
    assert hub.calls == []  # the Hub was not even asked


def test_only_the_first_node_publishes(tmp_path, hub):
    run = finished_run(tmp_path / "run")
    run.state.write_text(
        json.dumps({"state": "succeeded", "final_check": {"ok": None, "reason": "written and verified by node 0"}})
    )
    recipe = validate_recipe(yaml.safe_load(run.recipe.read_text()), run.root, "run")
    after_export(recipe, run, print)
    assert hub.calls == [] and "publish" not in json.loads(run.state.read_text())


def test_an_output_changed_after_its_check_is_not_published(tmp_path, hub):
    run = finished_run(tmp_path / "run")
    (run.final / "adapter" / "adapter_model.safetensors").write_bytes(os.urandom(100))
    with pytest.raises(PublishError, match="changed since the export checked it"):
        publish_run(run.root, say=lambda line: None)
    assert hub.calls == []


def test_without_a_token_nothing_is_published_and_the_fix_is_the_login(tmp_path, hub, monkeypatch):
    run = finished_run(tmp_path / "run")
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(hf.constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    with pytest.raises(PublishError, match="no Hugging Face token") as err:
        publish_run(run.root, say=lambda line: None)
    assert "hf auth login" in err.value.render() and hub.calls == []
    (tmp_path / "token").write_text("hf_stored_by_login\n")  # huggingface_hub's stored login is enough
    assert publish_run(run.root, say=lambda line: None)["state"] == "published"


def test_the_hub_refusing_is_a_publish_error_with_the_retry(tmp_path, hub):
    run = finished_run(tmp_path / "run")
    hub.refuse("create_commit", 403)
    with pytest.raises(PublishError, match="nothing was published") as err:
        publish_run(run.root, say=lambda line: None)
    assert f"ftrun publish {run.root}" in err.value.render() and hub.head == {}


def test_ftrun_publish_command(tmp_path, hub, capsys):
    from launcher.cli import main

    run = finished_run(tmp_path / "run")
    assert main(["publish", str(run.root), "--to", "hf://me/other"]) == 0
    assert "published to https://huggingface.co/me/other" in capsys.readouterr().out
    state = json.loads(run.state.read_text())
    assert state["publish"]["state"] == "published" and state["publish"]["repo"] == "me/other"
    (run.final / "export.json").write_text(json.dumps({"ok": False, "error": "exit code 1"}))
    assert main(["publish", str(run.root)]) != 0
    assert "nothing was published" in capsys.readouterr().err


@pytest.mark.parametrize(
    "publish, export, method, message",
    [
        ({"to": "me/repo"}, ["adapter"], "lora", "write hf://USER/REPO"),
        ({"to": "hf://me/repo", "what": ["merged"]}, ["adapter"], "lora", r"add \['merged'\] to export"),
        ({"to": "hf://me/repo", "what": ["adapter"]}, ["adapter", "merged"], "full", "a full fine-tune has none"),
        ({"to": "hf://me:hf_secret@repo"}, ["adapter"], "lora", "credentials do not belong in the recipe"),
    ],
)
def test_recipe_publish_is_checked_before_anything_runs(tmp_path, publish, export, method, message):
    raw = {"model": "a/b", "method": method, "data": "d.jsonl", "export": export, "publish": publish}
    with pytest.raises(RecipeError, match=message):
        validate_recipe(raw, tmp_path, "r")
    ok = validate_recipe(
        {
            **raw,
            "method": "lora",
            "export": ["adapter", "merged", "gguf"],
            "publish": {"to": "hf://me/repo", "what": ["adapter", "merged", "gguf"]},
        },
        tmp_path,
        "r",
    )
    assert ok.publish.private is True


@pytest.mark.slow
def test_a_finished_run_publishes_after_the_export_checked_it(tmp_path, tiny_model):
    """The whole path in real processes: training, the export's checks, then the supervisor publishes to the
    stand-in (reached through sitecustomize, tests/fake_hub.py), before on_finish runs."""
    from conftest import recipe_file
    from fake_hub import install
    from helpers import REPO, wait_until_ended

    hub = FakeHub(tmp_path / "hub")
    env = dict(
        os.environ,
        PYTHONPATH=f"{install(tmp_path / 'inject')}{os.pathsep}{REPO}",
        HF_HUB_OFFLINE="1",
        FTRUN_TEST_FAKE_HUB=str(tmp_path / "hub"),
        HF_TOKEN="hf_stand_in_token",
    )
    run = tmp_path / "run"
    marker = tmp_path / "on_finish.txt"
    recipe = recipe_file(
        tmp_path / "r.yaml",
        tiny_model,
        output_dir=run,
        max_steps=6,
        export=["adapter"],
        publish={"to": "hf://me/tiny-support", "what": ["adapter"]},
        report_to=[],
        on_finish=[[sys.executable, "-c", f"import time; open({str(marker)!r}, 'w').write(str(time.time()))"]],
    )
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "launcher.cli", str(recipe), "smoke.enabled=false"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    wait_until_ended(run, tmp_path)
    state = json.loads((run / "state.json").read_text())
    assert state["publish"]["state"] == "published", state.get("publish")
    hub.reload()
    assert {"README.md", "adapter_model.safetensors", "adapter_config.json", "ftrun/export.json"} <= set(hub.head)
    assert (
        hub.read("adapter_model.safetensors") == (run / "final" / "adapter" / "adapter_model.safetensors").read_bytes()
    )
    log = (run / "train.log").read_text()
    assert log.index("export finished") < log.index("publishing adapter") < log.index("on_finish")
    card = hf.ModelCard(hub.read("README.md").decode()).text
    assert "training loss" in card and "vllm serve" in card and "top-1 agreement with the base" in card
    print(f"trained, exported and published in {time.monotonic() - t0:.0f} s")


def test_the_card_has_the_task_evaluation_table(tmp_path, hub):
    run = finished_run(tmp_path / "run")
    (run.final / "task_eval.json").write_text(
        json.dumps(
            {
                "metric": "exact",
                "metric_reason": "the 40 references are 4 distinct short labels",
                "examples": 40,
                "shots": 3,
                "scores": {"base_zero_shot": 0.0, "base_few_shot": 0.35, "fine_tuned": 1.0, "merged": 0.975},
                "fine_tune_pays": True,
            }
        )
    )
    publish_run(run.root, say=lambda line: None)
    text = hf.ModelCard(hub.read("README.md").decode()).text
    table = text[text.index("## Task evaluation") :]
    rows = [
        "| base model, zero-shot | 0.0% |",
        "| base model, 3 examples in the prompt | 35.0% |",
        "| fine-tuned | 100.0% |",
        "| merged | 97.5% |",
    ]
    assert [line for line in table.splitlines() if line.startswith("| ") and "%" in line] == rows
    assert "40 held-out examples (never trained on), answered greedily; metric `exact`: the 40 references" in table
    assert json.loads(hub.read("ftrun/task_eval.json"))["scores"]["fine_tuned"] == 1.0
