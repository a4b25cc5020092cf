"""llama.cpp for the GGUF export, all from one pinned version: `ftrun llamacpp` installs its converter, checks a model.

The runtime and quantizer (`llama_model_quantize`, as `llama-quantize`) are `llama-cpp-python` PINNED
(launcher/plan/gguf_readiness.py), built from its sdist (docs/engines.md); the converter (`convert_hf_to_gguf.py`,
`conversion/`, its own `gguf-py`) is copied from that sdist's vendor/llama.cpp by `ftrun llamacpp install`, or
`FTRUN_LLAMA_CPP` names a checkout. The steps run in child processes entering through `main`
(launcher/deliver/llamacpp_steps.py). Only the standard library at module level.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Optional

from launcher.deliver.llamacpp_steps import _convert_main, _quantize_main
from launcher.gguf_types import DEFAULT_TYPE
from launcher.plan.gguf_readiness import (
    ARCHITECTURES_FILE,
    CONVERTER_HOME,
    DIST,
    INSTALL_HINT,
    PINNED,
    STAMP,
    Converter,
    _gguf_py_version,
    converter,
    readiness,
    runtime_version,
    supported_architectures,
)


def install(sdist: Optional[Path] = None, dest: Path = CONVERTER_HOME) -> Converter:
    """Put the pinned converter into dest, from the given llama-cpp-python sdist, else `pip download` of it."""
    with tempfile.TemporaryDirectory() as tmp:
        if sdist is None:
            download = ["download", "--no-deps", "--no-binary", DIST, f"{DIST}=={PINNED}", "-d", tmp]
            subprocess.run([sys.executable, "-m", "pip", *download], check=True)
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        version = re.search(r"llama_cpp_python-([\d.]+)\.tar\.gz$", Path(sdist).name)
        staging = Path(tempfile.mkdtemp(dir=dest.parent if dest.parent.is_dir() else None, prefix=".llamacpp-"))
        # models/templates/: chat templates some converters read (conversion/base.py RWKV, deepseek.py, minimax.py)
        wanted = (
            "convert_hf_to_gguf.py",
            "conversion/",
            "gguf-py/gguf/",
            "gguf-py/pyproject.toml",
            "models/templates/",
            "LICENSE",
        )
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
        info = {
            "version": version.group(1) if version else PINNED,
            "gguf_py": _gguf_py_version(staging),
            "sdist_sha256": hashlib.sha256(Path(sdist).read_bytes()).hexdigest(),
        }
        (staging / STAMP).write_text(json.dumps(info, indent=1) + "\n")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():
            import shutil

            shutil.rmtree(dest)
        os.replace(staging, dest)
    return converter() if dest == CONVERTER_HOME else Converter(dest, "install", info["version"], info["gguf_py"])


def main(argv: Optional[list[str]] = None, prog: str = "ftrun llamacpp") -> int:
    """`ftrun llamacpp install|architectures|check` (convert and quantize are the export's child processes)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("install", help=f"copy llama.cpp's converter from the {DIST} {PINNED} source distribution")
    p.add_argument("--sdist", type=Path, help="a downloaded llama_cpp_python-X.tar.gz (default: pip download)")
    p.add_argument("--dest", type=Path, default=CONVERTER_HOME)
    sub.add_parser("architectures", help=f"write {ARCHITECTURES_FILE.name} from the installed converter")
    p = sub.add_parser("check", help="can a GGUF of this model be made here?")
    p.add_argument("model")
    p.add_argument("--type", default=DEFAULT_TYPE)
    p = sub.add_parser(
        "convert", help="convert a merged model folder to a 16-bit GGUF (the export runs it as a child process)"
    )
    for a in ("--converter", "--model", "--outfile", "--outtype"):
        p.add_argument(a, required=True)
    p.add_argument("--mmproj", action="store_true", help="the vision projector of a vision-language model")
    p = sub.add_parser(
        "quantize", help="quantize a 16-bit GGUF to a smaller type (the export runs it as a child process)"
    )
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
            print(f"install the converter of {DIST} {PINNED} first: ftrun llamacpp install")
            return 2
        table = {
            "llama_cpp_python": conv.version,
            "gguf_py": conv.gguf_py,
            "architectures": supported_architectures(conv.folder),
            "mmproj_architectures": supported_architectures(conv.folder, "MMPROJ_MODEL_MAP"),
        }
        ARCHITECTURES_FILE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"{ARCHITECTURES_FILE}: {len(supported_architectures(conv.folder))} architectures")
        return 0
    if ns.cmd == "check":
        r = readiness(ns.model, ns.type)
        from launcher.plan.gguf_readiness import projector_problem

        projector = projector_problem(ns.model)  # a vision-language model's mmproj
        if projector:
            r.problems.append(projector)
        print(json.dumps({"ok": r.ok, "problems": r.problems, "notes": r.notes, "facts": r.facts}, indent=1))
        return 0 if r.ok else 2
    if ns.cmd == "convert":
        return _convert_main(ns)
    return _quantize_main(ns)


if __name__ == "__main__":
    sys.exit(main())
