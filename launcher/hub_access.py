"""Whether this process asks the Hugging Face Hub, and why not: offline by setting, or the Hub not answering.

A plan asks the Hub one short question first (`probe`) and, when that gets no answer, keeps every library off the
network for the rest of the process (`go_offline`). Without it a plan waits about 25 s on a machine without a
network: huggingface_hub 2.4.0's hf_hub_download, which datasets.load_dataset calls for a Hub dataset's README.md
(datasets 5.2.0 load.py `dataset_module_factory`), follows a failed metadata request with "No local file found.
Retrying.." and a second `_get_metadata_or_catch_error(..., etag_timeout=_ETAG_RETRY_TIMEOUT (60 s),
retry_on_errors=True)` (file_download.py `_hf_hub_download_to_cache_dir`), which `_http_backoff_base`
(utils/_http.py) repeats up to max_retries=5 times, waiting 1, 2, 4, 8 and 8 s. No setting of huggingface_hub
changes those retries; its offline mode skips them: `constants.is_offline_mode()` is read at each request
(utils/_http.py `hf_request_event_hook`) and datasets reads `datasets.config.HF_HUB_OFFLINE` at each load
(datasets utils/file_utils.py `_raise_if_offline_mode_is_enabled`), both set from HF_HUB_OFFLINE at import.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from typing import Optional

OFFLINE_SETTINGS = ("HF_HUB_OFFLINE", "FTRUN_OFFLINE")
PROBE_SECONDS = 2.0  # one request, no retry: a Hub that answers does so in a fraction of this
_TRUE = ("1", "true", "yes", "on")

_unanswered: Optional[str] = None  # why the probe got no answer, once it got none


def endpoint() -> str:
    """The Hub's address as huggingface_hub reads it (constants.py: HF_ENDPOINT, else https://huggingface.co)."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def offline_reason() -> Optional[str]:
    """Why the Hub is not asked in this process, in a few words; None when it may be."""
    if _unanswered:
        return _unanswered
    if any(os.environ.get(name, "").strip().lower() in _TRUE for name in OFFLINE_SETTINGS):
        return "offline (HF_HUB_OFFLINE / FTRUN_OFFLINE)"
    return None


def probe(timeout: float = PROBE_SECONDS) -> Optional[str]:
    """One HEAD request to the Hub's endpoint. None when anything answers (any HTTP status: the Hub is there, and
    the real request says what it thinks); otherwise the reason, and the process goes offline (`go_offline`).
    Asks nothing when the process is offline already, and returns that reason."""
    already = offline_reason()
    if already:
        return already
    url = endpoint()
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
        return None
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        cause = getattr(exc, "reason", None) or exc
        detail = getattr(cause, "strerror", None) or str(cause) or type(cause).__name__
        go_offline(f"the Hub at {url} could not be reached ({detail})")
        return _unanswered


def go_offline(why: str) -> None:
    """Every later Hub request of this process fails at once instead of retrying, and `offline_reason` says why:
    HF_HUB_OFFLINE for the libraries not imported yet, their own switches for those imported already."""
    global _unanswered
    _unanswered = why
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    config = sys.modules.get("datasets.config")
    if config is not None:
        config.HF_HUB_OFFLINE = True
