"""The base model's tokenizer as training reads it, without torch: its folder on this machine, the tokenizer that
encodes, the special tokens a chat template sees, and the chat template.

transformers reads the files (`PreTrainedTokenizerFast.from_pretrained`, which imports no torch), so every key of
`tokenizer_config.json` means what it means in training; the template sees exactly `special_tokens_map`
(transformers 5.24, tokenization_utils_base.py `apply_chat_template`), and tokenizer.json's post-processor decides
what encoding adds (`from_pretrained` drops add_bos_token/add_eos_token where a tokenizer_file resolves).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


@dataclass(frozen=True)
class ModelTokenizer:
    folder: Path
    tokenizer: Any  # the tokenizers.Tokenizer transformers encodes with: encode(text, add_special_tokens=...)
    template: Optional[str]  # the chat template (chat_template.jinja, else tokenizer_config.json's), or None
    special: dict[str, str]  # what apply_chat_template passes the template: bos_token, eos_token, pad_token, ...
    added: dict[str, int]  # the added tokens (content -> id) of tokenizer.json


def _installed(name: str) -> bool:
    """Whether `name` can be imported, without importing it (ValueError: a module set to None in sys.modules)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def tokenizer_dir(model: str) -> tuple[Optional[Path], str]:
    """The folder holding the model's tokenizer on this machine (its own or the HF cache), or (None, why not)."""
    if not _installed("transformers"):  # a light install: the plan estimates, and says why
        return None, (
            "transformers, which reads the model's tokenizer and chat template as training does, is not "
            "installed (pip install 'ftrun[train]')"
        )
    model_dir = Path(model)
    if not model_dir.is_dir():
        from launcher.model_files import cached_file

        cached = cached_file(model, "tokenizer.json")
        model_dir = cached.parent if cached else None
        if model_dir is None:
            return None, f"no local tokenizer for {model} (not a folder, not in the Hugging Face cache)"
    return model_dir, ""


def read_tokenizer(model_dir: Path) -> Optional[ModelTokenizer]:
    """The tokenizer in `model_dir` as transformers loads it, or None when the folder has no tokenizer.json."""
    model_dir = Path(model_dir)
    tok_json = model_dir / "tokenizer.json"
    if not tok_json.is_file():
        return None
    # read once per version of the files (the data check reads it twice; an edited file is read anew)
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
    versions = tuple(_version(model_dir / n) for n in names)
    return _read(model_dir.resolve(), versions)


def _version(path: Path) -> Optional[tuple[int, int]]:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=8)
def _read(model_dir: Path, versions: tuple) -> ModelTokenizer:
    tok_json = model_dir / "tokenizer.json"
    from transformers import PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its notes on a config's tokenizer_class are not the user's business here
    try:
        loaded = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    finally:
        hf_logging.set_verbosity(verbosity)
    jinja_file = model_dir / "chat_template.jinja"
    template = loaded.chat_template if isinstance(loaded.chat_template, str) else None
    if jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    raw = json.loads(tok_json.read_text(encoding="utf-8"))
    return ModelTokenizer(
        folder=model_dir,
        tokenizer=loaded.backend_tokenizer,
        template=template,
        special=dict(loaded.special_tokens_map),
        added={t["content"]: t["id"] for t in raw.get("added_tokens", [])},
    )
