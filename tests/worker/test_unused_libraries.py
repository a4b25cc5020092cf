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
