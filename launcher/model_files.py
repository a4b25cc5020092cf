"""Where a base model's files are on this machine: its local folder, or the Hugging Face cache (never a download)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def cached_file(model: str, filename: str) -> Optional[Path]:
    """A file of a Hub model in the local Hugging Face cache, as huggingface_hub's try_to_load_from_cache finds it."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, filename)
    except ValueError:  # not a repository id (a local path that is gone, say): nothing to read
        return None
    return Path(found) if isinstance(found, str) else None  # a str, None, or the "known missing" marker


def local_file(model: str, name: str) -> Optional[Path]:
    """A file of the base model on this machine: its folder, or the Hugging Face cache (no download)."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        p = folder / name
        return p if p.is_file() else None
    return cached_file(model, name)


def not_a_model(model: str) -> Optional[tuple[str, str]]:
    """Why `model` cannot be the base model because it is a file, a GGUF above all: (what, fix); None otherwise."""
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":  # by its name, there or not: a GGUF is never trainable
        return (
            f"model {model} is a GGUF file: llama.cpp's format for inference, its weights quantized to a few "
            "bits with none kept at training precision, so there is nothing to compute gradients on and ftrun "
            "cannot fine-tune it; ftrun trains a Hugging Face model, a folder (config.json and safetensors "
            "weights) or a Hub id (org/name)",
            "set model: to the original model the GGUF was made from (its Hub id is on the GGUF's model card, "
            "e.g. Qwen/Qwen3-8B), train that, then make the GGUF from the result: export: [gguf] in the recipe, "
            "or `ftrun export --gguf TYPE` after the run",
        )
    if path.is_file():
        folder = path.parent
        return (
            f"model {model} is a file; ftrun trains a Hugging Face model, a folder (config.json and safetensors "
            "weights) or a Hub id (org/name)",
            f"set model: to the folder that holds it, {folder}"
            if (folder / "config.json").is_file()
            else "set model: to the model's folder (the one with config.json) or its Hub id",
        )
    return None
