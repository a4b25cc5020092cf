"""Preference tuning on the engines and the other objective: ORPO, DDP x 2 against accumulation x 2, DeepSpeed ZeRO-3
against DDP, full fine-tuning against a frozen copy (slow tier; a file of its own, so that the slow tier's two
workers share the preference tests: tests/worker/test_preference.py has the rest)."""

from __future__ import annotations

import json

import pytest

from helpers import adapter_tensors, ftrun, metrics
from test_preference import DPO, QUICK, _foreground


@pytest.mark.slow
def test_orpo_trains_without_a_reference(write_recipe, tmp_path):
    recipe = write_recipe(**dict(DPO, objective="orpo", preference={"beta": 0.1}))
    res = ftrun(recipe, "--foreground", *QUICK, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [r for r in metrics(tmp_path / "run") if "rewards/margins" in r]
    assert rows and {"nll_loss", "log_odds_ratio"} <= set(rows[-1])
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert "reference: none (orpo needs no reference model)" in (tmp_path / "run" / "plan.json").read_text()


@pytest.mark.slow
def test_dpo_ddp_two_processes_follow_accumulation_two(write_recipe, tmp_path):
    fields = dict(
        DPO,
        max_steps=6,
        micro_batch_size=4,
        checkpoint_every_minutes=10,
        logging_steps=1,
        eval={"samples": 0, "task": {"examples": 0}},
    )

    one = _foreground(write_recipe, tmp_path, fields, "one", "gradient_accumulation_steps=2")
    ddp = _foreground(write_recipe, tmp_path, fields, "ddp", "engine=ddp", "num_processes=2")
    assert [r["step"] for r in one] == [r["step"] for r in ddp] == list(range(1, 7))
    for x, y in zip(one, ddp):
        for key in ("loss", "rewards/margins", "rewards/accuracies"):
            assert abs(x[key] - y[key]) < 1e-4, (key, x, y)
    ta, tb = adapter_tensors(tmp_path / "one"), adapter_tensors(tmp_path / "ddp")
    assert max((ta[k] - tb[k]).abs().max().item() for k in ta) < 1e-4


@pytest.mark.slow
def test_dpo_zero3_two_processes_follows_ddp(write_recipe, tmp_path):
    """DeepSpeed ZeRO-3 on 2 gloo processes: DPO with the adapter switched off as the reference, as DDP trains it."""
    pytest.importorskip("deepspeed")
    fields = dict(
        DPO,
        max_steps=4,
        micro_batch_size=4,
        checkpoint_every_minutes=10,
        logging_steps=1,
        eval={"samples": 0, "task": {"examples": 0}},
    )

    ddp = _foreground(write_recipe, tmp_path, fields, "ddp", "engine=ddp", "num_processes=2")
    zero = _foreground(write_recipe, tmp_path, fields, "zero", "engine=deepspeed", "num_processes=2")
    assert [r["step"] for r in ddp] == [r["step"] for r in zero] == list(range(1, 5))
    for x, y in zip(ddp, zero):
        for key in ("loss", "rewards/margins"):
            assert abs(x[key] - y[key]) < 2e-3, (key, x, y)
    assert zero[-1]["rewards/margins"] > 0


@pytest.mark.slow
def test_dpo_full_fine_tuning_trains_against_a_frozen_copy(write_recipe, tmp_path):
    recipe = write_recipe(**dict(DPO, method="full", max_steps=8, learning_rate=1e-3, export=["merged"]))
    res = ftrun(recipe, "--foreground", *QUICK, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    run = tmp_path / "run"
    plan = json.loads((run / "plan.json").read_text())
    assert "a frozen copy of the model" in plan["memory"]["explanations"]["reference model"]  # 0.0005 GB: rounds to 0
    rows = metrics(run)
    held = [r for r in rows if "eval_rewards/margins" in r]
    assert held[-1]["eval_rewards/margins"] > held[0]["eval_rewards/margins"] == 0.0
    assert (run / "final" / "model" / "config.json").is_file()
    report = json.loads((run / "final" / "export.json").read_text())
    assert report["ok"] and "merged" in report["outputs"]
