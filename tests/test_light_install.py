"""`pip install ftrun` without extras promises that plan, status and --help work (pyproject.toml's dependencies): every
shipped recipe plans with the training stack's packages absent, or is refused in one paragraph, never an internal
error (issue 46: a Hub dataset's plan ended in "ModuleNotFoundError: No module named 'datasets'")."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

# the `train`, `export` and `gpu` extras' top-level modules (pyproject.toml), absent from a light install
ABSENT = [
    "torch",
    "transformers",
    "trl",
    "peft",
    "accelerate",
    "datasets",
    "bitsandbytes",
    "tensorboard",
    "sacrebleu",
    "gguf",
    "matplotlib",
    "pynvml",
    "deepspeed",
    "unsloth",
]

# each recipe planned in one process where those modules cannot be imported (None in sys.modules: `import torch`
# raises ModuleNotFoundError, as in a venv without them); its exit code and its output
SCRIPT = """
import contextlib, io, json, sys
for name in json.loads(sys.argv[1]):
    sys.modules[name] = None
from launcher.cli import main
out = {}
for recipe, *overrides in json.loads(sys.argv[2]):
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        try:
            code = main(["plan", recipe, *overrides])
        except SystemExit as exc:
            code = exc.code
    out[recipe] = [code, said.getvalue()]
print(json.dumps(out))
"""


def _recipes(tiny_model, absent_parent, tiny_vlm) -> list[list[str]]:
    # the demo's recipes name the model scripts/demo.sh builds (.cache/tiny-model, absent on a fresh clone): the
    # tests' own build of it stands in. The DPO and GRPO steps start from the SFT demo's run (init_from:
    # ../runs/tiny-cpu), which exists only after scripts/demo.sh: they name a parent run that is absent wherever the
    # tests run, so that the outcome is the same on a fresh clone and after the demo (README's two commands, in order)
    out = []
    for p in sorted((REPO / "recipes").glob("*.yaml")):
        text = p.read_text()
        out.append(
            [
                str(p),
                *([f"model={tiny_model}"] if "cache/tiny-model" in text else []),
                *([f"model={tiny_vlm}"] if "cache/tiny-vlm" in text else []),
                *([f"init_from={absent_parent}"] if p.name in PARENT_RUN_STEPS else []),
            ]
        )
    return out


# the demo's steps that start from the SFT demo's run
PARENT_RUN_STEPS = ("tiny-cpu-dpo.yaml", "tiny-cpu-grpo.yaml")


def _each_recipe_planned_or_refused_in_a_paragraph(res: subprocess.CompletedProcess, absent_parent) -> None:
    assert res.returncode == 0, res.stderr[-3000:]
    said = json.loads(res.stdout.splitlines()[-1])
    for recipe, (code, text) in said.items():
        assert "internal error" not in text and "Traceback" not in text, (recipe, text[-2000:])
        if recipe.endswith(PARENT_RUN_STEPS):  # their parent run is absent: refused, naming init_from and the path
            assert code == 2 and "init_from" in text and str(absent_parent) in text, (recipe, text[-2000:])
            continue
        assert code == 0, (recipe, text[-2000:])
        assert "Plan: " in text, (recipe, text[-1000:])


def test_every_shipped_recipe_plans_without_the_training_stack(tmp_path, tiny_model, tiny_vlm):
    absent_parent = tmp_path / "runs" / "tiny-cpu"
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(ABSENT), json.dumps(_recipes(tiny_model, absent_parent, tiny_vlm))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    _each_recipe_planned_or_refused_in_a_paragraph(res, absent_parent)


@pytest.mark.slow
def test_a_fresh_venv_with_the_base_dependencies_only_plans_every_shipped_recipe(tmp_path, tiny_model, tiny_vlm):
    """The same, in a new virtual environment where `pip install ftrun` (no extras) put only pyproject.toml's
    dependencies and what they pull: no module of the training stack can be there, blocked or not."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    src = tmp_path / "src"  # what the package is made of, so that the build writes nothing into the checkout
    shutil.copytree(REPO / "launcher", src / "launcher", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    install = subprocess.run(
        [py, "-m", "pip", "install", "-q", str(src)], capture_output=True, text=True, timeout=900, cwd=tmp_path
    )
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    present = subprocess.run(
        [
            py,
            "-c",
            "import importlib.util as u, json, sys; print(json.dumps([m for m in sys.argv[1:] if u.find_spec(m)]))",
            *ABSENT,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(present.stdout) == [], present.stdout + present.stderr
    absent_parent = tmp_path / "runs" / "tiny-cpu"
    res = subprocess.run(
        [py, "-c", SCRIPT, "[]", json.dumps(_recipes(tiny_model, absent_parent, tiny_vlm))],
        cwd=tmp_path,  # the installed copy, not the checkout's
        capture_output=True,
        text=True,
        timeout=600,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    _each_recipe_planned_or_refused_in_a_paragraph(res, absent_parent)
