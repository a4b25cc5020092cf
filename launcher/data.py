"""Chat JSONL: check every line, count tokens with the model's own chat template, draw the smoke sample."""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from .errors import DataError

ROLES = ("system", "user", "assistant")
MAX_REPORTED = 8  # first errors shown; the count of all of them is given too


@dataclass(frozen=True)
class DataStats:
    examples: int
    total_tokens: int  # sum of min(tokens, max_length): what one epoch trains on
    mean_tokens: float
    max_tokens: int
    over_max_length: int
    tokens_source: str  # "tokenizer" (the model's chat template) or "characters" (estimate, 4 chars/token)
    max_length: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _line_problem(obj: Any) -> Optional[str]:
    if not isinstance(obj, dict):
        return f"expected a JSON object, found {type(obj).__name__}"
    if "messages" not in obj:
        keys = ", ".join(sorted(obj)) or "none"
        return f"no 'messages' key (keys present: {keys})"
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        return "'messages' must be a non-empty list of {role, content} objects"
    has_assistant = False
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            return f"messages[{i}] is not an object"
        role = m.get("role")
        if role not in ROLES:
            return f"messages[{i}].role is {role!r}; allowed: {', '.join(ROLES)}"
        content = m.get("content")
        if not isinstance(content, str):
            return f"messages[{i}].content must be a string, found {type(content).__name__}"
        if not content.strip():
            return f"messages[{i}] ({role}) has empty content"
        has_assistant |= role == "assistant"
    if not has_assistant:
        return "no assistant turn: there is nothing to learn from this example"
    return None


def load_examples(path: str | Path) -> list[list[dict[str, str]]]:
    """Every example's messages; a `DataError` naming the first bad lines (with line numbers) otherwise."""
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"data file '{path}' (recipe key 'data') does not exist",
            fix="set 'data' to a chat JSONL file; relative paths are read from the recipe's folder.",
        )
    problems: list[str] = []
    n_problems = 0
    examples: list[list[dict[str, str]]] = []
    with path.open("r", encoding="utf-8", errors="strict") as fh:
        try:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue  # blank lines (a trailing newline, say) carry no example
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    problem = f"not valid JSON ({exc.msg} at column {exc.colno})"
                else:
                    problem = _line_problem(obj)
                if problem:
                    n_problems += 1
                    if len(problems) < MAX_REPORTED:
                        problems.append(f"- line {lineno}: {problem}")
                    continue
                examples.append([{"role": m["role"], "content": m["content"]} for m in obj["messages"]])
        except UnicodeDecodeError as exc:
            raise DataError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                            fix="save the file as UTF-8 JSONL.") from None
    if n_problems:
        more = f"\n- ... and {n_problems - len(problems)} more" if n_problems > len(problems) else ""
        raise DataError(
            f"{path} has {n_problems} bad line{'s' if n_problems > 1 else ''}:\n" + "\n".join(problems) + more,
            fix='each line must be {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]} '
            "with at least one assistant turn; fix or remove these lines.",
        )
    if not examples:
        raise DataError(f"{path} holds no examples", fix="add chat examples, one JSON object per line.")
    return examples


# ---------------------------------------------------------------------------------------
# Token counting without torch: the model's tokenizer.json and its chat template (jinja2),
# rendered the way transformers renders it, so `ftrun plan` stays light.

def _template_env():
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        # transformers' {% generation %} marks assistant text for assistant-only loss; for
        # counting tokens it renders its body unchanged.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: __import__("datetime").datetime.now().strftime(fmt)
    return env


def _find_tokenizer_files(model_dir: Path) -> tuple[Optional[Path], Optional[str], dict[str, Any]]:
    tok_json = model_dir / "tokenizer.json"
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    template = None
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        template = jinja_file.read_text()
    elif isinstance(cfg.get("chat_template"), str):
        template = cfg["chat_template"]
    return (tok_json if tok_json.is_file() else None), template, cfg


def token_counter(model: str) -> tuple[Optional[Callable[[list[dict[str, str]]], int]], str]:
    """A function counting an example's tokens through the chat template, and where it came from.

    Returns (None, reason) when no local tokenizer is found: callers then estimate from characters
    and say so.
    """
    model_dir = Path(model)
    if not model_dir.is_dir():
        from .models import cached_file

        cached = cached_file(model, "tokenizer.json")
        model_dir = cached.parent if cached else None
        if model_dir is None:
            return None, f"no local tokenizer for {model} (not a folder, not in the Hugging Face cache)"
    tok_path, template, cfg = _find_tokenizer_files(model_dir)
    if tok_path is None:
        return None, f"{model_dir} has no tokenizer.json"
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tok_path))
    if template is None:
        return None, f"{model_dir} has a tokenizer but no chat template"
    compiled = _template_env().from_string(template)
    special = {k: (v if isinstance(v, str) else (v or {}).get("content")) for k, v in cfg.items() if k.endswith("_token")}

    def count(messages: list[dict[str, str]]) -> int:
        text = compiled.render(messages=messages, add_generation_prompt=False, **special)
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    return count, f"tokenizer and chat template of {model_dir}"


def example_lengths(examples: list[list[dict[str, str]]], model: str) -> tuple[list[int], str]:
    counter, source = token_counter(model)
    if counter is None:
        # About 4 characters per token for English text with today's BPE vocabularies, plus a few
        # template tokens per turn.
        return [sum(len(m["content"]) // 4 + 4 for m in ex) for ex in examples], "characters"
    try:
        return [counter(ex) for ex in examples], "tokenizer"
    except Exception as exc:  # a template that needs features we do not emulate
        raise DataError(
            f"the chat template of {model} could not render an example: {exc}",
            fix="check that the model's tokenizer_config.json has a working chat_template.",
        ) from None


def compute_stats(examples: list[list[dict[str, str]]], lengths: list[int], source: str, max_length: int) -> DataStats:
    clipped = [min(n, max_length) for n in lengths]
    return DataStats(
        examples=len(examples),
        total_tokens=sum(clipped),
        mean_tokens=round(sum(clipped) / len(clipped), 1),
        max_tokens=max(lengths),
        over_max_length=sum(1 for n in lengths if n > max_length),
        tokens_source=source,
        max_length=max_length,
    )


def smoke_sample(lengths: list[int], fraction: float, min_examples: int, seed: int, longest: int = 1) -> list[int]:
    """Indices of the smoke sample: `fraction` of the data, at least `min_examples`, the `longest` longest in.

    Peak memory is set by the longest batch, so the longest examples (one global batch: the smoke test's
    first step) are always in; the rest is a seeded random draw so the measured steps have the data's usual
    lengths. (More long examples in the measured steps biased the ETA: attention costs more per token on
    long sequences, measured -12% to +21% on CPU.)
    """
    n = len(lengths)
    want = min(n, max(math.ceil(fraction * n), min_examples))
    by_length = sorted(range(n), key=lambda i: (-lengths[i], i))
    top = set(by_length[: max(1, min(want, longest))])
    rest = [i for i in range(n) if i not in top]
    random.Random(seed).shuffle(rest)
    return sorted(top | set(rest[: want - len(top)]))


def write_jsonl(path: Path, examples: list[list[dict[str, str]]]) -> None:
    with path.open("w", encoding="utf-8") as fh:
        for ex in examples:
            fh.write(json.dumps({"messages": ex}, ensure_ascii=False) + "\n")
