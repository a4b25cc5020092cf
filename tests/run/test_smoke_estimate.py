"""The smoke test's extrapolation, by epochs and by max_steps, on measured step costs."""

import pytest

from launcher.data.dataset import DataStats
from launcher.recipe_loading import validate_recipe
from launcher.run.smoke import estimate, examples_per_step, export_seconds, memory_growth, step_seconds, training_tokens
from launcher.run.views import format_smoke

STATS = DataStats(
    examples=1000,
    total_tokens=100_000,
    mean_tokens=100.0,
    max_tokens=400,
    over_max_length=0,
    tokens_source="tokenizer",
    max_length=512,
)
# (tokens, seconds) per measured step: 0.5 s per step plus 1 ms per token, exactly
COSTS = [(t, 0.5 + 0.001 * t) for t in (800, 1200, 1600, 2000)]


def _recipe(tmp_path, **fields):
    return validate_recipe(
        {
            "model": "a/b",
            "method": "lora",
            "data": "d.jsonl",
            "micro_batch_size": 4,
            "gradient_accumulation_steps": 2,
            **fields,
        },
        tmp_path,
        "r",
    )


def test_epochs_recipe_uses_the_fitted_per_step_and_per_token_costs(tmp_path):
    recipe = _recipe(tmp_path, epochs=2)
    tokens = training_tokens(recipe, STATS, processes=1)
    assert tokens == 200_000
    steps = 2 * 125  # ceil(1000 / 8) per epoch
    assert step_seconds({"tokens_per_second": 1000.0, "step_costs": COSTS}, tokens, recipe, STATS, 1) == pytest.approx(
        0.5 * steps + 0.001 * tokens
    )


def test_max_steps_recipe_counts_its_steps(tmp_path):
    recipe = _recipe(tmp_path, max_steps=50)
    tokens = training_tokens(recipe, STATS, processes=2)
    assert tokens == 50 * 16 * 100
    assert step_seconds({"tokens_per_second": 1000.0, "step_costs": COSTS}, tokens, recipe, STATS, 2) == pytest.approx(
        0.5 * 50 + 0.001 * tokens
    )


def test_too_few_steps_fall_back_to_the_plain_rate(tmp_path):
    recipe = _recipe(tmp_path)
    assert step_seconds({"tokens_per_second": 2000.0, "step_costs": COSTS[:2]}, 10_000, recipe, STATS, 1) == 5.0


def test_checkpoint_time_counts_one_save_per_interval_plus_the_end(tmp_path):
    from launcher.run.smoke import saves_seconds

    recipe = _recipe(tmp_path, checkpoint_every_minutes=20)
    assert saves_seconds(2.0, 3 * 3600, recipe) == 2.0 * (9 + 2)  # 9 interval saves in 3 h, the last, the final model
    assert saves_seconds(2.0, 60, recipe) == 4.0


# measured by a smoke test: 6 s to start and import, 2 s per model load, a 100 MB checkpoint saved in 1 s
MEASURED = {"import_seconds": 6.0, "load_seconds": 2.0, "checkpoint_bytes": 100_000_000, "checkpoint_seconds": 1.0}


def test_export_time_counts_the_process_the_model_loads_and_the_bytes_written(tmp_path):
    params = 10_000_000
    rate = 1e8  # bytes/s, from the timed checkpoint save
    assert export_seconds(MEASURED, _recipe(tmp_path, export=[]), params) == 0.0
    # the adapter: one process, the base loaded once (with the adapter) for the checks
    assert export_seconds(MEASURED, _recipe(tmp_path, export=["adapter"]), params) == pytest.approx(6 + 2)
    # merged: the folder written in 16 bit and loaded back
    assert export_seconds(MEASURED, _recipe(tmp_path, export=["adapter", "merged"]), params) == pytest.approx(
        6 + 2 * 2 + 2 * params / rate
    )
    # gguf (implies merged): llama.cpp's converter in a process of its own, the file read back once in llama.cpp;
    # a quantized type (q4_k_m, the default) is written twice: the 16-bit conversion, then the quantized file
    assert export_seconds(MEASURED, _recipe(tmp_path, export=["gguf"]), params) == pytest.approx(
        6 * 2 + 3 * 2 + (2 + 2 + 4.89 / 8) * params / rate
    )
    assert export_seconds(MEASURED, _recipe(tmp_path, export=["gguf"], gguf_type="q8_0"), params) == pytest.approx(
        6 * 2 + 3 * 2 + (2 + 2 + 8.5 / 8) * params / rate
    )
    # a 16-bit GGUF comes from the converter directly
    assert export_seconds(MEASURED, _recipe(tmp_path, export=["gguf"], gguf_type="bf16"), params) == pytest.approx(
        6 * 2 + 3 * 2 + (2 + 2) * params / rate
    )
    # a full fine-tune has no adapter; merged loads the trained model, then the written copy
    full = _recipe(tmp_path, method="full", export=["merged"])
    assert export_seconds(MEASURED, full, params) == pytest.approx(6 + 2 * 2 + 2 * params / rate)
    # without a timed save the bytes are not guessed; a small save (a LoRA checkpoint) is mostly fixed cost
    assert export_seconds({**MEASURED, "checkpoint_seconds": None}, full, params) == pytest.approx(6 + 2 * 2)
    small = {**MEASURED, "checkpoint_bytes": 1_000_000, "checkpoint_seconds": 0.01}
    assert export_seconds(small, full, params) == pytest.approx(6 + 2 * 2)


def test_the_estimate_adds_start_steps_saves_and_export_without_counting_step_one_twice(tmp_path):
    recipe = _recipe(tmp_path, epochs=1, export=["adapter"], checkpoint_every_minutes=15)
    measured = {
        **MEASURED,
        "tokens_per_second": 1000.0,
        "step_costs": COSTS,
        "measured_seconds": 5.0,
        "warmup_tokens": 3000,
    }
    parts = estimate(measured, wall=20.0, recipe=recipe, stats=STATS, processes=1, params=10_000_000)
    # the smoke's wall time less its measured steps, its timed save and step 1 as a step of 3000 tokens
    assert parts["startup_seconds"] == pytest.approx(20.0 - 5.0 - 1.0 - (0.5 + 0.001 * 3000))
    assert parts["train_seconds"] == pytest.approx(0.5 * 125 + 0.001 * 100_000)
    assert parts["saves_seconds"] == pytest.approx(1.0 * 2)  # no 15-minute interval passes: the end and the final
    assert parts["export_seconds"] == pytest.approx(6 + 2)
    assert parts["estimated_seconds"] == pytest.approx(sum(v for k, v in parts.items() if k != "estimated_seconds"))


def test_the_task_evaluation_after_training_is_priced_from_the_smokes_generation(tmp_path):
    """One batch of 8 task prompts took 4 s, its longest answer at the cap: 100 examples are 13 batches, 52 s a
    scorer; the fine-tuned model and each exported model score, the base model twice more where no baseline ran.
    A batch whose longest answer stopped at half the cap is priced at the cap: a trained model may answer longer."""
    from launcher.run.smoke import task_eval_seconds

    steps = {**MEASURED, "tokens_per_second": 1000.0, "step_costs": COSTS, "measured_seconds": 5.0}
    measured = {
        **steps,
        "generation_tokens_per_second": 50.0,
        "generation_prompts": 8,
        "generation_new_tokens": 200,
        "generation_seconds": 4.0,
        "generation_longest": 32,
        "generation_max_new_tokens": 32,
    }
    adapter = _recipe(tmp_path, export=["adapter"])
    assert task_eval_seconds(measured, adapter, 100, base_scored=True) == pytest.approx(52.0)
    assert task_eval_seconds(measured, _recipe(tmp_path, export=["adapter", "merged"]), 100, True) == pytest.approx(
        104.0
    )
    assert task_eval_seconds(measured, _recipe(tmp_path, export=["gguf"]), 100, True) == pytest.approx(156.0)
    assert task_eval_seconds(measured, adapter, 100, base_scored=False) == pytest.approx(156.0)
    assert task_eval_seconds({**measured, "generation_longest": 16}, adapter, 100, True) == pytest.approx(104.0)
    assert task_eval_seconds(MEASURED, adapter, 100, True) == 0.0  # no generation measured: not guessed
    parts = estimate(
        measured, wall=20.0, recipe=adapter, stats=STATS, processes=1, params=10_000_000, task_examples=100
    )
    assert parts["task_eval_seconds"] == pytest.approx(52.0)
    assert parts["estimated_seconds"] == pytest.approx(sum(v for k, v in parts.items() if k != "estimated_seconds"))
    # the smoke's own generation is not start-up the full run pays again
    assert parts["startup_seconds"] == pytest.approx(
        estimate(steps, 20.0, adapter, STATS, 1, 10_000_000)["startup_seconds"] - 4.0
    )


def test_the_smoke_output_warns_where_its_peak_understates_the_run():
    """QLoRA on CPU grows during the run (measured, docs/BENCHMARKS.md): said with the smoke result, only there."""
    from launcher.run.views import memory_note

    assert memory_growth("cpu", "qlora") == {"cause": "bitsandbytes-cpu-qlora", "factor": 2.0}
    assert memory_growth("cuda", "qlora") is None and memory_growth("cpu", "lora") is None
    report = {
        "measured_steps": 7,
        "tokens_per_second": 1000.0,
        "peak_memory_gb": 0.9,
        "device": "cpu",
        "training_tokens": 80000,
        "estimated_seconds": 90.0,
        "price_per_hour_eur": 0.0,
    }
    assert "note:" not in format_smoke(report)
    grows = {**report, "memory_growth": memory_growth("cpu", "qlora")}
    assert "about 2x the peak of the first steps" in memory_note(grows)
    assert format_smoke(grows).splitlines()[-1] == "note: " + memory_note(grows)


def test_grpo_prices_a_step_as_a_step_not_by_its_tokens(tmp_path):
    """GRPO samples the same number of answers every step, token by token until the batch's longest answer ends,
    whatever its prompts' length: the demo's smoke steps held the longest prompts (1,980 and 1,353 tokens a step
    against the full run's 980), so priced by tokens/s its 120 steps came out at 20 s where they took a step's time
    each. Figures of the demo's smoke test (recipes/tiny-cpu-grpo.yaml, 2026-12-06)."""
    recipe = _recipe(
        tmp_path,
        objective="grpo",
        grpo={"num_generations": 4, "max_completion_length": 16},
        micro_batch_size=16,
        gradient_accumulation_steps=1,
        max_steps=120,
    )
    stats = DataStats(
        examples=256,
        total_tokens=15_448,
        mean_tokens=60.3,
        max_tokens=200,
        over_max_length=0,
        tokens_source="tokenizer",
        max_length=512,
    )
    measured = {"tokens_per_second": 5654.7, "step_costs": [[1980, 0.3906], [1353, 0.1988]]}
    tokens = training_tokens(recipe, stats, processes=1)
    assert tokens / measured["tokens_per_second"] == pytest.approx(20.5, abs=0.1)  # what it said before
    assert step_seconds(measured, tokens, recipe, stats, 1) == pytest.approx(120 * (0.3906 + 0.1988) / 2)
    # a step slowed by another process on a busy box counts once, not for every step: the median
    noisy = {**measured, "step_costs": [[1500, 0.30], [1400, 0.29], [1450, 1.9], [1300, 0.31], [1350, 0.30]]}
    assert step_seconds(noisy, tokens, recipe, stats, 1) == pytest.approx(120 * 0.30)
    # answers that ended sooner than the cap in the smoke may reach it as the model learns: the sampling part of a
    # step (half of it here) priced at the cap, 16 tokens against the smoke's longest of 8: 0.30 * (1 + 0.5 * 1)
    grown = {
        **noisy,
        "sampling_seconds": 1.0,
        "seconds": 2.0,
        "sampling_longest": [8, 8, 8],
        "max_completion_length": 16,
    }
    assert step_seconds(grown, tokens, recipe, stats, 1) == pytest.approx(120 * 0.45)
    at_cap = {**grown, "sampling_longest": [16, 16, 16]}
    assert step_seconds(at_cap, tokens, recipe, stats, 1) == pytest.approx(120 * 0.30)
    # SFT keeps its fit on tokens
    assert step_seconds(noisy, tokens, _recipe(tmp_path, max_steps=120), stats, 1) != pytest.approx(120 * 0.30)


def test_the_smoke_draws_a_grpo_step_as_its_prompts_not_its_answers(tmp_path):
    """A GRPO step of 16 answers is 4 prompts (num_generations 4): the smoke's sample, its longest first step and its
    step count are counted in prompts (launcher/run/smoke.py run_smoke)."""
    grpo = _recipe(
        tmp_path, objective="grpo", grpo={"num_generations": 4}, micro_batch_size=16, gradient_accumulation_steps=1
    )
    assert examples_per_step(grpo, 1) == 4 and examples_per_step(grpo, 2) == 8
    assert examples_per_step(_recipe(tmp_path), 1) == 8  # SFT: micro 4 x accumulation 2


def test_the_smoke_output_notes_grpo_rewards_that_never_varied_in_its_steps():
    """Before the full run: a smoke test in which no prompt's answers differed in reward at any step (exact match on a
    model that never answers right) learned nothing, and so will the full run unless the reward starts to vary."""
    report = {
        "measured_steps": 5,
        "tokens_per_second": 1000.0,
        "peak_memory_gb": 0.7,
        "device": "cpu",
        "training_tokens": 80000,
        "estimated_seconds": 60.0,
        "price_per_hour_eur": 0.0,
        "sampling_share": 0.4,
    }
    tied = format_smoke({**report, "frac_reward_zero_std": [1.0] * 6})
    assert tied.splitlines()[-1].startswith(
        "note: in all 6 steps of the smoke test no prompt's answers differed in reward (frac_reward_zero_std 1.0): "
        "every advantage was 0 and nothing was learned"
    ), tied
    assert "more answers per prompt (grpo.num_generations)" in tied
    assert "note:" not in format_smoke({**report, "frac_reward_zero_std": [1.0, 0.75, 1.0, 1.0, 1.0, 1.0]})
    assert "note:" not in format_smoke(report)  # SFT, or a smoke.json written before


def test_the_smoke_output_says_when_a_busy_cpu_box_set_the_steps_time():
    """On a CPU box others load, the smoke's steps run at the box's load of the moment (the demo's GRPO step: 0.5-1.1 s
    a step at a load of 8-13 on 2 cores): the forecast is said to hold only while the load stays."""
    report = {
        "measured_steps": 5,
        "tokens_per_second": 1000.0,
        "peak_memory_gb": 0.6,
        "device": "cpu",
        "training_tokens": 80000,
        "estimated_seconds": 120.0,
        "price_per_hour_eur": 0.0,
        "cpu_cores": 2,
    }
    busy = format_smoke({**report, "load_average": 11.34})
    assert busy.splitlines()[-1] == (
        "note: other processes kept this box busy while the smoke test measured (load 11.3 on 2 cores): its steps' "
        "time, and so the forecast, holds while the load stays as it was; a quieter box runs faster, a busier one "
        "slower"
    )
    assert "note:" not in format_smoke({**report, "load_average": 1.5})  # the cores were its own
    both = format_smoke({**report, "load_average": 4.0, "memory_growth": memory_growth("cpu", "qlora")})
    assert both.count("\nnote: ") == 2 and "load 4.0 on 2 cores" in both.splitlines()[-1]
