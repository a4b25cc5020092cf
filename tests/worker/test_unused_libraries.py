"""launcher/worker/unused_libraries.py: the libraries a run has installed but never calls stay out of its imports
(bitsandbytes outside qlora, full-8bit, a trainer: section, a quantized checkpoint and Unsloth; wandb where report_to
does not name it); the real worker checked by the import profile Python writes for it (PYTHONPROFILEIMPORTTIME)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from helpers import ftrun
from launcher.worker.unused_libraries import unused


@pytest.mark.parametrize(
    "method, engine, expected",
    [
        ("lora", "trl", ("bitsandbytes",)),
        ("full", "ddp", ("bitsandbytes",)),
        ("lora", "fsdp", ("bitsandbytes",)),
        ("qlora", "trl", ()),  # the 4-bit base
        ("full-8bit", "trl", ()),  # the 8-bit AdamW
        ("lora", "unsloth", ()),  # Unsloth imports it itself
    ],
)
def test_bitsandbytes_is_left_out_only_where_nothing_calls_it(tiny_model, method, engine, expected):
    assert unused(_recipe(tiny_model, method), engine) == (*expected, "wandb")


def _recipe(model, method="lora", report_to=("tensorboard",), trainer=None):
    return SimpleNamespace(model=str(model), method=method, report_to=list(report_to), trainer=trainer or {})


def test_a_trainer_section_keeps_bitsandbytes_for_the_optimizers_it_may_name(tiny_model):
    assert unused(_recipe(tiny_model, trainer={"optim": "paged_adamw_8bit"}), "trl") == ("wandb",)


def test_wandb_is_left_out_unless_report_to_names_it(tiny_model):
    assert unused(_recipe(tiny_model, report_to=["tensorboard", "wandb"]), "trl") == ("bitsandbytes",)
    assert unused(_recipe(tiny_model, report_to=["none"]), "trl") == ("bitsandbytes", "wandb")


def test_a_checkpoint_saved_quantized_or_not_read_keeps_bitsandbytes(tmp_path, tiny_model):
    quantized = tmp_path / "bnb-4bit"
    quantized.mkdir()
    cfg = json.loads((tiny_model / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantized / "config.json").write_text(json.dumps(cfg))
    assert unused(_recipe(quantized), "trl") == ("wandb",)
    (quantized / "config.json").write_text("{not json")
    assert unused(_recipe(quantized), "trl") == ("wandb",)
    assert unused(_recipe(tmp_path / "not-there"), "trl") == ("wandb",)


# wandb comes with the trackers extra, which .ci/run installs for the slow tier only: there the same run checks it
@pytest.mark.parametrize("tier", ["default", pytest.param("slow", marks=pytest.mark.slow)])
def test_a_lora_run_trains_without_importing_bitsandbytes_or_wandb(write_recipe, tmp_path, tier):
    """The whole worker, start to end: PEFT imports bitsandbytes at its import and again when it wraps the layers
    (get_peft_model's dispatchers), TRL wandb with its trainers; none of it happens, and the run trains. Every module
    Python imports for the worker is in its import profile, so a module of either there would be one it loaded."""
    import importlib.util

    assert importlib.util.find_spec("bitsandbytes"), "bitsandbytes is one of ftrun's dependencies (pyproject.toml)"
    if tier == "slow" and not importlib.util.find_spec("wandb"):
        pytest.skip("wandb is not installed here (the trackers extra): nothing to leave unimported")
    recipe = write_recipe(max_steps=2)
    res = ftrun(recipe, "--foreground", "smoke.enabled=false", cwd=tmp_path, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    log = (tmp_path / "run" / "train.log").read_text()
    imported = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", log, flags=re.M)
    assert "peft.tuners.lora.model" in imported and "trl.trainer.base_trainer" in imported  # the profile is there
    assert not [m for m in imported if m.startswith(("bitsandbytes.", "peft.tuners.lora.bnb", "wandb."))]
    assert "[ftrun worker] step 2/2" in log


def test_the_base_models_scoring_leaves_bitsandbytes_out_whatever_the_method(tiny_model, tmp_path):
    """It loads the base in 16 bits (launcher/worker/task_eval.py load_base), a QLoRA recipe's too."""
    from launcher.worker.unused_libraries import unused_when_scoring

    assert unused_when_scoring(_recipe(tiny_model, "qlora")) == ("bitsandbytes", "wandb")
    assert unused_when_scoring(_recipe(tmp_path / "not-there", "lora")) == ("wandb",)  # not read: kept


@pytest.mark.slow
def test_the_base_models_scoring_from_a_parent_adapter_prints_no_library_notice(write_recipe, reference_run):
    """`ftrun baseline` under init_from: the base phase (launcher/worker/task_eval.py) loads the base and merges the
    parent adapter with PEFT, which imported bitsandbytes ("Failed to load CPU gemm_4bit_forward ... 'kernels'") and
    read transformers' deprecated is_gradient_checkpointing (a FutureWarning) on every run. The phase's own start,
    in a process of its own as the launch runs it, up to the loaded model."""
    import subprocess
    import sys

    from conftest import REPO

    recipe = write_recipe(init_from=str(reference_run))
    script = (
        "import sys, warnings; warnings.simplefilter('default');"
        "from launcher.recipe_loading import load_recipe; from launcher.notices import quiet_scoring_notices;"
        "from launcher.worker.unused_libraries import keep_out, unused_when_scoring;"
        f"recipe = load_recipe({str(recipe)!r}); keep_out(unused_when_scoring(recipe)); quiet_scoring_notices();"
        "from launcher.worker.task_eval import load_base; load_base(recipe);"
        "print('bitsandbytes' in sys.modules and sys.modules['bitsandbytes'] is not None)"
    )
    res = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("False")  # never imported
    assert "kernels" not in res.stderr and "FutureWarning" not in res.stderr, res.stderr
