"""Data sources: the records of a local file, a folder of them, a dataset saved with `datasets`, or a Hub dataset.

Each source yields (where, record) pairs and an identity a resume compares (a file's sha256, a Hub revision). Hub
datasets go through `datasets.load_dataset`, which falls back to the HF cache offline (datasets 5.2.0, load.py
`CachedDatasetModuleFactory`).
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Optional

from launcher.store.checkpoint import sha256_file
from launcher.errors import DataError, json_problem

EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv")


@dataclass(frozen=True)
class Source:
    """One entry of the recipe's `data`: a path (local) or a Hub id, and how to read it."""

    path: str
    split: str = "train"
    subset: Optional[str] = None
    revision: Optional[str] = None
    columns: dict[str, str] = field(default_factory=dict)  # canonical field -> the source's column
    format: Optional[str] = None  # named in the recipe; else detected from the first records
    weight: float = 1.0
    ignore: tuple[str, ...] = ()  # keys at the top of a record left out, as the recipe says (the plan names them)
    dataset: Optional[str] = None  # LLaMA-Factory: the entry of the dataset_info.json that `info` is
    info: Optional[str] = None  # LLaMA-Factory: that dataset_info.json (path is then the entry's data)
    type: Optional[str] = None  # Axolotl: the dataset type (launcher/data/axolotl.py TYPES)
    options: dict[str, Any] = field(default_factory=dict)  # Axolotl: the entry's field mappings for its type

    @property
    def local(self) -> bool:
        p = Path(self.path)
        return (
            p.exists()
            or self.path.startswith((".", "/", "~"))
            or self.path.count("/") != 1
            or p.suffix.lower() in EXTENSIONS
        )

    def label(self) -> str:
        if self.local:
            return self.path
        extra = "".join(f", {k} {v}" for k, v in (("subset", self.subset), ("revision", self.revision)) if v)
        return f"Hub dataset {self.path} (split {self.split}{extra})"


def sources_of(spec: Any) -> list[Source]:
    """The recipe's `data` (a path, a {path: ...} mapping, a list of them, or the recipe's own objects) as Sources."""
    items = spec if isinstance(spec, (list, tuple)) else [spec]
    out = []
    for item in items:
        if hasattr(item, "model_dump"):
            item = item.model_dump()
        if isinstance(item, Source):
            out.append(item)
        elif isinstance(item, (str, Path)):
            out.append(Source(path=str(item)))
        elif isinstance(item, dict):
            out.append(_layout(_source(item)))
        else:
            raise DataError(
                f"data entry {item!r} is neither a path nor a {{path: ...}} mapping",
                fix="give data as a path, {path: org/name, split: train}, or a list of those.",
            )
    if not out:
        raise DataError("data is an empty list", fix="name at least one file, folder or Hub dataset under data.")
    for source in out:
        _only_options_that_apply(source)
    return out


def _source(item: dict[str, Any]) -> Source:
    """A {path: ...} mapping (the recipe's DataSource dumped) as a Source: Axolotl's field mappings gathered."""
    from launcher.data.axolotl import OPTION_DEFAULTS

    given = {k: v for k, v in item.items() if v is not None and v != {} and v != []}
    options = {k: given.pop(k) for k in list(given) if k in OPTION_DEFAULTS}
    if "ignore" in given:
        given["ignore"] = tuple(given["ignore"])
    if options and not given.get("type"):
        raise DataError(
            f"data entry {given.get('path')}: {', '.join(options)} {'is' if len(options) == 1 else 'are'} Axolotl's "
            "field mappings, read with its type:",
            fix="add the Axolotl type they belong to (type: chat_template, ...), or remove them.",
        )
    return Source(**given, options=options)


def _layout(source: Source) -> Source:
    """A data entry in another tool's layout, checked (a LLaMA-Factory entry resolved) before any record is read."""
    if source.dataset is not None and source.info is not None:
        return source  # resolved already (the worker reads the recipe's sources again)
    if source.dataset is not None:
        from launcher.data import llamafactory

        given = (("format", source.format), ("columns", source.columns), ("type", source.type))
        given += (("split", source.split != "train"), ("subset", source.subset), ("revision", source.revision))
        others = [k for k, v in given if v]
        if others:
            raise DataError(
                f"data entry {source.path} (dataset: {source.dataset}): {', '.join(others)} beside dataset:; the "
                "dataset_info.json entry says where the data is and how it reads",
                fix="set them in the dataset_info.json entry (file_name or hf_hub_url, split, subset, formatting, "
                "columns, tags), or read the data file itself without dataset: (docs/data.md).",
            )
        entry = llamafactory.read_entry(Path(source.path).expanduser(), source.dataset)
        return replace(source, path=entry.path, info=entry.info, split=entry.split, subset=entry.subset)
    if source.type is not None:
        from launcher.data import axolotl

        others = [k for k, v in (("format", source.format), ("columns", source.columns)) if v]
        problem = axolotl.type_problem(source.type, source.options) or (
            f"{', '.join(others)} beside type: (the type's own field mappings say how it reads)" if others else None
        )
        if problem:
            raise DataError(
                f"data entry {source.path}: {problem}",
                fix="change the data entry as it says (docs/data.md, Coming from LLaMA-Factory / Axolotl).",
            )
    return source


def _only_options_that_apply(source: Source) -> None:
    """A Hub-only option on a local source (which it would ignore) refused; a saved dataset takes split alone."""
    if not source.local:
        return
    path = Path(source.path)
    saved = path.is_dir() and _is_saved_dataset(path)
    ignored = [(k, v) for k, v in (("subset", source.subset), ("revision", source.revision)) if v is not None]
    if source.split != "train" and not saved:
        ignored.insert(0, ("split", source.split))
    if ignored:
        what = ", ".join(f"{k}: {v}" for k, v in ignored)
        raise DataError(
            f"data entry {source.path}: {what} applies to Hub datasets"
            + (" (a saved dataset takes split only)" if saved else "")
            + f", and {source.path} is a local {'saved dataset' if saved else 'file or folder'}, read whole",
            fix="remove it from the data entry, or split the data into files of its own (one file per "
            "split: the held-out part as eval.data).",
        )


def pinned(spec: Any, recorded: list[dict[str, Any]]) -> list[Source]:
    """The sources of `spec` with each Hub dataset at the revision data.json recorded (the commit that was checked)."""
    sources = sources_of(spec)
    if len(recorded) != len(sources):
        return sources
    return [
        replace(s, revision=r.get("revision") or s.revision) if not s.local else s for s, r in zip(sources, recorded)
    ]


@dataclass
class Records:
    rows: list[tuple[str, Any]]  # (where, record)
    identity: dict[str, Any]  # source, and sha256 (local) or revision (Hub)


def read(source: Source) -> Records:
    """Every record of the source, with where it came from; a DataError naming the path or dataset otherwise."""
    if source.local:
        path = Path(source.path).expanduser()
        if not path.exists():
            raise DataError(
                f"data '{source.path}' (recipe key 'data') does not exist",
                fix="set data to a .jsonl/.json/.parquet/.csv file or a folder of them (relative paths are read from "
                "the recipe's folder), or to a Hub dataset as org/name.",
            )
        if path.is_dir():
            rows, identity = _read_folder(path, source)
        else:
            rows, identity = list(_read_file(path, path.name)), {"source": str(path), "sha256": sha256_file(path)}
    else:
        rows, identity = _read_hub(source)
    if source.dataset is not None:  # the mapping is part of what trains: a changed entry is changed data
        identity["dataset_info"] = {"file": source.info, "dataset": source.dataset}
        identity["dataset_info"]["sha256"] = sha256_file(Path(source.info))
    return Records(_without_ignored(_renamed(rows, source), source), identity)


def _without_ignored(rows: list[tuple[str, Any]], source: Source) -> list[tuple[str, Any]]:
    """The recipe's ignore: keys left out of each record (the plan's data line names them)."""
    if not source.ignore:
        return rows
    drop = set(source.ignore)
    return [(w, {k: v for k, v in r.items() if k not in drop} if isinstance(r, dict) else r) for w, r in rows]


def _renamed(rows: list[tuple[str, Any]], source: Source) -> list[tuple[str, Any]]:
    """`columns: {messages: conversation}`: the source's column under the name the format expects."""
    if not source.columns or not rows:
        return rows
    first = rows[0][1]
    if isinstance(first, dict):
        missing = [f"{col} (columns.{key})" for key, col in source.columns.items() if col not in first]
        if missing:
            raise DataError(
                f"{source.label()} has no column {', '.join(missing)}; its columns: {', '.join(sorted(first))}",
                fix="map each field the format expects to one of the source's columns, e.g. "
                "columns: {messages: conversation}.",
            )
    out = []
    for where, rec in rows:
        if isinstance(rec, dict):
            rec = dict(rec)
            for key, col in source.columns.items():
                if col in rec:
                    rec[key] = rec.pop(col)
        out.append((where, rec))
    return out


def _read_file(path: Path, label: str) -> Iterator[tuple[str, Any]]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            for i, rec in enumerate(pq.read_table(path).to_pylist(), start=1):
                yield f"{label} row {i}", rec
        elif suffix == ".csv":
            with path.open("r", encoding="utf-8", newline="") as fh:
                for i, rec in enumerate(csv.DictReader(fh), start=1):
                    yield f"{label} row {i}", rec
        elif suffix == ".json" and not _is_json_lines(path):
            try:
                doc = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{path} is not valid JSON: {json_problem(exc)}",
                    fix="a .json file holds one list of records; use .jsonl for one record per line.",
                ) from None
            if isinstance(doc, dict) and len(doc) == 1 and isinstance(next(iter(doc.values())), list):
                doc = next(iter(doc.values()))  # {"train": [...]} or {"data": [...]}
            if not isinstance(doc, list):
                raise DataError(
                    f"{path} holds a JSON {type(doc).__name__}, not a list of records",
                    fix="write the records as one JSON list, or one per line as .jsonl.",
                )
            for i, rec in enumerate(doc, start=1):
                yield f"{label} record {i}", rec
        else:  # .jsonl, and .json written one record per line
            with path.open("r", encoding="utf-8", errors="strict") as fh:
                for lineno, line in enumerate(fh, start=1):
                    if not line.strip():
                        continue  # blank lines (a trailing newline, say) carry no example
                    try:
                        yield f"{label} line {lineno}", json.loads(line)
                    except json.JSONDecodeError as exc:
                        yield f"{label} line {lineno}", NotJson(f"not valid JSON: {json_problem(exc, lines=False)}")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})", fix="save the file as UTF-8."
        ) from None


def _is_json_lines(path: Path) -> bool:
    with path.open("r", encoding="utf-8", errors="replace") as fh:
        head = fh.read(1)
        while head.isspace():
            head = fh.read(1)
    return head == "{"


class NotJson(str):
    """A line that did not parse: the converter reports it as the line's problem."""


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def _read_folder(path: Path, source: Source) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    files = sorted(p for p in path.rglob("*") if p.is_file())
    files = [p for p in files if not any(part.startswith(".") for part in p.relative_to(path).parts)]
    digest = hashlib.sha256()
    for p in files:
        digest.update(f"{p.relative_to(path)}\0{sha256_file(p)}\n".encode())
    identity = {"source": str(path), "sha256": digest.hexdigest()}
    if _is_saved_dataset(path):  # Dataset.save_to_disk / DatasetDict.save_to_disk
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if source.split not in ds:
                raise DataError(
                    f"{path} has no split '{source.split}'; its splits: {', '.join(ds)}",
                    fix="set split: to one of them in the data entry.",
                )
            ds = ds[source.split]
        return [(f"{path.name} row {i}", rec) for i, rec in enumerate(ds.to_list(), start=1)], identity
    data_files = [p for p in files if p.suffix.lower() in EXTENSIONS]
    if not data_files:
        raise DataError(
            f"the folder {path} holds no {', '.join(EXTENSIONS)} files",
            fix="point data at a folder of data files, at one file, or at a dataset saved with datasets.",
        )
    rows = [r for p in data_files for r in _read_file(p, str(p.relative_to(path)))]
    return rows, identity


def _read_hub(source: Source) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    try:
        import datasets
        from datasets.exceptions import DatasetNotFoundError
    except ImportError:  # a light install (no extras): `ftrun plan` still plans on the recipe's tokens
        raise DataError(
            f"the Hub dataset {source.path} is read with the `datasets` library, which this install of "
            "ftrun lacks (the base install plans, it does not train)",
            fix="pip install 'ftrun[train]' to read it (and to train), or plan without reading it: "
            "tokens: N in the recipe, or `ftrun plan RECIPE --tokens N`",
        ) from None

    try:
        ds = datasets.load_dataset(source.path, name=source.subset, split=source.split, revision=source.revision)
    except ConnectionError as exc:
        raise DataError(
            f"the Hub dataset {source.path} is not in this box's Hugging Face cache and the Hub cannot be reached "
            f"({exc})",
            fix=f"download it once with a network (datasets.load_dataset('{source.path}')) into the cache this box "
            "reads (HF_HOME / HF_DATASETS_CACHE), unset HF_HUB_OFFLINE, or copy the files here and give their path.",
        ) from None
    except DatasetNotFoundError as exc:
        raise DataError(
            f"{source.label()}: {exc}",
            fix="check the name (org/name) and your access (HF_TOKEN for gated or private datasets).",
        ) from None
    except (ValueError, FileNotFoundError) as exc:  # an unknown split or subset, no data files
        raise DataError(
            f"{source.label()} could not be loaded: {exc}", fix="check split: and subset: against the dataset's page."
        ) from None
    # the cache folder of a Hub dataset is named by the commit it was downloaded at
    folders = [Path(f["filename"]).parent.name for f in getattr(ds, "cache_files", None) or []]
    revision = next((name for name in folders if re.fullmatch(r"[0-9a-f]{40}", name)), None)
    identity = dict(source=source.path, split=source.split, subset=source.subset, revision=revision or source.revision)
    return [(f"{source.path} row {i}", rec) for i, rec in enumerate(ds.to_list(), start=1)], identity
