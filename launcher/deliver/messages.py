"""What the export says to the user: the error it fails with, its progress lines, sizes in units a person reads."""

from __future__ import annotations

import json
from typing import Any

from launcher.errors import EXIT_RUN_FAILED, FtrunError


class ExportError(FtrunError):
    """An output was written but failed its check (or could not be written): the run itself is fine."""

    kind = "export failed"
    exit_code = EXIT_RUN_FAILED


def _say(msg: str) -> None:
    print(f"[ftrun export] {msg}", flush=True)


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


SERVING_RUNTIMES = ("vLLM", "llama-server", "llama.cpp", "Ollama")  # llama.cpp: llama-cpp-python's chat completion


# what each export's size counts (export_models.py, gguf_export.py)
SIZE_COVERS = {"adapter": "weights file", "merged": "folder", "model": "folder", "gguf": "file"}


def export_outputs(outputs: dict[str, Any]) -> str:
    """The export's outputs with their sizes and what each counts: "adapter 1.2 MB weights file, merged 2 GB folder"."""
    return ", ".join(
        f"{k} {v.get('size', '')}" + (f" {SIZE_COVERS[k]}" if k in SIZE_COVERS and v.get("size") else "")
        for k, v in outputs.items()
    )


def served_line(report: dict) -> str:
    """One line on the export's served-prompt checks: the runtimes whose prompts matched training's token ids (Ollama
    with its setting, if any), and why the others were not checked."""
    sp = report.get("served_prompt") or {}
    if not sp:
        return "served prompt: not checked (this export has no served-prompt record)"
    if sp.get("not_applicable"):
        return f"served prompt: not checked ({sp['not_applicable']})"
    if not sp.get("ok"):
        failed = [
            v["runtime"]
            for v in list(sp.get("runtimes", {}).values()) + list(sp.get("stops", {}).values())
            if not v.get("ok", True)
        ]
        return "served prompt != trained prompt: " + ("; ".join(failed) or "see final/export.json served_prompt")
    checked = [r for r in SERVING_RUNTIMES if r in sp.get("checked", [])]
    outputs = report.get("outputs", {})
    why = {
        "vLLM": "no adapter or model folder checked",
        "llama-server": "no GGUF in this export",
        "llama.cpp": "no GGUF in this export"
        if "gguf" not in outputs
        else "llama-cpp-python's chat completion takes no chat-template switches",
        "Ollama": "no GGUF in this export",
    }
    why.update(sp.get("not_checked") or {})  # a vision-language GGUF pair's (vision_gguf.served_checks)
    ollama = sp.get("runtimes", {}).get("ollama") or {}
    if ollama.get("not_checked"):  # a GGUF whose Ollama template ftrun does not model
        why["Ollama"] = ollama["not_checked"]
    env = " ".join(f"{k}={v}" for k, v in (sp.get("ollama_serve_with") or {}).items())
    names = [f"Ollama with {env}" if r == "Ollama" and env else r for r in checked]
    line = f"served prompt = trained prompt ({', '.join(names) or 'no runtime'})"
    if sp.get("chat_template_kwargs"):
        line += f" served with {json.dumps(sp['chat_template_kwargs'])}"
    missing = [r for r in SERVING_RUNTIMES if r not in checked]
    reasons: dict[str, list[str]] = {}
    for r in missing:
        reasons.setdefault(why[r], []).append(r)
    if reasons:
        line += "; not checked: " + "; ".join(f"{', '.join(rs)} ({w})" for w, rs in reasons.items())
    return line
