"""Whether a GGUF of a model can be made, checked before any training: llama.cpp's version and converter on this box,
the model's architecture in the converter's table, and its tokenizer's split rule. Owns where the pinned llama.cpp
lives (PINNED, CONVERTER_HOME) and the converter's table as ftrun ships it (ARCHITECTURES_FILE). Standard library only
at module level: `ftrun plan` imports this module.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from launcher.gguf_types import DEFAULT_TYPE, TYPES, listed
from launcher.model_files import local_file

# The one llama.cpp version: llama-cpp-python 0.3.36 vendors llama.cpp (converter, gguf-py 0.19.0, quantizer).
PINNED = "0.3.36"
DIST = "llama-cpp-python"
CONVERTER_HOME = Path(os.environ.get("FTRUN_CACHE", Path.home() / ".cache" / "ftrun")) / f"llama.cpp-{PINNED}"
STAMP = "ftrun-llamacpp.json"
BUILD_FLAGS = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
INSTALL_HINT = f'CMAKE_ARGS="{BUILD_FLAGS}" pip install --no-binary {DIST} "{DIST}=={PINNED}" && ftrun llamacpp install'


@dataclass
class Converter:
    folder: Path
    source: str  # "ftrun install of llama-cpp-python X" or "FTRUN_LLAMA_CPP"
    version: Optional[str]  # the llama-cpp-python version it came from (None: a checkout of unknown version)
    gguf_py: Optional[str]  # version of its own gguf-py


def converter() -> Optional[Converter]:
    """The converter ftrun runs: FTRUN_LLAMA_CPP (a llama.cpp checkout), else the installed copy of the pinned one."""
    env = os.environ.get("FTRUN_LLAMA_CPP")
    if env:
        folder = Path(env).expanduser()
        if (folder / "convert_hf_to_gguf.py").is_file():
            return Converter(folder, f"FTRUN_LLAMA_CPP={folder}", None, _gguf_py_version(folder))
        return None
    stamp = CONVERTER_HOME / STAMP
    if (CONVERTER_HOME / "convert_hf_to_gguf.py").is_file() and stamp.is_file():
        info = json.loads(stamp.read_text())
        return Converter(
            CONVERTER_HOME, f"{DIST} {info['version']} source distribution", info["version"], info.get("gguf_py")
        )
    return None


def _gguf_py_version(folder: Path) -> Optional[str]:
    toml = folder / "gguf-py" / "pyproject.toml"
    if not toml.is_file():
        return None
    m = re.search(r'^version\s*=\s*"([^"]+)"', toml.read_text(), re.M)
    return m.group(1) if m else None


def runtime_version(dist: str = DIST) -> Optional[str]:
    """The installed llama-cpp-python (or `dist`), from its metadata: importing it loads the shared library."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def supported_architectures(folder: Path, table: str = "TEXT_MODEL_MAP") -> dict[str, str]:
    """HF architecture class -> converter module, from conversion/__init__.py's TEXT_MODEL_MAP (the table its
    get_model_class looks names up in; MMPROJ_MODEL_MAP for `--mmproj`, the projector of a vision-language model),
    or from the @ModelBase.register(...) calls of an older single-file one. Reads the source: no torch."""
    init = folder / "conversion" / "__init__.py"
    if init.is_file():
        for node in ast.walk(ast.parse(init.read_text())):
            target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and getattr(target, "id", None) == table:
                return {k.value: v.value for k, v in zip(node.value.keys, node.value.values)}
        if table != "TEXT_MODEL_MAP":
            return {}
    text = (folder / "convert_hf_to_gguf.py").read_text()
    names = re.findall(r"@ModelBase\.register\(([^)]*)\)", text)
    return {n: "convert_hf_to_gguf" for group in names for n in re.findall(r'"([^"]+)"', group)}


def known_pre_tokenizers(folder: Path) -> tuple[str, dict[str, str]]:
    """(the check text, {hash: pre name}) of get_vocab_base_pre: llama.cpp names a BPE tokenizer's split rule
    by the sha256 of the token ids of that text, for the tokenizers its maintainers added."""
    base = folder / "conversion" / "base.py"
    src = (base if base.is_file() else folder / "convert_hf_to_gguf.py").read_text()
    chktxt = ""
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.FunctionDef) and node.name == "get_vocab_base_pre":
            for sub in ast.walk(node):
                if isinstance(sub, ast.Assign) and getattr(sub.targets[0], "id", None) == "chktxt":
                    chktxt = sub.value.value
            break
    known = dict(re.findall(r'chkhsh == "([0-9a-f]{64})":\s*\n(?:\s*#[^\n]*\n)*\s*res = "([^"]+)"', src))
    return chktxt, known


# The split rules llama.cpp implements under these names (llama-vocab.cpp), for a tokenizer whose hash it does not list
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
KNOWN_SPLITS = {_QWEN2_SPLIT: "qwen2", _LLAMA3_SPLIT: "llama-bpe"}


def split_rule(tokenizer_json: dict[str, Any]) -> Optional[str]:
    """llama.cpp's name for how this byte-level BPE tokenizer splits text before BPE, read from its structure."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"  # the GPT-2 regex inside ByteLevel
    if pre.get("type") == "Sequence":
        items = pre.get("pretokenizers", [])
        splits = [p for p in items if p.get("type") == "Split"]
        if len(splits) == 1 and any(p.get("type") == "ByteLevel" and not p.get("use_regex", True) for p in items):
            return KNOWN_SPLITS.get(splits[0].get("pattern", {}).get("Regex"))
    return None


@dataclass
class Readiness:
    """Whether a GGUF of this model can be made here: problems refuse, notes inform."""

    problems: list[str] = field(default_factory=list)  # the model cannot be converted (or a version mismatch)
    missing: list[str] = field(default_factory=list)  # software this box lacks (an install away)
    notes: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.missing

    @property
    def all_problems(self) -> list[str]:
        return self.missing + self.problems


def readiness(model: str, gguf_type: str, this_box: bool = True) -> Readiness:
    """What `ftrun plan` and the export check before anything heavy: the llama.cpp build and its converter,
    the model's architecture in the converter's table, and its tokenizer. `model`: a local folder or a Hub id
    (its cached files); files that are not on this box are noted, not guessed."""
    r = Readiness()
    kind = TYPES.get(gguf_type)
    if kind is None:
        r.problems.append(f"unknown GGUF type {gguf_type!r} (choose from {listed()})")
        return r
    have = runtime_version()
    conv = converter()
    folder, version, gguf_py = (str(conv.folder), conv.version, conv.gguf_py) if conv else (None, None, None)
    r.facts.update(runtime=have, converter=folder, converter_version=version, gguf_py=gguf_py)
    r.facts["gguf_package"] = runtime_version("gguf")
    where = "this box" if this_box else "the box that exports (ftrun's Docker image has it)"
    lacking = r.missing if this_box else r.notes
    if have is None:
        lacking.append(f"{DIST} (llama.cpp's runtime and quantizer) is not installed on {where}: {INSTALL_HINT}")
    elif have != PINNED:
        r.notes.append(f"{DIST} {have} is installed; ftrun is tested with {PINNED}")
    if conv is None:
        lacking.append(
            f"llama.cpp's converter is not installed on {where}: `ftrun llamacpp install` copies "
            f"convert_hf_to_gguf.py from the {DIST} {PINNED} source distribution"
        )
        # the architecture is still checked against the shipped table (the tokenizer needs the converter's code)
        shipped = f"{DIST} {PINNED}'s converter (its table as ftrun ships it, {ARCHITECTURES_FILE.name})"
        _check_architecture(model, shipped_architectures(), shipped, r)
        return r
    import importlib.util

    if importlib.util.find_spec("sentencepiece") is None:
        # conversion/base.py imports it before it looks for a tokenizer.model, so every model needs it
        lacking.append(
            "llama.cpp's converter needs the sentencepiece package (pip install sentencepiece, part of ftrun's "
            "gguf extra)"
        )
    if conv.version and have and conv.version != have:
        r.problems.append(
            f"the converter comes from {DIST} {conv.version}, the runtime is {have}: one version for "
            "both (`ftrun llamacpp install` again)"
        )
    if _check_architecture(model, supported_architectures(conv.folder), f"llama.cpp's converter ({conv.source})", r):
        _check_tokenizer(model, conv, r)
    return r


# The pinned converter's tables, for `ftrun plan` without llama.cpp; written by `ftrun llamacpp architectures`.
ARCHITECTURES_FILE = Path(__file__).with_name("llamacpp_architectures.json")


def shipped_architectures() -> dict[str, str]:
    return json.loads(ARCHITECTURES_FILE.read_text())["architectures"]


def shipped_projectors() -> dict[str, str]:
    """The converter's MMPROJ_MODEL_MAP as ftrun ships it: the architectures whose projector `--mmproj` converts."""
    return json.loads(ARCHITECTURES_FILE.read_text())["mmproj_architectures"]


# The attention window llama.cpp's mtmd gives a Qwen2.5-VL tower when its GGUF names none (tools/mtmd/clip.cpp)
LLAMACPP_QWEN25VL_WINDOW = 112


def projector_problem(model: str) -> Optional[str]:
    """Why llama.cpp's converter (installed, else the shipped table) cannot write this vision-language model's
    projector GGUF (`--mmproj`), or None (a text model, its config not on this box, or a projector it converts)."""
    config = local_file(model, "config.json")
    if config is None:
        return None
    cfg = json.loads(config.read_text())
    if not isinstance(cfg.get("vision_config"), dict):
        return None
    arch = (cfg.get("architectures") or [None])[0]
    conv = converter()
    table = supported_architectures(conv.folder, "MMPROJ_MODEL_MAP") if conv else shipped_projectors()
    where = (
        f"llama.cpp's converter ({conv.source})" if conv else f"{DIST} {PINNED}'s converter ({ARCHITECTURES_FILE.name})"
    )
    if arch in table:
        depth = int(cfg["vision_config"].get("depth", 32))
        if cfg.get("model_type") in ("qwen2_vl", "qwen2_5_vl") and depth < 3:
            # conversion/base.py MmprojModel maps names with get_tensor_name_map(MODEL_ARCH.MMPROJ, block_count =
            # depth); gguf-py tensor_mapping.py maps "visual.merger.mlp.{bid}" only for bid < block_count.
            return (
                f"{where} cannot convert the vision projector of {arch!r} with a vision tower of depth {depth}: it "
                "maps the merger's visual.merger.mlp.2 only for a tower of 3 blocks or more (gguf-py "
                "tensor_mapping.py, block ids below the tower's depth)"
            )
        window = cfg["vision_config"].get("window_size", LLAMACPP_QWEN25VL_WINDOW)
        if cfg.get("model_type") == "qwen2_5_vl" and window != LLAMACPP_QWEN25VL_WINDOW:
            return (
                f"llama.cpp would run the vision tower of this {arch!r} with other attention windows than training "
                f"did: the pinned converter writes no window size for qwen2.5vl (conversion/qwenvl.py), and "
                f"llama.cpp's mtmd then uses {LLAMACPP_QWEN25VL_WINDOW} pixels (tools/mtmd/clip.cpp, "
                f"attn_window_size default) where the model's vision_config.window_size is {window}"
            )
        return None
    return (
        f"{where} cannot convert the vision projector (mmproj) of architecture {arch!r}: it is not in the "
        f"converter's MMPROJ_MODEL_MAP ({len(table)} architectures, e.g. "
        f"{', '.join(sorted(a for a in table if 'VL' in a)[:5])}); the text GGUF alone would not see images"
    )


def _check_architecture(model: str, archs: dict[str, str], source: str, r: Readiness) -> bool:
    """Whether the model's architecture is in the table (a problem when not); False also when its config.json is not
    on this box (noted)."""
    config = local_file(model, "config.json")
    if config is None:
        r.notes.append(f"{model}'s config.json is not on this box: its architecture is checked when it is")
        return False
    cfg = json.loads(config.read_text())
    arch = (cfg.get("architectures") or [None])[0]
    r.facts["architecture"] = arch
    if arch not in archs:
        r.problems.append(
            f"{source} has no conversion for architecture {arch!r} "
            f"(it knows {len(archs)}, e.g. {', '.join(sorted(a for a in archs if 'CausalLM' in a)[:6])})"
        )
        return False
    r.notes.append(f"architecture {arch}: converted by llama.cpp's conversion/{archs[arch]}.py")
    return True


def plan_check(recipe: Any, this_box: bool) -> list[str]:
    """`ftrun plan`: whether the requested GGUF can be made, before any training. A model the converter cannot
    handle (or, on the box that trains and exports, a missing llama.cpp) is refused; the rest are plan notes."""
    if "gguf" not in (getattr(recipe, "export", None) or []):
        return []
    from launcher.errors import RecipeError

    gguf_type = getattr(recipe, "gguf_type", DEFAULT_TYPE)
    r = readiness(recipe.model, gguf_type, this_box=this_box)
    projector = projector_problem(recipe.model)
    if projector:
        r.problems.append(projector)
    if r.problems:
        raise RecipeError(
            f"export: gguf ({gguf_type}) cannot be made for {recipe.model}: " + "; ".join(r.problems),
            fix="remove gguf from export: before training (the merged model can still be served), "
            "or train a model llama.cpp's converter supports.",
        )
    if r.missing:
        from launcher.errors import MissingSoftware

        raise MissingSoftware(
            f"export: gguf ({gguf_type}) needs llama.cpp on this box: " + "; ".join(r.missing),
            fix="install it before training (the lines above), or remove gguf from export: and "
            "run `ftrun export RUN_DIR --gguf TYPE` later on a box that has it.",
        )
    return [f"export gguf {gguf_type}: " + "; ".join(r.notes)]


def _check_tokenizer(model: str, conv: Converter, r: Readiness) -> None:
    tj_path = local_file(model, "tokenizer.json")
    spm = local_file(model, "tokenizer.model")
    if tj_path is None:
        r.notes.append(
            "tokenizer: SentencePiece (tokenizer.model)"
            if spm is not None
            else "no tokenizer.json on this box: the tokenizer is checked at export"
        )
        return
    tj = json.loads(tj_path.read_text())
    m = tj.get("model") or {}
    byte_level = (tj.get("decoder") or {}).get("type") == "ByteLevel"
    if m.get("type") == "BPE" and byte_level and not m.get("byte_fallback"):
        chktxt, known = known_pre_tokenizers(conv.folder)
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(tj_path)).encode(chktxt).ids
        digest = hashlib.sha256(str(ids).encode()).hexdigest()
        rule = split_rule(tj)
        r.facts["tokenizer"] = {
            "kind": "byte-level BPE",
            "hash": digest,
            "pre": known.get(digest) or rule,
            "named_by": "llama.cpp" if digest in known else "split rule" if rule else None,
        }
        if digest in known:
            r.notes.append(f"tokenizer: byte-level BPE, known to llama.cpp as {known[digest]!r}")
        elif rule:
            r.notes.append(
                f"tokenizer: byte-level BPE not in llama.cpp's list; its split rule is llama.cpp's "
                f"{rule!r}, and the export checks that llama.cpp tokenizes the prompts identically"
            )
        else:
            r.problems.append(
                "the tokenizer is a byte-level BPE whose split rule llama.cpp does not implement "
                "(its hash is not in convert_hf_to_gguf's list and its regex is not GPT-2, Qwen2 or "
                "Llama 3's): llama.cpp and Ollama would split text differently from training"
            )
    elif spm is not None:
        r.facts["tokenizer"] = {"kind": "sentencepiece"}
        r.notes.append("tokenizer: SentencePiece (tokenizer.model)")
    else:
        r.facts["tokenizer"] = {"kind": str(m.get("type"))}
        r.notes.append(f"tokenizer: {m.get('type')} (left to the converter; the export checks its tokenization)")
