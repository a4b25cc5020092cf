"""Dataset formats: detect a source's format from its first records and convert each record to the form TRL trains.

The canonical forms (FORMS; docs/data.md, "Formats"): chat and prompt_completion and text as `SFTTrainer` takes
them (trl 1.16.0 `sft_trainer.py` `_prepare_dataset`), prompt as GRPO (`grpo_trainer.py`), preference as
`DPOTrainer`/`ORPOTrainer` (`dpo_trainer.py` `_prepare_dataset`; an implicit prompt split as `extract_prompt` does),
unpaired as `KTOTrainer` (`kto_trainer.py`). A `label` is honoured by objective kto alone, refused elsewhere.
Alpaca and ShareGPT records become chat. A problem with a record is a `RecordProblem` naming the field.

The recipe's `format:` values, the detection, the "expected one of" text, the bad-record advice and the dataset's
columns derive from the two tables FORMS and FORMATS; tests/test_tables.py walks every entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from launcher.errors import json_problem


@dataclass(frozen=True)
class Form:
    marker: str  # the key a converted example of this form has (example_form reads them in FORMS' order)
    columns: tuple[str, ...]  # the dataset columns it trains from (dataset.py to_dataset)
    reads_as: str  # how a user reads it


@dataclass(frozen=True)
class Format:
    description: str  # what the plan and the errors say
    form: str  # the FORMS entry it trains as
    keys: tuple[str, ...]  # a record with all of these keys is in this format (the first match in table order wins)
    example: str  # one record, as the bad-record advice shows it
    convert: Callable[[dict, Optional[str]], dict[str, Any]]  # a record to its form (a RecordProblem if it cannot)
    native: bool  # its records already are its form (nothing is renamed, split or assembled)
    reads: tuple[str, ...] = ()  # the keys at the top of a record it honours besides `keys` (check_top_keys)

    def honoured(self) -> tuple[str, ...]:
        return (*self.keys, *self.reads)


# A pair's two answers in the order TRL batches them (dpo_trainer.py DataCollatorForPreference), and a pair's keys.
SIDES = ("chosen", "rejected")
PAIR_KEYS = ("prompt", *SIDES)
# An unpaired answer's mark: true desirable, false undesirable (TRL's unpaired preference "label" column)
LABEL = "label"

# In the order example_form tells them apart (a pair and a prompt/completion have a prompt too: before prompt).
FORMS: dict[str, Form] = {
    "chat": Form("messages", ("messages",), "chat (the model's chat template)"),
    "preference": Form(SIDES[0], PAIR_KEYS, "preference pairs"),
    "unpaired": Form(LABEL, ("prompt", "completion", LABEL), "unpaired answers marked desirable or undesirable"),
    "prompt_completion": Form("completion", ("prompt", "completion"), "prompt/completion"),
    "prompt": Form("prompt", ("prompt", "reference"), "prompts (GRPO samples the answers)"),
    "text": Form("text", ("text",), "plain text (no chat template)"),
}

# The keys of a converted example; any other is a column kept for GRPO's rewards (dataset.py load_data `columns`)
EXAMPLE_KEYS = tuple(dict.fromkeys(k for f in FORMS.values() for k in (f.marker, *f.columns))) + ("tools", "images")
# What the formats read besides their detection keys: not kept as columns of their own.
READ_KEYS = ("input", "system", "history", "conversations", "instruction", "output")


def other_columns(example: dict[str, Any]) -> dict[str, Any]:
    """The record's columns an example keeps besides its form's own keys (the data's `answer`, `id`, ...)."""
    return {k: v for k, v in example.items() if k not in EXAMPLE_KEYS}


def canonical(example: Any) -> Any:
    """The example without the columns kept beside it: what it trains on, for comparisons of examples."""
    return {k: v for k, v in example.items() if k in EXAMPLE_KEYS} if isinstance(example, dict) else example


ROLES = ("system", "user", "assistant", "tool")
# Message fields kept besides role and content; dataset.py checks that the chat template renders them.
KEPT_FIELDS = ("tool_calls", "tool_call_id", "name", "reasoning_content", "thinking", "reasoning")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Per-turn training switches (OpenAI's "weight", Axolotl's message_field_training "train"): ftrun trains every
# assistant turn alike, so a turn switched on is accepted and one switched off is refused.
TRAINING_SWITCHES = ("weight", "train", "training")
# ShareGPT's role names as Axolotl, LLaMA-Factory and FastChat write them
SHAREGPT_ROLES = {
    **dict.fromkeys(("human", "user"), "user"),
    **dict.fromkeys(("gpt", "assistant", "model", "chatgpt", "bard", "bing", "function_call"), "assistant"),
    **dict.fromkeys(("system",), "system"),
    **dict.fromkeys(("tool", "observation", "function_response", "ipython"), "tool"),
}
DETECT_LINES = 20  # records read to detect a source's format


class RecordProblem(ValueError):
    """One record does not fit its format; the message names the field."""


def describe(fmt: str) -> str:
    return FORMATS[fmt].description


def form(fmt: str) -> str:
    return FORMATS[fmt].form


def example(fmt: str) -> str:
    return FORMATS[fmt].example


def listed(last: str = ", ") -> str:
    """The format names, for help texts and error messages ("a, b or c" with last=" or ")."""
    names = list(FORMATS)
    return ", ".join(names[:-1]) + last + names[-1]


def detect_one(record: Any) -> Optional[str]:
    if not isinstance(record, dict):
        return None
    return next((name for name, f in FORMATS.items() if all(k in record for k in f.keys)), None)


def detect(first: Iterable[tuple[str, Any]]) -> tuple[Optional[str], Optional[str]]:
    """(format, None) from the first records ((where, record) pairs), or (None, why not)."""
    seen: dict[str, str] = {}  # format -> first place
    unknown: Optional[tuple[str, Any]] = None
    for where, record in first:
        fmt = detect_one(record)
        if fmt is None:
            unknown = unknown or (where, record)
            continue
        seen.setdefault(fmt, where)
    if len(seen) > 1:
        return None, (
            "mixed formats: "
            + ", ".join(f"{describe(f)} from {w}" for f, w in seen.items())
            + "; one format per source (list several sources under data: to mix them)"
        )
    if seen:
        return next(iter(seen)), None
    if unknown is None:
        return None, "no records"
    where, record = unknown
    keys = ", ".join(sorted(record)) if isinstance(record, dict) else f"a JSON {type(record).__name__}, not an object"
    expected = ", ".join(" + ".join(f.keys) for f in FORMATS.values())
    return None, f"{where} is in no known format (keys: {keys or 'none'}); expected one of: {expected}"


def convert(record: Any, fmt: str, columns: bool = False) -> dict[str, Any]:
    """The canonical example for one record of format `fmt`; `RecordProblem` naming the field otherwise. `columns`:
    the record's other keys are kept as columns (GRPO's rewards get them by name), so none is refused."""
    if not isinstance(record, dict):
        raise RecordProblem(f"expected a JSON object, found {type(record).__name__}")
    if LABEL in record and FORMATS[fmt].form != "unpaired" and not columns:  # KTO's label: its own refusal first
        raise RecordProblem(
            f"'{LABEL}' ({record[LABEL]!r}) marks an answer desirable or undesirable, which only objective kto "
            f"trains, on {describe('unpaired')} records; a key that is not honoured is refused, not dropped in "
            f"silence: write the record as {example('unpaired')} and set objective: kto, or remove '{LABEL}'"
        )
    if all(k in record for k in FORMATS[fmt].keys) and not columns:  # else the converter names the missing key
        check_top_keys(record, fmt)
    other = detect_one(record)
    return FORMATS[fmt].convert(record, other)


# What the refusal of a key at the top of a record says of it (a key not here is refused all the same)
TOP_KEY_MEANINGS = {
    "label": "an unpaired preference label (KTO's desirable/undesirable): a preference objective that trains "
    "unpaired data reads it, no other",
    "kto_tag": "LLaMA-Factory's KTO label: read through the dataset_info.json entry (data: {path: dataset_info.json, "
    "dataset: NAME}) whose columns name it kto_tag",
    "chosen": "the preferred answer of a preference pair: objective dpo or orpo reads it, with 'prompt' and 'rejected'",
    "rejected": "the dispreferred answer of a preference pair: objective dpo or orpo reads it, with 'prompt' and "
    "'chosen'",
    "images": "images: a chat record's images, read as image data where the record holds one (docs/data.md, Images); "
    "an empty list holds none",
    "videos": "videos: ftrun trains text and images, no videos",
    "audios": "audio: ftrun trains text and images, no audio",
    "weight": "a per-example weight: ftrun trains every example alike (a source's weight: repeats its examples)",
    "segments": "Axolotl's input_output segments: read with type: input_output in the data entry",
}


def check_top_keys(record: dict, fmt: str, honoured: Optional[Iterable[str]] = None, how: str = "") -> None:
    """A RecordProblem naming each key at the top of `record` that format `fmt` (or the keys `honoured`, read `how`)
    does not read. An empty value (None, "") holds nothing to drop (a CSV column other rows fill)."""
    known = tuple(honoured) if honoured is not None else FORMATS[fmt].honoured()
    unknown = sorted(k for k, v in record.items() if k not in known and v not in (None, ""))
    if not unknown:
        return
    meanings = "".join(f"; '{k}' is {TOP_KEY_MEANINGS[k]}" for k in unknown if k in TOP_KEY_MEANINGS)
    raise RecordProblem(
        f"{', '.join(repr(k) for k in unknown)} at the top of the record, which {how or describe(fmt)} does not read "
        f"(it reads {', '.join(known)}){meanings}; a key that is not honoured is refused, not dropped in silence: "
        "remove it, map it to a field the format reads (columns: in the data entry; a dataset_info.json entry's "
        "columns), or name it under ignore: in the data entry to leave it out (the plan says so)"
    )


def _require(record: dict, keys: Iterable[str], fmt: str, other: Optional[str]) -> None:
    """A RecordProblem naming the first of `keys` that `record` lacks (and the format it looks like instead)."""
    for key in keys:
        if key not in record:
            present = ", ".join(sorted(record)) or "none"
            looks = (
                f"; this record looks like {describe(other)}: one format per source" if other and other != fmt else ""
            )
            raise RecordProblem(f"no '{key}' key (keys present: {present}){looks}")


def _text(record: dict, key: str, required: bool = True, blank_ok: bool = False) -> str:
    """The string under `key` ("" where it is missing and not `required`); a RecordProblem otherwise."""
    value = record.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise RecordProblem(f"'{key}' must be a string, found {type(value).__name__}")
    if required and not blank_ok and not value.strip():
        raise RecordProblem(f"'{key}' is empty")
    return value


def _maybe_json(value: Any, field: str) -> Any:
    """CSV and parquet columns hold nested values as JSON text."""
    if isinstance(value, str) and value.lstrip().startswith(("[", "{")):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise RecordProblem(f"'{field}' is not valid JSON: {json_problem(exc, lines=False)}") from None
    return value


def _tool_list(record: dict) -> dict[str, list]:
    """{"tools": [...]} where the record has tools, else {}."""
    tools = _maybe_json(record.get("tools"), "tools")
    if tools in (None, "", []):
        return {}
    if not isinstance(tools, list):
        raise RecordProblem(f"'tools' must be a list of tool schemas, found {type(tools).__name__}")
    # a bare function schema (LLaMA-Factory's, Glaive's) wrapped as chat templates read it (get_json_schema's form)
    return {
        "tools": [
            {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
            if isinstance(t, dict) and "name" in t and "function" not in t
            else t
            for t in tools
        ]
    }


def check_messages(msgs: Any, field: str, need_assistant: bool = True) -> list[dict[str, Any]]:
    """Messages as the chat template gets them (role, content and the kept fields); names the bad field."""
    msgs = _maybe_json(msgs, field)
    if not isinstance(msgs, list) or not msgs:
        raise RecordProblem(f"'{field}' must be a non-empty list of {{role, content}} objects")
    out = []
    for i, m in enumerate(msgs):
        where = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise RecordProblem(f"{where} is not an object")
        role = m.get("role")
        if role not in ROLES:
            raise RecordProblem(f"{where}.role is {role!r}; allowed: {', '.join(ROLES)}")
        content = m.get("content")
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list) or not calls:
                raise RecordProblem(f"{where}.tool_calls must be a non-empty list on an assistant message")
            for j, call in enumerate(calls):
                fn = call.get("function", call) if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise RecordProblem(
                        f"{where}.tool_calls[{j}] has no function name "
                        '(expected {"type": "function", "function": {"name": ..., "arguments": {...}}})'
                    )
        if content is None and calls:
            pass  # a tool call without text
        elif not isinstance(content, str):
            raise RecordProblem(f"{where}.content must be a string, found {type(content).__name__}")
        elif not content.strip() and not calls:
            raise RecordProblem(f"{where} ({role}) has empty content")
        for key in TRAINING_SWITCHES:
            if key in m and not (role == "assistant" and m[key] in (1, True)):
                raise RecordProblem(
                    f"{where}.{key} is {m[key]!r} on {'an' if role == 'assistant' else 'a'} {role} turn: a per-turn "
                    "training switch ftrun cannot honour "
                    "(it trains every assistant turn alike, and no other turn); remove the turns not to train on "
                    f"(or end the conversation before them), or drop '{key}' where the turn should train"
                )
        unknown = sorted(k for k in m if k not in ("role", "content", *KEPT_FIELDS, *TRAINING_SWITCHES))
        if unknown:
            raise RecordProblem(
                f"{where} has {', '.join(repr(k) for k in unknown)}, which ftrun does not read (it reads "
                f"role, content, {', '.join(KEPT_FIELDS)}); a key that is not honoured is refused, "
                "not dropped in silence: remove it, or move what it says into the content"
            )
        kept = {"role": role, "content": content}
        kept.update({k: m[k] for k in KEPT_FIELDS if m.get(k) not in (None, "")})
        out.append(kept)
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise RecordProblem(f"no assistant turn in '{field}': there is nothing to learn from this example")
    return out


def _chat(record: dict, messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"messages": messages, **_tool_list(record)}


def _messages(record: dict, other: Optional[str]) -> dict[str, Any]:
    _require(record, ("messages",), "messages", other)
    return _chat(record, check_messages(record["messages"], "messages"))


def _sharegpt(record: dict, other: Optional[str]) -> dict[str, Any]:
    _require(record, ("conversations",), "sharegpt", other)
    turns = _maybe_json(record["conversations"], "conversations")
    if not isinstance(turns, list) or not turns:
        raise RecordProblem("'conversations' must be a non-empty list of {from, value} objects")
    msgs = _system_turn(record) + sharegpt_messages(turns, "conversations")
    return _chat(record, check_messages(msgs, "conversations"))


def _system_turn(record: dict) -> list[dict[str, Any]]:
    system = record.get("system")
    return [{"role": "system", "content": system}] if isinstance(system, str) and system.strip() else []


def sharegpt_messages(turns: list, field: str) -> list[dict[str, Any]]:
    """ShareGPT turns ({from, value}; role/content ones as they are) as messages, not yet checked: the roles mapped
    (SHAREGPT_ROLES), a function_call turn as the assistant's tool_calls."""
    msgs: list[dict[str, Any]] = []
    for i, t in enumerate(turns):
        where = f"{field}[{i}]"
        if not isinstance(t, dict):
            raise RecordProblem(f"{where} is not an object")
        if "role" in t and "from" not in t:  # role/content under the ShareGPT key
            msgs.append(t)
            continue
        unread = sorted(k for k in t if k not in ("from", "value", *TRAINING_SWITCHES))
        if unread:
            raise RecordProblem(
                f"{where} has {', '.join(repr(k) for k in unread)}, which ftrun does not read in a ShareGPT turn (it "
                "reads from, value, and a training switch: weight, train); a key that is not honoured is refused, "
                "not dropped in silence: remove it, or move what it says into the value"
            )
        who, value = t.get("from"), t.get("value")
        role = SHAREGPT_ROLES.get(str(who).lower()) if who is not None else None
        if role is None:
            raise RecordProblem(f"{where}.from is {who!r}; known: {', '.join(sorted(SHAREGPT_ROLES))}")
        if not isinstance(value, str):
            raise RecordProblem(f"{where}.value must be a string, found {type(value).__name__}")
        if str(who).lower() == "function_call":
            try:
                call = json.loads(value)
            except json.JSONDecodeError as exc:
                raise RecordProblem(f"{where}.value (a function_call) is not JSON ({exc.msg})") from None
            calls = [
                {"type": "function", "function": {"name": c.get("name"), "arguments": c.get("arguments", {})}}
                if isinstance(c, dict)
                else c
                for c in (call if isinstance(call, list) else [call])
            ]
            msgs.append({"role": "assistant", "content": None, "tool_calls": calls})
            continue
        msgs.append({"role": role, "content": value, **{k: t[k] for k in TRAINING_SWITCHES if k in t}})
    return msgs


def _alpaca(record: dict, other: Optional[str]) -> dict[str, Any]:
    _require(record, ("instruction", "output"), "alpaca", other)
    instruction = _text(record, "instruction")
    extra = _text(record, "input", required=False)
    output = _text(record, "output")
    msgs: list[dict[str, Any]] = []
    system = _text(record, "system", required=False)
    if system.strip():
        msgs.append({"role": "system", "content": system})
    history = _maybe_json(record.get("history"), "history") or []  # LLaMA-Factory: [[question, answer], ...]
    if not isinstance(history, list) or not all(
        isinstance(h, list) and len(h) == 2 and all(isinstance(x, str) for x in h) for h in history
    ):
        raise RecordProblem("'history' must be a list of [question, answer] string pairs")
    for q, a in history:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    msgs += [
        {"role": "user", "content": f"{instruction}\n\n{extra}" if extra.strip() else instruction},
        {"role": "assistant", "content": output},
    ]
    return _chat(record, msgs)


def _prompt_completion(record: dict, other: Optional[str]) -> dict[str, Any]:
    _require(record, ("prompt", "completion"), "prompt_completion", other)
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return {"prompt": _text(record, "prompt"), "completion": _text(record, "completion")}
    if isinstance(prompt, list) and isinstance(completion, list):
        example = {
            "prompt": check_messages(prompt, "prompt", need_assistant=False),
            "completion": check_messages(completion, "completion"),
        }
        example.update(_tool_list(record))
        return example
    raise RecordProblem(
        f"'prompt' and 'completion' must both be strings (plain) or both lists of messages "
        f"(conversational), found {type(prompt).__name__} and {type(completion).__name__}"
    )


def _prompt_alone(record: dict, other: Optional[str]) -> dict[str, Any]:
    _require(record, ("prompt",), "prompt", other)
    prompt = _maybe_json(record["prompt"], "prompt")
    if isinstance(prompt, str):
        example: dict[str, Any] = {"prompt": _text(record, "prompt")}
    else:
        example = {"prompt": check_messages(prompt, "prompt", need_assistant=False)}
        if example["prompt"][-1]["role"] == "assistant":
            raise RecordProblem(
                "the last turn of 'prompt' is the assistant's: the prompt ends where the sampled answer begins "
                "(a user or tool turn)"
            )
    if record.get("reference") is not None:
        example["reference"] = _text(record, "reference")
    return example


def _plain_text(record: dict, other: Optional[str]) -> dict[str, Any]:
    _require(record, ("text",), "text", other)
    return {"text": _text(record, "text")}


def _unpaired(record: dict, other: Optional[str]) -> dict[str, Any]:
    _require(record, ("prompt", "completion", LABEL), "unpaired", other)
    label = record[LABEL]
    if isinstance(label, str) and label.strip() in ("true", "false"):
        label = label.strip() == "true"  # a CSV cell holds the JSON value as text, as _maybe_json reads lists
    if not isinstance(label, bool):
        raise RecordProblem(
            f"'{LABEL}' must be true (a desirable answer) or false (an undesirable one), found {label!r}"
            + (" (a string)" if isinstance(label, str) else "")
        )
    prompt, completion = _maybe_json(record["prompt"], "prompt"), _maybe_json(record["completion"], "completion")
    example = _prompt_completion({**record, "prompt": prompt, "completion": completion}, other)
    if isinstance(prompt, list):
        _answer(completion, "completion")
        if example["prompt"][-1]["role"] == "assistant":
            raise RecordProblem(
                "the last turn of 'prompt' is the assistant's: the prompt ends where the answer begins (a user or "
                "tool turn)"
            )
    return {**example, LABEL: label}


def _unpaired_messages(record: dict, other: Optional[str]) -> dict[str, Any]:
    """A conversation with its label: its last turn, the assistant's, is the answer the label marks; the turns before
    it are the prompt (TRL's unpaired type takes them apart so)."""
    _require(record, ("messages", LABEL), "unpaired_messages", other)
    msgs = check_messages(record["messages"], "messages")
    if msgs[-1]["role"] != "assistant" or len(msgs) < 2:
        raise RecordProblem(
            f"'{LABEL}' marks the conversation's answer, its last turn, which must be the assistant's after at least "
            f"one turn of prompt (found {', '.join(m['role'] for m in msgs)}); end each conversation with the answer "
            "the label marks"
        )
    rest = {k: v for k, v in record.items() if k != "messages"}
    return _unpaired({**rest, "prompt": msgs[:-1], "completion": msgs[-1:]}, other)


def _pair_check(chosen: Any, rejected: Any) -> None:
    if chosen == rejected:
        raise RecordProblem(
            "'chosen' and 'rejected' are the same answer: the pair prefers nothing; remove it or "
            "give the rejected answer"
        )


def _preference(record: dict, other: Optional[str]) -> dict[str, Any]:
    _require(record, PAIR_KEYS, "preference", other)
    prompt, chosen, rejected = (_maybe_json(record[k], k) for k in PAIR_KEYS)
    if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
        example = {k: _text(record, k) for k in PAIR_KEYS}
    elif all(isinstance(v, list) for v in (prompt, chosen, rejected)):
        example = {
            "prompt": check_messages(prompt, "prompt", need_assistant=False),
            "chosen": _answer(chosen, "chosen"),
            "rejected": _answer(rejected, "rejected"),
        }
        if example["prompt"][-1]["role"] == "assistant":
            raise RecordProblem(
                "the last turn of 'prompt' is the assistant's: the prompt ends where the chosen and "
                "the rejected answers begin (a user or tool turn)"
            )
        example.update(_tool_list(record))
    else:
        raise RecordProblem(
            "'prompt', 'chosen' and 'rejected' must all be strings (standard) or all lists of "
            f"messages (conversational), found {type(prompt).__name__}, {type(chosen).__name__} and "
            f"{type(rejected).__name__}"
        )
    _pair_check(example["chosen"], example["rejected"])
    return example


def _answer(msgs: Any, field: str) -> list[dict[str, Any]]:
    out = check_messages(msgs, field)
    if any(m["role"] != "assistant" for m in out):
        raise RecordProblem(
            f"'{field}' holds {', '.join(sorted({m['role'] for m in out if m['role'] != 'assistant'}))} "
            "turns: it is the answer alone (assistant turns); the turns before it go in 'prompt'"
        )
    return out


def _preference_implicit(record: dict, other: Optional[str]) -> dict[str, Any]:
    _require(record, SIDES, "preference_implicit", other)
    chosen, rejected = _maybe_json(record["chosen"], "chosen"), _maybe_json(record["rejected"], "rejected")
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise RecordProblem(
            "without a 'prompt', 'chosen' and 'rejected' must be whole conversations (lists of "
            f"messages), found {type(chosen).__name__} and {type(rejected).__name__}; plain strings "
            "need a 'prompt' beside them"
        )
    chosen, rejected = check_messages(chosen, "chosen"), check_messages(rejected, "rejected")
    shared = 0  # the turns both conversations share: the prompt (TRL's extract_prompt splits the same way)
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == len(chosen) == len(rejected):
        _pair_check(chosen, rejected)
    if shared == 0:
        raise RecordProblem(
            "'chosen' and 'rejected' share no first turn: with an implicit prompt both conversations "
            "begin with the same prompt turns; give a 'prompt' key, or the same first turns"
        )
    while shared and chosen[shared - 1]["role"] == "assistant":
        shared -= 1  # the answers begin with the first assistant turn after the shared prompt
    pair = {"prompt": chosen[:shared], "chosen": chosen[shared:], "rejected": rejected[shared:]}
    return _preference({**pair, **_kept_tools(record)}, other)


def _kept_tools(record: dict) -> dict[str, Any]:
    return {"tools": record["tools"]} if "tools" in record else {}


def _sharegpt_pair(record: dict, other: Optional[str]) -> dict[str, Any]:
    """LLaMA-Factory's ranking data in the ShareGPT layout: the prompt's turns under 'conversations', each answer one
    turn object ({"from": "gpt", "value": ...}, or a function_call) under 'chosen' and 'rejected'."""
    _require(record, ("conversations", *SIDES), "sharegpt_preference", other)
    turns = _maybe_json(record["conversations"], "conversations")
    if not isinstance(turns, list) or not turns:
        raise RecordProblem("'conversations' must be a non-empty list of {from, value} objects (the prompt)")
    answers = {}
    for side in SIDES:
        turn = _maybe_json(record[side], side)
        if isinstance(turn, list) and len(turn) == 1:
            turn = turn[0]
        if not isinstance(turn, dict):
            raise RecordProblem(
                f'\'{side}\' must be one turn object ({{"from": "gpt", "value": "..."}}), found {type(turn).__name__}'
            )
        answers[side] = sharegpt_messages([turn], side)
    pair = {"prompt": _system_turn(record) + sharegpt_messages(turns, "conversations"), **answers}
    return _preference({**pair, **_kept_tools(record)}, other)


def _alpaca_pair(record: dict, other: Optional[str]) -> dict[str, Any]:
    """LLaMA-Factory's ranking data in the Alpaca layout: instruction, input, system and history as an Alpaca
    record's, the two answers as strings under 'chosen' and 'rejected'."""
    _require(record, ("instruction", *SIDES), "alpaca_preference", other)
    msgs = _alpaca({**{k: v for k, v in record.items() if k not in SIDES}, "output": "-"}, other)["messages"][:-1]
    answers = {}
    for side in SIDES:
        if not isinstance(record[side], str):
            raise RecordProblem(f"'{side}' must be a string (the answer), found {type(record[side]).__name__}")
        answers[side] = [{"role": "assistant", "content": _text(record, side)}]
    return _preference({"prompt": msgs, **answers, **_kept_tools(record)}, other)


FORMATS: dict[str, Format] = {
    # before messages: a conversation with a label is one unpaired answer (objective kto), not a chat example
    "unpaired_messages": Format(
        "unpaired preference as conversations (messages/label; objective kto)",
        "unpaired",
        ("messages", LABEL),
        '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}], "label": '
        "false} (the last turn, the assistant's, is the answer the label marks)",
        _unpaired_messages,
        native=False,
    ),
    "messages": Format(
        "chat messages (role/content)",
        "chat",
        ("messages",),
        '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}',
        _messages,
        native=True,
        reads=("tools",),
    ),
    # before sharegpt: the prompt's conversation with the pair's two answers beside it (LLaMA-Factory's ranking data)
    "sharegpt_preference": Format(
        "ShareGPT preference pairs (conversations + chosen/rejected turns)",
        "preference",
        ("conversations", *SIDES),
        '{"conversations": [{"from": "human", "value": "..."}], "chosen": {"from": "gpt", "value": "..."}, '
        '"rejected": {"from": "gpt", "value": "..."}}',
        _sharegpt_pair,
        native=False,
        reads=("system", "tools"),
    ),
    "sharegpt": Format(
        "ShareGPT conversations (from/value)",
        "chat",
        ("conversations",),
        '{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}',
        _sharegpt,
        native=False,
        reads=("system", "tools"),
    ),
    # before prompt/completion: an unpaired answer is a prompt/completion record with its label
    "unpaired": Format(
        "unpaired preference (prompt/completion/label; objective kto)",
        "unpaired",
        ("prompt", "completion", LABEL),
        '{"prompt": [{"role": "user", "content": "..."}], "completion": [{"role": "assistant", "content": "..."}], '
        '"label": true} (false for an undesirable answer; or two strings)',
        _unpaired,
        native=True,
    ),
    "prompt_completion": Format(
        "prompt/completion",
        "prompt_completion",
        ("prompt", "completion"),
        '{"prompt": "...", "completion": "..."} (or both lists of messages)',
        _prompt_completion,
        native=True,
        reads=("tools",),
    ),
    "alpaca": Format(
        "Alpaca (instruction/input/output)",
        "chat",
        ("instruction", "output"),
        '{"instruction": "...", "input": "" (optional), "output": "...", "system": "..." (optional)}',
        _alpaca,
        native=False,
        reads=("input", "system", "history", "tools"),
    ),
    # before preference_implicit (chosen + rejected alone): LLaMA-Factory's ranking data in the Alpaca layout
    "alpaca_preference": Format(
        "Alpaca preference pairs (instruction/input + chosen/rejected)",
        "preference",
        ("instruction", *SIDES),
        '{"instruction": "...", "input": "" (optional), "chosen": "...", "rejected": "..."}',
        _alpaca_pair,
        native=False,
        reads=("input", "system", "history", "tools"),
    ),
    "text": Format(
        "plain text (continued pre-training)", "text", ("text",), '{"text": "..."}', _plain_text, native=True
    ),
    "preference": Format(
        "preference pairs (prompt/chosen/rejected)",
        "preference",
        PAIR_KEYS,
        '{"prompt": [{"role": "user", "content": "..."}], "chosen": [{"role": "assistant", '
        '"content": "..."}], "rejected": [{"role": "assistant", "content": "..."}]} (or three strings)',
        _preference,
        native=True,
        reads=("tools",),
    ),
    "preference_implicit": Format(
        "preference pairs with an implicit prompt (chosen/rejected conversations)",
        "preference",
        SIDES,
        '{"chosen": [{"role": "user", "content": "..."}, {"role": "assistant", "content": '
        '"..."}], "rejected": [{"role": "user", "content": "..."}, {"role": "assistant", '
        '"content": "..."}]}',
        _preference_implicit,
        native=False,
        reads=("tools",),
    ),
    # last: a prompt/completion example and a pair have a prompt too
    "prompt": Format(
        "prompts (prompt, reference optional; objective grpo)",
        "prompt",
        ("prompt",),
        '{"prompt": [{"role": "user", "content": "..."}], "reference": "..." (optional)} (or a string prompt)',
        _prompt_alone,
        native=True,
        reads=("reference",),
    ),
}


def example_form(example: dict[str, Any]) -> str:
    """The canonical form (a FORMS name) of a converted example."""
    return next((name for name, f in FORMS.items() if f.marker in example), "text")


def conversational(example: dict[str, Any]) -> bool:
    return "messages" in example or isinstance(example.get("prompt"), list)


def conversation(example: Any) -> list[dict[str, Any]]:
    """An example as a list of messages: a prompt then its answer, plain text as one user message."""
    if isinstance(example, list):
        return example
    if "messages" in example:
        return example["messages"]
    if "chosen" in example:  # a pair: its prompt and the chosen answer (what the task evaluation scores)
        return conversation(sequences(example)[0])
    if "prompt" in example and "completion" not in example:  # GRPO's prompt row: its reference as the answer
        prompt = example["prompt"]
        turns = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        reference = example.get("reference")
        return turns + ([{"role": "assistant", "content": reference}] if reference is not None else [])
    if isinstance(example.get("prompt"), list):
        return example["prompt"] + example["completion"]
    if "prompt" in example:
        return [{"role": "user", "content": example["prompt"]}, {"role": "assistant", "content": example["completion"]}]
    return [{"role": "user", "content": example["text"]}]


def sides(example: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A pair's two sequences as prompt/completion examples named by their side (SIDES), as TRL trains both."""
    extra = {"tools": example["tools"]} if example.get("tools") else {}
    return [(side, {"prompt": example["prompt"], "completion": example[side], **extra}) for side in SIDES]


def sequences(example: dict[str, Any]) -> list[dict[str, Any]]:
    """The sequences one example trains as: a preference pair's two (sides), any other example its own one."""
    return [seq for _, seq in sides(example)] if "chosen" in example else [example]
