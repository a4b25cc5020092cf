"""Every entry of every table ftrun keeps in one place, walked through the code that uses it.

One owner per table (docs/architecture.md): the GGUF types (launcher/gguf_types.py), the data formats
(launcher/data/formats.py), the run states (launcher/store/state.py), the copy destinations
(launcher/store/sync/kinds.py) and the GPU catalog (launcher/plan/gpus.yaml, read by launcher/plan/hardware.py).
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
    from launcher.recipe import validate_recipe
    from launcher.run.smoke import gguf_bytes_per_param

    t = gguf_types.TYPES[name]
    recipe = validate_recipe({"model": "Qwen/Qwen3-0.6B", "method": "lora", "data": "d.jsonl", "export": ["gguf"], "gguf_type": name},
                             base_dir=tmp_path, default_name="t")
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

    help_text = subprocess.run([sys.executable, "-m", "launcher.cli", "export", "--help"], capture_output=True,
                               text=True, cwd=REPO, timeout=120).stdout
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
}


def test_every_data_format_has_a_record_here():
    from launcher.data.formats import FORMATS

    assert set(RECORDS) == set(FORMATS)


@pytest.mark.parametrize("name", list(RECORDS))
def test_every_data_format_is_detected_converted_and_accepted(name, tmp_path):
    from launcher.data import formats
    from launcher.recipe import DataSource, validate_recipe

    record = RECORDS[name]
    assert formats.detect_one(record) == name  # the table's keys and order tell it apart from the others
    assert formats.detect([("line 1", record)]) == (name, None)
    example = formats.convert(record, name)
    assert {"chat": "messages", "prompt_completion": "prompt", "text": "text"}[formats.form(name)] in example
    recipe = validate_recipe({"model": "Qwen/Qwen3-0.6B", "method": "lora", "data": {"path": "d.jsonl", "format": name}},
                             base_dir=tmp_path, default_name="t")
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
    from launcher.run import views
    from launcher.store.rundir import RunDir
    from launcher.store.state import ACTIVE, ENDED, STATES, TRAINED, read_state, set_state

    assert state in STATES
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.recipe.write_text("model: x\n")
    set_state(run, state, reason="a reason")
    assert read_state(run)["state"] == state
    s = views.run_status(run)
    text = views.format_status(s)
    assert state in text or (state in ACTIVE and s["state"] == "interrupted")  # no process holds this test's run
    if state in ENDED:
        assert state in views.ENDING  # how its end is headed
        assert views.format_end_summary(views.end_summary(run)).startswith(f"== run {views.ENDING[state]}")
    assert not (set(ACTIVE) & set(ENDED)) and set(TRAINED) <= set(ENDED)


# ---------------------------------------------------------------------------------------------
# Copy destinations


def _kinds():
    from launcher.store.sync.kinds import KINDS

    return [k.name for k in KINDS]


@pytest.mark.parametrize("name", _kinds())
def test_every_copy_destination_is_chosen_by_its_example_and_named_in_the_recipe(name):
    from launcher.recipe import SyncSettings
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
    from launcher.recipe import validate_recipe

    hw = from_spec(f"2x{name}")
    assert hw.count == 2 and hw.gpu.name == catalog()[name].name and hw.gpu.memory_gb > 0
    recipe = validate_recipe({"model": "Qwen/Qwen3-0.6B", "data": "d.jsonl", "method": "lora"}, base_dir=REPO,
                             default_name="t")
    plan = plan_for(recipe, hw, tokens=1e6, arch=from_catalog("Qwen/Qwen3-0.6B"), allow_network=False)
    assert plan.to_dict()["gpus"]
