"""The base model's files on this box before any GPU time: a local folder, the Hugging Face cache, or a download
from the Hub with its size, progress and speed; a clear error when none of these can be had.

Through huggingface_hub 2.3.0's own functions (`_snapshot_download.py`, `hf_api.py`): snapshot_download
(local_files_only=True) finds a complete cached snapshot, HfApi.auth_check tells a missing repository from a gated one,
model_info(files_metadata=True) gives the sizes, snapshot_download fills the cache from_pretrained reads.
"""

from __future__ import annotations

import os
import sys
import time
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Callable, Optional

from launcher.errors import ModelError

# What from_pretrained reads for a causal LM and its tokenizer; not the weights' other copies (original/, ONNX, GGUF)
ALLOW = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py"]
IGNORE = ["original/*", "*/original/*", "onnx/*", "*.gguf"]
PYTORCH_BIN = "*.bin"  # only for repositories without safetensors


def is_hub_id(model: str) -> bool:
    """`org/name` that is not a folder on this box (recipe_loading.py resolves local paths to absolute ones)."""
    return not Path(model).expanduser().exists() and not model.startswith(("/", ".", "~")) and model.count("/") == 1


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode() or os.environ.get("FTRUN_OFFLINE", "").lower() in ("1", "true", "yes")


def _endpoint() -> Optional[str]:
    return os.environ.get("HF_ENDPOINT") or None  # read now, not at import (tests and a changed environment)


def format_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def cached(model: str) -> Optional[str]:
    """The complete cached snapshot of a Hub model (the worker loads from it without the network), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(
            model, allow_patterns=ALLOW + [PYTORCH_BIN], ignore_patterns=IGNORE, local_files_only=True
        )
    except LocalEntryNotFoundError:  # not cached, or cached in part (IncompleteSnapshotError is a subclass)
        return None
    # files fetched one by one (fetch_tokenizer) leave no cached listing to tell a partial snapshot: weights looked for
    return path if _has_weights(Path(path)) else None


def _has_weights(snapshot: Path) -> bool:
    """config.json and the weights: every shard an index names, else a safetensors or PyTorch file."""
    import json

    if not (snapshot / "config.json").is_file():
        return False
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (snapshot / index).is_file():
            shards = set(json.loads((snapshot / index).read_text()).get("weight_map", {}).values())
            return bool(shards) and all((snapshot / shard).is_file() for shard in shards)
    return any(snapshot.glob("*.safetensors")) or any(snapshot.glob("pytorch_model*.bin"))


def _unavailable(model: str, why: str, fix: str) -> ModelError:
    return ModelError(
        f"the model '{model}' is not on this box and cannot be downloaded: {why}; nothing was started", fix=fix
    )


def check(model: str) -> dict[str, Any]:
    """Can the worker load this model? Asked before the run directory is touched. Returns {"source":
    local|cache|hub, ...} with the bytes to download for the Hub; raises ModelError (exit 2) otherwise."""
    if not is_hub_id(model):
        return {"source": "local", "path": model}
    path = cached(model)
    if path:
        return {"source": "cache", "path": path, "bytes": 0}
    if _offline():
        raise _unavailable(
            model,
            "it is not in the Hugging Face cache and the network is off (HF_HUB_OFFLINE / FTRUN_OFFLINE)",
            f"download it while online (`hf download {model}`), unset HF_HUB_OFFLINE, or "
            "set `model` to a local folder that holds it.",
        )
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    api = HfApi(endpoint=_endpoint())
    token_set = bool(os.environ.get("HF_TOKEN"))
    try:
        api.auth_check(model)  # GatedRepoError before RepositoryNotFoundError: it subclasses it
        info = api.model_info(model, files_metadata=True)
    except GatedRepoError:
        raise _unavailable(
            model,
            "it is gated: its licence must be accepted on the Hub"
            + (", and the token in HF_TOKEN has no access yet" if token_set else " and a token given"),
            f"accept the licence on the model's page (https://huggingface.co/{model}), then "
            + (
                "wait for the approval and retry."
                if token_set
                else "set HF_TOKEN to a token of that account (`export HF_TOKEN=hf_...`)."
            ),
        ) from None
    except RepositoryNotFoundError:
        raise _unavailable(
            model,
            "the Hub has no such model" + ("" if token_set else " (or it is private)"),
            "check the spelling (organisation/name, as on its Hub page)"
            + (
                "; for a private model, check that HF_TOKEN's account can read it."
                if token_set
                else "; for a private model, set HF_TOKEN."
            ),
        ) from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status == 401:
            raise _unavailable(
                model,
                "the Hub refused the token in HF_TOKEN (401)",
                "set HF_TOKEN to a valid token (https://huggingface.co/settings/tokens).",
            ) from None
        raise _unavailable(
            model,
            f"the Hub answered {status}: {str(exc).splitlines()[0]}",
            "retry in a few minutes, or download it elsewhere and set `model` to the folder.",
        ) from None
    except Exception as exc:  # noqa: BLE001 - only the Hub client runs here: whatever it raises, the Hub was not had
        raise _unavailable(
            model,
            f"the Hub could not be reached ({type(exc).__name__}: {exc})",
            "check the network (or HF_ENDPOINT), or download the model elsewhere and set `model` "
            "to a local folder that holds it.",
        ) from None
    files = _wanted([(s.rfilename, s.size or 0) for s in info.siblings or []])
    return {
        "source": "hub",
        "sha": info.sha,
        "files": len(files),
        "bytes": sum(size for _, size in files),
        "allow": _allow([name for name, _ in files]),
        "tokenizer_files": [name for name, _ in files if name in TOKENIZER_FILES],
    }


# What the data check reads (launcher/data/dataset.py _renderer): the tokenizer and the chat template, a few MB at most
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def fetch_tokenizer(model: str, found: dict[str, Any]) -> Optional[str]:
    """A Hub model's tokenizer files into the cache before the data check, so that it uses the real chat template on
    a first run too. The main branch, as `fetch`: by commit hash no refs/main is written, which
    try_to_load_from_cache (launcher/plan/models.py) needs. Returns what to tell the user on failure, else None."""
    if found.get("source") != "hub" or not found.get("tokenizer_files"):
        return None
    from huggingface_hub import hf_hub_download

    for name in found["tokenizer_files"]:
        try:
            hf_hub_download(model, name, endpoint=_endpoint())
        except Exception as exc:  # noqa: BLE001 - the Hub answered check() a moment ago: not a reason to stop
            return (
                f"{model}'s {name} could not be fetched before the data check ({type(exc).__name__}: {exc}); "
                "the data check estimates tokens from characters and cannot check how the chat template "
                "renders tool calls and reasoning"
            )
    return None


def _allow(names: list[str]) -> list[str]:
    return ALLOW + ([PYTORCH_BIN] if not any(n.endswith(".safetensors") for n in names) else [])


def _wanted(files: list[tuple[str, int]]) -> list[tuple[str, int]]:
    allow = _allow([n for n, _ in files])
    return [(n, s) for n, s in files if any(fnmatch(n, p) for p in allow) and not any(fnmatch(n, p) for p in IGNORE)]


class _Meter:
    """Bytes written by snapshot_download, reported as lines at most every `every` seconds and at the end."""

    def __init__(self, model: str, total: int, say: Callable[[str], None], every: float):
        self.model, self.total, self.say, self.every = model, total, say, every
        self.done = 0
        self.t0 = self.last = time.monotonic()

    def add(self, n: float) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self.say(self.line())

    def line(self, final: bool = False) -> str:
        dt = max(time.monotonic() - self.t0, 1e-6)
        rate = self.done / dt
        if final:
            return f"downloaded {self.model}: {format_bytes(self.done)} in {dt:.1f} s ({format_bytes(rate)}/s)"
        share = f" of {format_bytes(self.total)} ({self.done / self.total:.0%})" if self.total else ""
        left = f", {(self.total - self.done) / rate:.0f} s left" if self.total and rate > 0 else ""
        return f"downloading {self.model}: {format_bytes(self.done)}{share}, {format_bytes(rate)}/s{left}"


def _bar_class(meter: _Meter, on_terminal: bool):
    """A tqdm for snapshot_download's tqdm_class: it draws on a terminal only, and the bar of written bytes feeds
    the meter (snapshot_download 2.3.0 also makes a "Downloading" byte bar for Xet and a bar of files)."""
    from tqdm.auto import tqdm

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = not on_terminal
            self._meter = kwargs.get("unit") == "B" and not str(kwargs.get("desc", "")).startswith("Downloading")
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            if self._meter and n:
                meter.add(n)
            return super().update(n)

    return Bar


def fetch(model: str, found: dict[str, Any], say: Callable[[str], None], every: float = 5.0) -> dict[str, Any]:
    """The model into the Hugging Face cache; returns what smoke.json records (source, bytes, seconds)."""
    if found["source"] != "hub":
        return {"model_source": found["source"], "download_bytes": 0, "download_seconds": 0.0}
    from huggingface_hub import snapshot_download

    say(f"downloading {model}: {found['files']} files, {format_bytes(found['bytes'])} into the Hugging Face cache")
    meter = _Meter(model, found["bytes"], say, every)
    t0 = time.monotonic()
    snapshot_download(
        model,
        allow_patterns=found["allow"],
        ignore_patterns=IGNORE,
        endpoint=_endpoint(),
        tqdm_class=_bar_class(meter, sys.stderr.isatty()),
    )
    seconds = time.monotonic() - t0
    say(meter.line(final=True))
    return {
        "model_source": "hub",
        "download_bytes": int(meter.done or found["bytes"]),
        "download_seconds": round(seconds, 2),
    }
