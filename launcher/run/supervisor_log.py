"""The supervisor's log line in train.log: timestamped, flushed as it happens."""

from __future__ import annotations

import time


def _log(msg: str) -> None:
    print(f"[ftrun supervisor {time.strftime('%H:%M:%S')}] {msg}", flush=True)
