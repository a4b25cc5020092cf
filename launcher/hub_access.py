"""Whether this process asks the Hugging Face Hub, and why not: offline by setting, or the Hub not answering.

A plan asks the Hub one short question first (`probe`); with no answer, every library stays off the network for the
rest of the process (`go_offline`). Else a plan waits about 25 s without a network: huggingface_hub 2.4.0
file_download.py `_hf_hub_download_to_cache_dir` retries a failed metadata request with backoff (utils/_http.py
`_http_backoff_base`, 1+2+4+8+8 s), which only offline mode skips (utils/_http.py `hf_request_event_hook`; datasets
5.2.0 utils/file_utils.py `_raise_if_offline_mode_is_enabled`), both read from HF_HUB_OFFLINE at import.
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
    """One HEAD request to the Hub's endpoint: None when anything answers (any HTTP status); otherwise the reason,
    and the process goes offline. Offline already: that reason, nothing asked."""
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
    """Every later Hub request of this process fails at once: HF_HUB_OFFLINE, and the imported libraries' switches."""
    global _unanswered
    _unanswered = why
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    config = sys.modules.get("datasets.config")
    if config is not None:
        config.HF_HUB_OFFLINE = True
