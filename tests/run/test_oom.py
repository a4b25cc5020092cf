"""Out of memory in the smoke test (a real allocator failure under --memory-limit): re-plan, keep the effective
batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, _load_script, recipe_file
from helpers import ftrun, metrics


@pytest.fixture(scope="module")
def big_vocab_model() -> Path:
    """The tiny model with its embedding padded to 32k rows: the logits of a long batch dominate memory."""
    out = REPO / ".cache" / "tiny-model-bigvocab"
    _load_script("make_tiny_model").build_tiny_model(out, model_vocab=32768)
    return out


FIELDS = dict(max_length=512, micro_batch_size=8, gradient_accumulation_steps=1, max_steps=4, smoke={"min_steps": 2})


@pytest.fixture(scope="module")
def wide_model() -> Path:
    """A wider tiny model (hidden 512, MLP 2048): trained without gradient checkpointing, its activations grow with
    the micro-batch. The loss no longer does: TRL's fused LM head (on a CPU launcher/worker/cpu_logprob.py) holds
    one chunk of logits whatever the batch, so the padded vocabulary alone no longer runs a batch out of memory."""
    out = REPO / ".cache" / "tiny-model-wide"
    _load_script("make_tiny_model").build_tiny_model(out, hidden=512, layers=2, heads=8, kv_heads=4, intermediate=2048)
    return out


# mb 8 peaks at 1.48 GB of RSS and mb 4 at 1.04 GB on this model (2026-12-02, 0.48 GB of it the imports); the cap
# counts address space above the imports: 0.8 GB stops mb 8 and holds mb 4
WIDE = {**FIELDS, "gradient_checkpointing": False}
WIDE_LIMIT = "0.8GB"


@pytest.mark.slow  # a long end-to-end run: the default tier stays under 6 minutes
def test_nothing_fits_stops_with_the_attempts_and_starts_nothing(tmp_path, big_vocab_model):
    recipe = recipe_file(
        tmp_path / "r.yaml",
        big_vocab_model,
        output_dir=tmp_path / "run",
        auto_adjust=["batch"],
        **{**FIELDS, "micro_batch_size": 2},
    )
    res = ftrun(recipe, "--memory-limit", "150MB", cwd=tmp_path)
    assert res.returncode == 4, res.stdout + res.stderr
    err = res.stderr
    assert "nothing the recipe allows (auto_adjust: ['batch']) is left to try" in err
    assert "- engine trl x 1: micro_batch_size=2 gradient_accumulation_steps=1" in err
    assert "- engine trl x 1: micro_batch_size=1 gradient_accumulation_steps=2" in err
    assert "out of memory (peak" in err and "GB of 0.15 GB above the imports)" in err
    assert "Fix: lower max_length (now 512)" in err
    assert "Traceback" not in err
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert state["state"] == "failed-smoke" and not (tmp_path / "run" / "metrics.jsonl").exists()

    # the same recipe again (here without the cap) starts from the recipe, not from the failed adjustments
    again = ftrun("smoke", recipe, cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert (
        "failed (the smoke test ran out of memory" in again.stdout and "starting again from the recipe" in again.stdout
    )
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert "adjustments" not in plan and plan["micro_batch_size"] == 2


@pytest.mark.slow
def test_shard_step_on_cpu_runs_a_real_sharded_attempt_and_lists_it(tmp_path, big_vocab_model):
    """Under --memory-limit the cap stands in for a card: after batch and checkpointing, the job is re-planned
    onto 2 DeepSpeed ZeRO-3 processes (the effective batch kept) and smoke-tested for real. On CPU, ZeRO-3 in
    fp32 holds more per process than one unsharded process at this size, so that attempt runs out too: the
    stop lists it, with the out-of-memory detected through torchrun (which reports the worker's exit as 1)."""
    pytest.importorskip("deepspeed")
    recipe = recipe_file(
        tmp_path / "r.yaml",
        big_vocab_model,
        output_dir=tmp_path / "run",
        **{**FIELDS, "micro_batch_size": 2, "gradient_accumulation_steps": 2},
    )
    res = ftrun(recipe, "--memory-limit", "150MB", cwd=tmp_path, timeout=600)
    assert res.returncode == 4, res.stdout + res.stderr
    assert (
        "re-planning: engine trl x 1 -> deepspeed x 2 over CPU processes, each capped at 0.15 GB like a card"
        in res.stdout
    )
    assert "gradient_accumulation_steps 4 -> 2 (same effective batch 4)" in res.stdout
    assert "re-planned: engine deepspeed, 2 processes" in res.stdout
    assert "- engine deepspeed x 2: micro_batch_size=1 gradient_accumulation_steps=2" in res.stderr
    assert "(shard: already deepspeed x 2)" in res.stderr
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert (plan["engine"], plan["num_processes"]) == ("deepspeed", 2)
    assert plan["adjustments"][-1]["set"] == {
        "engine": "deepspeed",
        "num_processes": 2,
        "gradient_accumulation_steps": 2,
    }
    oom = json.loads((tmp_path / "run" / "smoke" / "oom.json").read_text())
    # ENOMEM under the cap, from whichever allocation met it first: torch's ("DefaultCPUAllocator: can't allocate
    # memory") or a Rust library's (safetensors, tokenizers: "Cannot allocate memory (os error 12)")
    assert "can't allocate memory" in oom["error"] or "Cannot allocate memory" in oom["error"], oom["error"]
    assert "Traceback" not in res.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow  # a long end-to-end run: the default tier stays under 6 minutes
def test_auto_adjust_empty_is_respected(tmp_path, big_vocab_model):
    recipe = recipe_file(tmp_path / "r.yaml", big_vocab_model, output_dir=tmp_path / "run", auto_adjust=[], **FIELDS)
    res = ftrun("smoke", recipe, "--memory-limit", "150MB", cwd=tmp_path)
    assert res.returncode == 4 and "auto_adjust: []" in res.stderr
    assert "re-planning" not in res.stdout


@pytest.mark.slow
def test_oom_replans_to_smaller_micro_batch_and_trains_like_that_from_the_start(tmp_path, wide_model):
    recipe = recipe_file(tmp_path / "r.yaml", wide_model, output_dir=tmp_path / "run", **WIDE)
    res = ftrun(recipe, "--foreground", "--memory-limit", WIDE_LIMIT, cwd=tmp_path, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "re-planning: micro_batch_size 8 -> 4, gradient_accumulation_steps 1 -> 2" in res.stdout
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    final = {}
    for adj in plan["adjustments"]:
        assert "out of memory at peak" in adj["reason"]
        final.update(adj["set"])
    m, g = final["micro_batch_size"], final["gradient_accumulation_steps"]
    assert m < 8 and m * g == 8  # the effective batch is kept

    ref = recipe_file(
        tmp_path / "ref.yaml",
        wide_model,
        output_dir=tmp_path / "ref",
        **{**WIDE, "micro_batch_size": m, "gradient_accumulation_steps": g},
    )
    res = ftrun(ref, "--foreground", "smoke.enabled=false", cwd=tmp_path, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    assert [r["loss"] for r in metrics(tmp_path / "run")] == [r["loss"] for r in metrics(tmp_path / "ref")]
    # the same command again resumes/finishes with the adjusted recipe, not a trajectory mismatch
    again = ftrun(recipe, cwd=tmp_path)
    assert again.returncode == 0 and "finished" in again.stdout
    # status and plan show the run as adjusted, with the memory the smoke test measured
    status = ftrun("status", str(tmp_path / "run"), cwd=tmp_path).stdout
    assert "adjusted after out of memory: micro_batch_size 8 -> 4" in status
    assert "measured by the smoke test (the sizer estimated" in status
    planned = json.loads(ftrun("plan", recipe, "--json", cwd=tmp_path).stdout)
    assert (planned["micro_batch_size"], planned["gradient_accumulation_steps"]) == (m, g)
    assert planned["memory"]["source"] == "measured"


# --- the order of the re-plan steps, without running anything -------------------------------------


def _walk(recipe, plan):
    """Every step next_adjustment takes until none is left, applied one after the other."""
    from launcher.run.adjustments import next_adjustment

    steps = []
    while (step := next_adjustment(recipe, plan)) is not None:
        update, text = step
        steps.append((update, text))
        recipe = recipe.model_copy(update=update)
        if "engine" in update:
            plan = {**plan, "engine": update["engine"], "num_processes": update["num_processes"]}
    return recipe, steps


def _gpu_plan(tmp_path, gpus, **fields):
    from helpers import article_plan as make

    r = make_recipe(tmp_path, **fields)
    return r, make(tmp_path, gpus, **{k: v for k, v in fields.items()}).to_dict()


def make_recipe(tmp_path, **fields):
    from helpers import article_recipe as recipe

    return recipe(tmp_path, **fields)


def test_steps_in_order_and_shard_over_the_idle_cards_keeping_the_effective_batch(tmp_path):
    # LoRA on one of two H100s, the second card idle (the plan itself uses both: DDP, the box being billed whole;
    # a one-card plan is what a run planned on one card and resumed on this box carries)
    r, plan = _gpu_plan(
        tmp_path,
        "2xH100",
        method="lora",
        micro_batch_size=4,
        gradient_accumulation_steps=4,
        max_length=512,
        gradient_checkpointing=False,
    )
    assert (plan["engine"], plan["num_processes"]) == ("ddp", 2)
    plan = {**plan, "engine": "trl", "num_processes": 1}
    final, steps = _walk(r, plan)
    texts = [t for _, t in steps]
    assert texts[0].startswith("micro_batch_size 4 -> 2") and texts[1].startswith("micro_batch_size 2 -> 1")
    assert texts[2].startswith("gradient_checkpointing off -> on")
    assert steps[3][0] == {"engine": "fsdp", "num_processes": 2, "gradient_accumulation_steps": 8}
    assert "trl x 1 -> fsdp x 2" in texts[3] and "same effective batch 16" in texts[3]
    assert len(steps) == 4  # method/optimizer are not in the default auto_adjust
    assert final.micro_batch_size * final.gradient_accumulation_steps * 2 == 16

    # the adjusted recipe plans as what the step asked for
    from launcher.plan.hardware import from_spec
    from launcher.plan.plan import make_plan
    from helpers import ARTICLE_DATA

    replanned = make_plan(final, from_spec("2xH100"), ARTICLE_DATA, unsloth_available=False)
    assert (replanned.engine, replanned.num_processes, replanned.gradient_accumulation_steps) == ("fsdp", 2, 8)


def test_shard_comes_after_the_quality_steps_the_recipe_allows(tmp_path):
    r, plan = _gpu_plan(
        tmp_path,
        "2xH100",
        method="lora",
        micro_batch_size=1,
        gradient_accumulation_steps=8,
        auto_adjust=["batch", "checkpointing", "method", "shard"],
    )
    texts = [t for _, t in _walk(r, plan)[1]]
    assert [t.split(" ")[0] for t in texts] == ["method", "engine"]  # checkpointing is on by default


def test_ddp_becomes_fsdp_on_the_same_cards_and_a_sharded_plan_has_nothing_left(tmp_path):
    r, plan = _gpu_plan(
        tmp_path, "4xH100", method="lora", engine="auto", micro_batch_size=1, gradient_accumulation_steps=8
    )
    ddp = {**plan, "engine": "ddp", "num_processes": 4}
    update, _ = _walk(r.model_copy(update={"gradient_accumulation_steps": 2}), ddp)[1][0]
    assert update == {"engine": "fsdp", "num_processes": 4, "gradient_accumulation_steps": 2}
    assert _walk(r, {**plan, "engine": "fsdp", "num_processes": 4})[1] == []


def test_shard_respects_the_recipe_and_the_effective_batch(tmp_path):
    r, plan = _gpu_plan(tmp_path, "4xH100", method="lora", micro_batch_size=1, gradient_accumulation_steps=6)
    one = {**plan, "engine": "trl", "num_processes": 1}
    # an effective batch of 6 does not split over 4 cards: 3 of them, 2 micro-batches each
    assert _walk(r, one)[1][0][0] == {"engine": "fsdp", "num_processes": 3, "gradient_accumulation_steps": 2}
    odd = r.model_copy(update={"gradient_accumulation_steps": 1})
    assert _walk(odd, one)[1] == []  # an effective batch of 1 cannot be split: the training would change
    for field in ({"engine": "trl"}, {"num_processes": 1}, {"auto_adjust": ["batch", "checkpointing"]}):
        assert _walk(r.model_copy(update=field), one)[1] == [], field
    assert _walk(r, {**one, "nodes": {"nnodes": 2}})[1] == []


def test_the_stop_says_why_shard_was_not_tried(tmp_path):
    from launcher.run.adjustments import shard_blocker

    r, plan = _gpu_plan(tmp_path, "4xH100", method="lora", micro_batch_size=1, gradient_accumulation_steps=1)
    one = {**plan, "engine": "trl", "num_processes": 1}
    assert "effective batch 1 (micro-batch 1) does not split evenly" in shard_blocker(r, one)
    assert shard_blocker(r.model_copy(update={"engine": "trl"}), one) == "the recipe sets engine: trl"
    assert (
        shard_blocker(r, {**plan, "engine": "fsdp", "num_processes": 4})
        == "already fsdp x 4 over all 4 GPU(s) of this box"
    )
    assert "none more to shard over" in shard_blocker(r, {**one, "hardware": {"count": 1}})
    cpu = {"engine": "trl", "num_processes": 1, "device": "cpu", "hardware": {"count": 0, "cpu_count": 2}}
    assert "only under --memory-limit" in shard_blocker(r, cpu)
    big = r.model_copy(update={"gradient_accumulation_steps": 4})
    assert shard_blocker(big, one) == ""  # it would be taken


def test_cpu_shards_only_under_a_memory_limit(tmp_path, monkeypatch):
    import launcher.plan.engine_software
    from launcher.run.adjustments import shard_blocker

    r = make_recipe(tmp_path, method="full", micro_batch_size=1, gradient_accumulation_steps=4)
    cpu = {"engine": "trl", "num_processes": 1, "device": "cpu", "hardware": {"count": 0, "cpu_count": 2}}
    # The default tier runs without DeepSpeed (CI installs it for the slow tier only): say which case is tested.
    monkeypatch.setattr(launcher.plan.engine_software, "_deepspeed_installed", lambda: False)
    assert shard_blocker(r, {**cpu, "memory_limit_gb": 1.0}) == "DeepSpeed, which shards on CPU, is not installed"
    monkeypatch.setattr(launcher.plan.engine_software, "_deepspeed_installed", lambda: True)
    assert _walk(r, cpu)[1] == []  # the processes would share the same RAM: no help
    steps = _walk(r, {**cpu, "memory_limit_gb": 1.0})[1]
    assert [s[0] for s in steps] == [{"engine": "deepspeed", "num_processes": 2, "gradient_accumulation_steps": 2}]
    assert "capped at 1 GB like a card" in steps[0][1]
