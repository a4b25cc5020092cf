"""A recipe's dataset, from `data:` to examples: every source read, every record converted, tokens counted with the
model's own chat template, the template checked against what the records hold, the smoke sample drawn."""

from __future__ import annotations

import hashlib
import json
import math
import random
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from launcher.data import formats as formats
from launcher.data import images
from launcher.data.sources import NotJson, Source, read, sources_of
from launcher.data.tokenizer import read_tokenizer, tokenizer_dir
from launcher.errors import DataError

ROLES = formats.ROLES
MAX_REPORTED = 8  # distinct problems shown; the count of all bad records is given too
LOCATIONS_PER_PROBLEM = 3


@dataclass(frozen=True)
class DataStats:
    examples: int
    total_tokens: int  # sum of min(tokens, max_length): what one epoch trains on
    mean_tokens: float
    max_tokens: int
    over_max_length: int
    tokens_source: str  # "tokenizer" (the model's chat template) or "characters" (estimate, 4 chars/token)
    max_length: int
    description: str = ""  # "Alpaca (instruction/input/output), 10,000 examples, converted to chat"
    sources: tuple = ()  # per source: source, format, examples, weight, sha256 or revision
    sha256: str = ""  # LoadedData.sha256: what a resume compares
    loss_view: Optional[dict] = None  # what the loss sees (launcher/data/loss_view.py); None without a tokenizer
    held_out: int = 0  # distinct examples held out for evaluation (eval.fraction)
    held_out_lines: int = 0  # the data's examples that do not train for it: the held-out ones and their copies
    labels: Optional[dict] = None  # unpaired answers (objective kto): the training split's classes and their weights
    all_tokens: int = 0  # sum of the examples' tokens before max_length: what a truncation leaves out is the rest
    splits: bool = False  # packing splits a sequence longer than max_length into pieces (bfd_split): none is cut
    rewards: tuple = ()  # GRPO: what the plan's probe of each reward found (launcher/data/rewards.py refusals)
    completion_length: Optional[dict] = None  # GRPO: grpo.max_completion_length, and where it came from
    images: Optional[dict] = None  # image data: images, their tokens, the longest example (data/image_stats.py)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoadedData:
    examples: list[dict[str, Any]]
    where: list[str]  # "d.jsonl line 3" per example
    form: str  # a formats.FORMS name
    sources: list[dict[str, Any]] = field(default_factory=list)
    sha256: str = ""  # what a resume compares: a single file's own sha256, else a hash of every source's identity
    origin: list[int] = field(default_factory=list)  # per example: the index of its source in `sources`

    def describe(self) -> str:
        fmts = sorted({s["format"] for s in self.sources})
        layouts = sorted({s["layout"] for s in self.sources if s.get("layout")})
        what = ", ".join(layouts + [formats.describe(f) for f in fmts if not layouts])
        native = all(formats.FORMATS[f].native for f in fmts) and not layouts
        converted = "" if native else f", converted to {self.form.replace('_', '/')}"
        ignored = sorted({k for s in self.sources for k in s.get("ignore", ())})
        converted += f" (left out as the recipe's ignore: says: {', '.join(ignored)})" if ignored else ""
        many = f" from {len(self.sources)} sources" if len(self.sources) > 1 else ""
        n = len(self.examples)
        return f"{what}{'' if layouts else ' format'}, {n:,} example{'' if n == 1 else 's'}{many}{converted}"


def load_data(spec: Any, seed: int = 42, columns: bool = False) -> LoadedData:
    """The recipe's `data` (or `eval.data`) as training examples: the one way from a data spec to examples.
    `spec`: a path, a Hub id, a data mapping, or a list of them (mixed by weight, drawn with `seed`); a DataError names
    the bad records. `columns`: each example keeps its record's other columns (GRPO's rewards read them by name)."""
    sources = sources_of(spec)
    examples: list[dict[str, Any]] = []
    where: list[str] = []
    origin: list[int] = []
    records: list[dict[str, Any]] = []
    forms: set[str] = set()
    single_file_sha = None
    for i, source in enumerate(sources):
        got = read(source)
        if any(images.record_has_images(r) for _, r in got.rows):
            # conversations with images: TRL's vision layout (data/images.py)
            data = images.load_images(spec)
            form = formats.example_form(data.examples[0])  # chat
            return LoadedData(data.examples, data.where, form, data.sources, data.sha256, [0] * len(data.examples))
        ex, wh, fmt, layout = _convert_source(source, got.rows, columns)
        forms.add(_form_key(ex[0]))
        reps = _repeat(len(ex), source.weight, random.Random(f"ftrun-data-{seed}-{i}"))
        examples += [ex[j] for j in reps]
        where += [wh[j] for j in reps]
        origin += [i] * len(reps)
        records.append(
            {
                **got.identity,
                "format": fmt,
                "examples": len(ex),
                "weight": source.weight,
                **({"columns": dict(source.columns)} if source.columns else {}),
                **({"ignore": list(source.ignore)} if source.ignore else {}),
                **({"type": source.type, "options": dict(source.options)} if source.type else {}),
                **({"layout": layout} if layout else {}),
            }
        )
        if "revision" in got.identity:  # a Hub dataset: its content too (a revision may be unknown offline)
            records[-1]["content_sha256"] = _content_hash([formats.canonical(e) for e in ex])
        plain = source.dataset is None and source.type is None  # another tool's mapping is part of the identity
        if len(sources) == 1 and source.local and Path(source.path).is_file() and source.weight == 1 and plain:
            single_file_sha = got.identity["sha256"]
    if len(forms) > 1:
        raise DataError(
            "the data sources train differently: "
            + "; ".join(f"{r['source']} is {formats.describe(r['format'])}" for r in records),
            fix="mix only sources that become the same form (chat formats with each other; prompt/completion with "
            "prompt/completion of the same kind; text with text), or train them in separate runs.",
        )
    if not examples:
        raise DataError("the data weights leave no examples", fix="raise the weights (1 takes every example once).")
    sha = single_file_sha or hashlib.sha256(json.dumps(records, sort_keys=True, default=str).encode()).hexdigest()
    return LoadedData(examples, where, formats.example_form(examples[0]), records, sha, origin)


def identity(data_sha256: str, eval_sha256: Optional[str] = None) -> str:
    """What a run trains and evaluates on as one sha256: the training data's, combined with eval.data's."""
    if not eval_sha256:
        return data_sha256
    return hashlib.sha256(f"{data_sha256}+eval.data:{eval_sha256}".encode()).hexdigest()


def _form_key(example: dict[str, Any]) -> str:
    f = formats.example_form(example)
    return f + ("/conversational" if f in ("prompt_completion", "unpaired") and formats.conversational(example) else "")


def _kind_name(key: str) -> str:
    form, _, conversational = key.partition("/")
    if form not in ("prompt_completion", "unpaired"):
        return key
    reads = formats.FORMS[form].reads_as
    return f"conversational {reads} (messages)" if conversational else f"plain {reads} (strings)"


def _content_hash(examples: list[dict[str, Any]]) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps(e, sort_keys=True, ensure_ascii=False).encode() + b"\n")
    return h.hexdigest()


def _repeat(n: int, weight: float, rng: random.Random) -> list[int]:
    """Indices of a source's examples in the mix: each `int(weight)` times, plus a seeded draw for the fraction."""
    whole = int(weight)
    extra = round((weight - whole) * n)
    return [j for _ in range(whole) for j in range(n)] + sorted(rng.sample(range(n), extra))


def _convert_source(
    source: Source, rows: list[tuple[str, Any]], columns: bool = False
) -> tuple[list[dict], list[str], str, Optional[str]]:
    """A source's records as examples, where each came from, the ftrun format they are read as, and the other
    tool's layout they were written in (None for ftrun's own formats)."""
    label = source.label()
    if not rows:
        raise DataError(f"{label} holds no records", fix="add examples, one record per line (or row).")
    layout = _layout(source)
    fmt = source.format
    if layout is not None:
        fmt = None
    elif fmt is None:
        fmt, why = formats.detect((w, r) for w, r in rows[: formats.DETECT_LINES] if not isinstance(r, NotJson))
        if fmt is None:
            if why == "no records":
                why = f"its first {min(len(rows), formats.DETECT_LINES)} lines are not valid JSON"
            raise DataError(
                f"{label}: cannot tell its format: {why}",
                fix="convert the data to one of the formats in docs/data.md, or name the format and map "
                "the columns in the recipe: data: {path: ..., format: alpaca, columns: {output: answer}}; data "
                "written for LLaMA-Factory or Axolotl reads with its dataset_info.json entry or its type: "
                "(docs/data.md, Coming from LLaMA-Factory / Axolotl).",
            )
    elif fmt not in formats.FORMATS:
        raise DataError(f"{label}: unknown format '{fmt}'", fix=f"use one of: {', '.join(formats.FORMATS)}.")
    examples, where = [], []
    problems: dict[str, list[str]] = {}
    n_bad = 0
    kind = None
    for w, rec in rows:
        try:
            if isinstance(rec, NotJson):
                raise formats.RecordProblem(str(rec))
            if layout is not None:
                if not isinstance(rec, dict):
                    raise formats.RecordProblem(f"expected a JSON object, found {type(rec).__name__}")
                rec_fmt, rec = layout[1](rec)
                ex = formats.FORMATS[rec_fmt].convert(rec, None)  # the layout checked the record's keys
                fmt = fmt or rec_fmt
            else:
                rec_fmt = fmt
                ex = formats.convert(rec, fmt, columns)
            if columns:  # the record's other columns, for the rewards (not those its format read)
                read = (*formats.EXAMPLE_KEYS, *formats.READ_KEYS, *formats.FORMATS[rec_fmt].keys)
                ex = {**ex, **{k: v for k, v in rec.items() if k not in read}}
            k = _form_key(ex)
            if kind is not None and k != kind:
                raise formats.RecordProblem(
                    f"this record is {_kind_name(k)} but the first was {_kind_name(kind)}: one kind per source"
                )
            kind = k
        except formats.RecordProblem as exc:
            n_bad += 1
            problems.setdefault(str(exc), []).append(w)
            continue
        examples.append(ex)
        where.append(w)
    if n_bad:
        lines = [f"- {_some(places)}: {problem}" for problem, places in list(problems.items())[:MAX_REPORTED]]
        if len(problems) > MAX_REPORTED:
            lines.append(f"- ... and {len(problems) - MAX_REPORTED} other problems")
        read_as = layout[0] if layout else formats.describe(fmt)
        detected = "" if source.format or layout else ", detected from its first lines"
        raise DataError(
            f"{label} ({read_as}{detected}) has {n_bad} bad record{'s' if n_bad > 1 else ''} of {len(rows)}:\n"
            + "\n".join(lines),
            fix=f"each record must be like: {layout[2] if layout else formats.example(fmt)} ; fix or remove these "
            "records (docs/data.md).",
        )
    return examples, where, fmt, layout[0] if layout else None


def _some(places: list[str]) -> str:
    """The first LOCATIONS_PER_PROBLEM places, and how many more there are."""
    more = len(places) - LOCATIONS_PER_PROBLEM
    return ", ".join(places[:LOCATIONS_PER_PROBLEM]) + (f" and {more} more" if more > 0 else "")


def _layout(source: Source) -> Optional[tuple[str, Callable[[dict], tuple[str, dict]], str]]:
    """Another tool's layout of a source: (how it reads, record -> (format, record), an example), or None."""
    if source.dataset is not None:
        from launcher.data import llamafactory

        entry = llamafactory.read_entry(Path(source.info or source.path), source.dataset)
        return entry.describe(), lambda rec: llamafactory.convert(entry, rec), entry.example()
    if source.type is not None:
        from launcher.data import axolotl

        t = axolotl.TYPES[source.type]
        return t.description, lambda rec: axolotl.convert(source.type, source.options, rec), t.example
    return None


def load_examples(spec: Any) -> list[list[dict[str, Any]]]:
    """Every example as a list of messages (formats.conversation). Training reads `load_data(spec).examples`."""
    return [formats.conversation(e) for e in load_data(spec).examples]


# While `render_tracked` renders: (the blocks so far, the generation spans), as transformers 5.24 AssistantTracker
_TRACKING: ContextVar = ContextVar("ftrun_generation_tracking", default=None)


def render_tracked(compiled, **variables) -> tuple[str, list[tuple[int, int]]]:
    """A compiled chat template rendered, with the character spans of its {% generation %} blocks."""
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    token = _TRACKING.set((blocks, spans))
    try:
        for block in compiled.generate(**variables):
            blocks.append(block)
    finally:
        _TRACKING.reset(token)
    return "".join(blocks), spans


def _template_env():
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        # transformers' {% generation %} marks assistant text; it renders its body unchanged
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            rendered = caller()
            tracking = _TRACKING.get()
            if tracking is not None:  # render_tracked: where this block starts and ends in the text
                blocks, spans = tracking
                start = len("".join(blocks))
                spans.append((start, start + len(rendered)))
            return rendered

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: __import__("datetime").datetime.now().strftime(fmt)
    return env


def token_counter(model: str) -> tuple[Optional[Callable[[Any], int]], str]:
    """A function counting an example's tokens as TRL does, and its source; (None, why) without a local tokenizer."""
    renderer, source = _renderer(model)
    if renderer is None or renderer[0] is None:
        return None, source
    render, encode = renderer

    def count(example: Any) -> int:
        if isinstance(example, list):
            example = {"messages": example}
        if formats.conversational(example):
            return len(encode(render(example), False))
        text = example["text"] if "text" in example else example["prompt"] + example["completion"]
        return len(encode(text, True)) + 1  # + EOS (trl add_eos)

    return count, source


def _renderer(model: str):
    """((render(example) -> text, encode(text, special) -> ids), source), or (None, why not)."""
    model_dir, why = tokenizer_dir(model)
    if model_dir is None:
        return None, why
    read = read_tokenizer(model_dir)
    if read is None:
        return None, f"{model_dir} has no tokenizer.json"
    tokenizer, template, special = read.tokenizer, read.template, read.special

    def encode(text: str, add_special: bool) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=add_special).ids

    if template is None:  # plain text and plain prompt/completion need none
        return (None, encode), f"{model_dir} has a tokenizer but no chat template"
    compiled = _template_env().from_string(template)

    def render(example: dict[str, Any]) -> str:
        msgs = example["messages"] if "messages" in example else example["prompt"] + example["completion"]
        return compiled.render(messages=msgs, tools=example.get("tools"), add_generation_prompt=False, **special)

    return (render, encode), f"tokenizer and chat template of {model_dir}"


# What a chat template may leave out, and the example without it: identical renderings mean it was dropped.
def _without_tool_calls(m: dict[str, Any]) -> dict[str, Any]:
    # a turn that only calls tools has content None: without its calls, "" (Qwen2.5's template fails on None)
    if "tool_calls" not in m:
        return m
    return {**{k: v for k, v in m.items() if k != "tool_calls"}, "content": m.get("content") or ""}


def _each_message(edit: Callable[[dict], Optional[dict]]) -> Callable[[dict], dict]:
    """An example -> the example with `edit` applied to each of its messages (a None leaves the message out)."""

    def apply(ex: dict[str, Any]) -> dict[str, Any]:
        keys = ("messages",) if "messages" in ex else formats.FORMS["prompt_completion"].columns
        return {**ex, **{k: [e for e in map(edit, ex[k]) if e is not None] for k in keys}}

    return apply


FEATURES = (
    ("tool_calls", lambda ex: any("tool_calls" in m for m in _msgs(ex)), _each_message(_without_tool_calls)),
    (
        "the tool role",
        lambda ex: any(m["role"] == "tool" for m in _msgs(ex)),
        _each_message(lambda m: None if m["role"] == "tool" else m),
    ),
    (
        "reasoning content",
        lambda ex: any(k in m for m in _msgs(ex) for k in formats.REASONING_FIELDS),
        _each_message(lambda m: {k: v for k, v in m.items() if k not in formats.REASONING_FIELDS}),
    ),
    ("tools (the tool schemas)", lambda ex: bool(ex.get("tools")), lambda ex: {**ex, "tools": None}),
)


def _msgs(ex: dict[str, Any]) -> list[dict[str, Any]]:
    if "messages" in ex:
        return ex["messages"]
    return ex["prompt"] + ex["completion"] if isinstance(ex.get("prompt"), list) else []


def example_lengths(examples: list[Any], model: str, where: Optional[list[str]] = None) -> tuple[list[int], str]:
    """Tokens per example (as TRL tokenizes it) and "tokenizer", or an estimate from characters and "characters".
    A template that leaves out (or fails on) the FEATURES a record holds is a DataError naming the records."""
    examples = [{"messages": e} if isinstance(e, list) else e for e in examples]
    where = where or [f"example {i + 1}" for i in range(len(examples))]
    if any(formats.example_form(ex) == "preference" for ex in examples):
        # a pair trains as two sequences, the prompt with each answer: its tokens are both (the forward runs both)
        flat = [(f"{where[i]} ({side})", seq) for i, ex in enumerate(examples) for side, seq in formats.sides(ex)]
        counts, source = example_lengths([s for _, s in flat], model, [w for w, _ in flat])
        return [a + b for a, b in zip(counts[::2], counts[1::2])], source
    renderer, _ = _renderer(model)
    if renderer is not None and renderer[0] is None and not any(formats.conversational(ex) for ex in examples):
        encode = renderer[1]
        return [
            len(encode(ex["text"] if "text" in ex else ex["prompt"] + ex["completion"], True)) + 1 for ex in examples
        ], "tokenizer"
    if renderer is None or renderer[0] is None:
        # about 4 characters per token (English, today's BPE vocabularies), plus a few template tokens per turn
        return [_characters(ex) for ex in examples], "characters"
    counter, _ = token_counter(model)
    render = renderer[0]
    dropped: dict[str, list[str]] = {}
    lengths = []
    for ex, w in zip(examples, where):
        try:
            lengths.append(counter(ex))
            if formats.conversational(ex):
                full = None
                for name, has, without in FEATURES:
                    if has(ex):
                        full = full if full is not None else render(ex)
                        if render(without(ex)) == full:
                            dropped.setdefault(name, []).append(w)
        except Exception as exc:  # a template that needs features we do not emulate, or refuses the record
            raise DataError(
                f"the chat template of {model} could not render {w}: {exc}",
                fix="check that the model's chat template supports what this record holds (tool calls, the tool "
                "role, a system message), or change the record.",
            ) from None
    if dropped:
        raise DataError(
            f"the chat template of {model} does not render what these records hold, so training would silently "
            "drop it:\n" + "\n".join(f"- {name}: {_some(places)}" for name, places in dropped.items()),
            fix="train a model whose chat template renders them (Qwen3, Llama 3.1+ and most tool-calling models do), "
            "or remove those fields from these records.",
        )
    return lengths, "tokenizer"


def _characters(ex: dict[str, Any]) -> int:
    if "text" in ex:
        return len(ex["text"]) // 4 + 1
    if isinstance(ex.get("prompt"), str):
        return (len(ex["prompt"]) + len(ex["completion"])) // 4 + 1
    return sum(len(m.get("content") or "") // 4 + len(json.dumps(m.get("tool_calls", ""))) // 4 + 4 for m in _msgs(ex))


def compute_stats(
    examples: list[Any],
    lengths: list[int],
    source: str,
    max_length: int,
    data: Optional[LoadedData] = None,
    splits: bool = False,
) -> DataStats:
    """Token statistics of `examples` (those that train); `data` adds what was read. A pair's tokens are its two
    sequences'. `splits`: packing cuts a longer sequence into pieces (bfd_split or wrapped), so every token trains."""
    limits = [max_length * len(formats.sequences(ex)) if isinstance(ex, dict) else max_length for ex in examples]
    clipped = list(lengths) if splits else [min(n, limit) for n, limit in zip(lengths, limits)]
    return DataStats(
        all_tokens=sum(lengths),
        splits=splits,
        examples=len(examples),
        total_tokens=sum(clipped),
        mean_tokens=round(sum(clipped) / len(clipped), 1),
        max_tokens=max(lengths),
        over_max_length=sum(1 for n, limit in zip(lengths, limits) if n > limit),
        tokens_source=source,
        max_length=max_length,
        description=data.describe() if data else "",
        sources=tuple(data.sources) if data else (),
        sha256=data.sha256 if data else "",
    )


def smoke_sample(lengths: list[int], fraction: float, min_examples: int, seed: int, longest: int = 1) -> list[int]:
    """Indices of the smoke sample: `fraction` of the data, at least `min_examples`, the `longest` longest in; the rest
    a seeded draw, so the measured steps have the data's usual lengths (long ones biased the ETA -12% to +21%, CPU)."""
    n = len(lengths)
    want = min(n, max(math.ceil(fraction * n), min_examples))
    by_length = sorted(range(n), key=lambda i: (-lengths[i], i))
    top = set(by_length[: max(1, min(want, longest))])
    rest = [i for i in range(n) if i not in top]
    random.Random(seed).shuffle(rest)
    return sorted(top | set(rest[: want - len(top)]))


def write_jsonl(path: Path, examples: list[Any]) -> None:
    """Examples as JSON lines in their canonical form (a message list is written as {"messages": ...})."""
    with path.open("w", encoding="utf-8") as fh:
        for ex in examples:
            fh.write(json.dumps({"messages": ex} if isinstance(ex, list) else ex, ensure_ascii=False) + "\n")


def to_dataset(examples: list[Any]):
    """A `datasets.Dataset` for the trainer: message lists as `Json` values (datasets 5.2.0, features/features.py: Arrow
    would unify the messages' keys), tool schemas as JSON text, which TRL's tokenize_fn decodes (sft_trainer.py)."""
    from datasets import Dataset, Features, Json, List, Value

    rows = [{"messages": ex} if isinstance(ex, list) else dict(ex) for ex in examples]
    has_tools = any("tools" in r for r in rows)
    columns: dict[str, Any] = {}
    first = rows[0]
    for key in dict.fromkeys(k for f in formats.FORMS.values() for k in f.columns):
        if key in first:
            kind = "bool" if isinstance(first[key], bool) else "string"  # KTO's label: a bool, as TRL batches it
            columns[key] = List(Json()) if isinstance(first[key], list) else Value(kind)
    for key in first:  # a record's other columns kept for GRPO's rewards (load_data `columns`), each value as it was
        if key not in columns and key != "tools":
            columns[key] = Json()
            for r in rows:  # JSON text, which Json() stores as is: a string "5" would be read back as the number 5
                r[key] = None if r.get(key) is None else json.dumps(r[key], ensure_ascii=False)
    if has_tools:
        columns["tools"] = Value("string")
        for r in rows:
            r["tools"] = json.dumps(r["tools"], ensure_ascii=False) if r.get("tools") else None
    return Dataset.from_list(rows, features=Features(columns))
