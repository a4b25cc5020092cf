"""Data in the layouts of the tools users leave trains the tiny model end to end (slow tier): LLaMA-Factory's ranking
data through its dataset_info.json entry under DPO, and Axolotl's chat_template type under SFT with the answers-only
loss that both tools default to, recorded in the run's recipe.yaml."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from conftest import REPO, recipe_file
from helpers import ftrun, read_state

pytestmark = pytest.mark.slow

AS_SHAREGPT = {"system": "system", "user": "human", "assistant": "gpt", "tool": "observation"}


def _sharegpt(messages: list[dict]) -> list[dict]:
    return [{"from": AS_SHAREGPT[m["role"]], "value": m["content"]} for m in messages]


def _records(name: str) -> list[dict]:
    return [json.loads(line) for line in (REPO / "recipes" / "data" / name).read_text().splitlines() if line.strip()]


def _train(tmp_path, tiny_model, data, **fields):
    fields = {"max_steps": 4, "max_length": 512, "assistant_only_loss": None, **fields}  # None: left out, the default
    recipe = recipe_file(tmp_path / "r.yaml", tiny_model, output_dir=tmp_path / "run", data=data, **fields)
    res = ftrun(recipe, "--foreground", "smoke.enabled=false", cwd=tmp_path, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = tmp_path / "run"
    assert read_state(run)["state"] == "succeeded"
    return res.stdout, run


def test_llamafactory_sharegpt_ranking_entry_trains_under_dpo(tmp_path, tiny_model):
    folder = tmp_path / "data"
    folder.mkdir()
    pairs = [
        {
            "conversations": _sharegpt(r["prompt"]),
            "chosen": _sharegpt(r["chosen"])[0],
            "rejected": _sharegpt(r["rejected"])[0],
        }
        for r in _records("tiny-pref.jsonl")[:64]
    ]
    (folder / "dpo_demo.json").write_text(json.dumps(pairs))
    (folder / "dataset_info.json").write_text(
        json.dumps(
            {
                "dpo_demo": {
                    "file_name": "dpo_demo.json",
                    "formatting": "sharegpt",
                    "ranking": True,
                    "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
                }
            }
        )
    )
    out, run = _train(
        tmp_path, tiny_model, {"path": str(folder / "dataset_info.json"), "dataset": "dpo_demo"}, objective="dpo"
    )
    assert "LLaMA-Factory sharegpt (ranking), dataset_info.json entry 'dpo_demo', 64 examples" in out
    record = json.loads((run / "data.json").read_text())
    assert (
        record["sources"][0]["format"] == "preference" and record["sources"][0]["dataset_info"]["dataset"] == "dpo_demo"
    )


def test_axolotl_chat_template_entry_trains_the_answers_only_by_default(tmp_path, tiny_model):
    chats = [{"conversations": _sharegpt(r["messages"])} for r in _records("tiny-chat.jsonl")[:64]]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in chats))
    entry = {
        "path": str(path),
        "type": "chat_template",
        "field_messages": "conversations",
        "message_property_mappings": {"role": "from", "content": "value"},
    }
    out, run = _train(tmp_path, tiny_model, [entry])
    assert "loss on assistant turns only (the default where the chat template marks the answers" in out
    assert yaml.safe_load((run / "recipe.yaml").read_text())["assistant_only_loss"] is True
    # what TRL trained, from its own labels: the answers, not the whole conversation
    trained, total = (
        int(x.replace(",", ""))
        for x in re.search(r"data as TRL prepared it: .*?loss on ([\d,]+) of ([\d,]+) tokens", out).groups()
    )
    assert 0 < trained < 0.7 * total
