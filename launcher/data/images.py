"""Image data: conversations whose turns hold images, read into TRL's vision layout (every turn's content a list of
text and image parts, `images` the absolute paths in placeholder order: sft_trainer.py
DataCollatorForVisionLanguageModeling), every image opened and measured before any training. The layouts (image parts,
an `images` column with placeholders placed as trl 1.16 data_utils.py prepare_multimodal_messages does, image and
text columns) are docs/data.md's, "Images". An image is a path (relative to the data file's folder) or the value
of datasets' Image feature, a struct {"bytes", "path"} (datasets 5.2.0 features/image.py `Image.pa_type`; to_list
hands it over undecoded), whose bytes are written once under FTRUN_CACHE/images by their sha256. Each image is
decoded in full (PIL `load`) and its size kept for the token count (launcher/data/image_tokens.py)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from launcher.data import formats
from launcher.data.sources import Source, read, sources_of
from launcher.errors import DataError

IMAGE_KEYS = ("images", "image")  # the columns beside `messages` that hold a record's images (TRL's names)
IMAGE_PART = "image"
TEXT_PART = "text"
MAX_REPORTED = 8
# the question and answer columns of a Hub-style image record (an image column, no messages), in the order tried
PROMPT_COLUMNS = ("prompt", "question", "query")
ANSWER_COLUMNS = ("completion", "answer", "text")
# the keys of Hugging Face datasets' Image feature as stored (datasets features/image.py Image.pa_type)
STORED_KEYS = {"bytes", "path"}
# what a record's image part reads as in the text-only copy the chat checks see (formats.convert)
_STANDIN = "[image]"


@dataclass
class ImageData:
    """The image data set: examples in TRL's vision layout, where each came from, and each example's image sizes."""

    examples: list[dict[str, Any]]
    where: list[str]
    sizes: list[list[tuple[int, int]]]  # per example, per image: (width, height) in pixels
    sha256: str  # the data files' and the images' bytes: what a resume compares
    sources: list[dict[str, Any]] = field(default_factory=list)

    @property
    def pairs(self) -> bool:
        """Whether the examples are preference pairs (prompt, chosen, rejected), not conversations."""
        return bool(self.examples) and "chosen" in self.examples[0]

    @property
    def images(self) -> int:
        return sum(len(s) for s in self.sizes)

    def describe(self) -> str:
        n, k = len(self.examples), self.images
        distinct = len({p for e in self.examples for p in e["images"]})
        return (
            f"{'preference pairs' if self.pairs else 'chat'} with images, {n:,} {'pair' if self.pairs else 'example'}"
            f"{'' if n == 1 else 's'}, "
            f"{k:,} image{'' if k == 1 else 's'} "
            f"({distinct:,} distinct files, each opened and measured)"
        )


def record_has_images(record: Any) -> bool:
    """Whether a record holds an image: an `images`/`image` column, or an image part in a turn's content."""
    if not isinstance(record, dict):
        return False
    if any(record.get(k) for k in IMAGE_KEYS):
        return True
    turns = [m for k in ("messages", "prompt") if isinstance(record.get(k), list) for m in record[k]]
    for m in turns:  # a malformed record is the format check's to name
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == IMAGE_PART for p in content):
            return True
    return False


def data_has_images(spec: Any) -> bool:
    """Whether the recipe's data holds images (any record of a source: a Hub dataset is read from the HF cache, as
    the text data's reading would read it next)."""
    for source in sources_of(spec):
        if source.local and not Path(source.path).expanduser().exists():
            continue
        if any(record_has_images(r) for _, r in read(source).rows):
            return True
    return False


class _Problem(Exception):
    pass


def _base_dir(source: Source) -> Optional[Path]:
    """The folder relative image paths resolve against: the data file's; none for a Hub dataset."""
    if not source.local:
        return None
    path = Path(source.path).expanduser().resolve()
    return path if path.is_dir() else path.parent


def cache_dir() -> Path:
    """Where image bytes stored in the data are written as files: FTRUN_CACHE (else ~/.cache/ftrun), images/."""
    return Path(os.environ.get("FTRUN_CACHE", Path.home() / ".cache" / "ftrun")) / "images"


def _stored(data: bytes, name: Optional[str]) -> Path:
    """Image bytes as a file named by their sha256 (the original name's suffix kept), written once, atomically."""
    suffix = Path(name).suffix.lower() if name else ""
    suffix = suffix if suffix[1:].isalnum() and len(suffix) <= 6 else ""
    folder = cache_dir()
    path = folder / f"{hashlib.sha256(data).hexdigest()}{suffix}"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return path


def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    """A turn's content as parts: a string is one text part; a list is checked part by part."""
    if isinstance(content, str):
        return [{"type": TEXT_PART, "text": content}]
    if not isinstance(content, list) or not content:
        raise _Problem(f"{where}.content must be a string or a non-empty list of text and image parts")
    parts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == TEXT_PART and isinstance(p.get(TEXT_PART), str):
            parts.append({"type": TEXT_PART, "text": p[TEXT_PART]})
        elif kind == IMAGE_PART:
            parts.append(dict(p))
        else:
            raise _Problem(
                f'{where}.content[{j}] is not a text part {{"type": "text", "text": ...}} or an image part '
                f'{{"type": "image", "image": PATH}} (found {json.dumps(p)[:80]})'
            )
    return parts


def _resolve(value: Any, base: Optional[Path], where: str, labels: dict[Path, str]) -> Path:
    """An image value as a local file: a path (relative to `base`), or an Image feature's stored struct whose bytes
    are written to the cache (`labels` then says where they came from, for the error if they do not decode)."""
    if isinstance(value, dict) and value and set(value) <= STORED_KEYS:
        data, name = value.get("bytes"), value.get("path")
        if isinstance(data, (bytes, bytearray)) and data:
            path = _stored(bytes(data), name if isinstance(name, str) else None)
            labels[path] = f"{where} (image bytes{f' of {name}' if isinstance(name, str) and name else ''})"
            return path
        if data is None and isinstance(name, str) and name.strip():
            value = name  # the Image feature keeps only the path of a local file (features/image.py encode_example)
        else:
            raise _Problem(
                f'{where} is an image struct {{"bytes", "path"}} with neither image bytes nor a path '
                f"(found {_shown(value)}): the row holds no image"
            )
    if not isinstance(value, str) or not value.strip():
        raise _Problem(f"{where} must be an image file path or image bytes, found {_shown(value)}")
    if value.startswith(("http://", "https://", "hf://")):
        raise _Problem(
            f"{where} is a URL ({value}): images are read from local files or from the bytes stored in the data, so "
            "that each is opened and counted before any GPU time and a resume reads the same bytes; download them "
            "beside the data and write their paths (docs/data.md, Images)"
        )
    path = Path(value).expanduser()
    if path.is_absolute():
        return path
    if base is None:
        raise _Problem(
            f"{where} is a relative path ({value}) in a Hub dataset, which has no folder to read it from: the "
            "dataset must store the image bytes (an Image feature) or absolute paths"
        )
    return base / path


def _shown(value: Any) -> str:
    return json.dumps(value, default=lambda v: f"<{len(v)} bytes>" if isinstance(v, (bytes, bytearray)) else str(v))[
        :80
    ]


def normalize(
    record: Any, base: Optional[Path], labels: Optional[dict[Path, str]] = None
) -> tuple[dict[str, Any], list[Path]]:
    """A record as TRL's vision layout (paths still unopened, image bytes written to the cache), or a _Problem
    naming the field. `labels`: filled with where each image written from bytes came from."""
    labels = {} if labels is None else labels
    if isinstance(record, dict) and "messages" not in record and any(k in record for k in IMAGE_KEYS):
        record = _as_chat(record)
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        raise _Problem("an image record needs a 'messages' list of {role, content} turns")
    key = "images" if "images" in record else "image"
    column = record.get(key)
    if column is not None and not isinstance(column, list):
        column = [column]
    messages, inline, placeholders = [], [], 0
    for i, m in enumerate(record["messages"]):
        if not isinstance(m, dict):
            raise _Problem(f"messages[{i}] must be a {{role, content}} object")
        parts = _parts(m.get("content"), f"messages[{i}]")
        for j, p in enumerate(parts):
            if p["type"] != IMAGE_PART:
                continue
            if m.get("role") == "assistant":
                raise _Problem(
                    f"messages[{i}] (assistant) holds an image: the model reads images, it does not write them"
                )
            if p.get(IMAGE_PART) is not None:
                inline.append(_resolve(p[IMAGE_PART], base, f"messages[{i}].content[{j}].image", labels))
            else:
                placeholders += 1
            parts[j] = {"type": IMAGE_PART}
        if m.get("role") != "user" and all(p["type"] == TEXT_PART for p in parts):
            # a turn without images keeps its text as a string: what the task evaluation takes as a reference, and
            # what trl 1.16 wraps itself (data_utils.py prepare_multimodal_messages); a user turn stays a list of
            # parts, since trl puts an image column's images into the first user turn whose content is a string
            messages.append({**m, "content": "".join(p["text"] for p in parts)})
            continue
        messages.append({**{k: v for k, v in m.items() if k != "content"}, "content": parts})
    if inline and column:
        raise _Problem(
            f"the record has image paths in its turns and an '{'images' if 'images' in record else 'image'}' column "
            'too: write the images one way, as parts with their paths or as the column with {"type": "image"} '
            "placeholders"
        )
    many = isinstance(record.get(key), list)
    paths = inline or [
        _resolve(v, base, f"column {key}" + (f"[{k}]" if many else ""), labels) for k, v in enumerate(column or [])
    ]
    if column and placeholders == 0:  # TRL's rule: the images go before the first user turn's text
        first_user = next((m for m in messages if m.get("role") == "user"), None)
        if first_user is None:
            raise _Problem("the record has images but no user turn to put them in")
        first_user["content"] = [{"type": IMAGE_PART} for _ in paths] + first_user["content"]
    elif column and placeholders != len(paths):
        raise _Problem(
            f"{placeholders} image placeholder{'s' if placeholders != 1 else ''} in the turns and {len(paths)} "
            f"image{'s' if len(paths) != 1 else ''} in the '{'images' if 'images' in record else 'image'}' column: "
            'each {"type": "image"} part takes the next image in order, so their counts must be equal'
        )
    elif not column and placeholders:
        raise _Problem(
            f"{placeholders} image part{'s' if placeholders != 1 else ''} without a path and no 'images' column: "
            'give each image part its file ({"type": "image", "image": "photo.png"}) or add the column'
        )
    # the turns' roles, order and keys are checked as any chat's (formats.py), on a text-only copy
    text_only = [{**m, "content": text_of(m["content"])} for m in messages]
    rest = {k: v for k, v in record.items() if k not in ("messages", *IMAGE_KEYS)}
    try:
        formats.convert({**rest, "messages": text_only}, "messages")
    except formats.RecordProblem as exc:
        raise _Problem(str(exc)) from None
    return {"messages": messages, "images": [str(p) for p in paths]}, paths


def is_pair(record: Any) -> bool:
    """A preference pair: a prompt and a chosen and a rejected answer (TRL's preference columns)."""
    return isinstance(record, dict) and all(side in record for side in formats.SIDES)


def normalize_pair(
    record: dict[str, Any], base: Optional[Path], labels: Optional[dict[Path, str]] = None
) -> tuple[dict[str, Any], list[Path]]:
    """An image preference pair as trl 1.16's DPOTrainer takes it (dpo_trainer.py DataCollatorForVisionPreference:
    `prompt` a conversation whose user turn holds the image placeholders, `chosen` and `rejected` one assistant turn
    each, `images` the files in placeholder order), or a _Problem naming the field. The prompt is a string or a list
    of turns, with image parts or an `images`/`image` column, read as a chat's turns are (`normalize`)."""
    answers = {}
    for side in formats.SIDES:
        value = record[side]
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
            if value[0].get("role") != "assistant":
                raise _Problem(f"{side}[0] must be the assistant's turn, found role {value[0].get('role')!r}")
            value = value[0].get("content")
            value = text_of(_parts(value, f"{side}[0]")) if isinstance(value, list) else value
        if not isinstance(value, str) or not value.strip():
            raise _Problem(f"{side} must be the answer's text or one assistant turn, found {_shown(value)}")
        answers[side] = value
    prompt = record.get("prompt")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise _Problem(f"prompt must be the question's text or a list of turns, found {_shown(prompt)}")
    rest = {k: v for k, v in record.items() if k not in ("prompt", *formats.SIDES)}
    chat = {**rest, "messages": [*prompt, {"role": "assistant", "content": answers["chosen"]}]}
    example, paths = normalize(chat, base, labels)
    turns = example["messages"][:-1]
    if not turns or turns[-1].get("role") != "user":
        raise _Problem("the prompt must end with the user's turn that the answers reply to")
    pair = {"prompt": turns, **{k: [{"role": "assistant", "content": v}] for k, v in answers.items()}}
    return {**pair, "images": example["images"]}, paths


def _as_chat(record: dict[str, Any]) -> dict[str, Any]:
    """A Hub-style image record (an image column beside a question and an answer column) as a chat: the user turn
    the question (the image goes before it, TRL's rule), the assistant turn the answer; the record's other columns
    stay, for the format check to name."""

    def one(names: tuple[str, ...], what: str) -> Optional[str]:
        found = [n for n in names if record.get(n) not in (None, "")]
        if len(found) > 1:
            raise _Problem(
                f"the columns {', '.join(found)} could each be the {what}: map one with columns: in the data entry "
                f"(columns: {{{names[0]}: {found[0]}}}) and leave out the other with ignore:"
            )
        return found[0] if found else None

    key = "images" if "images" in record else "image"
    if record[key] in (None, []):
        raise _Problem(f"column {key} is empty (null): the row holds no image; remove the row or give it its image")
    answer = one(ANSWER_COLUMNS, "answer")
    if answer is None:
        keys = ", ".join(sorted(record))
        raise _Problem(
            f"an image record without 'messages' needs an answer column ({', '.join(ANSWER_COLUMNS)}; keys present: "
            f"{keys}): map the source's answer column with columns: in the data entry, e.g. columns: {{answer: "
            "label}, or write the record as messages"
        )
    question = one(PROMPT_COLUMNS, "question")
    value = record[answer]
    if isinstance(value, list) and len(value) == 1:  # ChartQA's label: a list of one answer
        value = value[0]
    if not isinstance(value, str):
        raise _Problem(f"column {answer} (the answer) must be text, found {_shown(value)}")
    text = record[question] if question else ""
    if not isinstance(text, str):
        raise _Problem(f"column {question} (the question) must be text, found {_shown(text)}")
    n = len(record[key]) if isinstance(record[key], list) else 1
    # one placeholder per image, before the question (TRL's rule for an image column: data_utils.py
    # prepare_multimodal_messages); an OCR record (unsloth/LaTeX_OCR) has no question: the image is the user turn
    user = [{"type": IMAGE_PART} for _ in range(n)] + ([{"type": TEXT_PART, "text": text}] if text else [])
    rest = {k: v for k, v in record.items() if k not in (answer, question)}
    return {**rest, "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": value}]}


def text_of(content: Any) -> str:
    """A turn's content as text, each image part one stand-in ("[image]")."""
    if isinstance(content, str):
        return content
    return " ".join(p["text"] if p["type"] == TEXT_PART else _STANDIN for p in content)


def measure(path: Path, label: Optional[str] = None) -> tuple[int, int]:
    """(width, height) of an image decoded in full; _Problem if it is missing or does not decode (`label`: where
    image bytes written to the cache came from, named instead of the cache file)."""
    from PIL import Image

    if not path.is_file():
        raise _Problem(f"image {path} does not exist")
    if label is not None:
        try:
            return measure(path)
        except _Problem as exc:
            reason = str(exc).split(" does not decode as an image ", 1)[-1]
            raise _Problem(f"{label} does not decode as an image {reason}") from None
    try:
        with Image.open(path) as im:
            im.load()  # decodes every pixel: a truncated or corrupt file fails here, not in a training step
            return im.size
    except Exception as exc:  # PIL raises UnidentifiedImageError, OSError, SyntaxError or ValueError by format
        raise _Problem(f"image {path} does not decode as an image ({type(exc).__name__}: {exc})") from None


def load_images(spec: Any) -> ImageData:
    """The recipe's image data, every record normalized and every image opened; a DataError lists every bad record
    (file and line, the field or the image path, the fix) at once."""
    examples, where, sizes, problems = [], [], [], []
    digest = hashlib.sha256()
    records = []
    seen: dict[Path, Any] = {}
    pairs: Optional[bool] = None  # preference pairs (DPO) or conversations: the first record says
    for source in sources_of(spec):
        got = read(source)
        base = _base_dir(source)
        records.append({**got.identity, "format": "images", "examples": len(got.rows)})
        for w, rec in got.rows:
            try:
                labels: dict[Path, str] = {}
                if pairs is None:
                    pairs = is_pair(rec)
                if is_pair(rec) != pairs:
                    raise _Problem(
                        f"a {'preference pair' if is_pair(rec) else 'conversation'} among "
                        f"{'preference pairs' if pairs else 'conversations'}: one kind of record per data set"
                    )
                example, paths = (normalize_pair if pairs else normalize)(rec, base, labels)
                measured = []
                for p in paths:
                    key = p.resolve()
                    if key in seen and isinstance(seen[key], _Problem) and p in labels:
                        seen.pop(key)  # bad bytes seen in another row: named again with this row's column
                    if key not in seen:
                        try:
                            seen[key] = measure(key, labels.get(p))
                            digest.update(str(key).encode() + hashlib.sha256(key.read_bytes()).digest())
                        except _Problem as exc:
                            seen[key] = exc
                    if isinstance(seen[key], _Problem):
                        raise seen[key]
                    measured.append(seen[key])
            except _Problem as exc:
                problems.append(f"- {w}: {exc}")
                continue
            examples.append(example)
            where.append(w)
            sizes.append(measured)
            digest.update(json.dumps(example, sort_keys=True).encode())
    if problems:
        shown = problems[:MAX_REPORTED] + (
            [f"- ... and {len(problems) - MAX_REPORTED} more"] if len(problems) > MAX_REPORTED else []
        )
        raise DataError(
            f"the image data has {len(problems)} bad record{'s' if len(problems) > 1 else ''}:\n" + "\n".join(shown),
            fix="each record must be like: "
            '{"messages": [{"role": "user", "content": [{"type": "image", "image": "photo.png"}, {"type": "text", '
            '"text": "..."}]}, {"role": "assistant", "content": "..."}]} (paths relative to the data file), or '
            'messages with {"type": "image"} placeholders and an "images" column, or an image column (a path or '
            "an Image feature's bytes) beside question and answer columns; fix or remove these records "
            "(docs/data.md, Images).",
        )
    if not examples:
        raise DataError("the image data holds no records", fix="add examples, one record per line.")
    for r in records:
        r["format"] = f"{'preference pairs' if pairs else 'chat'} with images"
    return ImageData(examples, where, sizes, digest.hexdigest(), records)


def refuse_text_model(model: str, spec: Any) -> None:
    """Image data for a model without a vision tower: a DataError naming the model, the data and the fix."""
    raise DataError(
        f"the data ({', '.join(s.path for s in sources_of(spec))}) holds images (first at "
        f"{first_image_record(spec)}), but the model {model} has no vision tower (its config.json has no "
        "vision_config): it cannot read them",
        fix="train a vision-language model (Qwen2.5-VL, Qwen3-VL, Gemma 3 4B+, ...), or remove the images from the "
        "data.",
    )


def first_image_record(spec: Any) -> Optional[str]:
    """Where the first record with an image is ("d.jsonl line 3"), for refusals that name one."""
    for source in sources_of(spec):
        if not source.local or Path(source.path).expanduser().exists():
            for w, r in read(source).rows:
                if record_has_images(r):
                    return w
    return None
