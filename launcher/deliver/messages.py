"""What the export says to the user: the error it fails with, its progress lines, sizes in units a person reads."""

from __future__ import annotations

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
    return f"{n:.1f} GB"
