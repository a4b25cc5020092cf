"""Every format and source trains the tiny model end to end (slow tier): a weighted mix of the chat formats from every
kind of source (JSONL, JSON, parquet, CSV, a folder, a dataset saved with `datasets`, a stand-in Hub cache) read by
the full run's worker; plain text through the smoke test (its sample written and read back), loss on every token;
prompt/completion, plain and conversational, loss on the completion only, as TRL prepared them (from the labels)."""

import json
import re

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from helpers import ftrun, read_state
from launcher.recipe import Recipe
from test_data import make_hub_cache

pytestmark = pytest.mark.slow

# the before/after answers (launcher/worker/samples.py) are not what this test checks
NO_SAMPLES = {"eval": {"samples": 0}} if "eval" in Recipe.model_fields else {}
QUICK = ["max_steps=2", "micro_batch_size=4", "max_length=64", "logging_steps=1"]


def _chat_rows(n: int, tag: str):
    return [(f"{tag} question {i}?", f"{tag} answer {i}.") for i in range(n)]


def _recipe(tmp_path, tiny_model, name: str, data):
    recipe = tmp_path / f"{name}.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_model),
                "method": "lora",
                "data": data,
                "gradient_accumulation_steps": 1,
                "learning_rate": 5e-3,
                "checkpoint_every_minutes": 10,
                "output_dir": str(tmp_path / name),
                "smoke": {"min_steps": 2},
                "export": [],
                **NO_SAMPLES,
            }
        )
    )
    return recipe


def _prepared(run, stdout: str) -> list[str]:
    """The worker's "data as TRL prepared it" lines: the smoke worker's (smoke/smoke.log), then the full run's."""
    smoke_log = run / "smoke" / "smoke.log"
    text = (smoke_log.read_text(errors="replace") if smoke_log.is_file() else "") + stdout
    return re.findall(r"data as TRL prepared it: (.*)", text)


def _loss_tokens(line: str) -> tuple[int, int]:
    trained, total = re.search(r"loss on ([\d,]+) of ([\d,]+) tokens", line).groups()
    return int(trained.replace(",", "")), int(total.replace(",", ""))


def _run(tmp_path, tiny_model, name: str, data, *overrides: str, env=None):
    recipe = _recipe(tmp_path, tiny_model, name, data)
    res = ftrun(recipe, "--foreground", *QUICK, *overrides, cwd=tmp_path, env=env, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = tmp_path / name
    assert read_state(run)["state"] == "succeeded"
    return res.stdout, json.loads((run / "data.json").read_text()), _prepared(run, res.stdout)


def test_every_format_and_source_trains(tmp_path, tiny_model):
    src = tmp_path / "src"
    (src / "folder").mkdir(parents=True)
    # Alpaca as JSONL, ShareGPT as parquet, messages as a JSON list and as CSV cells, text files in a folder
    (src / "alpaca.jsonl").write_text(
        "".join(json.dumps({"instruction": q, "input": "", "output": a}) + "\n" for q, a in _chat_rows(8, "alpaca"))
    )
    pq.write_table(
        pa.Table.from_pylist(
            [
                {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
                for q, a in _chat_rows(8, "sharegpt")
            ]
        ),
        src / "sharegpt.parquet",
    )
    msgs = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in _chat_rows(8, "json")]
    msgs[0] = [
        msgs[0][0],
        {"role": "tool", "content": "result"},
        msgs[0][1],
    ]  # the tool role, which this template renders
    (src / "chat.json").write_text(json.dumps([{"messages": m} for m in msgs]))
    (src / "folder" / "a.csv").write_text(
        "messages\n" + "".join('"' + json.dumps(m).replace('"', '""') + '"\n' for m in msgs[1:4])
    )
    (src / "folder" / "b.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in msgs[4:]))
    rows = [
        {"conversation": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]} for q, a in _chat_rows(8, "hub")
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(src / "saved"))
    cache = make_hub_cache(tmp_path / "hf", "acme/chats", rows)
    chat_mix = [
        {"path": str(src / "alpaca.jsonl"), "weight": 2},
        str(src / "sharegpt.parquet"),
        str(src / "chat.json"),
        str(src / "folder"),
        {"path": str(src / "saved"), "columns": {"conversations": "conversation"}},
        {"path": "acme/chats", "columns": {"conversations": "conversation"}, "weight": 0.5},
    ]
    # the worker reads the mix itself (the Hub dataset from the cache, offline), as a full run does
    out, record, prepared = _run(
        tmp_path, tiny_model, "chat", chat_mix, "smoke.enabled=false", env={"HF_DATASETS_CACHE": cache}
    )
    assert (
        "Alpaca (instruction/input/output), chat messages (role/content), ShareGPT conversations (from/value) "
        "format, 51 examples from 6 sources, converted to chat" in out
    )
    assert record["examples"] == 51 and [s["format"] for s in record["sources"]] == [
        "alpaca",
        "sharegpt",
        "messages",
        "messages",
        "sharegpt",
        "sharegpt",
    ]
    assert record["sources"][-1]["revision"] and all(s.get("sha256") for s in record["sources"][:-1])
    assert len(prepared) == 1 and "chat (the model's chat template), 51 examples" in prepared[0]
    # plain text: no chat template, loss on every token; the smoke test alone trains it (its sample written as
    # canonical lines and read back by the worker), and a resume on changed data is refused before any training
    (src / "text.jsonl").write_text(
        "".join(json.dumps({"text": f"Once upon a time, story {i} began."}) + "\n" for i in range(16))
    )
    recipe = _recipe(tmp_path, tiny_model, "text", str(src / "text.jsonl"))
    res = ftrun("smoke", recipe, *QUICK, cwd=tmp_path, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (line,) = _prepared(tmp_path / "text", res.stdout)
    trained, total = _loss_tokens(line)
    examples = int(re.search(r"([\d,]+) examples", line).group(1).replace(",", ""))
    # every token is a target but each row's first (the labels are shifted), as the data view counts them
    assert "plain text (no chat template)" in line and trained == total - examples, line
    (src / "text.jsonl").write_text((src / "text.jsonl").read_text().replace("story 3", "tale 3"))
    res = ftrun(recipe, "--foreground", *QUICK, cwd=tmp_path, timeout=120)
    assert res.returncode != 0 and "changed since this run started" in res.stderr, res.stdout + res.stderr

    # prompt/completion, plain and conversational: TRL trains on the completion only
    (src / "pc.jsonl").write_text(
        "".join(
            json.dumps({"prompt": f"Question {i}: what is {i} + {i}?", "completion": f" {2 * i}."}) + "\n"
            for i in range(16)
        )
    )
    (src / "pc-chat.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
                    "completion": [{"role": "assistant", "content": f"{2 * i}."}],
                }
            )
            + "\n"
            for i in range(16)
        )
    )
    for name in ("pc", "pc-chat"):
        out, record, prepared = _run(tmp_path, tiny_model, name, str(src / f"{name}.jsonl"), "smoke.enabled=false")
        trained, total = _loss_tokens(prepared[0])
        assert record["sources"][0]["format"] == "prompt_completion" and 0 < trained < total / 2, prepared
