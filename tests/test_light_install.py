"""`pip install ftrun` without extras promises that plan, status and --help work (pyproject.toml's dependencies): every
shipped recipe plans with the training stack's packages absent, or is refused in one paragraph, never an internal
error (issue 46: a Hub dataset's plan ended in "ModuleNotFoundError: No module named 'datasets'")."""

from __future__ import annotations

import json
import subprocess
import sys

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


def test_every_shipped_recipe_plans_without_the_training_stack(tmp_path, tiny_model):
    # the demo's recipes name the model scripts/demo.sh builds (.cache/tiny-model, absent on a fresh clone): the
    # tests' own build of it stands in
    recipes = [
        [str(p), *([f"model={tiny_model}"] if "cache/tiny-model" in p.read_text() else [])]
        for p in sorted((REPO / "recipes").glob("*.yaml"))
    ]
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(ABSENT), json.dumps(recipes)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    said = json.loads(res.stdout.splitlines()[-1])
    for recipe, (code, text) in said.items():
        assert "internal error" not in text and "Traceback" not in text, (recipe, text[-2000:])
        if recipe.endswith(("tiny-cpu-dpo.yaml", "tiny-cpu-grpo.yaml")):  # their parent is the SFT demo's run, absent
            assert code == 2 and "init_from" in text, (recipe, text[-2000:])
            continue
        assert code == 0, (recipe, text[-2000:])
        assert "Plan: " in text, (recipe, text[-1000:])
