"""Data written for the tools users leave, read as those tools read it or refused with the mapping to write:
LLaMA-Factory's dataset_info.json entries (alpaca with system and history, sharegpt with tools and the
function_call/observation roles, ranking pairs in either layout, kto_tag) and Axolotl's dataset types (alpaca,
chat_template with its field mappings, input_output, completion, the DPO types). Each file below is in the tool's
own layout, as its documentation and demo data write it (LLaMA-Factory data/dataset_info.json and data/*_demo.json;
Axolotl docs/dataset-formats/)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from launcher.data import llamafactory
from launcher.data.dataset import load_data
from launcher.errors import DataError

# ---------------------------------------------------------------------------------------------
# LLaMA-Factory

GLAIVE_TOOLS = [
    {
        "name": "generate_password",
        "description": "Generate a random password",
        "parameters": {"type": "object", "properties": {"length": {"type": "integer"}}, "required": ["length"]},
    }
]
LF_FILES = {
    "alpaca_demo.json": [
        {
            "instruction": "Add the numbers.",
            "input": "2+2",
            "output": "4",
            "system": "Be brief.",
            "history": [["Hi", "Hello."], ["Ready?", "Yes."]],
        },
        {"instruction": "Say hi.", "input": "", "output": "Hi."},
    ],
    "glaive_toolcall_demo.json": [
        {
            "conversations": [
                {"from": "human", "value": "A password of 12 characters, please."},
                {
                    "from": "function_call",
                    "value": json.dumps({"name": "generate_password", "arguments": {"length": 12}}),
                },
                {"from": "observation", "value": json.dumps({"password": "aB3$dE6&gH9*"})},
                {"from": "gpt", "value": "Here it is: aB3$dE6&gH9*"},
            ],
            "tools": json.dumps(GLAIVE_TOOLS),
        }
    ],
    "dpo_sharegpt_demo.json": [
        {
            "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "2+2?"}],
            "chosen": {"from": "gpt", "value": "4"},
            "rejected": {"from": "gpt", "value": "5"},
        }
    ],
    "dpo_alpaca_demo.json": [{"instruction": "Add the numbers.", "input": "2+2", "chosen": "4", "rejected": "5"}],
    "c4_demo.json": [{"text": "Once upon a time."}, {"text": "The end."}],
    "kto_demo.json": [
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}], "label": False},
        {"messages": [{"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}], "label": True},
    ],
}
LF_INFO = {
    "alpaca_demo": {
        "file_name": "alpaca_demo.json",
        "columns": {
            "prompt": "instruction",
            "query": "input",
            "response": "output",
            "system": "system",
            "history": "history",
        },
    },
    "alpaca_no_columns": {"file_name": "alpaca_demo.json"},
    "glaive_toolcall_demo": {
        "file_name": "glaive_toolcall_demo.json",
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "tools": "tools"},
    },
    "dpo_sharegpt_demo": {
        "file_name": "dpo_sharegpt_demo.json",
        "formatting": "sharegpt",
        "ranking": True,
        "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
    },
    "dpo_alpaca_demo": {
        "file_name": "dpo_alpaca_demo.json",
        "ranking": True,
        "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected"},
    },
    "kto_demo": {
        "file_name": "kto_demo.json",
        "formatting": "sharegpt",
        "columns": {"messages": "messages", "kto_tag": "label"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
    },
    "mllm_demo": {"file_name": "alpaca_demo.json", "columns": {"images": "images"}},
    "c4_demo": {"file_name": "c4_demo.json", "columns": {"prompt": "text"}},
    "modelscope_only": {"ms_hub_url": "llamafactory/alpaca_en"},
}


@pytest.fixture
def lf_dir(tmp_path) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    for name, records in LF_FILES.items():
        (folder / name).write_text(json.dumps(records, indent=2))
    (folder / "dataset_info.json").write_text(json.dumps(LF_INFO, indent=2))
    return folder


def _entry(folder: Path, name: str, **more):
    return load_data({"path": str(folder / "dataset_info.json"), "dataset": name, **more})


def _refusal(spec) -> DataError:
    with pytest.raises(DataError) as err:
        load_data(spec)
    return err.value


def test_llamafactory_alpaca_with_system_and_history_reads_as_llamafactory_reads_it(lf_dir):
    data = _entry(lf_dir, "alpaca_demo")
    first, second = data.examples
    # converter.py AlpacaDatasetConverter: the system apart, the history's pairs, then "instruction\ninput"
    assert first["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Ready?"},
        {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": "Add the numbers.\n2+2"},
        {"role": "assistant", "content": "4"},
    ]
    assert second["messages"] == [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}]
    assert data.describe().startswith("LLaMA-Factory alpaca, dataset_info.json entry 'alpaca_demo', 2 examples")
    # the folder (LLaMA-Factory's dataset_dir) names the same file
    assert load_data({"path": str(lf_dir), "dataset": "alpaca_demo"}).examples == data.examples
    # what the run records and a resume compares: the entry too, not only the data file
    assert data.sources[0]["dataset_info"]["dataset"] == "alpaca_demo"


def test_llamafactory_pretraining_entry_without_a_response_column_is_plain_text(lf_dir):
    # LLaMA-Factory's c4_demo: an alpaca entry whose one column is the prompt, the document of stage pt
    data = _entry(lf_dir, "c4_demo")
    assert data.examples == [{"text": "Once upon a time."}, {"text": "The end."}] and data.form == "text"
    assert "LLaMA-Factory alpaca (pre-training text)" in data.describe()


def test_llamafactory_keys_its_entry_does_not_name_are_refused_not_dropped(lf_dir):
    # LLaMA-Factory itself ignores system and history when the entry's columns do not name them
    err = _refusal({"path": str(lf_dir / "dataset_info.json"), "dataset": "alpaca_no_columns"})
    assert "alpaca_demo.json record 1: 'history', 'system' at the top of the record" in str(err)
    assert "dataset_info.json entry 'alpaca_no_columns' does not read" in str(err)
    # ignore: leaves them out, and the data line says so
    data = _entry(lf_dir, "alpaca_no_columns", ignore=["history", "system"])
    assert data.examples[0]["messages"] == [
        {"role": "user", "content": "Add the numbers.\n2+2"},
        {"role": "assistant", "content": "4"},
    ]
    assert "left out as the recipe's ignore: says: history, system" in data.describe()


def test_llamafactory_sharegpt_tools_and_function_call_observation_roles(lf_dir):
    (ex,) = _entry(lf_dir, "glaive_toolcall_demo").examples
    assert [m["role"] for m in ex["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert ex["messages"][1]["tool_calls"] == [
        {"type": "function", "function": {"name": "generate_password", "arguments": {"length": 12}}}
    ]
    assert ex["messages"][2]["content"] == json.dumps({"password": "aB3$dE6&gH9*"})
    # the JSON-text tools, each bare schema wrapped as LLaMA-Factory's tool formatters wrap it for the template
    assert ex["tools"] == [{"type": "function", "function": GLAIVE_TOOLS[0]}]


def test_llamafactory_sharegpt_turns_out_of_order_are_refused_where_it_skips_them(tmp_path, lf_dir):
    bad = [{"conversations": [{"from": "gpt", "value": "4"}, {"from": "human", "value": "2+2?"}]}]
    (lf_dir / "glaive_toolcall_demo.json").write_text(json.dumps(bad))
    err = _refusal({"path": str(lf_dir), "dataset": "glaive_toolcall_demo"})
    assert "conversations[0] is a assistant turn where LLaMA-Factory expects user or observation" in str(err)
    assert "it skips this record" in str(err)


@pytest.mark.parametrize("name", ["dpo_sharegpt_demo", "dpo_alpaca_demo"])
def test_llamafactory_ranking_pairs_in_either_layout(lf_dir, name):
    data = _entry(lf_dir, name)
    (ex,) = data.examples
    assert data.form == "preference"
    user = "2+2?" if name == "dpo_sharegpt_demo" else "Add the numbers.\n2+2"
    system = [{"role": "system", "content": "Be brief."}] if name == "dpo_sharegpt_demo" else []
    assert ex == {
        "prompt": system + [{"role": "user", "content": user}],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    }


def test_ranking_pairs_without_dataset_info_are_detected_as_pairs_and_refused_under_sft(tmp_path):
    """The issue's case: {conversations, chosen, rejected} was read as ShareGPT SFT data, its pairs dropped."""
    from types import SimpleNamespace

    from launcher.data.stats import objective_fits

    for name in ("dpo_sharegpt_demo.json", "dpo_alpaca_demo.json"):
        path = tmp_path / name.replace(".json", ".jsonl")
        path.write_text("".join(json.dumps(r) + "\n" for r in LF_FILES[name]))
        data = load_data(str(path))
        assert data.form == "preference", data.describe()
        assert data.examples[0]["rejected"] == [{"role": "assistant", "content": "5"}]
        with pytest.raises(DataError) as err:
            objective_fits(SimpleNamespace(objective="sft"), data.form, "data")
        assert "set objective: dpo" in err.value.fix
        objective_fits(SimpleNamespace(objective="dpo"), data.form, "data")


def test_llamafactory_kto_tag_is_the_unpaired_label_never_an_sft_target(lf_dir):
    from types import SimpleNamespace

    from launcher.data.stats import objective_fits

    assert llamafactory.unpaired_format() == "unpaired"  # TRL's {prompt, completion, label}, objective kto
    data = _entry(lf_dir, "kto_demo")
    assert [e["label"] for e in data.examples] == [False, True]
    assert data.examples[0]["completion"] == [{"role": "assistant", "content": "5"}]
    with pytest.raises(DataError, match="unpaired data, which objective sft does not train") as err:
        objective_fits(SimpleNamespace(objective="sft"), data.form, "data")
    assert "set objective: kto" in err.value.fix


def test_a_label_beside_sft_data_is_refused_not_trained(tmp_path):
    from types import SimpleNamespace

    from launcher.data.dataset import load_data
    from launcher.data.stats import objective_fits

    # a conversation that carries a label is an unpaired answer: objective kto trains it, SFT refuses it
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(LF_FILES["kto_demo.json"][0]) + "\n")
    data = load_data(str(path))
    assert data.examples[0]["label"] is False
    with pytest.raises(DataError, match="unpaired data, which objective sft does not train") as err:
        objective_fits(SimpleNamespace(objective="sft"), data.form, "data")
    assert "set objective: kto" in err.value.fix
    # one labelled record among chat records is refused by its line, never trained as a target (a record past the
    # lines the detection reads: tests/worker/test_kto.py)
    chat = {"messages": LF_FILES["kto_demo.json"][1]["messages"]}
    path.write_text(json.dumps(chat) + "\n" + json.dumps(chat) + "\n" + json.dumps(LF_FILES["kto_demo.json"][0]) + "\n")
    err = _refusal(str(path))
    assert "mixed formats" in str(err) and "d.jsonl line 3" in str(err) and "objective kto" in str(err)


def test_llamafactory_entries_it_cannot_read_are_refused_with_the_fix(lf_dir):
    assert "columns.images: ftrun reads images in its own chat layout" in str(
        _refusal({"path": str(lf_dir), "dataset": "mllm_demo"})
    )
    err = _refusal({"path": str(lf_dir), "dataset": "modelscope_only"})
    assert "ms_hub_url: ftrun reads local files and Hugging Face Hub datasets" in str(err)
    err = _refusal({"path": str(lf_dir), "dataset": "nope"})
    assert "defines no dataset 'nope'" in str(err) and "alpaca_demo" in str(err)
    err = _refusal({"path": str(lf_dir), "dataset": "alpaca_demo", "format": "alpaca"})
    assert "format beside dataset:" in str(err)


def test_a_recipe_points_at_a_dataset_info_entry(tmp_path, lf_dir):
    from launcher.recipe_loading import validate_recipe

    recipe = validate_recipe(
        {
            "model": "Qwen/Qwen3-0.6B",
            "method": "lora",
            "data": {"path": "data/dataset_info.json", "dataset": "glaive_toolcall_demo"},
        },
        base_dir=tmp_path,
        default_name="t",
    )
    assert recipe.data.dataset == "glaive_toolcall_demo"
    assert load_data(recipe.data).examples[0]["messages"][2]["role"] == "tool"


# ---------------------------------------------------------------------------------------------
# Axolotl


def _axolotl(tmp_path, records, **entry):
    path = tmp_path / "ax.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return load_data({"path": str(path), **entry})


def test_axolotl_alpaca_is_its_alpaca_prompt_text_with_the_output_trained(tmp_path):
    data = _axolotl(
        tmp_path,
        [{"instruction": "Add.", "input": "2+2", "output": "4"}, {"instruction": "Hi.", "output": "Hi."}],
        type="alpaca",
    )
    first, second = data.examples
    # prompters.py AlpacaPrompter, instruct style
    assert first == {
        "prompt": "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n### Instruction:\nAdd.\n\n### Input:\n2+2\n\n"
        "### Response:\n",
        "completion": "4",
    }
    assert second["prompt"].endswith("completes the request.\n\n### Instruction:\nHi.\n\n### Response:\n")
    assert data.form == "prompt_completion"


def test_axolotl_chat_template_with_its_field_mappings(tmp_path):
    records = [
        {
            "conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": "2+2?"},
                {"from": "gpt", "value": "4"},
                {"from": "human", "value": "3+3?"},
                {"from": "model", "value": "6"},
            ]
        }
    ]
    entry = dict(
        type="chat_template",
        field_messages="conversations",
        message_property_mappings={"role": "from", "content": "value"},
        roles={"user": ["human"], "assistant": ["gpt", "model"], "system": ["system"]},
    )
    (ex,) = _axolotl(tmp_path, records, **entry).examples
    assert [(m["role"], m["content"]) for m in ex["messages"]] == [
        ("system", "Be brief."),
        ("user", "2+2?"),
        ("assistant", "4"),
        ("user", "3+3?"),
        ("assistant", "6"),
    ]
    # the older spelling, and the default role names (human/user, gpt/assistant)
    old = dict(
        type="chat_template", field_messages="conversations", message_field_role="from", message_field_content="value"
    )
    assert _axolotl(tmp_path, [{"conversations": records[0]["conversations"][:3]}], **old).examples[0]["messages"][
        2
    ] == {"role": "assistant", "content": "4"}
    # a name the roles do not map is refused, with where to map it
    (tmp_path / "ax.jsonl").write_text(json.dumps(records[0]) + "\n")
    err = _refusal({"path": str(tmp_path / "ax.jsonl"), **old})
    assert "is 'model'; roles: names" in str(err) and "(add it under roles:)" in str(err)


def test_axolotl_input_output_trains_the_labelled_segments(tmp_path):
    segs = [{"text": "Q: 2+2?\n", "label": False}, {"text": "A: 4", "label": True}]
    (ex,) = _axolotl(tmp_path, [{"segments": segs}], type="input_output").examples
    assert ex == {"prompt": "Q: 2+2?\n", "completion": "A: 4"}
    (ex,) = _axolotl(tmp_path, [{"segments": [{"text": "All of it.", "label": True}]}], type="input_output").examples
    assert ex == {"text": "All of it."}
    # two trained spans with untrained text between: TRL trains one completion; refused with the record to write
    two = segs + [{"text": "\nQ: 3+3?\n", "label": False}, {"text": "A: 6", "label": True}]
    with pytest.raises(DataError, match="2 trained spans with untrained text between or after them"):
        _axolotl(tmp_path, [{"segments": two}], type="input_output")


def test_axolotl_completion_reads_its_field(tmp_path):
    (ex,) = _axolotl(tmp_path, [{"body": "Once upon a time."}], type="completion", field="body").examples
    assert ex == {"text": "Once upon a time."}


@pytest.mark.parametrize(
    "kind, record, system, user",
    [
        (
            "chatml.intel",
            {"system": "Be brief.", "question": "2+2?", "chosen": "4", "rejected": "5"},
            "Be brief.",
            "2+2?",
        ),
        ("chatml.prompt_pairs", {"prompt": "2+2?", "chosen": "4", "rejected": "5"}, None, "2+2?"),
        ("llama3.icr", {"input": "2+2?", "chosen": "4", "rejected": "5"}, None, "2+2?"),
        (
            "chatml.ultra",
            {
                "prompt": "2+2?",
                "chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
                "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}],
            },
            None,
            "2+2?",
        ),
        (
            "llama3.argilla_chat",
            {
                "chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
                "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}],
            },
            None,
            "2+2?",
        ),
        (
            "chat_template.default",
            {
                "messages": [{"role": "user", "content": "2+2?"}],
                "chosen": {"role": "assistant", "content": "4"},
                "rejected": {"role": "assistant", "content": "5"},
            },
            None,
            "2+2?",
        ),
    ],
)
def test_axolotl_dpo_types_are_preference_pairs(tmp_path, kind, record, system, user):
    data = _axolotl(tmp_path, [record], type=kind)
    assert data.form == "preference"
    assert data.examples == [
        {
            "prompt": ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}],
            "chosen": [{"role": "assistant", "content": "4"}],
            "rejected": [{"role": "assistant", "content": "5"}],
        }
    ]


def test_axolotl_types_and_keys_ftrun_reads_otherwise_are_refused_with_the_mapping(tmp_path):
    path = tmp_path / "ax.jsonl"
    path.write_text(
        json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}) + "\n"
    )
    err = _refusal({"path": str(path), "type": "sharegpt"})
    assert (
        "type: chat_template, field_messages: conversations, message_property_mappings: {role: from, content: value}"
        in str(err)
    )
    err = _refusal({"path": str(path), "type": "chat_template", "roles_to_train": ["user", "assistant"]})
    assert "set assistant_only_loss: false to train every turn" in str(err)
    err = _refusal({"path": str(path), "type": "completion", "field_messages": "conversations"})
    assert "field_messages: type completion does not read it" in str(err)
    err = _refusal({"path": str(path), "field_messages": "conversations"})
    assert "field_messages is Axolotl's field mappings, read with its type:" in str(err)
    err = _refusal({"path": str(path), "type": "chatml.nonesuch"})
    assert "not one of Axolotl's DPO types ftrun reads (chatml.default, chatml.intel" in str(err)
    # a message key the mapping does not read: refused, never dropped
    path.write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "q", "mood": "calm"}, {"role": "assistant", "content": "a"}]}
        )
        + "\n"
    )
    err = _refusal({"path": str(path), "type": "chat_template"})
    assert "messages[0] has 'mood', which the mapping does not read" in str(err)
    # a turn switched off (Axolotl's per-turn training) is refused by ftrun's own rule, with its line
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "q", "weight": 0}, {"role": "assistant", "content": "a"}]})
        + "\n"
    )
    err = _refusal({"path": str(path), "type": "chat_template"})
    assert "messages[0].weight is 0 on a user turn: a per-turn training switch ftrun cannot honour" in str(err)


def test_a_recipe_takes_an_axolotl_entry_as_axolotl_writes_it(tmp_path):
    from launcher.recipe_loading import validate_recipe

    recipe = validate_recipe(
        {
            "model": "Qwen/Qwen3-0.6B",
            "method": "lora",
            "data": [
                {
                    "path": "chat.jsonl",
                    "type": "chat_template",
                    "field_messages": "conversations",
                    "message_property_mappings": {"role": "from", "content": "value"},
                }
            ],
        },
        base_dir=tmp_path,
        default_name="t",
    )
    (tmp_path / "chat.jsonl").write_text(
        json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}) + "\n"
    )
    data = load_data(recipe.data)
    assert data.examples[0]["messages"] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert data.sources[0]["type"] == "chat_template"


def test_llamafactory_openai_formatting_keeps_tool_calls_and_tool_results(tmp_path):
    calls = [{"type": "function", "function": {"name": "lights", "arguments": {"room": "kitchen"}}}]
    record = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Lights on."},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "content": "ok"},
            {"role": "tool", "content": "ok too"},
            {"role": "assistant", "content": "Done."},
        ]
    }
    (tmp_path / "oai.json").write_text(json.dumps([record]))
    tags = {
        "role_tag": "role",
        "content_tag": "content",
        "user_tag": "user",
        "assistant_tag": "assistant",
        "observation_tag": "tool",
        "system_tag": "system",
    }
    info = {"oai": {"file_name": "oai.json", "formatting": "openai", "columns": {"messages": "messages"}, "tags": tags}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    (ex,) = load_data({"path": str(tmp_path), "dataset": "oai"}).examples
    assert [m["role"] for m in ex["messages"]] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert ex["messages"][2]["tool_calls"] == calls
    # a bad record shows the entry's own layout as the example to follow
    (tmp_path / "oai.json").write_text(json.dumps([{"messages": [{"role": "user", "content": "hi"}]}]))
    err = _refusal({"path": str(tmp_path), "dataset": "oai"})
    assert "ends with a user or observation turn" in str(err)
    assert '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}' in err.fix


def test_llamafactory_columns_and_tags_given_are_the_only_ones_read(lf_dir):
    """DatasetAttr.join: an entry with columns reads those alone (orca_pairs' columns have no query: its input is not
    read); with tags, an unnamed tag is unset (kto_en_demo's tags have no system_tag)."""
    info = json.loads((lf_dir / "dataset_info.json").read_text())
    info["no_query"] = {"file_name": "alpaca_demo.json", "columns": {"prompt": "instruction", "response": "output"}}
    (lf_dir / "dataset_info.json").write_text(json.dumps(info))
    err = _refusal({"path": str(lf_dir), "dataset": "no_query", "ignore": ["system", "history"]})
    assert "'input' at the top of the record, which the dataset_info.json entry 'no_query' does not read" in str(err)
    kto = json.loads((lf_dir / "kto_demo.json").read_text())
    kto[0]["messages"].insert(0, {"role": "system", "content": "Be brief."})
    (lf_dir / "kto_demo.json").write_text(json.dumps(kto))
    err = _refusal({"path": str(lf_dir), "dataset": "kto_demo"})
    assert "messages[0].role is 'system'; the entry's tags name user: user, assistant: assistant" in str(err)
    assert 'add the tag, e.g. "system_tag": "system"' in str(err)


def test_axolotl_chat_template_keeps_tool_calls_and_decodes_their_json_arguments(tmp_path):
    record = {
        "messages": [
            {"role": "user", "content": "Lights on."},
            {
                "role": "assistant",
                "tool_calls": [{"type": "function", "function": {"name": "lights", "arguments": '{"room": "hall"}'}}],
            },
            {"role": "tool", "name": "lights", "content": "ok"},
            {"role": "assistant", "content": "Done."},
        ],
        "tools": [{"type": "function", "function": {"name": "lights", "parameters": {"type": "object"}}}],
    }
    (ex,) = _axolotl(tmp_path, [record], type="chat_template").examples
    assert ex["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"room": "hall"}
    assert ex["messages"][2] == {"role": "tool", "content": "ok", "name": "lights"}
    assert ex["tools"] == record["tools"]


def test_every_axolotl_type_and_key_is_a_data_entry_key_and_documented():
    from launcher.data import axolotl
    from launcher.recipe_sections import DataSource

    docs = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    assert set(axolotl.OPTION_DEFAULTS) <= set(DataSource.model_fields)
    for name, t in axolotl.TYPES.items():
        assert set(t.options) <= set(axolotl.OPTION_DEFAULTS), name
        assert name.split(".")[0] in docs and t.example and t.description, name
    for key in (*axolotl.OPTION_DEFAULTS, *llamafactory.COLUMNS, *llamafactory.DEFAULT_TAGS, *llamafactory.ENTRY_KEYS):
        assert re.search(rf"`{key}[`:]", docs), key
