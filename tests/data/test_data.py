"""Data in: every format and source becomes the examples TRL trains; bad records are named with line and field;
token statistics are what TRL tokenizes; a chat template that would drop tool calls or reasoning is refused."""

import json
import shutil

import pytest

from launcher.data.dataset import compute_stats, example_lengths, load_data, load_examples, smoke_sample, to_dataset
from launcher.errors import DataError
from helpers import HUB_REVISION, make_hub_cache  # noqa: F401 (tests/data/test_data_training.py imports it from here)

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
TOOL_CHAT = {
    "messages": [
        {"role": "user", "content": "Lights on in the kitchen"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "lights", "arguments": {"room": "kitchen", "on": True}}}
            ],
        },
        {"role": "tool", "name": "lights", "content": "ok"},
        {"role": "assistant", "content": "Done.", "reasoning_content": "The tool said ok."},
    ]
}

# A Qwen-like template that renders tool schemas, tool calls, tool results and reasoning (the tiny model's does not).
RICH_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for t in tools %}{{- t | tojson }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content %}{{- '<think>' + m.reasoning_content + '</think>' }}{%- endif %}"
    "{{- m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}{{- '<tool_call>' + c.function.name + (c.function.arguments | tojson) + "
    "'</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _write(tmp_path, lines, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return p


def _error(spec) -> str:
    with pytest.raises(DataError) as err:
        load_data(spec)
    assert err.value.fix
    return err.value.message


# -- formats --------------------------------------------------------------------------------------------------


def test_each_format_is_detected_and_converted(tmp_path):
    cases = {
        "messages": (GOOD, GOOD, "chat messages"),
        "alpaca": (
            {"instruction": "Add", "input": "1+1", "output": "2", "system": "be brief"},
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "Add\n\n1+1"},
                    {"role": "assistant", "content": "2"},
                ]
            },
            "Alpaca (instruction/input/output) format, 1 example, converted to chat",
        ),
        "sharegpt": (
            {
                "conversations": [
                    {"from": "system", "value": "s"},
                    {"from": "human", "value": "q"},
                    {"from": "gpt", "value": "a"},
                ]
            },
            {
                "messages": [
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a"},
                ]
            },
            "converted to chat",
        ),
        "plain": (
            {"prompt": "The sky is", "completion": " blue."},
            {"prompt": "The sky is", "completion": " blue."},
            "prompt/completion format",
        ),
        "conversational": (
            {"prompt": [{"role": "user", "content": "sky?"}], "completion": [{"role": "assistant", "content": "blue"}]},
            {"prompt": [{"role": "user", "content": "sky?"}], "completion": [{"role": "assistant", "content": "blue"}]},
            "prompt/completion",
        ),
        "text": ({"text": "Once upon a time."}, {"text": "Once upon a time."}, "plain text (continued pre-training)"),
    }
    for name, (record, expected, described) in cases.items():
        data = load_data(_write(tmp_path, [record], f"{name}.jsonl"))
        assert data.examples == [expected], name
        assert described in data.describe(), (name, data.describe())
        assert data.where == [f"{name}.jsonl line 1"]


def test_sharegpt_tool_turns_and_role_names(tmp_path):
    rec = {
        "system": "sys",
        "tools": json.dumps([{"name": "lights"}]),
        "conversations": [
            {"from": "human", "value": "on"},
            {"from": "function_call", "value": json.dumps({"name": "lights", "arguments": {"on": True}})},
            {"from": "observation", "value": "ok"},
            {"from": "gpt", "value": "Done."},
        ],
    }
    (ex,) = load_data(_write(tmp_path, [rec])).examples
    assert [m["role"] for m in ex["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert ex["messages"][2]["tool_calls"][0]["function"] == {"name": "lights", "arguments": {"on": True}}
    # a bare function schema (LLaMA-Factory's, Glaive's) in the form templates and servers read
    assert ex["tools"] == [{"type": "function", "function": {"name": "lights"}}]


def test_chat_lines_keep_tool_calls_the_tool_role_and_reasoning(tmp_path):
    (ex,) = load_data(_write(tmp_path, [{**TOOL_CHAT, "tools": [{"name": "lights"}]}])).examples
    assert ex["messages"] == TOOL_CHAT["messages"]
    assert ex["tools"] == [{"type": "function", "function": {"name": "lights"}}]
    # and they reach the trainer as they are: no None-filled keys on the other turns
    row = to_dataset([ex, GOOD])[1]
    assert row["messages"] == GOOD["messages"]
    assert to_dataset([ex])[0]["messages"][1]["tool_calls"][0]["function"]["arguments"] == {
        "room": "kitchen",
        "on": True,
    }


@pytest.mark.parametrize(
    "record, expected",
    [
        ("{not json", "d.jsonl line 2: not valid JSON"),
        ({"messages": []}, "d.jsonl line 2: 'messages' must be a non-empty list"),
        (
            {"messages": [{"role": "bot", "content": "x"}]},
            "line 2: messages[0].role is 'bot'; allowed: system, user, assistant, tool",
        ),
        (
            {"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}]},
            "line 2: messages[0] (user) has empty content",
        ),
        ({"messages": [{"role": "user", "content": "q"}]}, "line 2: no assistant turn"),
        ({"messages": [{"role": "user", "content": 3}]}, "line 2: messages[0].content must be a string, found int"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"x": 1}]}]},
            "line 2: messages[1].tool_calls[0] has no function name",
        ),
        ([1, 2], "line 2: expected a JSON object, found list"),
    ],
)
def test_bad_chat_line_is_named_with_its_field(tmp_path, record, expected):
    message = _error(_write(tmp_path, [GOOD, record, GOOD]))
    assert expected in message
    assert "1 bad record of 3" in message


@pytest.mark.parametrize(
    "first, bad, expected",
    [
        ({"instruction": "q", "output": "a"}, {"instruction": "q", "output": ""}, "line 2: 'output' is empty"),
        ({"instruction": "q", "output": "a"}, {"instruction": "q", "input": "x"}, "line 2: no 'output' key"),
        (
            {"instruction": "q", "output": "a"},
            {"instruction": 5, "output": "a"},
            "line 2: 'instruction' must be a string",
        ),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
            {"conversations": [{"from": "robot", "value": "q"}]},
            "line 2: conversations[0].from is 'robot'",
        ),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
            {"conversations": [{"from": "human", "value": "q"}]},
            "line 2: no assistant turn in 'conversations'",
        ),
        (
            {"prompt": "p", "completion": "c"},
            {"prompt": "p", "completion": 3},
            "line 2: 'prompt' and 'completion' must both",
        ),
        (
            {"prompt": "p", "completion": "c"},
            {"prompt": [{"role": "user", "content": "p"}], "completion": [{"role": "assistant", "content": "c"}]},
            "line 2: this record is conversational prompt/completion (messages) but the first was plain",
        ),
        ({"text": "a"}, {"text": ""}, "line 2: 'text' is empty"),
        ({"text": "a"}, {"body": "a"}, "line 2: no 'text' key (keys present: body)"),
    ],
)
def test_bad_line_in_each_format_is_named_with_its_field(tmp_path, first, bad, expected):
    message = _error(_write(tmp_path, [first, bad]))
    assert expected in message, message


def test_one_error_for_a_file_in_another_format_and_counted_repeats(tmp_path):
    # an Alpaca file is read as Alpaca: no "no 'messages' key" eight times
    alpaca = [{"instruction": f"q{i}", "input": "", "output": "a"} for i in range(30)]
    assert len(load_data(_write(tmp_path, alpaca)).examples) == 30
    # the same problem on many lines: one line of the error, the first places and the count
    message = _error(_write(tmp_path, [GOOD] + ["{"] * 20))
    assert "has 20 bad records of 21" in message
    assert message.count("not valid JSON") == 1 and "line 2, d.jsonl line 3, d.jsonl line 4 and 17 more" in message


def test_mixed_formats_and_empty_sources_are_refused_with_the_reason(tmp_path):
    mixed = _write(tmp_path, [GOOD, {"text": "x"}])
    assert (
        "mixed formats: chat messages (role/content) from d.jsonl line 1, plain text (continued pre-training) "
        "from d.jsonl line 2" in _error(mixed)
    )
    # past the lines the format is detected from: the record is named, and what it looks like
    late = _write(tmp_path, [GOOD] * 25 + [{"instruction": "q", "output": "a"}], "late.jsonl")
    assert (
        "late.jsonl line 26: no 'messages' key (keys present: instruction, output); this record looks like Alpaca "
        "(instruction/input/output): one format per source" in _error(late)
    )
    assert "holds no records" in _error(_write(tmp_path, ["", ""], "empty.jsonl"))
    assert "is in no known format (keys: body)" in _error(_write(tmp_path, [{"body": "x"}], "odd.jsonl"))
    # sources that train differently do not mix
    text = _write(tmp_path, [{"text": "x"}], "t.jsonl")
    assert "train differently" in _error([str(_write(tmp_path, [GOOD], "c.jsonl")), str(text)])
    assert "does not exist" in _error(str(tmp_path / "missing.jsonl"))


def test_format_and_columns_named_in_the_recipe(tmp_path):
    p = _write(tmp_path, [{"question": "q", "answer": "a"}])
    data = load_data({"path": str(p), "format": "alpaca", "columns": {"instruction": "question", "output": "answer"}})
    assert data.examples[0]["messages"][-1] == {"role": "assistant", "content": "a"}
    assert "has no column nope (columns.output)" in _error({"path": str(p), "columns": {"output": "nope"}})


# -- sources --------------------------------------------------------------------------------------------------


def test_json_parquet_csv_and_folders(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.json").write_text(
        json.dumps([{"instruction": "q1", "output": "a1"}, {"instruction": "q2", "output": "a2"}])
    )
    pq.write_table(pa.Table.from_pylist([{"instruction": "q3", "input": "", "output": "a3"}]), tmp_path / "b.parquet")
    (tmp_path / "c.csv").write_text('instruction,input,output\nq4,,"a4, with a comma"\n')
    assert [len(load_data(str(tmp_path / f)).examples) for f in ("a.json", "b.parquet", "c.csv")] == [2, 1, 1]
    folder = load_data(str(tmp_path))
    assert folder.where == ["a.json record 1", "a.json record 2", "b.parquet row 1", "c.csv row 1"]
    assert folder.examples[-1]["messages"][-1]["content"] == "a4, with a comma"
    # a CSV cell that holds messages as JSON text
    (tmp_path / "m.csv").write_text('messages\n"' + json.dumps(GOOD["messages"]).replace('"', '""') + '"\n')
    assert load_data(str(tmp_path / "m.csv")).examples == [GOOD]
    (tmp_path / "bad.csv").write_text("instruction,output\nq,\n")
    assert "bad.csv row 1: 'output' is empty" in _error(str(tmp_path / "bad.csv"))


def test_saved_dataset_and_hub_cache(tmp_path, monkeypatch):
    import datasets

    rows = [{"conversation": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]} for i in range(3)]
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(saved))
    data = load_data({"path": str(saved), "columns": {"conversations": "conversation"}})
    assert len(data.examples) == 3 and data.sources[0]["format"] == "sharegpt" and len(data.sources[0]["sha256"]) == 64
    assert "no split 'test'" in _error({"path": str(saved), "split": "test"})

    cache = make_hub_cache(tmp_path / "hf", "acme/chats", rows)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    data = load_data({"path": "acme/chats", "columns": {"conversations": "conversation"}})
    assert data.where[0] == "acme/chats row 1" and data.examples[0]["messages"][0]["content"] == "q0"
    assert data.sources[0]["revision"] == HUB_REVISION and len(data.sources[0]["content_sha256"]) == 64
    # the worker reads the revision the launcher recorded
    from launcher.data.sources import pinned

    spec = [{"path": "acme/chats", "columns": {"conversations": "conversation"}}]
    (source,) = pinned(spec, data.sources)
    assert source.revision == HUB_REVISION and load_data([source]).examples == data.examples
    message = _error("acme/not-cached")
    assert "is not in this box's Hugging Face cache and the Hub cannot be reached" in message


def test_weighted_mix_and_recorded_identity(tmp_path):
    a = _write(tmp_path, [{"text": f"a{i}"} for i in range(10)], "a.jsonl")
    b = _write(tmp_path, [{"text": f"b{i}"} for i in range(10)], "b.jsonl")
    data = load_data([{"path": str(a), "weight": 2}, {"path": str(b), "weight": 0.5}], seed=1)
    texts = [e["text"] for e in data.examples]
    assert sum(t.startswith("a") for t in texts) == 20 and sum(t.startswith("b") for t in texts) == 5
    assert load_data([{"path": str(a), "weight": 2}, {"path": str(b), "weight": 0.5}], seed=1).examples == data.examples
    assert [s["weight"] for s in data.sources] == [2, 0.5] and all(len(s["sha256"]) == 64 for s in data.sources)
    # one plain file: its own sha256, as runs recorded before sources existed
    from launcher.store.checkpoint import sha256_file

    assert load_data(str(a)).sha256 == sha256_file(a)
    before = data.sha256
    b.write_text(b.read_text().replace("b3", "B3"))
    assert load_data([{"path": str(a), "weight": 2}, {"path": str(b), "weight": 0.5}], seed=1).sha256 != before


def test_load_examples_gives_conversations_for_prompts(tmp_path):
    assert load_examples(_write(tmp_path, [{"text": "t"}])) == [[{"role": "user", "content": "t"}]]
    assert load_examples(_write(tmp_path, [{"prompt": "p", "completion": "c"}], "pc.jsonl"))[0][1] == {
        "role": "assistant",
        "content": "c",
    }


# -- tokens and the chat template ---------------------------------------------------------------------------


def test_token_stats_use_the_chat_template(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ex = [GOOD["messages"], [{"role": "system", "content": "be brief"}] + GOOD["messages"]]
    lengths, source = example_lengths(ex, str(tiny_model))
    assert source == "tokenizer"
    expected = [len(tok.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"]) for m in ex]
    assert lengths == expected
    stats = compute_stats(ex, lengths, source, max_length=expected[0])
    assert stats.over_max_length == 1 and stats.total_tokens == 2 * expected[0] and stats.max_tokens == expected[1]


def test_token_counts_match_trl_for_text_and_prompt_completion(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = {"text": "Once upon a time there was a tiny model."}
    plain = {"prompt": "The sky is", "completion": " blue."}
    conv = {"prompt": [{"role": "user", "content": "sky?"}], "completion": [{"role": "assistant", "content": "blue"}]}
    lengths, source = example_lengths([text, plain, conv], str(tiny_model))
    # TRL (sft_trainer.py _prepare_dataset): EOS appended to plain text, tokenized with the tokenizer's special
    # tokens and no chat template; conversational prompt + completion through the template
    assert source == "tokenizer"
    assert lengths[0] == len(tok(text["text"] + tok.eos_token)["input_ids"])
    assert lengths[1] == len(tok(plain["prompt"] + plain["completion"] + tok.eos_token)["input_ids"])
    assert lengths[2] == len(
        tok.apply_chat_template(conv["prompt"] + conv["completion"], tokenize=True, return_dict=True)["input_ids"]
    )


def test_template_that_drops_tool_calls_or_reasoning_is_refused_naming_lines(tmp_path, tiny_model):
    plain_tool = {
        "messages": [
            {"role": "user", "content": "on"},
            {
                "role": "assistant",
                "content": "calling",
                "tool_calls": [{"type": "function", "function": {"name": "lights", "arguments": {}}}],
            },
            {"role": "tool", "content": "ok"},
            {"role": "assistant", "content": "Done."},
        ]
    }
    reasoning = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "because"},
        ]
    }
    data = load_data(_write(tmp_path, [GOOD, plain_tool, reasoning]))
    with pytest.raises(DataError) as err:
        example_lengths(data.examples, str(tiny_model), data.where)
    message = err.value.message
    assert "- tool_calls: d.jsonl line 2" in message and "- reasoning content: d.jsonl line 3" in message
    assert "the tool role" not in message  # the tiny template renders any role
    # the same records with a template that renders them count, and the rendered text holds them
    rich = tmp_path / "rich"
    shutil.copytree(tiny_model, rich, ignore=shutil.ignore_patterns("*.safetensors"))
    (rich / "chat_template.jinja").write_text(RICH_TEMPLATE)
    cfg = json.loads((rich / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (rich / "tokenizer_config.json").write_text(json.dumps(cfg))
    lengths, source = example_lengths(data.examples + [{**TOOL_CHAT, "tools": [{"name": "lights"}]}], str(rich))
    assert source == "tokenizer" and lengths[1] > lengths[0]


def test_unknown_model_falls_back_to_characters():
    lengths, source = example_lengths([GOOD["messages"], {"text": "abcdefgh"}], "nobody/no-such-model-xyz")
    assert source == "characters" and lengths[0] > 0 and lengths[1] == 3


# -- the smoke sample ---------------------------------------------------------------------------------------


def test_smoke_sample_includes_the_longest():
    lengths = list(range(1000))
    idx = smoke_sample(lengths, 0.01, 20, seed=1)
    assert len(idx) == 20 and 999 in idx
    assert smoke_sample(lengths, 0.01, 20, seed=1) == idx  # seeded
    assert len(smoke_sample(lengths, 0.5, 2, seed=1)) == 500


def test_smoke_sample_holds_one_batch_of_the_longest_and_a_random_rest():
    lengths = list(range(1000))
    idx = smoke_sample(lengths, 0.2, 20, seed=3, longest=8)
    assert len(idx) == 200 and set(range(992, 1000)) <= set(idx)
    rest = [lengths[i] for i in idx if i < 992]
    assert 400 < sum(rest) / len(rest) < 600  # the data's usual lengths (mean 499.5), not the long tail


# -- the recipe's data ----------------------------------------------------------------------------------------


def test_recipe_data_is_a_path_a_hub_id_a_source_or_a_weighted_list(tmp_path, write_recipe):
    from launcher.errors import RecipeError
    from launcher.recipe_loading import load_recipe

    _write(tmp_path, [GOOD])
    (tmp_path / "acme" / "chats").mkdir(parents=True)  # a folder of that name here: local
    r = load_recipe(write_recipe(data="d.jsonl"))
    assert r.data == str(tmp_path / "d.jsonl") and r.snapshot()["data"] == r.data  # as before: a plain string
    assert load_recipe(write_recipe(data="tatsu-lab/alpaca")).data == "tatsu-lab/alpaca"  # a Hub id stays one
    r = load_recipe(
        write_recipe(
            data=[
                {"path": "d.jsonl", "weight": 2},
                {"path": "acme/chats", "split": "train_sft", "columns": {"messages": "conv"}},
            ]
        )
    )
    assert r.data[0].path == str(tmp_path / "d.jsonl") and r.data[1].path == str(tmp_path / "acme" / "chats")
    r = load_recipe(write_recipe(data={"path": "d.jsonl", "format": "messages"}))
    assert len(load_data(r.data).examples) == 1
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(data={"path": "d.jsonl", "format": "chatml"}))
    assert "data" in err.value.message and "chatml" in err.value.message


def test_changed_data_or_eval_data_is_caught_at_the_launch_and_at_a_worker_restart(tmp_path, tiny_model):
    """The run's data identity covers eval.data too; the worker compares what it reads with the launch's record
    (data.json), so a restart after a crash never trains on data edited in between."""
    from launcher.data.stats import data_stats
    from launcher.recipe_loading import validate_recipe
    from launcher.store.rundir import RunDir
    from launcher.worker.inputs import _data_changed

    train = _write(tmp_path, [{"text": f"line {i}"} for i in range(20)], "train.jsonl")
    held = _write(tmp_path, [{"text": f"held {i}"} for i in range(4)], "held.jsonl")
    raw = {"model": str(tiny_model), "method": "lora", "data": str(train), "eval": {"data": str(held)}}
    recipe = validate_recipe(raw, tmp_path, "r")
    *_, stats = data_stats(recipe)
    without = data_stats(validate_recipe({**raw, "eval": {}}, tmp_path, "r"))[2]
    assert without.sha256 == load_data(str(train)).sha256  # a run without eval.data: as before
    assert stats.sha256 != without.sha256

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    (run.root / "data.json").write_text(json.dumps({"sha256": stats.sha256}))
    assert _data_changed(run, recipe, load_data(str(train), recipe.seed).sha256) is None
    held.write_text(held.read_text() + json.dumps({"text": "one more"}) + "\n")  # eval data edited during the run
    assert data_stats(recipe)[2].sha256 != stats.sha256  # the launch refuses the resume (prepare._prepare)
    why = _data_changed(run, recipe, load_data(str(train), recipe.seed).sha256)
    assert why and "the data changed since the launch checked it" in why and "--allow-changes" in why


# -- keys ftrun does not honour are refused, never dropped -------------------------------------------------------


@pytest.mark.parametrize(
    "turn, said",
    [
        (
            {"role": "assistant", "content": "Paris.", "weight": 0},
            "messages[1].weight is 0 on an assistant turn: a per-turn training switch ftrun cannot honour",
        ),
        ({"role": "assistant", "content": "Paris.", "train": False}, "messages[1].train is False on an assistant turn"),
        (
            {"role": "assistant", "content": "Paris.", "loss_mask": [0, 1]},
            "messages[1] has 'loss_mask', which ftrun does not read",
        ),
        (
            {"role": "assistant", "content": "Paris.", "mask": True, "id": 7},
            "messages[1] has 'id', 'mask', which ftrun does not read",
        ),
    ],
)
def test_a_per_turn_key_ftrun_does_not_honour_is_refused_with_its_line(tmp_path, turn, said):
    """OpenAI's and Axolotl's per-turn training weight ("weight": 0: do not train on this turn) and any other key
    in a message: refused with the line, never dropped while the turn trains anyway."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": "The capital of France?"},
                {"role": "assistant", "content": "Paris."},
            ]
        }
    ] * 3
    rows = rows + [{"messages": [{"role": "user", "content": "The capital of France?"}, turn]}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    msg = _error(str(path))
    assert "line 4" in msg and said in msg, msg


def test_a_turn_switched_on_is_what_ftrun_does_and_loads(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello.", "weight": 1}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello.", "train": True}]},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_data(str(path))
    assert [m for e in data.examples for m in e["messages"] if "weight" in m or "train" in m] == []


@pytest.mark.parametrize(
    "entry, said",
    [
        ({"split": "test"}, "split: test applies to Hub datasets"),
        ({"subset": "en"}, "subset: en applies to Hub datasets"),
        ({"revision": "main", "split": "validation"}, "split: validation, revision: main applies to Hub datasets"),
    ],
)
def test_a_hub_only_option_on_a_local_file_is_refused_naming_both(tmp_path, entry, said):
    from launcher.data.sources import sources_of

    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}) + "\n"
    )
    with pytest.raises(DataError) as err:
        sources_of([{"path": str(path), **entry}])
    assert said in err.value.message and str(path) in err.value.message and "read whole" in err.value.message
    assert sources_of([{"path": str(path), "split": "train"}])  # the default says nothing new: it loads
