"""The benchmark scripts: each answers --help quickly; the measuring helper reads metrics rows as both sides write them.

The benchmarks themselves are scripts (docs/BENCHMARKS.md), not timed tests; their --quick runs take minutes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = ["bench_throughput", "bench_eta", "bench_overhead", "gpu_bench", "bench_task_eval"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_help(name):
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / f"{name}.py"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "--quick" in out.stdout or "--dry-run" in out.stdout


def test_tokens_per_second_excludes_warmup():
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_common as bc

    rows = [
        {"step": 2, "time": 100.0, "tokens_seen": 1000},
        {"step": 4, "time": 102.0, "tokens_seen": 3000},
        {"step": 6, "time": 104.0, "tokens_seen": 5000},
    ]
    assert bc.tokens_per_second(rows) == 1000.0  # (5000 - 1000) / (104 - 100): steps 1-2 (warm-up) left out
    assert bc.tokens_per_second(rows[:1]) is None


@pytest.mark.slow
def test_throughput_quick_output(tmp_path):
    """--quick runs end to end and prints the ratios (96 examples: 6 steps, 3 logged rows, the fewest that leave
    two after the warm-up) on the smallest bench model, the tests' tiny model's shape: 89 s on 2 quiet cores against
    160 s with --quick's own size s (2026-12-05), most of that the plain script's bf16 autocast on a CPU."""
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "bench_throughput.py"),
            "--quick",
            "--size",
            "xs",
            "--examples",
            "96",
            "--json",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    for ratio in ("ftrun/plain", "defaults/plain", "ftrun/plain-fp32", "defaults/plain-fp32"):
        assert f"ratio {ratio}:" in out.stdout, ratio
    assert (tmp_path / "r.json").is_file()
