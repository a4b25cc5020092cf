"""Every entry of every table ftrun keeps in one place, walked through the code that uses it.

One owner per table (docs/architecture.md): the GGUF types (launcher/gguf_types.py), the data formats
(launcher/data/formats.py), the run states (launcher/store/state.py), the copy destinations
(launcher/store/sync/kinds.py), the GPU catalog (launcher/plan/gpus.yaml, read by launcher/plan/hardware.py), the
methods and objectives (launcher/methods.py), the engines (launcher/engine_kinds.py), the trackers
(launcher/tracker_kinds.py) and the export formats (launcher/export_formats.py).
An entry added to a table without what its users need fails here, not in a user's run.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

# ---------------------------------------------------------------------------------------------
# GGUF types


def _gguf_types():
    from launcher import gguf_types

    return list(gguf_types.TYPES)


@pytest.mark.parametrize("name", _gguf_types())
def test_every_gguf_type_is_accepted_sized_checked_and_advised(name, tmp_path):
    from launcher import gguf_types
    from launcher.deliver import parity
    from launcher.recipe_loading import validate_recipe
    from launcher.run.smoke import gguf_bytes_per_param

    t = gguf_types.TYPES[name]
    recipe = validate_recipe(
        {"model": "Qwen/Qwen3-0.6B", "method": "lora", "data": "d.jsonl", "export": ["gguf"], "gguf_type": name},
        base_dir=tmp_path,
        default_name="t",
    )
    assert recipe.gguf_type == name
    assert 0 < gguf_types.bytes_per_param(name) <= 4 and gguf_bytes_per_param(name) >= gguf_types.bytes_per_param(name)
    assert t.converter in (None, "f16", "bf16", "f32") and isinstance(t.ftype, int)
    # the export's check has bounds for it, and a GGUF identical to its reference passes them
    tol = parity.TOLERANCE[f"gguf:{name}"]
    assert set(tol) == {"max_kl", "min_top1", "max_ppl", "min_greedy"}
    import torch

    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    same = [{"logits": logits, "ids": [1, 2, 3, 4, 5], "greedy": [1, 2]}]
    assert parity.compare(same, same, f"gguf:{name}")["ok"]
    higher = gguf_types.advised_above(name)
    assert higher is None or gguf_types.TYPES[higher].bits > t.bits


def test_the_gguf_help_and_the_recipe_list_every_type():
    from launcher import gguf_types
    from launcher.recipe import Recipe

    help_text = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "export", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    ).stdout
    description = Recipe.model_fields["gguf_type"].description
    for name in gguf_types.TYPES:
        assert name in " ".join(help_text.split()) and name in description


# ---------------------------------------------------------------------------------------------
# Data formats: one valid record per format, here; a format without one fails the first test

RECORDS = {
    "messages": {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]},
    "sharegpt": {"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]},
    "prompt_completion": {"prompt": "Hi?", "completion": "Hello."},
    "alpaca": {"instruction": "Greet.", "input": "", "output": "Hello."},
    "text": {"text": "Hello."},
    "preference": {"prompt": "Hi?", "chosen": "Hello.", "rejected": "Go away."},
    "unpaired": {"prompt": "Hi?", "completion": "Go away.", "label": False},
    "unpaired_messages": {
        "messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Go away."}],
        "label": False,
    },
    "preference_implicit": {
        "chosen": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}],
        "rejected": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "No."}],
    },
    "prompt": {"prompt": [{"role": "user", "content": "Hi?"}], "reference": "Hello."},
    "sharegpt_preference": {
        "conversations": [{"from": "human", "value": "Hi?"}],
        "chosen": {"from": "gpt", "value": "Hello."},
        "rejected": {"from": "gpt", "value": "Go away."},
    },
    "alpaca_preference": {"instruction": "Greet.", "input": "", "chosen": "Hello.", "rejected": "Go away."},
}


def test_every_data_format_has_a_record_here():
    from launcher.data.formats import FORMATS

    assert set(RECORDS) == set(FORMATS)


@pytest.mark.parametrize("name", list(RECORDS))
def test_every_data_format_is_detected_converted_and_accepted(name, tmp_path):
    from launcher.data import formats
    from launcher.recipe_loading import validate_recipe
    from launcher.recipe_sections import DataSource

    record = RECORDS[name]
    assert formats.detect_one(record) == name  # the table's keys and order tell it apart from the others
    assert formats.detect([("line 1", record)]) == (name, None)
    example = formats.convert(record, name)
    assert formats.FORMS[formats.form(name)].marker in example
    assert formats.example_form(example) == formats.form(name)
    recipe = validate_recipe(
        {"model": "Qwen/Qwen3-0.6B", "method": "lora", "data": {"path": "d.jsonl", "format": name}},
        base_dir=tmp_path,
        default_name="t",
    )
    assert recipe.data[0].format == name if isinstance(recipe.data, list) else recipe.data.format == name
    assert name in DataSource.model_fields["format"].description
    assert formats.describe(name) and formats.example(name)
    # a record in no format names every format's keys
    _, why = formats.detect([("line 1", {"nothing": 1})])
    assert " + ".join(formats.FORMATS[name].keys) in why


def test_a_bad_record_shows_its_formats_example_line(tmp_path):
    from launcher.data.dataset import load_data
    from launcher.data.formats import FORMATS
    from launcher.errors import DataError

    for name, fmt in FORMATS.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps({"unrelated": 1}) + "\n")
        with pytest.raises(DataError) as err:
            load_data({"path": str(path), "format": name})
        assert fmt.example in err.value.fix


# ---------------------------------------------------------------------------------------------
# Run states


def _states():
    from launcher.store.state import STATES

    return list(STATES)


@pytest.mark.parametrize("state", _states())
def test_every_run_state_is_recorded_and_shown(state, tmp_path):
    from launcher.run import facts, summary_view, views
    from launcher.store.rundir import RunDir
    from launcher.store.state import ACTIVE, ENDED, STATES, TRAINED, read_state, set_state

    assert state in STATES
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.recipe.write_text("model: x\n")
    set_state(run, state, reason="a reason")
    assert read_state(run)["state"] == state
    s = facts.run_status(run)
    text = views.format_status(s)
    assert state in text or (state in ACTIVE and s["state"] == "interrupted")  # no process holds this test's run
    if state in ENDED:
        assert state in summary_view.ENDING  # how its end is headed
        assert summary_view.format_end_summary(facts.end_summary(run)).startswith(
            f"== run {summary_view.ENDING[state]}"
        )
    assert not (set(ACTIVE) & set(ENDED)) and set(TRAINED) <= set(ENDED)


def test_every_worker_exit_is_worded_once_for_the_smoke_test_and_the_supervisor():
    from launcher.errors import WORKER_EXITS
    from launcher.run import smoke, supervisor
    from launcher.worker import exits

    for code, e in WORKER_EXITS.items():
        assert smoke.REASONS[code] == (e.what, e.fix)
        assert supervisor.FATAL.get(code) == (None if e.restart else f"{e.what}; {e.fix}")
    assert {exits.EXIT_OOM, exits.EXIT_NAN, exits.EXIT_BAD_WORLD, exits.EXIT_DISK_FULL} <= set(supervisor.FATAL)


# ---------------------------------------------------------------------------------------------
# Copy destinations


def _kinds():
    from launcher.store.sync.kinds import KINDS

    return [k.name for k in KINDS]


@pytest.mark.parametrize("name", _kinds())
def test_every_copy_destination_is_chosen_by_its_example_and_named_in_the_recipe(name):
    from launcher.recipe_sections import SyncSettings
    from launcher.store.sync.base import Destination
    from launcher.store.sync.kinds import KINDS, kind_of

    kind = next(k for k in KINDS if k.name == name)
    assert kind_of(kind.example) is kind
    # each kind proves a copy its own way (kind.verification says how): it overrides the read-back of the interface
    assert issubclass(kind.cls, Destination) and kind.cls.verify_dir is not Destination.verify_dir
    assert kind.verification
    for form in kind.forms:
        assert form in SyncSettings.model_fields["to"].description


def test_a_destination_no_kind_takes_is_refused_with_every_form():
    from launcher.errors import SyncError
    from launcher.store.sync.kinds import KINDS, destination

    with pytest.raises(SyncError) as err:
        destination("not a destination")
    for kind in KINDS:
        for form in kind.forms:
            assert form in err.value.fix


# ---------------------------------------------------------------------------------------------
# The GPU catalog


def _gpus():
    from launcher.plan.hardware import catalog

    return list(catalog())


@pytest.mark.parametrize("name", _gpus())
def test_every_catalog_gpu_is_found_by_name_and_planned_for(name):
    from launcher.plan.hardware import catalog, from_spec
    from launcher.plan.models import from_catalog
    from launcher.plan.plan import plan_for
    from launcher.recipe_loading import validate_recipe

    hw = from_spec(f"2x{name}")
    assert hw.count == 2 and hw.gpu.name == catalog()[name].name and hw.gpu.memory_gb > 0
    recipe = validate_recipe(
        {"model": "Qwen/Qwen3-0.6B", "data": "d.jsonl", "method": "lora"}, base_dir=REPO, default_name="t"
    )
    plan = plan_for(recipe, hw, tokens=1e6, arch=from_catalog("Qwen/Qwen3-0.6B"), allow_network=False)
    assert plan.to_dict()["gpus"]


# ---------------------------------------------------------------------------------------------
# Methods and objectives (launcher/methods.py)


def _methods():
    from launcher.methods import METHODS

    return list(METHODS)


@pytest.mark.parametrize("name", _methods())
def test_every_method_is_accepted_sized_planned_saved_and_named(name):
    from launcher.methods import METHODS
    from launcher.plan import sizing
    from launcher.plan import throughput
    from launcher.plan.hardware import from_spec
    from launcher.plan.models import from_catalog
    from launcher.plan.plan import plan_for
    from launcher.recipe import Recipe
    from launcher.recipe_loading import validate_recipe
    from launcher.store import final

    m = METHODS[name]
    recipe = validate_recipe(
        {"model": "Qwen/Qwen3-0.6B", "data": "d.jsonl", "method": name}, base_dir=REPO, default_name="t"
    )
    assert recipe.method == name and f"{name} ({m.help})" in Recipe.model_fields["method"].description
    arch = from_catalog("Qwen/Qwen3-0.6B")
    est = sizing.memory(arch, sizing.Workload(name, 512, 1, True, 16, "all-linear", "trl", 1, "cuda"))
    assert ("adapters" in est.breakdown_gb) == m.adapter and ("optimizer" in est.breakdown_gb) != m.adapter
    assert est.trainable_params == (arch.lora_params(16, "all-linear") if m.adapter else arch.params)
    assert final.kind(name) == (final.ADAPTER if m.adapter else final.MODEL)
    assert m.title and throughput.MFU[name] == m.mfu
    plan = plan_for(recipe, from_spec("1xH100-80GB"), tokens=1e6, arch=arch, allow_network=False).to_dict()
    assert plan["fits"], plan
    if m.lighter:
        lighter = METHODS[m.lighter]
        assert m.lighter_by in Recipe.model_fields["auto_adjust"].annotation.__args__[0].__args__
        smaller = sizing.memory(arch, sizing.Workload(m.lighter, 512, 1, True, 16, "all-linear", "trl", 1, "cuda"))
        assert smaller.per_gpu_gb < est.per_gpu_gb and lighter.adapter == m.adapter


def test_every_objective_names_a_trainer_and_configuration_of_the_installed_trl():
    from launcher.recipe_sections import SECTIONS

    from launcher.data import formats
    from launcher.methods import OBJECTIVES

    from launcher.methods import trl_class

    assert "sft" in OBJECTIVES
    forms = {f.form for f in formats.FORMATS.values()}
    for o in OBJECTIVES.values():
        assert callable(trl_class(o.name, "trainer")) and callable(trl_class(o.name, "config")), o
        assert set(o.forms) <= forms and o.sequences_per_example >= 1
        config = {f.name for f in __import__("dataclasses").fields(trl_class(o.name, "config"))}
        # the keys of its recipe section that it passes on (the reference's source and where answers are generated
        # are ftrun's choices, made with other fields)
        assert {k for k in o.settings if k not in ("reference", "generation")} <= config
        assert o.section in ("", *SECTIONS) and bool(o.settings) == bool(o.section)
    assert {f for o in OBJECTIVES.values() for f in o.forms} == forms  # every form trains under some objective


@pytest.mark.parametrize("name", list(__import__("launcher.methods").methods.OBJECTIVES))
def test_every_objective_is_accepted_and_planned(name):
    from launcher.methods import OBJECTIVES
    from launcher.plan.hardware import from_spec
    from launcher.plan.models import from_catalog
    from launcher.plan.plan import plan_for
    from launcher.recipe import Recipe
    from launcher.recipe_loading import validate_recipe

    recipe = validate_recipe(
        {"model": "Qwen/Qwen3-0.6B", "data": "d.jsonl", "method": "lora", "objective": name},
        base_dir=REPO,
        default_name="t",
    )
    assert f"{name} ({OBJECTIVES[name].help})" in Recipe.model_fields["objective"].description
    plan = plan_for(recipe, from_spec("1xH100-80GB"), tokens=1e6, arch=from_catalog("Qwen/Qwen3-0.6B"))
    assert plan.fits and plan.to_dict()["engine"] == ("unsloth" if OBJECTIVES[name].unsloth else "trl")
    why = "\n".join(plan.reasons)
    assert ("generation:" in why) == OBJECTIVES[name].generates
    assert ("generation" in plan.to_dict()["memory"]["breakdown_gb"]) == OBJECTIVES[name].generates


# ---------------------------------------------------------------------------------------------
# Engines (launcher/engine_kinds.py)


def _engines():
    from launcher.engine_kinds import ENGINES

    return list(ENGINES)


@pytest.mark.parametrize("name", _engines())
def test_every_engine_is_accepted_planned_and_launched_with_its_config_file(name, tmp_path):
    from launcher.engine_kinds import ENGINES
    from launcher.plan.hardware import from_spec
    from launcher.plan.models import from_catalog
    from launcher.plan.plan import plan_for
    from launcher.recipe import Recipe
    from launcher.recipe_loading import validate_recipe
    from launcher.worker.engines import launch_command

    e = ENGINES[name]
    assert name in Recipe.model_fields["engine"].description
    recipe = validate_recipe(
        {"model": "Qwen/Qwen3-0.6B", "data": "d.jsonl", "method": "lora", "engine": name},
        base_dir=REPO,
        default_name="t",
    )
    plan = plan_for(
        recipe, from_spec("2xH100-80GB"), tokens=1e6, arch=from_catalog("Qwen/Qwen3-0.6B"), allow_network=False
    ).to_dict()
    assert plan["engine"] == name and (int(plan["num_processes"]) > 1) == e.multi_process
    (tmp_path / "recipe.yaml").write_text("model: x\n")
    argv = launch_command(plan, tmp_path, "full")
    module = {
        "python": "launcher.worker.train",
        "torchrun": "torch.distributed.run",
        "accelerate": "accelerate.commands.launch",
    }[e.launcher]
    assert argv[2] == module, argv
    written = sorted(p.name for p in tmp_path.iterdir() if p.name != "recipe.yaml")
    assert written == ([e.config_file] if e.config_file else [])


# ---------------------------------------------------------------------------------------------
# Trackers (launcher/tracker_kinds.py)


def test_every_tracker_is_accepted_and_installed_by_the_extra_or_with_training():
    import tomllib

    from launcher.recipe import Recipe
    from launcher.recipe_loading import validate_recipe
    from launcher.tracker_kinds import TRACKERS

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installed_by = {
        req.split(">")[0].split("=")[0].split("[")[0].strip(): extra for extra, reqs in extras.items() for req in reqs
    }
    for t in TRACKERS.values():
        recipe = validate_recipe(
            {"model": "m", "data": "d.jsonl", "method": "lora", "report_to": [t.name]}, base_dir=REPO, default_name="t"
        )
        assert recipe.report_to == [t.name] and t.name in Recipe.model_fields["report_to"].description
        assert installed_by.get(t.package) in ("trackers", "train"), (t.package, installed_by)
    assert {p for p, extra in installed_by.items() if extra == "trackers"} <= {t.package for t in TRACKERS.values()}


def test_a_missing_tracker_is_refused_with_its_package(monkeypatch):
    from types import SimpleNamespace

    from launcher.errors import RecipeError
    from launcher.tracker_kinds import TRACKERS
    from launcher.worker import trackers

    # as on a box without any of them (the slow tier installs the `trackers` extra)
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name, *a, **k: None)
    absent = [t for t in TRACKERS if t != "tensorboard"]
    assert trackers.missing(absent) == absent
    with pytest.raises(RecipeError) as err:
        trackers.check_installed(SimpleNamespace(report_to=absent))
    assert all(TRACKERS[t].package in err.value.fix for t in absent)


# ---------------------------------------------------------------------------------------------
# Export formats (launcher/export_formats.py)


def test_every_export_format_is_accepted_ordered_and_estimated():
    from launcher.deliver import export_inputs
    from launcher.export_formats import FORMATS, made
    from launcher.recipe import Recipe
    from launcher.recipe_loading import validate_recipe
    from launcher.run.smoke import export_seconds

    assert export_inputs.FORMATS == tuple(FORMATS)
    for f in FORMATS.values():
        recipe = validate_recipe(
            {"model": "m", "data": "d.jsonl", "method": "lora", "export": [f.name]}, base_dir=REPO, default_name="t"
        )
        assert f.name in Recipe.model_fields["export"].description
        assert made([f.name]) == tuple(n for n in FORMATS if n == f.name or n in f.needs)
        measured = {"import_seconds": 1.0, "load_seconds": 1.0, "checkpoint_bytes": 1e6, "checkpoint_seconds": 1.0}
        assert export_seconds(measured, recipe, 10**6) > 0


# ---------------------------------------------------------------------------------------------
# One owner: a table's names and values are written in its owner alone


# A value only the table's owner may write, and the owner (another product module writing it is a copy).
OWNED = {
    '("qlora", "lora")': "launcher/methods.py",
    '("lora", "qlora")': "launcher/methods.py",
    '("full", "full-8bit")': "launcher/methods.py",
    '"full fine-tuning with 8-bit AdamW"': "launcher/methods.py",
    '("fsdp", "deepspeed")': "launcher/engine_kinds.py",
    '("ddp", "fsdp", "deepspeed")': "launcher/engine_kinds.py",
    '"accelerate_fsdp.yaml"': "launcher/engine_kinds.py",
    '"deepspeed.json"': "launcher/engine_kinds.py",
    '"mlflow-skinny"': "launcher/tracker_kinds.py",
    '"tensorboard", "wandb"': "launcher/tracker_kinds.py",
    '["adapter", "merged", "gguf"]': "launcher/export_formats.py",
}


def test_no_product_module_copies_a_table():
    copies = []
    for path in sorted((REPO / "launcher").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        text = path.read_text(encoding="utf-8")
        copies += [
            f"{rel}: {value} (owner {owner})" for value, owner in OWNED.items() if value in text and rel != owner
        ]
    assert not copies, "\n".join(copies)


def test_every_method_engine_and_tracker_is_documented():
    from launcher.engine_kinds import ENGINES
    from launcher.methods import METHODS
    from launcher.tracker_kinds import TRACKERS

    docs = {"docs/sizing.md": METHODS, "docs/engines.md": ENGINES, "docs/tracking.md": TRACKERS}
    missing = [
        f"{doc}: {name}"
        for doc, table in docs.items()
        for name in table
        if f"`{name}`" not in (REPO / doc).read_text(encoding="utf-8")
        and f" {name} " not in (REPO / doc).read_text(encoding="utf-8")
    ]
    assert not missing, missing


def test_the_sizing_docs_method_rows_hold_the_tables_bytes():
    from launcher.methods import METHODS

    text = (REPO / "docs/sizing.md").read_text(encoding="utf-8")
    for m in METHODS.values():
        row = next(line for line in text.splitlines() if line.startswith(f"| `{m.name}` |"))
        assert f"| {m.weight_bytes} + {m.gradient_bytes} + {m.optimizer_bytes} = {m.trained_bytes} | {m.mfu} |" in row


# ---------------------------------------------------------------------------------------------
# GRPO's reward kinds (launcher/data/rewards.py KINDS): each one's value in the recipe, and what the walk needs beside
# it (a reward function's file). A kind added to the table without a row here fails the first test.
REWARD_VALUES = {
    "metric": ("exact", None),
    "function": (
        "rewards.py:score",
        "def score(prompts, completions, reference, **kwargs):\n"
        "    return [float(c[0]['content'].strip() == r) for c, r in zip(completions, reference)]\n",
    ),
}


def test_every_reward_kind_has_a_value_here():
    from launcher.data.rewards import KINDS
    from launcher.recipe_sections import RewardSpec

    assert set(REWARD_VALUES) == set(KINDS)
    assert [k for k in RewardSpec.model_fields if k not in ("weight", "scores")] == list(KINDS)


@pytest.mark.parametrize("key", list(REWARD_VALUES))
def test_every_reward_kind_is_accepted_probed_built_and_worded(key, write_recipe, tmp_path):
    from launcher.data import rewards
    from launcher.data.dataset import load_data
    from launcher.data.stats import data_stats
    from launcher.plan.sampling import _reward_words
    from launcher.recipe_loading import load_recipe

    value, source = REWARD_VALUES[key]
    if source:
        (tmp_path / value.split(":")[0]).write_text(source)
    data = tmp_path / "math.jsonl"
    pairs = [(f"What is {a} plus {b}?", str(a + b)) for a, b in [(2, 3), (4, 4), (7, 5), (9, 1), (6, 8), (3, 3)] * 4]
    rows = [{"prompt": [{"role": "user", "content": q}], "reference": a} for q, a in pairs]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = load_recipe(
        write_recipe(
            objective="grpo",
            data=str(data),
            reward={key: value, "weight": 2},
            grpo={"num_generations": 4, "max_completion_length": 16},
        )
    )
    spec = recipe.rewards[0]
    kind = rewards.KINDS[key]
    assert spec.kind is kind and spec.value.endswith(value) and spec.name == kind.name(value)  # FILE.py resolved
    probed = data_stats(recipe)[2].rewards  # the plan's probe of the data
    assert len(probed) == 1 and probed[0].startswith("reward ")
    assert _reward_words(spec) == f"2 x {kind.words(spec.value)}"
    funcs, weights = rewards.build(recipe, rewards.prompt_rows(load_data(data, columns=True).examples))
    scores = funcs[0](
        prompts=["What is 2 plus 3?"] * 2,
        completions=[[{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "7"}]],
        reference=["5", "5"],
    )
    assert weights == [2.0] and scores[0] > scores[1]
