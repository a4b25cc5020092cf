"""Recipe validation: every problem reported at once, did-you-mean, overrides, path resolution."""

import re
from pathlib import Path

import pytest
import yaml

from launcher.errors import RecipeError, UsageError
from helpers import stand_in_adapter
from launcher.recipe_loading import load_recipe, parse_overrides


def _write(tmp_path: Path, data: dict, name="r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


BASE = {"model": "Qwen/Qwen3-8B", "method": "qlora", "data": "train.jsonl"}


def test_minimal_recipe_gets_defaults_and_resolves_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    r = load_recipe(_write(tmp_path / "recipes", BASE))
    assert r.model == "Qwen/Qwen3-8B"  # a Hub id stays a Hub id
    assert r.data == str(tmp_path / "recipes" / "train.jsonl")  # relative to the recipe's folder
    assert r.output_dir == str(tmp_path / "runs" / "r")  # default: runs/<recipe name> here
    assert r.checkpoint_every_minutes == 20 and r.lora.r == 16 and r.lora.target_modules == "all-linear"
    assert r.smoke.fraction == 0.01 and r.engine == "auto" and r.resume == "auto"


def test_local_model_dir_resolves_against_recipe_folder(tmp_path):
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    r = load_recipe(_write(tmp_path, {**BASE, "model": "models/tiny"}))
    assert r.model == str(tmp_path / "models" / "tiny")


def test_all_errors_at_once_with_did_you_mean(tmp_path):
    bad = {**BASE, "method": "qlra", "lerning_rate": 1e-4, "micro_batch_size": 0, "lora": {"rr": 8}, "epochs": "x"}
    with pytest.raises(RecipeError) as err:
        load_recipe(_write(tmp_path, bad))
    text = err.value.render()
    assert "5 problems" in text
    assert "unknown key 'lerning_rate' (did you mean 'learning_rate'?)" in text
    assert "unknown key 'lora.rr' (did you mean 'lora.r'?)" in text
    assert "'method' = 'qlra'" in text and "'qlora', 'lora', 'full' or 'full-8bit'" in text
    assert "'micro_batch_size' = 0: Input should be greater than 0" in text
    assert "'epochs' = 'x'" in text
    assert "Fix:" in text


def test_missing_required_key_names_it(tmp_path):
    with pytest.raises(RecipeError, match=r"'data' is required: The training data"):
        load_recipe(_write(tmp_path, {"model": "m/x", "method": "lora"}))


def test_trainer_keys_owned_by_recipe_are_refused(tmp_path):
    with pytest.raises(RecipeError, match=r"trainer.num_train_epochs -> epochs"):
        load_recipe(_write(tmp_path, {**BASE, "trainer": {"num_train_epochs": 2}}))


def test_overrides_take_precedence_over_recipe(tmp_path):
    p = _write(tmp_path, {**BASE, "max_steps": 100, "lora": {"r": 32, "alpha": 64}})
    r = load_recipe(p, ["max_steps=20", "lora.r=8", "smoke.enabled=false", "learning_rate=1e-5"])
    assert r.max_steps == 20 and r.lora.r == 8 and r.lora.alpha == 64
    assert r.smoke.enabled is False and r.learning_rate == 1e-5


def test_override_with_unknown_key_is_an_error(tmp_path):
    with pytest.raises(RecipeError, match=r"unknown key 'max_step' \(did you mean 'max_steps'\?\)"):
        load_recipe(_write(tmp_path, BASE), ["max_step=3"])


@pytest.mark.parametrize(
    "pair, says",
    [("max_steps", "write max_steps=VALUE"), ("=3", "no key before '='"), ("lora.=3", "'lora.' is not a key")],
)
def test_malformed_override(pair, says):
    with pytest.raises(UsageError, match=f"'{re.escape(pair)}' is neither an option nor a key=value override.*{says}"):
        parse_overrides([pair])


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


def test_invalid_yaml_names_the_line(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("model: x\nmethod: [lora\n")
    with pytest.raises(RecipeError, match=r"not valid YAML at line \d+"):
        load_recipe(p)


def test_recipe_must_be_a_mapping(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="must be a mapping"):
        load_recipe(p)


def test_trajectory_hash_ignores_operational_settings(tmp_path):
    p = _write(tmp_path, BASE)
    a = load_recipe(p)
    b = load_recipe(p, ["checkpoint_every_minutes=5", "keep_checkpoints=4"])
    c = load_recipe(p, ["learning_rate=1e-3"])
    assert a.trajectory_hash() == b.trajectory_hash() != c.trajectory_hash()


def test_every_shipped_recipe_parses(tmp_path):
    """On a fresh clone too: a recipe continuing an earlier run (init_from) gets a stand-in of that run's adapter, as
    no demo has run there (tests/plan/test_recipes_plan.py checks the refusal without one)."""
    recipes = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))
    assert recipes, "no recipes shipped"
    for path in recipes:
        parent = yaml.safe_load(path.read_text()).get("init_from")
        overrides = [f"init_from={stand_in_adapter(tmp_path / path.stem / Path(parent).name)}"] if parent else []
        load_recipe(path, overrides)
