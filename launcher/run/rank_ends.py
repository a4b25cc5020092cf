"""How each rank of an attempt ended, and which end is the cause: killed by a signal, a Python exception, a CUDA or
NCCL error, or a crash without a traceback. Read from torchrun's own per-rank record, not its total exit code.

torchrun (and accelerate launch, the same elastic agent) exits 1 whenever any rank failed; its per-rank record is in
its stderr (the tail kept by launcher/run/attempt.py). torch 2.13: elastic/multiprocessing/api.py
SubprocessContext._poll collects every rank's exit code (survivors' too, after SIGTERM), and errors/__init__.py
ChildFailedError.format_msg prints each with _FAILURE_FORMAT_TEMPLATE under "Root Cause (first observed failure)". A
rank's exception is in its TORCHELASTIC_ERROR_FILE (errors/error_handler.py ErrorHandler.record_exception:
{"message": {"message", "extraInfo": {"py_callstack"}}}, filled through launcher/worker/train.py _recorded); a signal
leaves none.
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from launcher.worker.exits import EXIT_STOPPED

# Signals from outside (a person, a runtime, a preemption): an interruption; a fault signal (SIGSEGV, ...) is a crash
EXTERNAL_SIGNALS = ("SIGKILL", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGPIPE", "SIGXCPU")
# A survivor's error once its peer is gone (gloo/transport/tcp/pair.cc, NCCL's abort): never the cause of the others
PEER_GONE = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "connection refused",
    "remote process exited",
    "communicator was aborted",
    "ncclremoteerror",
    "socket closed",
    "timed out",
    "timeout",
)
# A CUDA or NCCL error: announced as such (the GPU, the driver, the interconnect), a restart allowed.
CUDA_MARKERS = (
    "cuda error",
    "cudaerror",
    "nccl error",
    "ncclunhandledcudaerror",
    "ncclsystemerror",
    "ncclinternalerror",
    "distbackenderror",
    "cublas_status",
    "cudnn_status",
    "device-side assert",
    "uncorrectable ecc",
    "illegal memory access",
    "xid",
)

_ENTRY = re.compile(
    r"time\s*:\s*(?P<time>\S+)\s*\n\s*host\s*:.*\n\s*rank\s*:\s*(?P<rank>-?\d+)\s*\(local_rank:\s*(?P<local>\d+)\)\s*\n"
    r"\s*exitcode\s*:\s*(?P<code>-?\d+)\s*\(pid:\s*(?P<pid>\d+)\)\s*(?:\((?P<sig>\w+)\))?\s*\n"
    r"\s*error_file\s*:\s*(?P<file>.*)"
)
_REPORT = "ChildFailedError"


@dataclass
class RankEnd:
    rank: Optional[int]  # None: a launcher that said nothing per rank, or a single worker
    exit_code: int
    signal: Optional[str] = None
    pid: Optional[int] = None
    root_cause: bool = False  # what torchrun calls the first observed failure
    message: Optional[str] = None  # the exception's last line, from the error file
    traceback: Optional[str] = None
    step: Optional[int] = None  # the rank's last heartbeat step (launcher/store/heartbeat_files.py)
    phase: Optional[str] = None

    @property
    def kind(self) -> str:
        """signal (an interruption), stopped (saved after a signal), cuda, exception, or crash."""
        if self.signal in EXTERNAL_SIGNALS:
            return "signal"
        if self.exit_code == EXIT_STOPPED:
            return "stopped"
        text = f"{self.message or ''}\n{self.traceback or ''}".lower()
        if self.message and any(m in text for m in CUDA_MARKERS):
            return "cuda"
        if self.message:
            return "exception"
        return "crash"

    @property
    def peer_gone(self) -> bool:
        return bool(self.message) and any(m in self.message.lower() for m in PEER_GONE)

    def signature(self) -> Optional[str]:
        """The same exception at the same place: its last line and frames, without addresses or pids."""
        if not self.message:
            return None
        frames = re.findall(r'File "([^"]+)", line (\d+)', self.traceback or "")
        return re.sub(r"0x[0-9a-f]+|pid \d+", "", self.message) + "|" + ";".join(f"{f}:{n}" for f, n in frames)


def signal_name(code: int) -> Optional[str]:
    if code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def parse_report(text: str) -> list[RankEnd]:
    """The ranks torchrun reports as failed in its last ChildFailedError message within `text` ([] when none)."""
    at = text.rfind(_REPORT)
    if at < 0:
        return []
    report = text[at:]
    root_at = report.find("Root Cause")
    ends = []
    for m in _ENTRY.finditer(report):
        code = int(m["code"])
        ends.append(
            RankEnd(
                rank=int(m["rank"]),
                exit_code=code,
                signal=m["sig"] or signal_name(code),
                pid=int(m["pid"]),
                root_cause=root_at >= 0 and m.start() > root_at,
            )
        )
        ends[-1].message, ends[-1].traceback = read_error_file(m["file"].strip())
    return ends


def read_error_file(path: str) -> tuple[Optional[str], Optional[str]]:
    """(the exception's last line, its traceback) from an error file ErrorHandler.record_exception wrote."""
    if not path or path.startswith("<") or not Path(path).is_file():
        return None, None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None, None
    message = data.get("message")
    if isinstance(message, dict):
        tb = (message.get("extraInfo") or {}).get("py_callstack")
        return (str(message.get("message") or "").strip().splitlines() or [None])[-1], tb
    return (str(message).strip().splitlines() or [None])[-1] if message else None, None


def single(exit_code: int, error_file: Optional[Path]) -> list[RankEnd]:
    """A single worker's end: its own exit code, its error file (the supervisor names one)."""
    end = RankEnd(rank=0, exit_code=exit_code, signal=signal_name(exit_code), root_cause=True)
    if error_file is not None and exit_code > 0:
        end.message, end.traceback = read_error_file(str(error_file))
    return [end]


def cause(ends: list[RankEnd]) -> Optional[RankEnd]:
    """The end that caused the others. PEER_GONE errors, SIGTERMs (torchrun closing the survivors) and exits that
    say nothing are consequences while another end is known; among the rest, torchrun's root cause, else a signal
    from outside before an exception."""
    if not ends:
        return None
    rest = [e for e in ends if not e.peer_gone] or ends
    rest = [e for e in rest if e.signal != "SIGTERM"] or rest
    order = {"signal": 0, "cuda": 1, "exception": 1, "crash": 2, "stopped": 3}
    return min(rest, key=lambda e: (order[e.kind] >= 2, not e.root_cause, order[e.kind]))


def facts(end: RankEnd, ends: list[RankEnd]) -> dict[str, Any]:
    """What the supervisor stores about an attempt's end (state.json `last_end`); views word it."""
    out = {k: v for k, v in asdict(end).items() if k not in ("traceback", "root_cause") and v is not None}
    out["kind"] = end.kind
    out["ranks"] = [
        {
            "rank": e.rank,
            "exit_code": e.exit_code,
            **({"signal": e.signal} if e.signal else {}),
            **({"error": e.message} if e.message else {}),
        }
        for e in ends
    ]
    return out
