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


@pytest.mark.parametrize(
    "objective, key, use",
    [
        ("grpo", "num_generations", "grpo.num_generations"),
        ("grpo", "max_completion_length", "grpo.max_completion_length"),
        ("grpo", "temperature", "grpo.temperature"),
        ("grpo", "beta", "grpo.beta"),
        ("grpo", "use_vllm", "grpo.generation"),
        ("grpo", "reward_weights", "each reward's weight"),
        ("dpo", "loss_type", "preference.loss_type"),
        ("sft", "activation_checkpointing", "gradient_checkpointing"),  # transformers 5.24's name for it
        ("grpo", "activation_checkpointing", "gradient_checkpointing"),
    ],
)
def test_a_trl_field_ftrun_sets_is_refused_under_trainer_with_the_recipe_key(tmp_path, objective, key, use):
    recipe = {**BASE, "method": "lora", "objective": objective, "trainer": {key: 1}}
    with pytest.raises(RecipeError) as err:
        load_recipe(_write(tmp_path, recipe))
    assert f"trainer.{key} -> " in err.value.message and use in err.value.message


def test_a_trl_field_another_objective_owns_stays_the_users(tmp_path):
    """SFTConfig's loss_type (nll, dft) is not ftrun's: DPO's is (preference.loss_type)."""
    assert load_recipe(_write(tmp_path, {**BASE, "trainer": {"loss_type": "dft"}})).trainer == {"loss_type": "dft"}


# Fields trainer_config sets that trainer: may still change: they shape no plan figure nor the trajectory
LEFT_TO_TRAINER = {
    "dataloader_num_workers",  # data loading processes (0: the examples are in memory)
    "disable_tqdm",  # TRL's progress bar (ftrun prints its own step lines)
    "save_only_model",  # ftrun saves its checkpoints itself (save_strategy "no", owned)
    "ddp_timeout",  # the process group's timeout: trainer.ddp_timeout wins on purpose (process_group_seconds)
    "run_name",  # a tracker's run name (launcher/worker/trackers.py reads trainer.run_name)
    "project",
}


@pytest.mark.parametrize("objective", ["sft", "dpo", "orpo", "grpo"])
def test_every_field_ftrun_sets_in_trls_configuration_is_in_the_owned_table(tmp_path, monkeypatch, objective):
    """The one table (launcher/recipe.py OWNED_TRAINER_KEYS, OBJECTIVE_TRAINER_KEYS) walked against what
    launcher/worker/trainer_config.py passes TRL's configuration for each objective."""
    import torch

    from launcher.methods import trl_class
    from launcher.recipe import owned_trainer_key
    from launcher.store.rundir import RunDir
    from launcher.worker import trainer_config as tc

    real = trl_class(objective, "config")
    passed: dict = {}

    class Capture(real):  # the configuration's own fields (trainer_config keeps those), its arguments captured
        def __new__(cls, **fields):
            passed.update(fields)
            return None

    monkeypatch.setattr(tc, "trl_class", lambda objective, what: Capture)
    data = tmp_path / "d.jsonl"
    data.write_text("")
    recipe = load_recipe(
        _write(tmp_path, {**BASE, "method": "lora", "objective": objective, "output_dir": str(tmp_path / "run")})
    )
    (tmp_path / "run").mkdir()
    tc.trainer_config(recipe, RunDir(tmp_path / "run"), "full", "cpu", torch.float32, 10, tmp_path / "out")
    assert passed, "trainer_config passed TRL's configuration nothing"
    unowned = sorted(k for k in passed if not owned_trainer_key(k, objective) and k not in LEFT_TO_TRAINER)
    assert not unowned, f"fields ftrun sets for {objective} that trainer: could set again: {unowned}"


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
