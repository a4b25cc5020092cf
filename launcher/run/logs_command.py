"""`ftrun logs`: the run's train.log, and with -f its new lines while a process of the run lives."""

from __future__ import annotations

import sys
import time

from launcher.store.rundir import RunDir
from launcher.store.state import run_holder


def logs_command(run: RunDir, follow: bool = False) -> int:
    """Print train.log; `follow`: keep printing its new lines until no verified process holds the run."""
    if not run.log.is_file():
        print(f"no log yet in {run.root}")
        return 0
    with run.log.open("r", errors="replace") as fh:
        sys.stdout.write(fh.read())
        sys.stdout.flush()
        while follow:
            line = fh.readline()
            if line:
                sys.stdout.write(line)
                sys.stdout.flush()
                continue
            # followed while a verified process (launcher, then supervisor) holds the run
            if run_holder(run) is None:
                sys.stdout.write(fh.read())  # what was written just before the end
                sys.stdout.flush()
                return 0
            time.sleep(0.5)
    return 0
