"""Preference tuning (objective dpo, orpo): the pairs' formats and their refusals, the recipe's keys, the plan's two
sequences and reference, and end to end on the tiny model: DPO from an SFT run's adapter, kill -9 + resume, a
precomputed reference. ORPO and the engines (DDP, ZeRO-3, full fine-tuning): tests/worker/test_preference_engines.py."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from helpers import (
    adapter_tensors,
    article_plan,
    freeze_worker,
    ftrun,
    metrics,
    polled_status,
    wait_for,
    wait_until_ended,
)

PAIRS = REPO / "recipes" / "data" / "tiny-pref.jsonl"
SAID = ("time", "tokens_per_second", "peak_memory_gb", "eval_seconds")  # wall-clock values


def _lines(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _turn(role: str, text: str) -> dict:
    return {"role": role, "content": text}


# ---------------------------------------------------------------------------------------------
# Formats (launcher/data/formats.py) and their refusals, with line numbers


def test_the_three_preference_formats_become_one_form(tmp_path):
    from launcher.data.dataset import load_data

    conversational = {
        "prompt": [_turn("user", "2+2?")],
        "chosen": [_turn("assistant", "4")],
        "rejected": [_turn("assistant", "5")],
    }
    standard = {"prompt": "2+2?", "chosen": "4", "rejected": "5"}
    implicit = {
        "chosen": [_turn("system", "Be brief."), _turn("user", "2+2?"), _turn("assistant", "4")],
        "rejected": [_turn("system", "Be brief."), _turn("user", "2+2?"), _turn("assistant", "5")],
    }
    got = {}
    for name, record in (("conv", conversational), ("std", standard), ("implicit", implicit)):
        data = load_data(_lines(tmp_path / f"{name}.jsonl", [record] * 3))
        assert data.form == "preference", name
        got[name] = data.examples[0]
    assert got["conv"] == conversational and got["std"] == standard
    # the implicit prompt is what both conversations share, up to the first answer
    assert got["implicit"] == {
        "prompt": implicit["chosen"][:2],
        "chosen": implicit["chosen"][2:],
        "rejected": implicit["rejected"][2:],
    }
    from launcher.data import formats

    # what the samples and the task evaluation score: the prompt and the chosen answer
    assert formats.conversation(got["conv"]) == conversational["prompt"] + conversational["chosen"]


@pytest.mark.parametrize(
    "bad, said",
    [
        ({"prompt": "2+2?", "chosen": "4", "rejected": "4"}, "the same answer"),
        ({"prompt": "2+2?", "chosen": "4", "rejected": " "}, "'rejected' is empty"),
        (
            {
                "prompt": [_turn("user", "2+2?")],
                "chosen": [_turn("assistant", "")],
                "rejected": [_turn("assistant", "5")],
            },
            "chosen[0] (assistant) has empty content",
        ),
        (
            {
                "prompt": [_turn("user", "2+2?")],
                "chosen": [_turn("assistant", "4")],
                "rejected": [_turn("user", "again"), _turn("assistant", "5")],
            },
            "the answer alone",
        ),
        ({"prompt": "2+2?", "chosen": [_turn("assistant", "4")], "rejected": "5"}, "all be strings"),
        (
            {
                "chosen": [_turn("user", "a"), _turn("assistant", "4")],
                "rejected": [_turn("user", "b"), _turn("assistant", "5")],
            },
            "share no first turn",
        ),
    ],
)
def test_a_bad_pair_is_refused_with_its_line(tmp_path, bad, said):
    from launcher.data.dataset import load_data
    from launcher.errors import DataError

    good = {
        "prompt": [_turn("user", "2+2?")],
        "chosen": [_turn("assistant", "4")],
        "rejected": [_turn("assistant", "5")],
    }
    if isinstance(bad.get("prompt"), str):
        good = {"prompt": "2+2?", "chosen": "4", "rejected": "5"}
    if "prompt" not in bad:
        good = {
            "chosen": [_turn("user", "q"), _turn("assistant", "4")],
            "rejected": [_turn("user", "q"), _turn("assistant", "5")],
        }
    path = _lines(tmp_path / "pairs.jsonl", [good, good, bad, good])
    with pytest.raises(DataError) as err:
        load_data(path)
    text = str(err.value)
    assert "pairs.jsonl line 3" in text and said in text, text


def test_pairs_from_the_hub_cache_a_mixture_and_eval_data(tmp_path, monkeypatch, write_recipe):
    """Pairs read like examples: a Hub dataset (through the HF cache, columns mapped), mixed by weight with a local
    file, and separate eval.data of pairs; the data check counts both sides of each pair."""
    import datasets

    from launcher.data.dataset import load_data
    from launcher.data.stats import data_stats
    from launcher.recipe_loading import load_recipe
    from helpers import make_hub_cache

    rows = [
        {
            "question": [_turn("user", f"Spell {w} backwards.")],
            "good": [_turn("assistant", w[::-1])],
            "bad": [_turn("assistant", w)],
        }
        for w in ("chair", "lamp", "table", "green")
    ]
    cache = make_hub_cache(tmp_path / "hf", "acme/prefs", rows)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    hub = {"path": "acme/prefs", "columns": {"prompt": "question", "chosen": "good", "rejected": "bad"}}
    data = load_data([hub, {"path": str(PAIRS), "weight": 0.05}])
    assert data.form == "preference" and data.sources[0]["format"] == "preference"
    assert len(data.examples) == 4 + 20 and data.examples[0]["chosen"][0]["content"] == "riahc"
    recipe = load_recipe(
        write_recipe(
            objective="dpo",
            data=[hub, str(PAIRS)],
            max_length=512,
            eval={"data": str(PAIRS), "samples": 0, "task": {"examples": 0}},
        )
    )
    examples, lengths, stats = data_stats(recipe)
    assert stats.examples == 404 and stats.loss_view["pairs"]["pairs"] == 404
    assert stats.loss_view["stats"]["examples"] == 808  # each pair's two sequences, checked as the loss sees them


def test_an_objective_refuses_data_it_does_not_train(write_recipe, tmp_path):
    from launcher.data.stats import data_stats
    from launcher.errors import DataError
    from launcher.recipe_loading import load_recipe

    with pytest.raises(DataError, match="chat data, which objective dpo does not train") as err:
        data_stats(load_recipe(write_recipe(objective="dpo")))  # the demo's chat data
    assert "set objective: sft" in err.value.fix
    with pytest.raises(DataError, match="preference data, which objective sft does not train") as err:
        data_stats(load_recipe(write_recipe(data=str(PAIRS))))
    assert "set objective: dpo" in err.value.fix


# ---------------------------------------------------------------------------------------------
# The recipe: keys that apply to the objective, init_from


@pytest.mark.parametrize(
    "fields, said",
    [
        (dict(preference={"beta": 0.2}), "preference.beta does not apply to objective sft"),
        (
            dict(objective="orpo", preference={"loss_type": "ipo"}),
            "preference.loss_type does not apply to objective orpo",
        ),
        (dict(objective="dpo", packing=True), "packing apply to objective sft"),
        (dict(objective="orpo", padding_free=True), "padding_free apply to objective sft"),
        (dict(objective="dpo", padding_free=True, assistant_only_loss=True), "assistant_only_loss, padding_free apply"),
        (dict(objective="dpo", init_from="nowhere"), "does not exist"),
        (dict(objective="dpo", method="full", init_from="adapter"), "init_from starts from an adapter"),
        (dict(objective="dpo", init_from="."), "holds no adapter_config.json"),
        (dict(objective="dpo", init_from="adapter", lora={"r": 32}), "lora.r 32 (the parent's: 8) would be ignored"),
        # the default value given on purpose is ignored as well (issue 46): refused whatever its value
        (dict(objective="dpo", init_from="adapter", lora={"r": 16}), "lora.r 16 (the parent's: 8) would be ignored"),
        (
            dict(objective="dpo", init_from="adapter", lora={"target_modules": ["q_proj"]}),
            "lora.target_modules ['q_proj'] (the parent's: ['q_proj', 'v_proj']) would be ignored",
        ),
        (dict(objective="dpo", init_from="adapter", model="Qwen/Qwen3-8B"), "was trained on"),
    ],
)
def test_a_key_that_does_not_apply_is_refused(write_recipe, tmp_path, tiny_model, fields, said):
    from launcher.errors import RecipeError
    from launcher.recipe_loading import load_recipe

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(
        json.dumps(
            {
                "r": 8,
                "lora_alpha": 16,
                "lora_dropout": 0.0,
                "base_model_name_or_path": str(tiny_model),
                "target_modules": ["v_proj", "q_proj"],
            }
        )
    )

    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(data=str(PAIRS), **fields))
    assert said in str(err.value), str(err.value)


def test_a_run_from_init_from_says_the_parents_rank_everywhere(write_recipe, tmp_path, tiny_model):
    """Issue 46: one value, from the parent: the recipe resolves lora: to the parent adapter's settings, so the plan,
    the serving command (vLLM's --max-lora-rank) and the run's recipe.yaml say r=8, not the default 16."""
    from launcher.recipe_loading import load_recipe
    from launcher.run import commands
    from launcher.store.rundir import RunDir

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(
        json.dumps(
            {
                "r": 8,
                "lora_alpha": 16,
                "lora_dropout": 0.0,
                "base_model_name_or_path": str(tiny_model),
                "target_modules": ["v_proj", "q_proj"],
            }
        )
    )
    recipe = load_recipe(write_recipe(data=str(PAIRS), objective="dpo", init_from=str(tmp_path / "adapter")))
    assert (recipe.lora.r, recipe.lora.target_modules) == (8, ["q_proj", "v_proj"])
    run = RunDir(tmp_path / "run")
    (run.final / "adapter").mkdir(parents=True)
    run.recipe.write_text(yaml.safe_dump(recipe.snapshot()))
    assert load_recipe(run.recipe).lora.r == 8  # the run's own recipe.yaml reloads as it was checked
    served = commands.serve_command(run, str(run.final / "adapter"))
    assert "--max-lora-rank 8" in served, served


def test_padding_free_is_on_where_the_objective_honours_it(write_recipe, tmp_path):
    """padding_free left out: SFT's micro-batches are one row, a preference trainer pads (trl 1.16 DPOTrainer turns
    a given padding_free=True off with a warning, so a given true is refused above); false is taken everywhere. The
    run folder's snapshot (every key with its value) holds the resolved bool, true for sft as when true was every
    objective's default (a finished run's recipe.yaml is compared key by key), and reads back to the same recipe."""
    import yaml

    from launcher.recipe_loading import load_recipe
    from launcher.worker.trainer_config import padding_free_collator

    seen = {}
    for name, fields in {
        "sft": {},
        "sft_off": dict(padding_free=False),
        "dpo": dict(objective="dpo", data=str(PAIRS)),
        "dpo_off": dict(objective="dpo", data=str(PAIRS), padding_free=False),
    }.items():
        recipe = load_recipe(write_recipe(**fields))
        snapshot = tmp_path / f"{name}-snapshot.yaml"  # as launch writes the run's recipe.yaml
        snapshot.write_text(yaml.safe_dump(recipe.snapshot(), sort_keys=False))
        assert load_recipe(snapshot).snapshot() == recipe.snapshot()
        assert recipe.snapshot()["padding_free"] is recipe.padding_free
        tokenizer = type("Tokenizer", (), {"pad_token_id": 0})
        seen[name] = (recipe.padding_free, padding_free_collator(recipe, tokenizer) is not None)
    assert seen == {"sft": (True, True), "sft_off": (False, False), "dpo": (False, False), "dpo_off": (False, False)}


def test_a_loss_type_the_installed_trl_lacks_is_refused_before_training(write_recipe):
    from launcher.errors import RecipeError
    from launcher.recipe_loading import load_recipe
    from launcher.recipe_trainer import check_trainer_fields, dpo_loss_types

    assert {"sigmoid", "ipo", "hinge"} <= set(dpo_loss_types())
    check_trainer_fields(load_recipe(write_recipe(data=str(PAIRS), objective="dpo", preference={"loss_type": "ipo"})))
    with pytest.raises(RecipeError, match="did you mean 'sigmoid'"):
        check_trainer_fields(
            load_recipe(write_recipe(data=str(PAIRS), objective="dpo", preference={"loss_type": "sigmod"}))
        )
    with pytest.raises(RecipeError, match="not a field of TRL's DPOConfig"):
        check_trainer_fields(
            load_recipe(write_recipe(data=str(PAIRS), objective="dpo", trainer={"completion_only_loss": True}))
        )


def test_an_sft_recipe_keeps_its_trajectory_hash(write_recipe):
    """Runs started before the objective key existed resume: an SFT recipe's trajectory has no new keys."""
    from launcher.recipe_loading import load_recipe

    recipe = load_recipe(write_recipe())
    assert not {"objective", "preference", "init_from"} & set(recipe.trajectory())
    dpo = load_recipe(write_recipe(data=str(PAIRS), objective="dpo"))
    assert dpo.trajectory()["objective"] == "dpo" and dpo.trajectory_hash() != recipe.trajectory_hash()


# ---------------------------------------------------------------------------------------------
# The plan: two sequences per example and the reference (docs/sizing.md, "Preference tuning")


def test_the_plan_of_an_8b_qlora_dpo_job_on_one_4090_states_the_pairs_and_the_reference(tmp_path):
    # checkpointing set, as the article's table assumes: left out, the plan turns it off for SFT where its activations
    # fit the card (launcher/plan/speed.py), and the comparison would no longer be of the same settings
    same = {"gradient_checkpointing": True}
    sft = article_plan(tmp_path, "1xRTX4090", **same)
    dpo = article_plan(tmp_path, "1xRTX4090", objective="dpo", **same)
    precomputed = article_plan(tmp_path, "1xRTX4090", objective="dpo", preference={"reference": "precomputed"}, **same)
    orpo = article_plan(tmp_path, "1xRTX4090", objective="orpo", **same)
    assert dpo.fits and dpo.engine == "trl"
    text = "\n".join(dpo.reasons)
    assert "a micro-batch of 1 pairs runs 2 sequences" in text
    assert "reference: the base model with the LoRA adapter switched off" in text and "each step" in text
    mem = dpo.memory["breakdown_gb"]
    # two sequences: the activations double; the reference adds no weights (the same base, the adapter off)
    assert mem["activations"] == pytest.approx(2 * sft.memory["breakdown_gb"]["activations"], rel=0.02)
    assert mem["reference model"] == 0.0 and "switched off" in dpo.memory["explanations"]["reference model"]
    # time: the same tokens twice, and a reference forward over each of them
    assert dpo.tokens["training_tokens"] == sft.tokens["training_tokens"]  # the data's own count (both sides)
    assert dpo.estimate["hours"] > sft.estimate["hours"]
    assert "reference model" not in orpo.memory["breakdown_gb"] and "needs no reference model" in "\n".join(
        orpo.reasons
    )
    assert orpo.estimate["hours"] < dpo.estimate["hours"]
    # ORPO's loss reads the whole logits (trl's ORPOTrainer takes outputs.logits), DPO's the fused head: 2 sequences x
    # seq_len tokens x the vocabulary at 12 B (loss_head.LOGIT_BYTES_HF) against the head's tiles
    from launcher.plan import sizing_constants
    from launcher.plan import loss_head

    tokens = 2 * orpo.tokens["seq_len"]
    assert orpo.memory["breakdown_gb"]["logits and loss"] == pytest.approx(
        tokens * orpo.model["vocab"] * loss_head.LOGIT_BYTES_HF / sizing_constants.GB, rel=0.01
    )
    assert orpo.memory["breakdown_gb"]["logits and loss"] > 5 * dpo.memory["breakdown_gb"]["logits and loss"]
    assert "loss: the model's whole logits (trl's ORPOTrainer takes them" in "\n".join(orpo.reasons)
    assert "fused LM head (trl's ORPOTrainer" not in "\n".join(orpo.reasons)
    assert "loss: TRL's fused LM head (trl's DPOTrainer" in "\n".join(dpo.reasons)
    assert "once, before the first step" in "\n".join(precomputed.reasons)
    assert any("learning_rate is the recipe's default" in n for n in dpo.notes)  # SFT's rate, TRL's named
    assert not any(
        "learning_rate" in n for n in article_plan(tmp_path, "1xRTX4090", objective="dpo", learning_rate=1e-5).notes
    )
    full = article_plan(tmp_path, "8xH100-80GB", objective="dpo", method="full")
    assert full.memory["breakdown_gb"]["reference model"] > 0 and "frozen copy" in "\n".join(full.reasons)


# ---------------------------------------------------------------------------------------------
# End to end on the tiny model

DPO = dict(
    objective="dpo",
    data=str(PAIRS),
    max_length=512,
    max_steps=24,
    learning_rate=2e-3,
    logging_steps=4,
    eval={"fraction": 0.1, "every_minutes": 10, "samples": 0, "task": {"examples": 0}},
)
QUICK = ("smoke.enabled=false",)


def _foreground(write_recipe, tmp_path: Path, fields: dict, name: str, *overrides: str) -> list[dict]:
    """A run in the foreground, named `name`, with `fields` and `overrides`: its metrics rows."""
    recipe = write_recipe(f"{name}.yaml", output_dir=str(tmp_path / name), **fields)
    res = ftrun(recipe, "--foreground", *QUICK, *overrides, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    return metrics(tmp_path / name)


def _train_rows(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in SAID} for r in metrics(run)]


@pytest.fixture(scope="module")
def sft_run(sft_parent) -> Path:
    """The parent: LoRA SFT on the demo's chat data, shared with the other preference and GRPO tests (conftest
    sft_parent: one run for both files)."""
    return sft_parent


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory, tiny_model, sft_run) -> Path:
    from conftest import uninterrupted_run

    return uninterrupted_run(tmp_path_factory, tiny_model, "pref-dpo", dict(DPO, init_from=str(sft_run)), *QUICK)


@pytest.mark.slow
def test_dpo_from_an_sft_runs_adapter_learns_the_held_out_preferences(dpo_run, sft_run, tmp_path):
    rows = metrics(dpo_run)
    evals = [r for r in rows if "eval_rewards/accuracies" in r]
    train = [r for r in rows if "rewards/margins" in r]
    assert evals[0]["step"] == 0 and evals[0]["eval_rewards/margins"] == 0.0  # the policy starts as its reference
    assert evals[-1]["eval_rewards/accuracies"] > 0.5, evals
    assert evals[-1]["eval_rewards/margins"] > evals[0]["eval_rewards/margins"], evals
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies"} <= set(train[-1])
    # the result is the trained adapter alone (not trl's frozen "ref" copy), of the parent's shape, moved from it
    adapter = dpo_run / "final" / "adapter"
    assert not (adapter / "ref").exists()
    parent, child = adapter_tensors(sft_run), adapter_tensors(dpo_run)
    assert parent.keys() == child.keys() and any(not (parent[k] == child[k]).all() for k in parent)
    plan = "\n".join(json.loads((dpo_run / "plan.json").read_text())["reasons"])
    assert f"init_from: the adapter of {sft_run}" in plan and "parent adapter's frozen copy" in plan
    text = ftrun("status", dpo_run, cwd=tmp_path).stdout
    assert "rewards   margin" in text and "held-out pairs" in text


@pytest.mark.slow
def test_dpo_kill9_then_resume_matches_the_uninterrupted_run(write_recipe, tmp_path, dpo_run, sft_run):
    recipe = write_recipe(**dict(DPO, init_from=str(sft_run), max_restarts=0, checkpoint_every_minutes=0.0001))
    assert ftrun(recipe, *QUICK, cwd=tmp_path).returncode == 0
    run = tmp_path / "run"

    def past_a_checkpoint(r: Path) -> bool:
        steps = [int(p.parent.name.split("-")[1]) for p in (r / "checkpoints").glob("step-*/manifest.json")]
        return bool(steps) and 6 <= max(steps) < 20 and max(steps) % 4 != 0  # inside a logging window

    st = freeze_worker(run, past_a_checkpoint, timeout=240)
    os.kill(st["supervisor_pid"], signal.SIGKILL)
    os.kill(st["worker_pid"], signal.SIGKILL)
    wait_for(lambda: polled_status(run)["state"] == "interrupted", 30, "state interrupted")
    res = ftrun(recipe, *QUICK, cwd=tmp_path)
    assert res.returncode == 0 and "continuing" in res.stdout, res.stdout + res.stderr
    wait_until_ended(run, tmp_path)
    assert "resuming from step-" in (run / "train.log").read_text()
    assert _train_rows(run) == _train_rows(dpo_run)  # losses, rewards, eval figures: exact on CPU
    a, b = adapter_tensors(dpo_run), adapter_tensors(run)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_the_loss_plot_draws_the_margins_of_a_preference_run(tmp_path):
    from launcher.deliver.plots import plot_loss

    rows = [
        {"step": s, "loss": 0.7 - s / 100, "learning_rate": 1e-3, "rewards/margins": s / 10, "rewards/accuracies": 0.5}
        for s in range(1, 6)
    ]
    rows += [
        {"step": s, "eval_loss": 0.69, "eval_rewards/margins": s / 20, "eval_rewards/accuracies": 0.6} for s in (0, 5)
    ]
    path = _lines(tmp_path / "metrics.jsonl", rows)
    out = plot_loss(path, tmp_path / "loss.png")
    import matplotlib.image

    height, width = matplotlib.image.imread(str(out)).shape[:2]
    assert (height, width) == (700, 800)  # the second panel (an SFT run's plot is 450 high)


@pytest.mark.slow
def test_a_precomputed_reference_trains_as_the_reference_pass_each_step(write_recipe, tmp_path, dpo_run, sft_run):
    """preference.reference: precomputed (TRL's precompute_ref_log_probs: the parent adapter's copy over the data once,
    before the first step) follows the run that computes the reference beside each step."""
    recipe = write_recipe(**dict(DPO, init_from=str(sft_run), preference={"reference": "precomputed"}))
    res = ftrun(recipe, "--foreground", *QUICK, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    a = [r for r in metrics(dpo_run) if "loss" in r]
    b = [r for r in metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b)) < 1e-4, (a, b)
    assert "once, before the first step" in (tmp_path / "run" / "plan.json").read_text()
