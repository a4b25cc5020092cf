"""A recipe file read into a `Recipe`: its YAML (each key once), `key=value` overrides, every error at once.
Precedence, lowest first: the defaults < the recipe file < `key=value`. Relative paths resolve against the recipe's
folder, those given on the command line against the working directory.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from launcher.data import sources as data_sources
from launcher.errors import RecipeError, UsageError, close_name
from launcher.recipe import Recipe, has_adapter
from launcher.recipe_sections import fields, secret_keys
from launcher.store.rundir import RunDir


# Names people bring from other tools, for keys whose spelling is not close to ftrun's.
KEY_ALIASES = {
    "lr": "learning_rate",
    "batch_size": "micro_batch_size",
    "num_epochs": "epochs",
    "num_train_epochs": "epochs",
    "per_device_train_batch_size": "micro_batch_size",
    "max_seq_length": "max_length",
    "base_model": "model",
    "dataset": "data",
    "datasets": "data",  # Axolotl
    "sequence_len": "max_length",  # Axolotl
    "cutoff_len": "max_length",  # LLaMA-Factory
    "dataset_dir": "data",  # LLaMA-Factory: data: {path: DATASET_DIR/dataset_info.json, dataset: NAME}
}


def _suggest(loc: str) -> str:
    options = [key for key, _ in fields(Recipe)]
    if KEY_ALIASES.get(loc) in options:
        return f" (did you mean '{KEY_ALIASES[loc]}'?)"
    close = close_name(loc, options)
    if not close:  # a typo in the last part of a nested key: compare the leaf names
        leaf = loc.rsplit(".", 1)[-1]
        leaves = {o.rsplit(".", 1)[-1]: o for o in options if o.count(".") == loc.count(".")}
        near = close_name(leaf, list(leaves))
        close = leaves[near] if near else None
    return f" (did you mean '{close}'?)" if close else ""


def _format_errors(err: ValidationError, source: str) -> RecipeError:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"- unknown key '{loc}'{_suggest(loc)}")
        elif e["type"] == "missing":
            doc = dict(fields(Recipe)).get(loc)
            doc = doc.description if doc is not None else ""
            lines.append(f"- '{loc}' is required" + (f": {doc}" if doc else ""))
        else:
            value = e.get("input")
            secret = any(loc == k or loc.startswith(f"{k}.") for k in secret_keys(Recipe))  # a token, a password
            shown = "<secret>" if secret else repr(value) if not isinstance(value, dict) else "{...}"
            msg = e["msg"].removeprefix("Value error, ")
            # a check across keys (a model validator) has no key of its own: its message names the keys
            lines.append(f"- '{loc}' = {shown}: {msg}" if loc else f"- {msg}")
    n = len(lines)
    return RecipeError(
        f"{source} has {n} problem{'s' if n > 1 else ''}:\n" + "\n".join(lines),
        fix="correct the keys above in the recipe (or the key=value arguments); `ftrun explain` lists every key.",
    )


_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*")


def _unread_words(words: list[str]) -> list[str]:
    """Each word of the command line's overrides (in the order typed) that is not key=value, with the form that would
    have worked: `max_steps 20`, `epochs = 1`, `epochs =1`, `epochs= 1` -> `max_steps=20`, `epochs=1`;
    `learning_rate:1e-4` -> `learning_rate=1e-4`. One line each; [] when every word is key=value."""
    lines, i = [], 0
    while i < len(words):
        word, after = words[i], words[i + 1 :]
        key, sep, _ = word.partition("=")
        if sep and key and _KEY.fullmatch(key):  # key=value (key= sets the key to null)
            if word.endswith("=") and after and "=" not in after[0]:  # `epochs= 1`: the value stood apart
                lines.append(f"- '{word} {after[0]}': the value stands apart from its key; write {word}{after[0]}")
                i += 2
                continue
            i += 1
            continue
        if sep and key:
            lines.append(
                f"- '{word}': '{key}' is not a key (a recipe key is a name or a dotted path such as lora.r); "
                f"write it like lora.r=8"
            )
        elif sep:  # `=1` or `=`: no key before '=' (a key given apart from it is named by the branch below)
            lines.append(f"- '{word}': no key before '='; write it like max_steps=20")
        elif ":" in word and _KEY.fullmatch(word.partition(":")[0]):
            name, _, value = word.partition(":")
            lines.append(
                f"- '{word}': ':' between key and value is the recipe file's form; on the command line "
                f"write {name}={value}"
            )
        elif _KEY.fullmatch(word) and Path(word).suffix.lower() in (".yaml", ".yml"):
            lines.append(f"- '{word}': a second recipe; ftrun reads one recipe per command, run it on its own")
        elif _KEY.fullmatch(word):
            nxt = after[0] if after else None
            if nxt == "=" and len(after) > 1:  # `epochs = 1`
                lines.append(f"- '{word} = {after[1]}': spaces around '='; write {word}={after[1]}")
                i += 3
                continue
            if nxt is not None and nxt.startswith("=") and nxt != "=":  # `epochs =1`
                lines.append(f"- '{word} {nxt}': a space before '='; write {word}{nxt}")
                i += 2
                continue
            if nxt is not None and "=" not in nxt:  # `max_steps 20`
                lines.append(f"- '{word} {nxt}': a key and its value as two words; write {word}={nxt}")
                i += 2
                continue
            lines.append(f"- '{word}': a key without a value; write {word}=VALUE")
        else:
            lines.append(f"- '{word}': not key=value; write overrides like max_steps=20 lora.r=8")
        i += 1
    return lines


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`lora.r=8 max_steps=20` -> nested dict; values are parsed as YAML scalars. `pairs` are the command line's words
    after the recipe in the order typed: a word that is not key=value is refused by name, never dropped."""
    unread = _unread_words(pairs)
    if unread:
        head = "is neither an option nor a key=value override (ftrun would have run without it)"
        raise UsageError(
            (
                f"{unread[0][2:].replace(': ', f' {head}: ', 1)}"
                if len(unread) == 1
                else f"{len(unread)} parts of the command line are neither options nor key=value overrides (ftrun "
                f"would have run without them):\n" + "\n".join(unread)
            ),
            fix="write each override as key=value, no spaces around '=' (quote a value with spaces: key='a b'); "
            "`ftrun explain` lists the keys.",
        )
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override '{pair}' conflicts with another override of '{part}'")
        node[parts[-1]] = value
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _looks_local(model: str) -> bool:
    return model.startswith((".", "/", "~")) or model.count("/") != 1


def _resolve_data(value: Any, base_dir: Path) -> Any:
    """Local data paths against the recipe's folder; a Hub id (org/name, no such file or folder here) as it is."""
    if isinstance(value, list):
        return [_resolve_data(v, base_dir) for v in value]
    if isinstance(value, dict) and isinstance(value.get("path"), str):
        return {**value, "path": _resolve_data(value["path"], base_dir)}
    if isinstance(value, str):
        candidate = base_dir / Path(value).expanduser()
        if _looks_local(value) or candidate.exists() or Path(value).suffix.lower() in data_sources.EXTENSIONS:
            return str(candidate.resolve())
    return value


def _resolve_reward(value: Any, base_dir: Path) -> Any:
    """A reward function's FILE.py:NAME made absolute against the recipe's folder; a MODULE:NAME, or a relative FILE.py
    not found there (an installed package's file: launcher/data/rewards.py load_function), stays as it is."""
    if isinstance(value, list):
        return [_resolve_reward(v, base_dir) for v in value]
    if isinstance(value, dict) and isinstance(value.get("function"), str) and ":" in value["function"]:
        file, _, name = value["function"].rpartition(":")
        if not file.endswith(".py"):
            return value
        found = (base_dir / Path(file).expanduser()).resolve()
        if not found.exists() and not Path(file).expanduser().is_absolute():
            return value
        return {**value, "function": f"{found}:{name}"}
    return value


def _resolve_paths(raw: dict[str, Any], base_dir: Path, default_name: str) -> dict[str, Any]:
    out = dict(raw)
    if out.get("data") is not None:
        out["data"] = _resolve_data(out["data"], base_dir)
    if isinstance(out.get("eval"), dict) and out["eval"].get("data") is not None:
        out["eval"] = {**out["eval"], "data": _resolve_data(out["eval"]["data"], base_dir)}  # the same forms as data
    if isinstance(out.get("model"), str):
        model = out["model"]
        candidate = base_dir / Path(model).expanduser()
        # "org/name" is a Hub id unless such a folder (or a file, refused by name then) exists next to the recipe.
        if _looks_local(model) or candidate.exists():
            out["model"] = str(candidate.resolve())
    if out.get("reward"):
        out["reward"] = _resolve_reward(out["reward"], base_dir)
    if out.get("output_dir") is None:
        out["output_dir"] = str((Path.cwd() / "runs" / default_name).resolve())
    elif isinstance(out.get("output_dir"), str):
        out["output_dir"] = str((base_dir / Path(out["output_dir"]).expanduser()).resolve())
    if isinstance(out.get("init_from"), str):
        out["init_from"] = _parent_or_its_copy(str((base_dir / Path(out["init_from"]).expanduser()).resolve()), out)
    return out


def _parent_or_its_copy(init_from: str, resolved: dict[str, Any]) -> str:
    """The run at output_dir's own copy of the parent adapter (launcher/run/parent.py) once the source holds none."""
    if not isinstance(resolved.get("output_dir"), str) or has_adapter(init_from):
        return init_from
    held = RunDir(Path(resolved["output_dir"])).pinned_parent()
    return held["copy"] if held and held["init_from"] == init_from else init_from


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, first: int, again: int):
        super().__init__(f"the key {key!r} is written twice (lines {first} and {again})")
        self.key, self.first, self.again = key, first, again


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that names a key twice (PyYAML keeps the last in silence): checked in
    construct_mapping, before merge keys (<<) are flattened into it."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise _DuplicateKey(key, seen[key], line)
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _command_line_paths(over: dict[str, Any]) -> dict[str, Any]:
    """The paths of the command line's overrides resolved against the working directory (absolute by then, the
    recipe's own resolution leaves them as they are)."""
    resolved = _resolve_paths(over, Path.cwd(), default_name="")
    return {k: v if v is None else resolved[k] for k, v in over.items()}  # `output_dir=` keeps meaning the default


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, merge overrides, resolve paths, validate: one `Recipe`, or one `RecipeError` listing every problem."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(
            f"recipe file '{path}' does not exist",
            fix="give the path of a recipe YAML, e.g. `ftrun recipes/tiny-cpu.yaml` (see recipes/).",
        )
    try:
        raw = yaml.load(path.read_text(), Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as exc:
        raise RecipeError(
            f"{path}: {exc}; YAML would keep only the last value",
            fix=f"keep one '{exc.key}' (line {exc.first} or {exc.again}) and delete the other.",
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError(
            f"{path} is not valid YAML{where}: {getattr(exc, 'problem', exc)}",
            fix="check indentation and quoting on that line.",
        ) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError(
            f"{path} must be a mapping of keys to values, found a {type(raw).__name__}",
            fix="write the recipe as `key: value` lines (see recipes/tiny-cpu.yaml).",
        )
    merged = _merge(raw, _command_line_paths(parse_overrides(overrides or [])))
    return validate_recipe(merged, path.parent.resolve(), path.stem, source=str(path))


def validate_recipe(raw: dict[str, Any], base_dir: Path, default_name: str, source: str = "the recipe") -> Recipe:
    try:
        return Recipe.model_validate(_resolve_paths(raw, base_dir, default_name))
    except ValidationError as err:
        raise _format_errors(err, source) from None
