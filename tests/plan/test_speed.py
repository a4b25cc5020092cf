"""The plan's use of spare memory (launcher/plan/speed.py): faster settings only for keys the recipe leaves out, kept
by a resume, undone first by an out of memory, and carried to the worker through the run's recipe.yaml."""

from __future__ import annotations

import yaml

from launcher.plan.hardware import catalog_box
from launcher.plan.plan import make_plan
from launcher.recipe_loading import validate_recipe
from launcher.run.adjustments import next_adjustment, with_adjustments, with_plan_settings
from launcher.store.rundir import RunDir


def _recipe(tmp_path, **keys):
    base = {
        "model": "Qwen/Qwen3-8B",
        "method": "lora",
        "data": "train.jsonl",
        "tokens": 15_000_000,
        "output_dir": str(tmp_path / "run"),
    }
    return validate_recipe({**base, **keys}, tmp_path, "r", source="test")


def test_h200_lora_turns_checkpointing_off_and_grows_the_micro_batch(tmp_path):
    p = make_plan(_recipe(tmp_path), catalog_box("H200", 1), tokens=15_000_000)
    assert p.speed["set"]["gradient_checkpointing"] is False
    assert p.micro_batch_size > 2 and p.micro_batch_size * p.gradient_accumulation_steps == 8
    assert any(r.startswith("gradient checkpointing off") and "more time per token" in r for r in p.reasons)
    slow = make_plan(
        _recipe(tmp_path, gradient_checkpointing=True, micro_batch_size=2, gradient_accumulation_steps=4),
        catalog_box("H200", 1),
        tokens=15_000_000,
    )
    assert slow.speed is None and slow.micro_batch_size == 2  # given keys are honoured
    assert p.tokens["estimated_tokens_per_second"] > 1.4 * slow.tokens["estimated_tokens_per_second"]


def test_rtx4090_qlora_keeps_checkpointing(tmp_path):
    p = make_plan(_recipe(tmp_path, method="qlora", engine="trl"), catalog_box("RTX4090", 1), tokens=15_000_000)
    assert "gradient_checkpointing" not in (p.speed or {}).get("set", {})


def test_cpu_keeps_the_recipe(tmp_path):
    from launcher.plan.hardware import from_spec

    p = make_plan(_recipe(tmp_path, model="Qwen/Qwen3-0.6B"), from_spec("cpu"), tokens=100_000)
    assert p.speed is None


def test_the_choice_reaches_recipe_yaml_a_resume_keeps_it_and_an_oom_undoes_it_first(tmp_path):
    recipe = _recipe(tmp_path)
    plan = make_plan(recipe, catalog_box("H200", 1), tokens=15_000_000).to_dict()
    chosen = with_plan_settings(recipe, plan)
    assert chosen.gradient_checkpointing is False and chosen.micro_batch_size == plan["micro_batch_size"]
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.recipe.write_text(yaml.safe_dump(chosen.snapshot()))  # as the launch writes it; the worker reads this
    # a resume on another box: the keys the recipe leaves out come from the run, so the trajectory is the same
    again = with_adjustments(run, _recipe(tmp_path))
    assert again.trajectory_hash() == chosen.trajectory_hash()
    update, text = next_adjustment(chosen, plan)
    assert update == {"gradient_checkpointing": True, "micro_batch_size": 2, "gradient_accumulation_steps": 4}
    assert "undone" in text
    back = chosen.model_copy(update=update)
    assert next_adjustment(back, plan)[0] == {"micro_batch_size": 1, "gradient_accumulation_steps": 8}
