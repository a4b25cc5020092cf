"""How the plan writes its figures for a reader: hours, token counts, the memory unit."""

from __future__ import annotations


# The one memory unit of every figure the plan shows, said once (JSON "units", the text's last line).
UNIT = "GB = 2**30 bytes (GiB), as nvidia-smi and card names count: an RTX 4090 is 24 GB, an H100 80 GB"


def _fmt_hours(h: float | None) -> str:
    if h is None:
        return "unknown"
    minutes = round(h * 60)
    if h * 60 < 0.995:  # under a minute: seconds, as `ftrun status` shows the same forecast (views.format_duration)
        return f"{max(1, round(h * 3600))} s"
    if minutes < 60:
        return f"{minutes} min"
    if minutes < 48 * 60:
        return f"{minutes // 60} h {minutes % 60:02d} min"
    return f"{h / 24:.1f} days"


def _fmt_tokens(n: float | None) -> str:
    if n is None:
        return "unknown"
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    if n >= 1e3:
        return f"{n / 1e3:.1f}k"
    return f"{n:.0f}"
