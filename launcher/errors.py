"""Errors a user can act on: each carries what went wrong, where, and the fix to suggest."""

from __future__ import annotations

# Exit codes, documented in the README; scripts rely on them.
EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_BAD_INPUT = 2  # recipe, data, command line
EXIT_DOES_NOT_FIT = 3  # the plan finds no way to run the job on this box
EXIT_SMOKE_FAILED = 4
EXIT_RUN_FAILED = 5
EXIT_BUSY = 6  # another ftrun owns the run directory


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
