"""Errors a user can act on: each carries what went wrong, where, and the fix to suggest.

Owns the table of the worker's failure exits (WORKER_EXITS); launcher/worker/exits.py exits with these codes.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Optional

# Exit codes, documented in the README; scripts rely on them.
EXIT_INTERNAL = 1
EXIT_BAD_INPUT = 2  # recipe, data, command line
EXIT_DOES_NOT_FIT = 3  # the plan finds no way to run the job on this box
EXIT_SMOKE_FAILED = 4
EXIT_RUN_FAILED = 5
EXIT_BUSY = 6  # another ftrun owns the run directory
EXIT_NOTHING_LEARNED = 7  # GRPO trained to its end, its rewards never varied: a resume would do the same

# The worker's own exit codes (launcher/worker/exits.py), read by the supervisor and the smoke test.
EXIT_STOPPED = 77  # stopped by SIGTERM/SIGINT after saving a checkpoint (preemption, `ftrun stop`)
EXIT_OOM = 78
EXIT_NAN = 79
EXIT_BAD_WORLD = 80
EXIT_DISK_FULL = 81


@dataclass(frozen=True)
class WorkerExit:
    """How a worker's exit code reads, the fix to suggest, and whether the supervisor restarts the worker after it."""

    what: str
    fix: str
    restart: bool

    @property
    def reason(self) -> str:
        return f"{self.what}; {self.fix}"


# Each failure exit of a worker, once (launcher/run/smoke.py REASONS, launcher/run/supervisor.py FATAL)
WORKER_EXITS = {
    EXIT_OOM: WorkerExit(
        "out of GPU memory",
        "lower micro_batch_size (raise gradient_accumulation_steps to keep the "
        "effective batch), lower max_length, or use method: qlora",
        restart=False,
    ),
    EXIT_NAN: WorkerExit(
        "the loss became NaN or infinite",
        "lower learning_rate and check the data for empty or broken examples",
        restart=False,
    ),
    EXIT_BAD_WORLD: WorkerExit(
        "the worker saw another device or process count than the plan",
        "the worker's log says what it saw (train.log; the smoke test shows its last lines)",
        restart=False,
    ),
    EXIT_DISK_FULL: WorkerExit(
        "disk full while saving a checkpoint",
        "free space on the run directory's disk (`df -h`), then run the same command to resume "
        "from the newest verified checkpoint",
        restart=False,
    ),
    EXIT_BAD_INPUT: WorkerExit(
        "the worker rejected its input",
        "the worker's log says why (train.log; the smoke test shows its last lines)",
        restart=False,
    ),
    -9: WorkerExit(
        "the worker was killed (SIGKILL), most often by the kernel when memory runs out",
        "lower micro_batch_size or max_length, or use a box with more memory; `dmesg | tail` shows OOM kills",
        restart=True,
    ),
}


class FtrunError(Exception):
    """An error with a message for the user and the fix to suggest; never shown as a traceback."""

    kind = "error"
    exit_code = EXIT_INTERNAL

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.message = message
        self.fix = fix

    def render(self) -> str:
        text = f"ftrun: {self.kind}: {self.message}"
        if self.fix:
            text += f"\n  Fix: {self.fix}"
        return text


class RecipeError(FtrunError):
    kind = "recipe error"
    exit_code = EXIT_BAD_INPUT


class DataError(FtrunError):
    kind = "data error"
    exit_code = EXIT_BAD_INPUT


class UsageError(FtrunError):
    kind = "usage error"
    exit_code = EXIT_BAD_INPUT


class ModelError(FtrunError):
    kind = "model error"
    exit_code = EXIT_BAD_INPUT


class PlanError(FtrunError):
    """The job does not fit this box (or any box ftrun knows); carries concrete options."""

    kind = "does not fit"
    exit_code = EXIT_DOES_NOT_FIT


class MissingSoftware(PlanError):
    """The job needs a package this machine lacks (Unsloth, DeepSpeed): an install away, never "does not fit"."""

    kind = "missing software"
    exit_code = EXIT_BAD_INPUT


class HardwareError(FtrunError):
    kind = "hardware error"
    exit_code = EXIT_BAD_INPUT


class SmokeError(FtrunError):
    kind = "smoke test failed"
    exit_code = EXIT_SMOKE_FAILED


class SmokeOOM(SmokeError):
    """The smoke test ran out of memory; the launcher may re-plan and retry."""

    def __init__(self, message: str, fix: str | None = None, peak_memory_gb: float | None = None):
        super().__init__(message, fix)
        self.peak_memory_gb = peak_memory_gb


class RunError(FtrunError):
    kind = "run error"
    exit_code = EXIT_RUN_FAILED


class BusyError(FtrunError):
    kind = "busy"
    exit_code = EXIT_BUSY


class SyncError(FtrunError):
    kind = "sync error"
    exit_code = EXIT_RUN_FAILED


# A raw control character inside a JSON string, by the name a user knows it and the escape JSON wants instead.
_CONTROL = {"\t": ("a tab", "\\t"), "\n": ("a line break", "\\n"), "\r": ("a carriage return", "\\r")}


def json_problem(exc, lines: bool = True) -> str:
    """A json.JSONDecodeError in words, its place said once (Python's message may end in "at"); a broken string is
    placed where it starts. `lines`: name the line too (a whole JSON file; a JSONL line's caller names it)."""
    doc, pos = exc.doc or "", exc.pos

    def where(p: int) -> str:
        line = doc.count("\n", 0, p) + 1
        column = p - (doc.rfind("\n", 0, p) + 1) + 1
        return f"line {line}, column {column}" if lines else f"column {column}"

    if exc.msg.startswith("Invalid control character"):
        start, inside, escaped = None, False, False
        for i, ch in enumerate(doc[:pos]):  # valid JSON up to pos: quotes outside strings open them
            if escaped:
                escaped = False
            elif inside and ch == "\\":
                escaped = True
            elif ch == '"':
                inside, start = not inside, i if not inside else start
        ch = doc[pos] if pos < len(doc) else ""
        name, escape = _CONTROL.get(
            ch, (f"the control character U+{ord(ch or chr(0)):04X}", f"\\u{ord(ch or chr(0)):04x}")
        )
        at = "" if start is None else f" ({where(pos).split(', ')[-1]})"
        return (
            f"the string that starts at {where(start if start is not None else pos)} holds {name}{at} as a raw "
            f"character, which JSON does not allow inside a string: write it as {escape}"
        )
    if exc.msg.startswith("Unterminated string"):
        return f"the string that starts at {where(pos)} never ends (its closing quote is missing)"
    return f"{exc.msg.removesuffix(' at')} at {where(pos)}"


# "Did you mean" only for close spellings (difflib's ratio): 'lr' vs 'lora' 0.67, 'max_len' vs 'max_length' 0.82
SUGGEST_CUTOFF = 0.75


def close_name(name: str, options: list[str]) -> Optional[str]:
    """The option a misspelt name most likely meant, or None when none is close."""
    near = difflib.get_close_matches(name, options, n=1, cutoff=SUGGEST_CUTOFF)
    return near[0] if near else None
