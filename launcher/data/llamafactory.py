"""LLaMA-Factory's datasets: an entry of its dataset_info.json (where the data is, its formatting, columns and tags)
and each record read as LLaMA-Factory reads it, as a record of one of ftrun's formats (launcher/data/formats.py).

As LLaMA-Factory defines them (src/llamafactory/data/parser.py `DatasetAttr`, converter.py `AlpacaDatasetConverter`,
`SharegptDatasetConverter`, `OpenAIDatasetConverter`); what each reads as: docs/data.md, "LLaMA-Factory". Where
LLaMA-Factory skips a record with a warning or reads a column silently as something else, ftrun refuses the record
with its line, as it does every key the entry's columns do not name.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from launcher.data import formats
from launcher.errors import DataError, json_problem

INFO_FILE = "dataset_info.json"
FORMATTINGS = ("alpaca", "sharegpt", "openai")
# DatasetAttr's columns and their defaults by formatting (parser.py): the record's key each reads
COLUMNS = ("prompt", "query", "response", "history", "messages", "system", "tools", "chosen", "rejected", "kto_tag")
MEDIA_COLUMNS = ("images", "videos", "audios")
DEFAULT_COLUMNS = {
    "alpaca": {"prompt": "instruction", "query": "input", "response": "output"},
    "sharegpt": {"messages": "conversations"},
    "openai": {"messages": "conversations"},
}
DEFAULT_TAGS = dict(role_tag="from", content_tag="value", user_tag="human", assistant_tag="gpt")
DEFAULT_TAGS.update(observation_tag="observation", function_tag="function_call", system_tag="system")
# the entry's keys ftrun reads; where the data lies (one of these)
WHERE = ("file_name", "hf_hub_url")
ENTRY_KEYS = (*WHERE, "formatting", "ranking", "subset", "split", "columns", "tags")
# the entry's keys ftrun cannot honour, and what to write instead
ENTRY_REFUSED = {
    "ms_hub_url": "ftrun reads local files and Hugging Face Hub datasets: download it and give file_name",
    "om_hub_url": "ftrun reads local files and Hugging Face Hub datasets: download it and give file_name",
    "script_url": "ftrun runs no dataset scripts: save the data as .json/.jsonl/.parquet and give file_name",
    "cloud_file_name": "ftrun reads local files and Hugging Face Hub datasets: copy it here and give file_name",
    "folder": "ftrun reads a Hub dataset whole: give the data folder's files as file_name",
    "num_samples": "give weight: in the recipe's data entry instead (0.5 draws a seeded half, 2 takes each twice)",
}
# LLaMA-Factory's roles (data_utils.py Role) as ftrun's ShareGPT role names (formats.SHAREGPT_ROLES)
AS_SHAREGPT = dict(user="human", assistant="gpt", observation="observation", function="function_call", system="system")


@dataclass(frozen=True)
class Entry:
    """One dataset_info.json entry, resolved: where its data is and how its records read."""

    name: str
    info: str  # the dataset_info.json file
    path: str  # the data: a file or folder (relative to the info file's folder), or a Hub dataset id
    formatting: str = "alpaca"
    ranking: bool = False
    subset: Optional[str] = None
    split: str = "train"
    columns: dict[str, str] = field(default_factory=dict)  # DatasetAttr column -> the record's key
    tags: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        kind = " (kto)" if "kto_tag" in self.columns else " (ranking)" if self.ranking else ""
        if self.formatting == "alpaca" and not self.ranking and "response" not in self.columns:
            kind = " (pre-training text)"
        return f"LLaMA-Factory {self.formatting}{kind}, dataset_info.json entry '{self.name}'"

    def example(self) -> str:
        c = self.columns
        if self.formatting == "alpaca":
            keys = [c[k] for k in ("prompt", "query") if c.get(k)]
            answers = (
                [f'"{c["chosen"]}": "...", "{c["rejected"]}": "..."']
                if self.ranking
                else [
                    f'"{c[k]}": ' + ("true" if k == "kto_tag" else '"..."') for k in ("response", "kto_tag") if c.get(k)
                ]
            )
            return "{" + ", ".join([*(f'"{k}": "..."' for k in keys), *answers]) + "}"
        t = {**{k: k.removesuffix("_tag") for k in DEFAULT_TAGS}, **self.tags}
        turn = '{"%s": "%%s", "%s": "..."}' % (t["role_tag"], t["content_tag"])
        first = turn % t["user_tag"]
        if self.ranking:
            answer = turn % t["assistant_tag"]
            return f'{{"{c["messages"]}": [{first}], "{c["chosen"]}": {answer}, "{c["rejected"]}": {answer}}}'
        label = f', "{c["kto_tag"]}": true' if c.get("kto_tag") else ""
        return f'{{"{c["messages"]}": [{first}, {turn % t["assistant_tag"]}]{label}}}'


def read_entry(info: Path, name: str) -> Entry:
    """The entry `name` of the dataset_info.json at `info` (or in the folder `info`); a DataError naming the key."""
    path = info / INFO_FILE if info.is_dir() else info
    label = f"{path} (data entry dataset: {name})"
    if not path.is_file():
        raise DataError(
            f"{label}: no such file",
            fix=f"give as path the {INFO_FILE} file (or its folder, LLaMA-Factory's dataset_dir) that defines the "
            "dataset.",
        )
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not valid JSON: {json_problem(exc)}", fix="fix the file.") from None
    if not isinstance(doc, dict) or name not in doc:
        known = ", ".join(sorted(doc)) if isinstance(doc, dict) else "none"
        raise DataError(
            f"{path} defines no dataset '{name}' (it defines: {known})", fix="name one of them as dataset:."
        )
    attr = doc[name]
    if not isinstance(attr, dict):
        raise DataError(f"{label}: the entry is a {type(attr).__name__}, not an object", fix="fix the entry.")
    problems = []
    for key, why in ENTRY_REFUSED.items():
        if key in attr and not (key in ("ms_hub_url", "om_hub_url") and any(k in attr for k in WHERE)):
            problems.append(f"{key}: {why}")
    unknown = [k for k in attr if k not in ENTRY_KEYS and k not in ENTRY_REFUSED]
    if unknown:
        problems.append(f"{', '.join(unknown)}: not a key of LLaMA-Factory's dataset_info.json that ftrun knows")
    formatting = attr.get("formatting", "alpaca")
    if formatting not in FORMATTINGS:
        problems.append(f"formatting {formatting!r}: one of {', '.join(FORMATTINGS)}")
        formatting = "alpaca"
    # DatasetAttr.join: an entry that has columns (tags) reads those alone, the defaults of the others unset
    given = attr.get("columns") or {}
    columns = {} if "columns" in attr else dict(DEFAULT_COLUMNS[formatting])
    given_tags = attr.get("tags") or {}
    tags = {} if "tags" in attr else dict(DEFAULT_TAGS)
    if not isinstance(given, dict) or not isinstance(given_tags, dict):
        problems.append("columns and tags are objects ({name: column})")
        given, given_tags = {}, {}
    for key, column in given.items():
        if key in MEDIA_COLUMNS:
            problems.append(
                f"columns.{key}: ftrun reads images in its own chat layout (docs/data.md, Images), not through "
                f"LLaMA-Factory's {key} column, and no videos or audio; remove it (and the records' {column})"
            )
        elif key not in COLUMNS:
            problems.append(f"columns.{key}: LLaMA-Factory has no such column (it has {', '.join(COLUMNS)})")
        else:
            columns[key] = column
    for key, tag in given_tags.items():
        if key not in DEFAULT_TAGS:
            problems.append(f"tags.{key}: LLaMA-Factory has no such tag (it has {', '.join(DEFAULT_TAGS)})")
        else:
            tags[key] = tag
    if formatting != "alpaca" and not columns.get("messages"):
        problems.append(f"formatting {formatting} needs columns.messages (the record's key of the conversation)")
    if formatting != "alpaca" and not (tags.get("role_tag") and tags.get("content_tag")):
        problems.append("tags without role_tag and content_tag: the keys of a turn's role and text")
    ranking = bool(attr.get("ranking", False))
    if ranking and not (columns.get("chosen") and columns.get("rejected")):
        problems.append(
            "ranking: true needs columns.chosen and columns.rejected (the record's keys of the two answers)"
        )
    if formatting == "alpaca" and columns.get("kto_tag") and not columns.get("response"):
        problems.append("columns.kto_tag needs columns.response (the answer it marks)")
    if ranking and columns.get("kto_tag"):
        problems.append("ranking: true and columns.kto_tag: a pair or an unpaired example, not both")
    where = next((attr[k] for k in WHERE if k in attr), None)
    if where is None and not any(k in attr for k in ENTRY_REFUSED):
        problems.append(f"no {' or '.join(WHERE)}: where the data is")
    if problems:
        raise DataError(
            f"{label}: ftrun cannot read this entry as LLaMA-Factory does:\n- " + "\n- ".join(problems),
            fix="change the entry as each line says (docs/data.md, Coming from LLaMA-Factory / Axolotl).",
        )
    local = "file_name" in attr
    return Entry(
        name=name,
        info=str(path),
        path=str(path.parent / where) if local else str(where),
        formatting=formatting,
        ranking=ranking,
        subset=attr.get("subset"),
        split=attr.get("split", "train"),
        columns={k: v for k, v in columns.items() if v},
        tags=tags,
    )


def convert(entry: Entry, record: dict) -> tuple[str, dict[str, Any]]:
    """One record as LLaMA-Factory reads it: (ftrun's format, the record in it); a RecordProblem naming the key."""
    c = entry.columns
    formats.check_top_keys(record, "", c.values(), f"the dataset_info.json entry '{entry.name}'")
    has_system = c.get("system") and record.get(c["system"]) not in (None, "")
    system = _string(record, c["system"]) if has_system else None
    tools = record.get(c["tools"]) if c.get("tools") else None
    if entry.formatting == "alpaca":
        if not c.get("response") and not entry.ranking:
            # no response column: LLaMA-Factory's pre-training document (stage pt, c4_demo): plain text
            formats.check_top_keys(record, "", [c[k] for k in ("prompt", "query") if c.get(k)], entry.describe())
            return "text", {"text": _alpaca_prompt(record, c, None)[-1]["content"]}
        prompt = _alpaca_prompt(record, c, system)

        def answer(column: str) -> list[dict[str, Any]]:
            return [{"role": "assistant", "content": _string(record, c[column])}]

        if c.get("kto_tag"):
            return _unpaired(entry, record, prompt, answer("response"))
        if entry.ranking:
            return _pair(entry, prompt, answer("chosen"), answer("rejected"), tools)
        return "messages", _with_tools({"messages": prompt + answer("response")}, tools)
    turns = formats._maybe_json(record.get(c["messages"]), c["messages"])
    if not isinstance(turns, list) or not turns:
        raise formats.RecordProblem(f"'{c['messages']}' must be a non-empty list of turns")
    msgs = _turns(entry, turns, c["messages"])
    if msgs and msgs[0]["role"] == "system":
        system, msgs = msgs[0]["content"], msgs[1:]
    head = [{"role": "system", "content": system}] if isinstance(system, str) and system.strip() else []
    if not msgs:
        raise formats.RecordProblem(f"'{c['messages']}' holds only a system turn")
    answered = msgs[-1]["role"] == "assistant"
    if entry.ranking:
        if answered:
            raise formats.RecordProblem(
                f"'{c['messages']}' has {len(msgs)} turns and ends with the assistant's: with ranking: true the "
                f"turns are the prompt (ending with a user or observation turn), the answers are '{c['chosen']}' and "
                f"'{c['rejected']}'"
            )
        chosen, rejected = (_answer_turn(entry, record, c[k]) for k in ("chosen", "rejected"))
        return _pair(entry, head + msgs, chosen, rejected, tools)
    if not answered:
        raise formats.RecordProblem(
            f"'{c['messages']}' has {len(msgs)} turns and ends with a user or observation turn: LLaMA-Factory trains "
            "the last turn as the answer (an assistant or function_call turn), and skips this record"
        )
    if c.get("kto_tag"):
        return _unpaired(entry, record, head + msgs[:-1], msgs[-1:])
    return "messages", _with_tools({"messages": head + msgs}, tools)


_string = functools.partial(formats._text, blank_ok=True)


def _with_tools(example: dict[str, Any], tools: Any) -> dict[str, Any]:
    if tools not in (None, "", []):
        example["tools"] = tools
    return example


def _alpaca_prompt(record: dict, c: dict[str, str], system: Optional[str]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system}] if system and system.strip() else []
    history = formats._maybe_json(record.get(c["history"]), c["history"]) if c.get("history") else None
    if history not in (None, ""):
        if not isinstance(history, list) or not all(
            isinstance(h, list) and len(h) == 2 and all(isinstance(x, str) for x in h) for h in history
        ):
            raise formats.RecordProblem(f"'{c['history']}' must be a list of [question, answer] string pairs")
        for q, a in history:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    # LLaMA-Factory joins the instruction and the input with one newline, each only where not empty
    parts = [record[c[k]] for k in ("prompt", "query") if c.get(k) and record.get(c[k])]
    for k in ("prompt", "query"):
        if c.get(k) and record.get(c[k]) not in (None, "") and not isinstance(record[c[k]], str):
            raise formats.RecordProblem(f"'{c[k]}' must be a string, found {type(record[c[k]]).__name__}")
    if not parts:
        raise formats.RecordProblem(
            f"no user turn: '{c.get('prompt')}' and '{c.get('query')}' are both missing or empty"
        )
    msgs.append({"role": "user", "content": "\n".join(parts)})
    return msgs


def _turns(entry: Entry, turns: list, key: str, after: str = "system") -> list[dict[str, Any]]:
    """The turns as messages, their roles by the entry's tags, in LLaMA-Factory's order."""
    t = entry.tags
    names = {"user_tag": "user", "assistant_tag": "assistant", "observation_tag": "observation"}
    names.update({"function_tag": "function", "system_tag": "system"})
    by_tag = {t[tag]: role for tag, role in names.items() if t.get(tag)}
    out: list[dict[str, Any]] = []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise formats.RecordProblem(f"{where} is not an object")
        role = by_tag.get(turn.get(t["role_tag"]))
        if role is None:
            unset = [tag for tag in names if not t.get(tag)]
            raise formats.RecordProblem(
                f"{where}.{t['role_tag']} is {turn.get(t['role_tag'])!r}; the entry's tags name "
                + ", ".join(f"{names[tag]}: {t[tag]}" for tag in names if t.get(tag))
                + (
                    f" (its tags leave {', '.join(unset)} unset: LLaMA-Factory skips such a record; add the tag, e.g. "
                    f'"{unset[-1]}": "{names[unset[-1]]}")'
                    if unset
                    else ""
                )
            )
        extra = [k for k in turn if k not in (t["role_tag"], t["content_tag"])]
        calls = turn.get("tool_calls") if entry.formatting == "openai" else None
        if calls is not None:
            extra.remove("tool_calls")
        if extra:
            raise formats.RecordProblem(
                f"{where} has {', '.join(repr(k) for k in extra)}, which LLaMA-Factory does not read (it reads "
                f"{t['role_tag']}, {t['content_tag']}"
                + (", tool_calls" if entry.formatting == "openai" else "")
                + "); a key that is not honoured is refused, not dropped in silence: remove it"
            )
        if role == "system" and (i > 0 or after != "system"):
            raise formats.RecordProblem(f"{where} is a system turn: LLaMA-Factory reads one, the first")
        prev = out[-1]["role"] if out else after
        if role != "system":
            expected = ("user", "observation") if prev in ("system", "assistant") else ("assistant", "function")
            # OpenAI's layout: several tool results in a row (LLaMA-Factory joins them into one observation)
            several = entry.formatting == "openai" and role == "observation" and prev == "tool"
            if role not in expected and not several:
                raise formats.RecordProblem(
                    f"{where} is a {role} turn where LLaMA-Factory expects {' or '.join(expected)} (turns alternate "
                    "user or observation, then assistant or function_call); it skips this record"
                )
        content = turn.get(t["content_tag"])
        if calls is not None:  # OpenAI's form: the assistant's tool_calls as they are
            out.append({"role": "assistant", "content": content or None, "tool_calls": calls})
            continue
        converted = formats.sharegpt_messages([{"from": AS_SHAREGPT[role], "value": content}], where)
        out.append(converted[0])
    return out


def _answer_turn(entry: Entry, record: dict, key: str) -> list[dict[str, Any]]:
    turn = formats._maybe_json(record.get(key), key)
    if not isinstance(turn, dict):
        raise formats.RecordProblem(
            f"'{key}' must be one turn object ({entry.tags['role_tag']}, {entry.tags['content_tag']}), found "
            f"{type(turn).__name__}"
        )
    return _turns(entry, [turn], key, after="user")  # the answer to the prompt: the assistant's or a function_call


def _pair(entry, prompt, chosen, rejected, tools) -> tuple[str, dict[str, Any]]:
    return "preference", _with_tools({"prompt": prompt, "chosen": chosen, "rejected": rejected}, tools)


def _unpaired(entry: Entry, record: dict, prompt, completion) -> tuple[str, dict[str, Any]]:
    key = entry.columns["kto_tag"]
    label = record.get(key)
    if not isinstance(label, bool):
        raise formats.RecordProblem(
            f"'{key}' (the kto_tag) must be true (a desirable answer) or false (an undesirable one), found "
            f"{label!r}; LLaMA-Factory would train this record as an SFT example"
        )
    fmt = unpaired_format()
    if fmt is None:
        raise formats.RecordProblem(
            f"'{key}' marks this answer {'desirable' if label else 'undesirable'} (LLaMA-Factory's kto_tag): "
            "unpaired preference data that this ftrun has no objective for; an undesirable answer trained as an "
            f"SFT target teaches what it should not: remove columns.kto_tag and the records marked false to train "
            "the rest as SFT data"
        )
    return fmt, {"prompt": prompt, "completion": completion, "label": label}


def unpaired_format() -> Optional[str]:
    """The format of TRL's unpaired preference data ({prompt, completion, label}), where formats.FORMATS has one."""
    want = {"prompt", "completion", "label"}
    return next((n for n, f in formats.FORMATS.items() if set(f.keys) == want), None)
