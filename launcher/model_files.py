"""Where a base model's files are on this machine: its local folder, or the Hugging Face cache (never a download).

One lookup for every stage that reads a model's config, tokenizer or weights without loading it (the plan's
architecture, the data check's tokenizer, the final result's check, llama.cpp's readiness, the worker's dtype).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def cached_file(model: str, filename: str) -> Optional[Path]:
    """A file of a Hub model in the local Hugging Face cache (no download), where huggingface_hub itself looks:
    HF_HUB_CACHE, else HF_HOME/hub, else XDG_CACHE_HOME/huggingface/hub (huggingface_hub.constants), the
    snapshot refs/main points at (try_to_load_from_cache)."""
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
