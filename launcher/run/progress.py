"""The live progress display of a run: the progress bar, `ftrun status --watch`, and the foreground run's threads."""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, TextIO

from launcher.run.facts import end_summary, run_status
from launcher.run.summary_view import exporting, format_end_summary
from launcher.run.views import format_duration, format_status
from launcher.store.rundir import RunDir
from launcher.store.state import ACTIVE, ENDED, run_holder


def progress_fields(s: dict[str, Any]) -> str:
    """step, loss, tokens/s and ETA on one line (the live bar's text and the plain line when not a terminal)."""
    step = f"step {s.get('step') or 0}/{s['total_steps']}" if s.get("total_steps") else f"step {s.get('step') or 0}"
    loss = f"loss {s['loss']:.4f}" if s.get("loss") is not None else "loss -"
    tps = f"{s['tokens_per_second']:,.0f} tokens/s" if s.get("tokens_per_second") else "- tokens/s"
    return f"{s['state']}  {step}  {loss}  {tps}  ETA {format_duration(s.get('eta_seconds'))}"


class Progress:
    """A live progress bar for a run (rich) on a terminal; plain lines, one per change, when not a terminal."""

    def __init__(self, out: TextIO = sys.stdout, live: Optional[bool] = None):
        self.out = out
        self.live = out.isatty() if live is None else live
        self._last = None
        self._rich = None

    def __enter__(self) -> "Progress":
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn

            self._rich = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                console=Console(file=self.out, force_terminal=True),
                refresh_per_second=2,
                transient=False,
            )
            self._rich.start()
            self._task = self._rich.add_task("", total=None, info="")
        return self

    def update(self, s: dict[str, Any]) -> None:
        if self._rich is not None:
            loss = f"loss {s['loss']:.4f}" if s.get("loss") is not None else "loss -"
            tps = f"{s['tokens_per_second']:,.0f} tok/s" if s.get("tokens_per_second") else "- tok/s"
            self._rich.update(
                self._task,
                description=s["state"],
                completed=s.get("step") or 0,
                total=s.get("total_steps"),
                info=f"{loss}  {tps}  ETA {format_duration(s.get('eta_seconds'))}",
            )
            return
        key = (s["state"], s.get("step"), s.get("loss"))
        if key != self._last:
            self._last = key
            print(f"[{time.strftime('%H:%M:%S')}] {progress_fields(s)}", file=self.out, flush=True)

    def print(self, text: str) -> None:
        """A line above the bar (the bar stays at the bottom)."""
        if self._rich is not None:
            self._rich.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, file=self.out, flush=True)

    def __exit__(self, *exc) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None


def watch(
    run: RunDir,
    *,
    interval: float = 2.0,
    out: TextIO = sys.stdout,
    live: Optional[bool] = None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """`ftrun status --watch`: the live bar until the run leaves the active states; then its summary."""
    with Progress(out, live) as bar:
        while True:
            s = run_status(run)
            bar.update(s)
            if s["state"] not in ACTIVE + ("planned",) or (s["state"] == "planned" and not run_holder(run)):
                if not (s["state"] == "succeeded" and exporting(s)):  # the export is part of the run's end
                    break
            sleep(interval)
    print(format_end_summary(end_summary(run)) if s["state"] in ENDED else format_status(s), file=out, flush=True)
    return s


@contextmanager
def attached(run: RunDir, out: TextIO = sys.stdout, interval: float = 2.0) -> Iterator[None]:
    """`ftrun RECIPE --foreground`: file descriptors 1 and 2, inherited by the children, become pipes whose lines go
    to train.log (as a detached run's) and to where they went before, above a live progress bar on a terminal."""
    live = out.isatty()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    log = run.log.open("ab")
    written = threading.Lock()  # one line at a time in train.log, from either pipe
    reads = []
    for fd in (1, 2):
        read_end, write_end = os.pipe()
        os.dup2(write_end, fd)
        os.close(write_end)
        reads.append(read_end)
    terminal = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    stop = threading.Event()
    with Progress(terminal, live=live) as bar:

        def pump(read_end: int, to: int) -> None:
            with os.fdopen(read_end, "rb") as fh:
                for line in fh:
                    with written:
                        log.write(line)
                        log.flush()
                    if live:
                        bar.print(line.decode(errors="replace").rstrip("\n"))
                    else:
                        os.write(to, line)

        def refresh() -> None:
            while True:
                bar.update(run_status(run))
                if stop.wait(interval):
                    return

        threads = [threading.Thread(target=pump, args=(r, to), daemon=True) for r, to in zip(reads, saved)]
        if live:
            threads.append(threading.Thread(target=refresh, daemon=True))
        for th in threads:
            th.start()
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)  # the pipes' last writers here: the children have exited
            os.dup2(saved[1], 2)
            stop.set()
            for th in threads:
                th.join(timeout=5)
            if live:
                bar.update(run_status(run))
    terminal.close()
    log.close()
    for fd in saved:
        os.close(fd)
