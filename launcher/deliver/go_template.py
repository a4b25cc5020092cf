"""An Ollama TEMPLATE rendered as Ollama renders it, for the templates ftrun writes: Go's text/template actions
`range`, `if`/`else if`/`else`, `eq`/`ne`/`not`/`and`/`or`, fields, string literals and `{{-`/`-}}` trimming.

Ollama (template/template.go Execute) collates the messages (`collate`) and executes with {System, Messages, Tools,
Response: ""}, missingkey=zero. An action outside this subset raises `Unsupported`: never reported as checked.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\(|\)|[^\s()]+')


class Unsupported(ValueError):
    pass


def collate(messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """Ollama's collate (template/template.go 357-374, v0.33.0-rc2): the joined system messages, and the messages
    with consecutive same-role ones merged, tool results excepted."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    out: list[dict[str, Any]] = []
    for m in messages:
        if out and out[-1]["Role"] == m["role"] and m["role"] != "tool":
            out[-1]["Content"] += "\n\n" + m["content"]
        else:
            out.append({"Role": m["role"], "Content": m["content"]})
    return "\n\n".join(system), out


def _parse(template: str) -> list:
    """A tree of ("text", s) / ("out", expr) / ("if", [(cond, body)...], else) / ("range", expr, body)."""
    pieces: list[tuple[str, str]] = []
    pos, trim = 0, False  # trim: the action before ended in -}}
    for m in _ACTION.finditer(template):
        text = template[pos : m.start()]
        text = text.rstrip() if m.group(1) else text
        pieces += [("text", text.lstrip() if trim else text), ("act", m.group(2).strip())]
        pos, trim = m.end(), bool(m.group(3))
    pieces.append(("text", template[pos:].lstrip() if trim else template[pos:]))
    items = iter(pieces)

    def block(stop: tuple[str, ...]) -> tuple[list, Optional[str]]:
        nodes: list = []
        for kind, value in items:
            if kind == "text":
                if value:
                    nodes.append(("text", value))
                continue
            head = value.split(None, 1)[0] if value else ""
            if head in ("end", "else") and head in stop:
                return nodes, value
            if head == "if":
                branches, otherwise = [], []
                cond = value[2:].strip()
                while True:
                    body, ended = block(("end", "else"))
                    branches.append((cond, body))
                    if ended is None or ended == "end":
                        break
                    rest = ended[4:].strip()
                    if rest.startswith("if "):
                        cond = rest[3:].strip()
                        continue
                    otherwise, ended = block(("end",))
                    break
                nodes.append(("if", branches, otherwise))
            elif head == "range":
                body, _ = block(("end",))
                nodes.append(("range", value[5:].strip(), body))
            elif head in ("with", "define", "template", "block", "break", "continue") or value.startswith("/*"):
                raise Unsupported(f"action {{{{ {value} }}}}")
            else:
                nodes.append(("out", value))
        if stop:
            raise Unsupported("a block without its {{ end }}")
        return nodes, None

    nodes, _ = block(())
    return nodes


def _eval(expr: str, dot: Any, root: dict[str, Any]) -> Any:
    tokens = _TOKEN.findall(expr)
    value, rest = _call(tokens, dot, root)
    if rest:
        raise Unsupported(f"expression {expr!r}")
    return value


def _operand(tokens: list[str], dot: Any, root: dict[str, Any]) -> tuple[Any, list[str]]:
    t, rest = tokens[0], tokens[1:]
    if t == "(":
        value, rest = _call(rest, dot, root)
        if not rest or rest[0] != ")":
            raise Unsupported("unbalanced parenthesis")
        return value, rest[1:]
    if t.startswith('"'):
        return json.loads(t), rest
    if t == ".":
        return dot, rest
    if t.startswith("$."):
        return _field(root, t[2:]), rest
    if t.startswith("."):
        return _field(dot, t[1:]), rest
    if t in ("true", "false"):
        return t == "true", rest
    raise Unsupported(f"operand {t!r}")


def _call(tokens: list[str], dot: Any, root: dict[str, Any]) -> tuple[Any, list[str]]:
    if not tokens:
        raise Unsupported("empty expression")
    fn = tokens[0]
    if fn in ("eq", "ne", "and", "or", "not"):
        args, rest = [], tokens[1:]
        while rest and rest[0] != ")":
            value, rest = _operand(rest, dot, root)
            args.append(value)
        if fn == "eq":
            return any(args[0] == a for a in args[1:]), rest
        if fn == "ne":
            return args[0] != args[1], rest
        if fn == "not":
            return not bool(args[0]), rest
        if fn == "and":
            return next((a for a in args if not bool(a)), args[-1]), rest
        return next((a for a in args if bool(a)), args[-1]), rest
    if fn[0] not in '."$(' and fn not in ("true", "false"):
        raise Unsupported(f"function {fn!r}")
    return _operand(tokens, dot, root)


def _field(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = obj.get(name) if isinstance(obj, dict) else None  # missingkey=zero
    return "" if obj is None else obj


def _run(nodes: list, dot: Any, root: dict[str, Any], out: list[str]) -> None:
    for node in nodes:
        if node[0] == "text":
            out.append(node[1])
        elif node[0] == "out":
            value = _eval(node[1], dot, root)
            out.append("" if value is None else str(value))
        elif node[0] == "if":
            for cond, body in node[1]:
                if bool(_eval(cond, dot, root)):
                    _run(body, dot, root, out)
                    break
            else:
                _run(node[2], dot, root, out)
        elif node[0] == "range":
            for item in _eval(node[1], dot, root) or []:
                _run(node[2], item, root, out)


def render(template: str, messages: list[dict[str, Any]]) -> str:
    """The prompt Ollama builds from this template for a chat request with these messages."""
    system, collated = collate(messages)
    root = {"System": system, "Messages": collated, "Tools": None, "Response": ""}
    out: list[str] = []
    _run(_parse(template), root, root, out)
    return "".join(out)
