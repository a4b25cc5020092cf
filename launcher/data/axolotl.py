"""Axolotl's dataset types (a data entry's `type:` and its field mappings): each record read as Axolotl reads it, as
a record of one of ftrun's formats (launcher/data/formats.py), or the type refused with the mapping to write.

As Axolotl defines them (axolotl docs/dataset-formats/, src/axolotl/prompt_strategies/); each type and what it
trains as: docs/data.md, "Axolotl". DPO prompts Axolotl writes as ChatML or Llama 3 text ftrun renders with the
model's chat template, the one it is served with.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

from launcher.data import formats

RecordProblem = formats.RecordProblem

# AlpacaPrompter, the instruct style (Axolotl's default prompt style for type: alpaca)
ALPACA_SYSTEM = (
    "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
    "response that appropriately completes the request."
)
ALPACA_SYSTEM_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request."
)
ALPACA_TURN = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_TURN_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"

# chat_template's default role names (ChatTemplatePrompter: roles left out)
DEFAULT_ROLES = dict(human="user", user="user", assistant="assistant", gpt="assistant", system="system", tool="tool")

# A data entry's Axolotl keys (recipe_sections.DataSource) and the types that read them; defaults as Axolotl's.
OPTION_DEFAULTS: dict[str, Any] = {
    "field_messages": "messages",
    "message_property_mappings": None,
    "message_field_role": "role",
    "message_field_content": "content",
    "roles": None,
    "roles_to_train": ["assistant"],
    "train_on_eos": "turn",
    "field_system": "system",
    "field_tools": "tools",
    "drop_system_message": False,
    "field": "text",
    "field_chosen": "chosen",
    "field_rejected": "rejected",
}


@dataclass(frozen=True)
class Type:
    description: str
    options: tuple[str, ...]  # the entry's Axolotl keys it reads
    convert: Callable[[dict, dict], tuple[str, dict[str, Any]]]  # (record, options) -> (ftrun format, record)
    example: str


_string = functools.partial(formats._text, blank_ok=True)  # Axolotl reads an empty string as it is


def _alpaca(record: dict, o: dict) -> tuple[str, dict[str, Any]]:
    formats.check_top_keys(record, "", ("instruction", "input", "output"), "Axolotl's type alpaca")
    instruction, output = _string(record, "instruction"), _string(record, "output")
    extra = _string(record, "input", False)
    if extra:
        prompt = f"{ALPACA_SYSTEM}\n\n" + ALPACA_TURN.format(instruction=instruction, input=extra)
    else:
        prompt = f"{ALPACA_SYSTEM_NO_INPUT}\n\n" + ALPACA_TURN_NO_INPUT.format(instruction=instruction)
    return "prompt_completion", {"prompt": prompt, "completion": output}


def _completion(record: dict, o: dict) -> tuple[str, dict[str, Any]]:
    key = o["field"]
    formats.check_top_keys(record, "", (key,), f"Axolotl's type completion (field: {key})")
    return "text", {"text": _string(record, key)}


def _input_output(record: dict, o: dict) -> tuple[str, dict[str, Any]]:
    formats.check_top_keys(record, "", ("segments",), "Axolotl's type input_output")
    segments = record.get("segments")
    if not isinstance(segments, list) or not segments:
        raise RecordProblem("'segments' must be a non-empty list of {text, label} objects")
    parts: list[tuple[str, bool]] = []
    for i, seg in enumerate(segments):
        if not isinstance(seg, dict) or not isinstance(seg.get("text"), str) or not isinstance(seg.get("label"), bool):
            raise RecordProblem(f'segments[{i}] must be {{"text": "...", "label": true or false}}')
        extra = sorted(k for k in seg if k not in ("text", "label"))
        if extra:
            raise RecordProblem(f"segments[{i}] has {', '.join(map(repr, extra))}, which Axolotl does not read")
        parts.append((seg["text"], seg["label"]))
    labels = [lab for _, lab in parts]
    if not any(labels):
        raise RecordProblem("no segment has label: true: there is nothing to train on in this record")
    first = labels.index(True)
    if not all(labels[first:]):
        spans = sum(1 for i, lab in enumerate(labels) if lab and (i == 0 or not labels[i - 1]))
        raise RecordProblem(
            f"the segments hold {spans} trained spans with untrained text between or after them: TRL trains one "
            "completion after one prompt, so the untrained segments must all come first; write one record per "
            "trained span (the text before it unlabelled, the span labelled), or drop the untrained text after it"
        )
    prompt = "".join(text for text, _ in parts[:first])
    completion = "".join(text for text, _ in parts[first:])
    if not prompt:
        return "text", {"text": completion}
    return "prompt_completion", {"prompt": prompt, "completion": completion}


def _role_map(o: dict) -> dict[str, str]:
    roles = o.get("roles")
    if not roles:
        return dict(DEFAULT_ROLES)
    if not isinstance(roles, dict) or not all(isinstance(v, list) for v in roles.values()):
        raise RecordProblem("roles: maps each role to the names the data gives it, e.g. {assistant: [gpt, model]}")
    return {name: role for role, names in roles.items() for name in names}


def _properties(o: dict) -> dict[str, str]:
    """The message's key for each property: message_property_mappings, else message_field_role / _content."""
    mapped = dict(o.get("message_property_mappings") or {})
    mapped.setdefault("role", o["message_field_role"])
    mapped.setdefault("content", o["message_field_content"])
    return mapped


def _message(m: Any, where: str, props: dict[str, str], roles: dict[str, str]) -> dict[str, Any]:
    """One message as Axolotl's transform_message makes it: the mapped properties, the role through `roles`, the
    KEPT_FIELDS kept (the data check refuses a template that drops them), tool-call arguments decoded from JSON."""
    if not isinstance(m, dict):
        raise RecordProblem(f"{where} is not an object")
    mapped = set(props.values())
    unread = sorted(k for k in m if k not in (*mapped, *formats.KEPT_FIELDS, *formats.TRAINING_SWITCHES))
    if unread:
        raise RecordProblem(
            f"{where} has {', '.join(map(repr, unread))}, which the mapping does not read (message_property_mappings "
            f"reads {', '.join(f'{p}: {k}' for p, k in props.items())}, and {', '.join(formats.KEPT_FIELDS)} as they "
            "are); a key that is not honoured is refused, not dropped in silence: map it or remove it"
        )
    name = m.get(props["role"])
    role = roles.get(name)
    if role is None:
        raise RecordProblem(
            f"{where}.{props['role']} is {name!r}; roles: names {', '.join(sorted(roles))} (add it under roles:)"
        )
    out = {prop: m[key] for prop, key in props.items() if key in m}
    out.update({k: m[k] for k in m if k not in mapped and m[k] is not None})
    out["role"] = role
    for i, call in enumerate(out.get("tool_calls") or []):
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            fn["arguments"] = formats._maybe_json(fn["arguments"], f"{where}.tool_calls[{i}].function.arguments")
    return out


def _chat_template(record: dict, o: dict) -> tuple[str, dict[str, Any]]:
    key, system_key, tools_key = o["field_messages"], o["field_system"], o["field_tools"]
    formats.check_top_keys(
        record, "", (key, system_key, tools_key), f"Axolotl's type chat_template (field_messages: {key})"
    )
    msgs = formats._maybe_json(record.get(key), key)
    if not isinstance(msgs, list) or not msgs:
        raise RecordProblem(f"'{key}' (field_messages) must be a non-empty list of messages")
    props, roles = _properties(o), _role_map(o)
    out = [_message(m, f"{key}[{i}]", props, roles) for i, m in enumerate(msgs)]
    if out[0]["role"] != "system" and record.get(system_key) not in (None, ""):
        out.insert(0, {"role": "system", "content": _string(record, system_key)})
    if o["drop_system_message"] and out[0]["role"] == "system":
        out = out[1:]
    example: dict[str, Any] = {"messages": out}
    if record.get(tools_key) not in (None, "", []):
        example["tools"] = record[tools_key]
    return "messages", example


def _dpo(prompt_keys: tuple[str, ...], answers: str) -> Callable[[dict, dict], tuple[str, dict[str, Any]]]:
    """An Axolotl chatml.* / llama3.* DPO type: the user text from the first of `prompt_keys` (else chosen's first
    message), an optional system; the answers as "strings", or each side's "second" message."""

    def convert(record: dict, o: dict) -> tuple[str, dict[str, Any]]:
        chosen_key = "chosen" if "chosen" in record or answers != "strings" else "chosen_response"
        rejected_key = "rejected" if "rejected" in record or answers != "strings" else "rejected_response"
        prompt_key = next((k for k in prompt_keys if k in record), prompt_keys[-1] if prompt_keys else None)
        reads = [k for k in (prompt_key, chosen_key, rejected_key) if k] + (["system"] if prompt_keys else [])
        formats.check_top_keys(record, "", reads, "this Axolotl DPO type")
        if answers == "strings":
            chosen, rejected = _string(record, chosen_key), _string(record, rejected_key)
        else:
            chosen, rejected = (_second(record, k) for k in (chosen_key, rejected_key))
        user = _string(record, prompt_key) if prompt_key else _first_user(record, chosen_key)
        system = _string(record, "system", False) if prompt_keys else ""
        prompt = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return "preference", {
            "prompt": prompt,
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}],
        }

    return convert


def _second(record: dict, key: str) -> str:
    msgs = formats._maybe_json(record.get(key), key)
    if not isinstance(msgs, list) or len(msgs) < 2 or not isinstance(msgs[1], dict):
        raise RecordProblem(
            f"'{key}' must be a conversation [user message, assistant message] (this type reads its "
            "second message's content)"
        )
    content = msgs[1].get("content")
    if not isinstance(content, str):
        raise RecordProblem(f"'{key}'[1].content must be a string, found {type(content).__name__}")
    return content


def _first_user(record: dict, key: str) -> str:
    msgs = formats._maybe_json(record.get(key), key)
    content = msgs[0].get("content") if isinstance(msgs, list) and msgs and isinstance(msgs[0], dict) else None
    if not isinstance(content, str):
        raise RecordProblem(f"'{key}'[0].content (the user's question) must be a string")
    return content


def _dpo_chat_template(record: dict, o: dict) -> tuple[str, dict[str, Any]]:
    key, ck, rk = o["field_messages"], o["field_chosen"], o["field_rejected"]
    formats.check_top_keys(record, "", (key, ck, rk), "Axolotl's type chat_template.default")
    props, roles = _properties(o), _role_map(o)
    msgs = formats._maybe_json(record.get(key), key)
    if isinstance(msgs, str):
        msgs = [{props["role"]: next(n for n, r in roles.items() if r == "user"), props["content"]: msgs}]
    if not isinstance(msgs, list) or not msgs:
        raise RecordProblem(f"'{key}' (field_messages) must be the prompt: a list of messages, or a string")
    prompt = [_message(m, f"{key}[{i}]", props, roles) for i, m in enumerate(msgs)]

    def answer(k: str) -> list[dict[str, Any]]:
        raw = formats._maybe_json(record.get(k), k)
        return [{"role": "assistant", "content": raw}] if isinstance(raw, str) else [_message(raw, k, props, roles)]

    return "preference", {"prompt": prompt, "chosen": answer(ck), "rejected": answer(rk)}


_CHAT_OPTIONS = tuple(OPTION_DEFAULTS)[:10]  # field_messages ... drop_system_message
_DPO_PAIRS = '{"prompt": [...], "chosen": "...", "rejected": "..."}'
TYPES: dict[str, Type] = {
    "alpaca": Type(
        "Axolotl alpaca (its Alpaca prompt text, the output trained)",
        (),
        _alpaca,
        '{"instruction": "...", "input": "..." (optional), "output": "..."}',
    ),
    "completion": Type(
        "Axolotl completion (raw text, every token trained)", ("field",), _completion, '{"text": "..."}'
    ),
    "input_output": Type(
        "Axolotl input_output (the labelled segments trained)",
        (),
        _input_output,
        '{"segments": [{"text": "...", "label": false}, {"text": "...", "label": true}]}',
    ),
    "chat_template": Type(
        "Axolotl chat_template (the model's chat template, the assistant turns trained)",
        _CHAT_OPTIONS,
        _chat_template,
        '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}',
    ),
    "chat_template.default": Type(
        "Axolotl DPO chat_template.default (prompt messages, chosen and rejected)",
        (*_CHAT_OPTIONS[:5], "field_chosen", "field_rejected"),
        _dpo_chat_template,
        '{"messages": [{"role": "user", "content": "..."}], "chosen": {"role": "assistant", "content": "..."}, '
        '"rejected": {"role": "assistant", "content": "..."}}',
    ),
}
# Axolotl's DPO prompt strategies (dpo/chatml.py, dpo/llama3.py): the keys each reads
DPO_STRATEGIES = {
    "default": (("prompt", "input", "question", "instruction"), "strings"),
    "intel": (("question",), "strings"),
    "prompt_pairs": (("prompt",), "strings"),
    "icr": (("input",), "strings"),
    "ultra": (("prompt",), "second"),
    "argilla_chat": ((), "second"),
}
for _family in ("chatml", "llama3"):
    for _name, (_keys, _answers) in DPO_STRATEGIES.items():
        TYPES[f"{_family}.{_name}"] = Type(
            f"Axolotl DPO {_family}.{_name} (rendered with the model's chat template)",
            (),
            _dpo(_keys, _answers),
            '{"chosen": [{"role": "user", ...}, {"role": "assistant", ...}], "rejected": [...]}'
            if _name == "argilla_chat"
            else "{" + f'"{_keys[0]}": "...", "chosen": "...", "rejected": "..."' + "}",
        )

# types Axolotl has that ftrun reads otherwise: the mapping to write instead
REFUSED = {
    "sharegpt": "Axolotl's sharegpt type was replaced by chat_template: write type: chat_template, field_messages: "
    "conversations, message_property_mappings: {role: from, content: value}, or leave type: out (ftrun detects "
    "ShareGPT conversations itself)",
    "messages": "write type: chat_template (the messages under field_messages), or leave type: out",
    "alpaca_chat": "ftrun renders instruction data with the model's chat template when type: is left out (format: "
    "alpaca)",
    "alpaca_w_system": "ftrun renders instruction data with the model's chat template when type: is left out (format: "
    "alpaca, with a system key)",
    "pretrain": "write type: completion (raw text, every token trained)",
}


def type_problem(name: str, given: dict[str, Any]) -> Optional[str]:
    """Why the entry's type: and Axolotl keys cannot be read as Axolotl reads them (the mapping to write), or None."""
    if name in REFUSED:
        return f"type: {name}: {REFUSED[name]}"
    if name not in TYPES:
        family = name.split(".")[0]
        if family in ("chatml", "llama3", "chat_template") and "." in name:
            near = [t for t in TYPES if t.startswith(family + ".")]
            return f"type: {name}: not one of Axolotl's DPO types ftrun reads ({', '.join(near)})"
        return (
            f"type: {name}: not an Axolotl type ftrun reads ({', '.join(TYPES)}); convert the data to one of "
            "ftrun's formats (docs/data.md), or to one of these types"
        )
    t = TYPES[name]
    extra = [k for k in given if k not in t.options]
    if extra:
        return (
            f"{', '.join(extra)}: type {name} does not read {'it' if len(extra) == 1 else 'them'} (it reads "
            + (", ".join(t.options) or "no field mappings")
            + ")"
        )
    roles_to_train = given.get("roles_to_train", OPTION_DEFAULTS["roles_to_train"])
    if roles_to_train != ["assistant"]:
        return (
            f"roles_to_train: {roles_to_train}: ftrun trains the assistant turns (answers-only loss, the default) or "
            "the whole conversation (assistant_only_loss: false); remove roles_to_train, or set "
            "assistant_only_loss: false to train every turn"
        )
    if given.get("train_on_eos", "turn") != "turn":
        return (
            f"train_on_eos: {given['train_on_eos']}: ftrun trains each assistant turn's end-of-turn token (Axolotl's "
            "turn, the default); remove train_on_eos"
        )
    return None


def convert(name: str, given: dict[str, Any], record: dict) -> tuple[str, dict[str, Any]]:
    """One record of Axolotl type `name` (with the entry's Axolotl keys `given`): (ftrun's format, the record)."""
    options = {**OPTION_DEFAULTS, **given}
    return TYPES[name].convert(record, options)
