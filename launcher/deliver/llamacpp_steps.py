"""llama.cpp's converter or quantizer run on the export's files, each in its own process (`python -m
launcher.deliver.llamacpp convert|quantize`), which measures its peak RSS and keeps a crash in C there. Neither holds
the model in RAM (lazy conversion; src/llama-quant.cpp quantizes in slabs). Only the standard library at module level.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from launcher.gguf_types import TYPES
from launcher.plan.gguf_readiness import Converter, _gguf_py_version, split_rule


@dataclass
class Step:
    seconds: float
    peak_rss_bytes: Optional[int]
    extra: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 2), "peak_rss_bytes": self.peak_rss_bytes, **self.extra}


class StepFailed(RuntimeError):
    pass


def _run_step(args: list[str], what: str) -> Step:
    import time

    t0 = time.monotonic()
    path = str(Path(__file__).resolve().parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", "")
    child = [sys.executable, "-m", "launcher.deliver.llamacpp", *args]
    res = subprocess.run(child, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=path))
    seconds = time.monotonic() - t0
    out = res.stdout + res.stderr
    extra: dict[str, Any] = {}
    for line in res.stdout.splitlines():
        if line.startswith("FTRUN_RESULT "):
            extra = json.loads(line[len("FTRUN_RESULT ") :])
    if res.returncode != 0 or not extra.get("ok"):
        tail = "\n".join(l for l in out.strip().splitlines() if not l.startswith("FTRUN_RESULT"))[-2500:]
        raise StepFailed(f"{what} failed (exit {res.returncode}):\n{tail}")
    extra.pop("ok")
    return Step(seconds, extra.pop("peak_rss_bytes", None), extra)


def convert(conv: Converter, model_dir: Path, out: Path, outtype: str, mmproj: bool = False) -> Step:
    """convert_hf_to_gguf.py on a merged 16-bit folder (outtype f32/f16/bf16/q8_0); with mmproj, its vision projector
    (conversion/__init__.py MMPROJ_MODEL_MAP)."""
    paths = ["--converter", str(conv.folder), "--model", str(model_dir), "--outfile", str(out)]
    return _run_step(
        ["convert", *paths, "--outtype", outtype] + (["--mmproj"] if mmproj else []),
        "llama.cpp's converter" + (" (--mmproj)" if mmproj else ""),
    )


def quantize(src: Path, out: Path, gguf_type: str, threads: Optional[int] = None) -> Step:
    threads = threads or os.cpu_count() or 1
    args = ["quantize", "--input", str(src), "--output", str(out), "--type", gguf_type, "--threads", str(threads)]
    return _run_step(args, "llama.cpp's quantizer")


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _convert_main(ns) -> int:
    folder = Path(ns.converter)
    # the converter's own gguf-py first, not the installed gguf package
    sys.path[:0] = [str(folder / "gguf-py"), str(folder)]
    os.environ["NO_LOCAL_GGUF"] = "1"  # already on sys.path; the script must not insert it a second time
    import gguf

    if not Path(gguf.__file__).resolve().is_relative_to(folder.resolve()):
        raise SystemExit(f"gguf came from {gguf.__file__}, not from {folder}/gguf-py")
    named: dict[str, Any] = {}
    try:
        from conversion import base  # llama.cpp split the converter into a package in 2026
    except ImportError:
        import convert_hf_to_gguf as base
    holder = base.TextModel
    original = holder.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            # an unknown tokenizer hash: name its split rule where llama.cpp implements it (the export checks it)
            tj = Path(self.dir_model) / "tokenizer.json"
            rule = split_rule(json.loads(tj.read_text())) if tj.is_file() else None
            if rule is None:
                raise
            named["pre"] = rule
            print(
                f"[ftrun] tokenizer hash not in llama.cpp's list; split rule {rule!r} named from tokenizer.json",
                flush=True,
            )
            return rule

    holder.get_vocab_base_pre = get_vocab_base_pre
    import convert_hf_to_gguf

    sys.argv = ["convert_hf_to_gguf.py", ns.model, "--outfile", ns.outfile, "--outtype", ns.outtype]
    if getattr(ns, "mmproj", False):
        sys.argv.append("--mmproj")
    convert_hf_to_gguf.main()
    result = {
        "ok": Path(ns.outfile).is_file(),
        "peak_rss_bytes": _peak_rss(),
        "pre_named_by": "ftrun split rule" if named else "llama.cpp",
        "gguf_py": getattr(gguf, "__version__", None) or _gguf_py_version(folder),
    }
    print("FTRUN_RESULT " + json.dumps(result), flush=True)
    return 0


def _quantize_main(ns) -> int:
    import ctypes

    import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = TYPES[ns.type].ftype
    params.nthread = int(ns.threads)
    rc = llama_cpp.llama_model_quantize(ns.input.encode(), ns.output.encode(), ctypes.byref(params))
    print(
        "FTRUN_RESULT "
        + json.dumps({"ok": rc == 0 and Path(ns.output).is_file(), "rc": rc, "peak_rss_bytes": _peak_rss()}),
        flush=True,
    )
    return 0 if rc == 0 else 1
