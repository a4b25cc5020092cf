"""llama.cpp for the GGUF export: its converter, its quantizer and its runtime, all from one pinned version.

One version of llama.cpp does everything, so what is checked is what Ollama and llama.cpp run:
- the runtime and the quantizer come from `llama-cpp-python` (PINNED), built from its source distribution
  (`pip install -e ".[gguf]"`, see docs/engines.md: build without -march=native); the quantizer is its
  binding of `llama_model_quantize` (llama_cpp/llama_cpp.py), the same code as the `llama-quantize` tool;
- the converter is `convert_hf_to_gguf.py` with its `conversion/` package and its own `gguf-py`, taken from
  the `vendor/llama.cpp` folder of the same source distribution by `python -m launcher.deliver.llamacpp install`
  (into CONVERTER_HOME) and run with that gguf-py, never with another version of the `gguf` package.
  `FTRUN_LLAMA_CPP` may name a llama.cpp checkout instead (then its version is the user's choice).

Memory: the converter maps the safetensors files and writes one tensor at a time (its default lazy mode),
and the quantizer maps the 16-bit GGUF and quantizes tensor by tensor in slabs of at most `max_buf_size`
(vendor/llama.cpp/src/llama-quant.cpp); neither holds the model in RAM, and the two run one after the
other, each in its own process whose peak RSS goes into export.json.

Only the standard library at module level: `ftrun plan` imports this module.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from launcher.gguf_types import DEFAULT_TYPE, TYPES, bytes_per_param, listed  # noqa: F401 (the table: launcher/gguf_types.py)

# The one llama.cpp version: llama-cpp-python 0.3.36 vendors llama.cpp (converter, gguf-py 0.19.0, quantizer).
PINNED = "0.3.36"
DIST = "llama-cpp-python"
CONVERTER_HOME = Path(os.environ.get("FTRUN_CACHE", Path.home() / ".cache" / "ftrun")) / f"llama.cpp-{PINNED}"
STAMP = "ftrun-llamacpp.json"
BUILD_FLAGS = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
INSTALL_HINT = (f'CMAKE_ARGS="{BUILD_FLAGS}" pip install --no-binary {DIST} "{DIST}=={PINNED}" && '
                "python -m launcher.deliver.llamacpp install")


# ---------------------------------------------------------------------------------------------
# Where things are

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
        return Converter(CONVERTER_HOME, f"{DIST} {info['version']} source distribution", info["version"],
                         info.get("gguf_py"))
    return None


def _gguf_py_version(folder: Path) -> Optional[str]:
    toml = folder / "gguf-py" / "pyproject.toml"
    if not toml.is_file():
        return None
    m = re.search(r'^version\s*=\s*"([^"]+)"', toml.read_text(), re.M)
    return m.group(1) if m else None


def runtime_version() -> Optional[str]:
    """The installed llama-cpp-python (read from its metadata: importing it loads the shared library)."""
    from importlib import metadata

    try:
        return metadata.version(DIST)
    except metadata.PackageNotFoundError:
        return None


def installed_gguf_version() -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version("gguf")
    except metadata.PackageNotFoundError:
        return None


def install(sdist: Optional[Path] = None, dest: Path = CONVERTER_HOME) -> Converter:
    """Put the pinned converter (convert_hf_to_gguf.py, conversion/, gguf-py/) into dest, from the
    llama-cpp-python source distribution: the given file, else `pip download` of the pinned version."""
    with tempfile.TemporaryDirectory() as tmp:
        if sdist is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", DIST,
                            f"{DIST}=={PINNED}", "-d", tmp], check=True)
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        version = re.search(r"llama_cpp_python-([\d.]+)\.tar\.gz$", Path(sdist).name)
        staging = Path(tempfile.mkdtemp(dir=dest.parent if dest.parent.is_dir() else None, prefix=".llamacpp-"))
        # models/templates/: chat templates some converters read (conversion/base.py RWKV, deepseek.py, minimax.py)
        wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/", "gguf-py/pyproject.toml", "models/templates/",
                  "LICENSE")
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                parts = member.name.split("/", 3)
                if len(parts) < 4 or parts[1:3] != ["vendor", "llama.cpp"] or not member.isfile():
                    continue
                rel = parts[3]
                if any(rel == w or (w.endswith("/") and rel.startswith(w)) for w in wanted):
                    target = staging / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(member) as src:
                        target.write_bytes(src.read())
        if not (staging / "convert_hf_to_gguf.py").is_file():
            raise RuntimeError(f"{sdist} holds no vendor/llama.cpp/convert_hf_to_gguf.py")
        info = {"version": version.group(1) if version else PINNED, "gguf_py": _gguf_py_version(staging),
                "sdist_sha256": hashlib.sha256(Path(sdist).read_bytes()).hexdigest()}
        (staging / STAMP).write_text(json.dumps(info, indent=1) + "\n")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():
            import shutil

            shutil.rmtree(dest)
        os.replace(staging, dest)
    return converter() if dest == CONVERTER_HOME else Converter(dest, "install", info["version"], info["gguf_py"])


# ---------------------------------------------------------------------------------------------
# What the converter supports, read from its source (no torch: `ftrun plan` runs this)

def supported_architectures(folder: Path) -> dict[str, str]:
    """HF architecture class -> converter module, from conversion/__init__.py's TEXT_MODEL_MAP (the table its
    get_model_class looks names up in), or from the @ModelBase.register(...) calls of an older single-file one."""
    init = folder / "conversion" / "__init__.py"
    if init.is_file():
        for node in ast.walk(ast.parse(init.read_text())):
            target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and getattr(target, "id", None) == "TEXT_MODEL_MAP":
                return {k.value: v.value for k, v in zip(node.value.keys, node.value.values)}
    text = (folder / "convert_hf_to_gguf.py").read_text()
    names = re.findall(r"@ModelBase\.register\(([^)]*)\)", text)
    return {n: "convert_hf_to_gguf" for group in names for n in re.findall(r'"([^"]+)"', group)}


def _vocab_source(folder: Path) -> str:
    base = folder / "conversion" / "base.py"
    return (base if base.is_file() else folder / "convert_hf_to_gguf.py").read_text()


def known_pre_tokenizers(folder: Path) -> tuple[str, dict[str, str]]:
    """(the check text, {hash: pre name}) of get_vocab_base_pre: llama.cpp names a BPE tokenizer's split rule
    by the sha256 of the token ids of that text, for the tokenizers its maintainers added."""
    src = _vocab_source(folder)
    chktxt = ""
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.FunctionDef) and node.name == "get_vocab_base_pre":
            for sub in ast.walk(node):
                if isinstance(sub, ast.Assign) and getattr(sub.targets[0], "id", None) == "chktxt":
                    chktxt = sub.value.value
            break
    known = dict(re.findall(r'chkhsh == "([0-9a-f]{64})":\s*\n(?:\s*#[^\n]*\n)*\s*res = "([^"]+)"', src))
    return chktxt, known


# The split rules (pre-tokenizer regexes) llama.cpp implements under these names (llama-vocab.cpp). A byte-level
# BPE tokenizer whose hash llama.cpp does not list (a tokenizer trained for the model, or a list older than the
# model) is named by its split rule instead; the export then checks that llama.cpp tokenizes the prompts exactly
# like the model's own tokenizer.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
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
    r.facts.update(runtime=have, converter=str(conv.folder) if conv else None,
                   converter_version=conv.version if conv else None, gguf_py=conv.gguf_py if conv else None,
                   gguf_package=installed_gguf_version())
    # a box planned by name runs ftrun's Docker image, which has llama-cpp-python and the converter (docker/)
    where = "this box" if this_box else "the box that exports (ftrun's Docker image has it)"
    if have is None:
        (r.missing if this_box else r.notes).append(
            f"{DIST} (llama.cpp's runtime and quantizer) is not installed on {where}: {INSTALL_HINT}")
    elif have != PINNED:
        r.notes.append(f"{DIST} {have} is installed; ftrun is tested with {PINNED}")
    if conv is None:
        (r.missing if this_box else r.notes).append(
            f"llama.cpp's converter is not installed on {where}: `python -m launcher.deliver.llamacpp install` copies "
            f"convert_hf_to_gguf.py from the {DIST} {PINNED} source distribution")
        # the architecture is still checked, against the converter's table as ftrun ships it (the tokenizer
        # check needs the converter's own code, on the box that exports)
        _check_architecture(model, shipped_architectures(), f"{DIST} {PINNED}'s converter (its table as ftrun "
                            f"ships it, {ARCHITECTURES_FILE.name})", r)
        return r
    import importlib.util

    if importlib.util.find_spec("sentencepiece") is None:
        # conversion/base.py imports it before it looks for a tokenizer.model, so every model needs it
        (r.missing if this_box else r.notes).append(
            "llama.cpp's converter needs the sentencepiece package (pip install sentencepiece, part of ftrun's "
            "gguf extra)")
    if conv.version and have and conv.version != have:
        r.problems.append(f"the converter comes from {DIST} {conv.version}, the runtime is {have}: one version for "
                          "both (`python -m launcher.deliver.llamacpp install` again)")
    if _check_architecture(model, supported_architectures(conv.folder), f"llama.cpp's converter ({conv.source})", r):
        _check_tokenizer(model, conv, r)
    return r


# The converter's table (conversion/__init__.py TEXT_MODEL_MAP) of the pinned version, shipped with ftrun so that
# `ftrun plan` on a machine without llama.cpp (planning a box to rent) still refuses an architecture it cannot
# convert. Written by `python -m launcher.deliver.llamacpp architectures`; tests/test_gguf.py checks it against the install.
ARCHITECTURES_FILE = Path(__file__).with_name("llamacpp_architectures.json")


def shipped_architectures() -> dict[str, str]:
    return json.loads(ARCHITECTURES_FILE.read_text())["architectures"]


def _check_architecture(model: str, archs: dict[str, str], source: str, r: Readiness) -> bool:
    """Whether the model's architecture (its config.json, where that is on this box) is in the table; a problem
    when it is not. False also when the config is not here (noted: checked where it is)."""
    config = _model_file(model, "config.json")
    if config is None:
        r.notes.append(f"{model}'s config.json is not on this box: its architecture is checked when it is")
        return False
    cfg = json.loads(config.read_text())
    arch = (cfg.get("architectures") or [None])[0]
    r.facts["architecture"] = arch
    if arch not in archs:
        r.problems.append(f"{source} has no conversion for architecture {arch!r} "
                          f"(it knows {len(archs)}, e.g. {', '.join(sorted(a for a in archs if 'CausalLM' in a)[:6])})")
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
    if r.problems:
        raise RecipeError(f"export: gguf ({gguf_type}) cannot be made for {recipe.model}: " + "; ".join(r.problems),
                          fix="remove gguf from export: before training (the merged model can still be served), "
                          "or train a model llama.cpp's converter supports.")
    if r.missing:
        from launcher.errors import MissingSoftware

        raise MissingSoftware(f"export: gguf ({gguf_type}) needs llama.cpp on this box: " + "; ".join(r.missing),
                              fix="install it before training (the lines above), or remove gguf from export: and "
                              "run `ftrun export RUN_DIR --gguf TYPE` later on a box that has it.")
    return [f"export gguf {gguf_type}: " + "; ".join(r.notes)]


def _model_file(model: str, name: str) -> Optional[Path]:
    from launcher.model_files import local_file

    return local_file(model, name)


def _check_tokenizer(model: str, conv: Converter, r: Readiness) -> None:
    tj_path = _model_file(model, "tokenizer.json")
    spm = _model_file(model, "tokenizer.model")
    if tj_path is None:
        r.notes.append("tokenizer: SentencePiece (tokenizer.model)" if spm is not None else
                       "no tokenizer.json on this box: the tokenizer is checked at export")
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
        r.facts["tokenizer"] = {"kind": "byte-level BPE", "hash": digest, "pre": known.get(digest) or rule,
                                "named_by": "llama.cpp" if digest in known else "split rule" if rule else None}
        if digest in known:
            r.notes.append(f"tokenizer: byte-level BPE, known to llama.cpp as {known[digest]!r}")
        elif rule:
            r.notes.append(f"tokenizer: byte-level BPE not in llama.cpp's list; its split rule is llama.cpp's "
                           f"{rule!r}, and the export checks that llama.cpp tokenizes the prompts identically")
        else:
            r.problems.append("the tokenizer is a byte-level BPE whose split rule llama.cpp does not implement "
                              "(its hash is not in convert_hf_to_gguf's list and its regex is not GPT-2, Qwen2 or "
                              "Llama 3's): llama.cpp and Ollama would split text differently from training")
    elif spm is not None:
        r.facts["tokenizer"] = {"kind": "sentencepiece"}
        r.notes.append("tokenizer: SentencePiece (tokenizer.model)")
    else:
        r.facts["tokenizer"] = {"kind": str(m.get("type"))}
        r.notes.append(f"tokenizer: {m.get('type')} (left to the converter; the export checks its tokenization)")


# ---------------------------------------------------------------------------------------------
# Converting and quantizing: each in its own process (peak RSS measured, a crash in C stays there)

@dataclass
class Step:
    seconds: float
    peak_rss_bytes: Optional[int]
    log_tail: str
    extra: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 2), "peak_rss_bytes": self.peak_rss_bytes, **self.extra}


class StepFailed(RuntimeError):
    pass


def _run_step(args: list[str], what: str) -> Step:
    import time

    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "launcher.deliver.llamacpp", *args], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])
                                  + os.pathsep + os.environ.get("PYTHONPATH", "")))
    seconds = time.monotonic() - t0
    out = res.stdout + res.stderr
    extra: dict[str, Any] = {}
    for line in res.stdout.splitlines():
        if line.startswith("FTRUN_RESULT "):
            extra = json.loads(line[len("FTRUN_RESULT "):])
    if res.returncode != 0 or not extra.get("ok"):
        tail = "\n".join(l for l in out.strip().splitlines() if not l.startswith("FTRUN_RESULT"))[-2500:]
        raise StepFailed(f"{what} failed (exit {res.returncode}):\n{tail}")
    extra.pop("ok")
    return Step(seconds, extra.pop("peak_rss_bytes", None), out[-2500:], extra)


def convert(conv: Converter, model_dir: Path, out: Path, outtype: str) -> Step:
    """convert_hf_to_gguf.py on a merged 16-bit folder (outtype f32/f16/bf16/q8_0)."""
    return _run_step(["convert", "--converter", str(conv.folder), "--model", str(model_dir), "--outfile", str(out),
                      "--outtype", outtype], "llama.cpp's converter")


def quantize(src: Path, out: Path, gguf_type: str, threads: Optional[int] = None) -> Step:
    return _run_step(["quantize", "--input", str(src), "--output", str(out), "--type", gguf_type,
                      "--threads", str(threads or os.cpu_count() or 1)], "llama.cpp's quantizer")


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _convert_main(ns) -> int:
    folder = Path(ns.converter)
    # The converter's own gguf-py first: it is written against that version, not the installed gguf package.
    sys.path[:0] = [str(folder / "gguf-py"), str(folder)]
    os.environ["NO_LOCAL_GGUF"] = "1"  # already on sys.path; the script must not insert it a second time
    import gguf

    if not Path(gguf.__file__).resolve().is_relative_to(folder.resolve()):
        raise SystemExit(f"gguf came from {gguf.__file__}, not from {folder}/gguf-py")
    named: dict[str, Any] = {}
    try:
        from conversion import base  # llama.cpp split the converter into a package in 2026
        holder = base.TextModel
    except ImportError:
        import convert_hf_to_gguf as base
        holder = base.TextModel
    original = holder.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            # llama.cpp's list does not know this tokenizer's hash: name its split rule when it is one llama.cpp
            # implements (the export then compares llama.cpp's tokenization with the model's), else refuse
            tj = Path(self.dir_model) / "tokenizer.json"
            rule = split_rule(json.loads(tj.read_text())) if tj.is_file() else None
            if rule is None:
                raise
            named["pre"] = rule
            print(f"[ftrun] tokenizer hash not in llama.cpp's list; split rule {rule!r} named from tokenizer.json",
                  flush=True)
            return rule

    holder.get_vocab_base_pre = get_vocab_base_pre
    import convert_hf_to_gguf

    sys.argv = ["convert_hf_to_gguf.py", ns.model, "--outfile", ns.outfile, "--outtype", ns.outtype]
    convert_hf_to_gguf.main()
    print("FTRUN_RESULT " + json.dumps({"ok": Path(ns.outfile).is_file(), "peak_rss_bytes": _peak_rss(),
                                         "pre_named_by": "ftrun split rule" if named else "llama.cpp",
                                         "gguf_py": getattr(gguf, "__version__", None) or _gguf_py_version(folder)}),
          flush=True)
    return 0


def _quantize_main(ns) -> int:
    import ctypes

    import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = TYPES[ns.type].ftype
    params.nthread = int(ns.threads)
    rc = llama_cpp.llama_model_quantize(ns.input.encode(), ns.output.encode(), ctypes.byref(params))
    print("FTRUN_RESULT " + json.dumps({"ok": rc == 0 and Path(ns.output).is_file(), "rc": rc,
                                         "peak_rss_bytes": _peak_rss()}), flush=True)
    return 0 if rc == 0 else 1


# ---------------------------------------------------------------------------------------------
# Reading a GGUF back in llama.cpp

def metadata(path: Path) -> dict[str, Any]:
    """The GGUF's architecture numbers, tokenizer, chat template and tensor types (the gguf package's reader)."""
    import gguf

    r = gguf.GGUFReader(str(path))

    def f(key: str):
        x = r.fields.get(key)
        return None if x is None else x.contents()

    arch = f("general.architecture")
    counts: dict[str, int] = {}
    for t in r.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    tokens = r.fields.get("tokenizer.ggml.tokens")
    return {
        "architecture": arch,
        "file_type": f("general.file_type"),
        "block_count": f(f"{arch}.block_count"),
        "embedding_length": f(f"{arch}.embedding_length"),
        "feed_forward_length": f(f"{arch}.feed_forward_length"),
        "head_count": f(f"{arch}.attention.head_count"),
        "head_count_kv": f(f"{arch}.attention.head_count_kv"),
        "key_length": f(f"{arch}.attention.key_length"),
        "rms_eps": f(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_freq_base": f(f"{arch}.rope.freq_base"),
        "vocab_size": len(tokens.data) if tokens is not None else None,
        "chat_template": f("tokenizer.chat_template"),
        "tokenizer_pre": f("tokenizer.ggml.pre"),
        "tokenizer_model": f("tokenizer.ggml.model"),
        "eos_token_id": f("tokenizer.ggml.eos_token_id"),
        "tensors": len(r.tensors),
        "tensor_types": dict(sorted(counts.items())),
        "tensor_names": [t.name for t in r.tensors],
    }


def run_prompts(path: Path, prompts: list[dict[str, Any]], greedy_tokens: int, stop_ids: set[int],
                threads: Optional[int] = None) -> tuple[list[dict[str, Any]], list[bool]]:
    """Per prompt, through llama.cpp: the next-token logits at every position of the text (teacher-forced) and
    the greedy continuation of the prompt (argmax, stopping after an end token as transformers' generate does);
    and whether llama.cpp tokenizes each text exactly as the model's tokenizer did."""
    import numpy as np
    import torch
    from llama_cpp import Llama

    n_ctx = max(max(len(p["ids"]), len(p["prompt_ids"]) + greedy_tokens) for p in prompts) + 8
    llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                n_threads=threads or os.cpu_count(), n_gpu_layers=0, verbose=False, seed=0)
    outs, same_tokens = [], []
    try:
        for p in prompts:
            ids = list(p["ids"])
            same_tokens.append(llm.tokenize(p["text"].encode(), add_bos=False, special=True)[:len(ids)] == ids)
            llm.reset()
            llm.eval(ids)
            logits = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
            llm.reset()
            llm.eval(list(p["prompt_ids"]))
            tokens: list[int] = []
            for _ in range(greedy_tokens):
                tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                tokens.append(tok)
                if tok in stop_ids:
                    break
                llm.eval([tok])
            outs.append({"logits": logits, "greedy": tokens, "ids": ids})
    finally:
        llm.close() if hasattr(llm, "close") else None
        del llm
    return outs, same_tokens


# ---------------------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.deliver.llamacpp", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("install", help=f"copy llama.cpp's converter from the {DIST} {PINNED} source distribution")
    p.add_argument("--sdist", type=Path, help="a downloaded llama_cpp_python-X.tar.gz (default: pip download)")
    p.add_argument("--dest", type=Path, default=CONVERTER_HOME)
    sub.add_parser("architectures", help=f"write {ARCHITECTURES_FILE.name} from the installed converter")
    p = sub.add_parser("check", help="can a GGUF of this model be made here?")
    p.add_argument("model")
    p.add_argument("--type", default=DEFAULT_TYPE)
    p = sub.add_parser("convert")
    for a in ("--converter", "--model", "--outfile", "--outtype"):
        p.add_argument(a, required=True)
    p = sub.add_parser("quantize")
    for a in ("--input", "--output", "--type", "--threads"):
        p.add_argument(a, required=True)
    ns = parser.parse_args(argv)
    if ns.cmd == "install":
        conv = install(ns.sdist, ns.dest)
        print(f"llama.cpp converter from {DIST} {conv.version} (gguf-py {conv.gguf_py}) in {conv.folder}")
        have = runtime_version()
        if have != conv.version:
            print(f"note: the installed {DIST} is {have}; build the same version: {INSTALL_HINT}")
        return 0
    if ns.cmd == "architectures":
        conv = converter()
        if conv is None or conv.version != PINNED:
            print(f"install the converter of {DIST} {PINNED} first: python -m launcher.deliver.llamacpp install")
            return 2
        ARCHITECTURES_FILE.write_text(json.dumps({"llama_cpp_python": conv.version, "gguf_py": conv.gguf_py,
                                                  "architectures": supported_architectures(conv.folder)},
                                                 indent=1, sort_keys=True) + "\n")
        print(f"{ARCHITECTURES_FILE}: {len(supported_architectures(conv.folder))} architectures")
        return 0
    if ns.cmd == "check":
        r = readiness(ns.model, ns.type)
        print(json.dumps({"ok": r.ok, "problems": r.problems, "notes": r.notes, "facts": r.facts}, indent=1))
        return 0 if r.ok else 2
    if ns.cmd == "convert":
        return _convert_main(ns)
    return _quantize_main(ns)


if __name__ == "__main__":
    sys.exit(main())
