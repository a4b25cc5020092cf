"""Run a command and print its wall seconds and the CPU seconds of every process it started, detached ones included.

Usage: python scripts/cpu_seconds.py LABEL COMMAND [ARGS...]; also appends a JSON line to $CPU_SECONDS_LOG if set.
The process becomes a child subreaper (prctl PR_SET_CHILD_SUBREAPER, Linux): a run's supervisor and worker, which
leave their launcher's session, are re-parented here when their parent ends, and reaping them adds their CPU to this
process's RUSAGE_CHILDREN. On a box shared with other work, CPU seconds move far less than wall time
(docs/BENCHMARKS.md, "CI's time after issues 55, 58, 59").
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    start = time.time()
    pid = os.fork()
    if pid == 0:
        os.execvp(argv[2], argv[2:])
    rc, wall = 1, 0.0
    while True:  # every descendant, until none is left
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if done == pid:
            rc, wall = os.waitstatus_to_exitcode(status), time.time() - start
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    row = {"label": argv[1], "rc": rc, "wall": round(wall, 1), "cpu": round(used.ru_utime + used.ru_stime, 1)}
    print("cpu_seconds " + json.dumps(row), file=sys.stderr)
    if os.environ.get("CPU_SECONDS_LOG"):
        with open(os.environ["CPU_SECONDS_LOG"], "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv))
