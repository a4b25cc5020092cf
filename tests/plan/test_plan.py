"""Engine choice (the article's rules, one case each), refusals with advice, CPU plans, calibration, output."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.errors import MissingSoftware, PlanError
from launcher.plan.hardware import from_spec
from launcher.plan.this_box import detect
from launcher.plan.models import from_catalog
from launcher.plan.advice import _box_rows
from launcher.plan.choice import WORKDAY_HOURS
from launcher.plan.job import _job
from launcher.plan.plan import make_plan
from launcher.plan.text import format_plan

REPO = Path(__file__).resolve().parents[2]
from helpers import ARTICLE_DATA, article_plan as plan, article_recipe as recipe  # noqa: E402


def cpu_box(ram_gb=24.0, cores=2):
    return from_spec("cpu").__class__((), "none", cores, ram_gb, "detected")


@pytest.fixture
def tiny_dir(tmp_path):
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "vocab_size": 1000,
                "tie_word_embeddings": True,
            }
        )
    )
    return d


# --- the article's rules, one case each ------------------------------------------------------


def test_fits_one_card_unsloth_when_installed(tmp_path):
    p = plan(tmp_path, "RTX4090", unsloth=True)
    assert (p.engine, p.num_processes, p.device) == ("unsloth", 1, "cuda")
    assert any("fits one card" in r for r in p.reasons)


def test_fits_one_card_trl_without_unsloth(tmp_path):
    p = plan(tmp_path, "RTX4090", unsloth=False)
    assert p.engine == "trl" and p.num_processes == 1
    assert any("Unsloth not installed" in r for r in p.reasons)


def test_full_finetune_never_uses_unsloth(tmp_path):
    p = plan(tmp_path, "H100", unsloth=True, method="full-8bit")
    assert p.engine == "trl"


def test_a_box_in_hand_uses_its_cards_when_that_is_faster(tmp_path):
    p = plan(tmp_path, "2xA100-80GB", model="meta-llama/Llama-3.1-70B")  # ~16 h on one card
    assert (p.engine, p.num_processes) == ("ddp", 2)
    assert any("billed whole" in r and "1.8x" in r for r in p.reasons)


def test_renting_follows_the_workday_rule(tmp_path):
    """Choosing a box to rent, one card if it finishes within a working day, else DDP: the alternatives."""
    short = {a["gpus"] for a in plan(tmp_path, "RTX4090", model="meta-llama/Llama-3.1-8B").alternatives}
    assert short and all(g.startswith("1x") for g in short)  # ~3 h on one card: no multi-card box to rent
    rows = _box_rows(
        _job(
            recipe(tmp_path, model="meta-llama/Llama-3.1-70B"),
            from_catalog("meta-llama/Llama-3.1-70B"),
            ARTICLE_DATA,
            None,
        )[0],
        "auto",
        True,
        WORKDAY_HOURS,
    )
    two = next(r for r in rows if r["gpus"] == "2xA100-80GB")  # ~16 h on one A100: rent two
    assert two["engine"] == "ddp"


def test_ddp_on_pcie_says_it_scales_worse(tmp_path):
    p = plan(tmp_path, "2xL40S", model="Qwen/Qwen2.5-32B")
    assert p.engine == "ddp" and any("PCIe" in r and "worse" in r for r in p.reasons)


def test_fits_no_single_card_shards_with_fsdp(tmp_path):
    p = plan(tmp_path, "4xH100-80GB", method="full")
    assert (p.engine, p.num_processes) == ("fsdp", 4)
    text = " ".join(p.reasons)
    assert "largest card" in text and "fewest that fits" in text and "spare" in text
    assert p.memory["per_gpu_gb"] < 85.52


def test_deepspeed_when_chosen(tmp_path):
    p = plan(tmp_path, "4xH100-80GB", method="full", engine="deepspeed")
    assert p.engine == "deepspeed" and p.num_processes == 4


def test_qlora_with_fsdp_for_70b_over_two_cards(tmp_path):
    p = plan(tmp_path, "2xRTX5090", model="meta-llama/Llama-3.1-70B", max_length=1024)
    assert p.engine == "fsdp" and p.method == "qlora"
    assert any("moderate pace" in r for r in p.reasons)


def test_nothing_fits_refuses_with_options(tmp_path):
    with pytest.raises(PlanError) as err:
        plan(tmp_path, "RTX4090", method="lora", model="meta-llama/Llama-3.1-70B")
    e = err.value
    assert e.exit_code == 3
    assert "--gpus" in e.fix and "EUR" in e.fix
    assert "method=qlora" not in e.fix or "fits" in e.fix  # advice is only given when it was checked


def test_refusal_suggests_what_makes_it_fit_here(tmp_path):
    with pytest.raises(PlanError) as err:
        plan(
            tmp_path,
            "H100",
            method="lora",
            model="Qwen/Qwen2.5-32B",
            max_length=8192,
            micro_batch_size=4,
            data=SimpleNamespace(**{**ARTICLE_DATA.__dict__, "max_tokens": 8192}),
        )
    assert "max_length=" in err.value.fix and "fits" in err.value.fix


@pytest.mark.parametrize(
    "engine,gpus,why",
    [
        ("fsdp", "H100", "needs 2 or more GPUs"),
        ("ddp", "H100", "needs 2 or more GPUs"),
        ("unsloth", "H100", "not installed"),
    ],
)
def test_forced_engine_refused_with_reason(tmp_path, engine, gpus, why):
    with pytest.raises(PlanError, match=why):
        plan(tmp_path, gpus, engine=engine)


def test_forced_engine_honoured_when_possible(tmp_path):
    p = plan(tmp_path, "2xH100-80GB", engine="ddp")
    assert p.engine == "ddp" and p.num_processes == 2 and any("forced" in r for r in p.reasons)


def test_forced_unsloth_for_full_is_refused(tmp_path):
    with pytest.raises(PlanError, match="LoRA/QLoRA only"):
        plan(tmp_path, "H100", unsloth=True, method="full", engine="unsloth")


# --- CPU boxes --------------------------------------------------------------------------------


def test_cpu_box_plans_tiny_model(tmp_path, tiny_dir):
    data = SimpleNamespace(
        examples=64,
        total_tokens=64 * 120,
        mean_tokens=120.0,
        max_tokens=256,
        over_max_length=0,
        tokens_source="tokenizer",
    )
    p = make_plan(
        recipe(
            tmp_path,
            model=str(tiny_dir),
            method="lora",
            max_length=256,
            micro_batch_size=8,
            gradient_accumulation_steps=1,
            max_steps=12,
        ),
        cpu_box(),
        data,
        unsloth_available=True,
    )
    assert (p.device, p.engine, p.num_processes, p.price_per_hour_eur) == ("cpu", "trl", 1, 0.0)
    assert p.total_steps == 12 and p.estimate["cost_eur"] == 0.0
    assert any("CPU run" in r and "tiny" in r for r in p.reasons)
    assert p.memory["per_gpu_gb"] < 24
    assert p.estimate["hours"] < 0.5


def test_cpu_box_uses_recipe_price(tmp_path, tiny_dir):
    p = make_plan(
        recipe(tmp_path, model=str(tiny_dir), method="lora", price_per_hour_eur=0.10), cpu_box(), ARTICLE_DATA
    )
    assert p.price_per_hour_eur == 0.10


def test_real_model_on_cpu_is_refused_with_the_cheapest_box(tmp_path):
    with pytest.raises(PlanError) as err:
        plan(tmp_path, cpu_box(ram_gb=512, cores=64), method="lora")  # fits RAM, but would take weeks
    assert "--gpus" in err.value.fix and "EUR" in err.value.fix
    with pytest.raises(PlanError, match="RAM"):
        plan(tmp_path, cpu_box(), method="lora")


def test_cpu_refuses_fsdp(tmp_path, tiny_dir):  # ddp, deepspeed: tests/worker/test_engines.py
    with pytest.raises(PlanError, match="impossible here"):
        make_plan(recipe(tmp_path, model=str(tiny_dir), method="lora", engine="fsdp"), cpu_box(), ARTICLE_DATA)


def test_unsloth_missing_on_a_cpu_is_missing_software(tmp_path, tiny_dir):
    with pytest.raises(MissingSoftware) as err:
        make_plan(
            recipe(tmp_path, model=str(tiny_dir), method="lora", engine="unsloth"),
            cpu_box(),
            ARTICLE_DATA,
            unsloth_available=False,
        )
    assert err.value.exit_code == 2 and "does not fit" not in err.value.render()


# --- tokens, steps, calibration, output --------------------------------------------------------


def test_steps_from_examples_batch_and_epochs(tmp_path):
    p = plan(tmp_path, "RTX4090", micro_batch_size=2, gradient_accumulation_steps=4, epochs=3)
    assert p.total_steps == 3 * 1250  # ceil(10,000 / 8) per epoch
    assert p.tokens["training_tokens"] == 15_000_000


def test_tokens_flag_without_data(tmp_path):
    p = make_plan(recipe(tmp_path), from_spec("RTX4090"), None, tokens=15_000_000, unsloth_available=True)
    assert p.tokens["training_tokens"] == 15_000_000 and p.estimate["hours"] > 1
    assert any("assume" in n for n in p.notes)


def test_character_based_token_counts_are_said(tmp_path):
    data = SimpleNamespace(**{**ARTICLE_DATA.__dict__, "tokens_source": "characters"})
    p = plan(tmp_path, "RTX4090", data=data)
    assert "characters" in p.tokens["source"]


def test_smoke_measurement_replaces_estimates(tmp_path):
    r = recipe(tmp_path)
    est = make_plan(r, from_spec("RTX4090"), ARTICLE_DATA, unsloth_available=False)
    cal = make_plan(
        r,
        from_spec("RTX4090"),
        ARTICLE_DATA,
        unsloth_available=False,
        smoke={"tokens_per_second": 1000.0, "peak_memory_gb": 14.2, "device": "cuda"},
    )
    assert cal.measured["tokens_per_second"] == 1000.0 and cal.memory["per_gpu_gb"] == 14.2
    assert cal.estimate["hours"] == pytest.approx(15e6 / 1000 / 3600, rel=1e-3)
    assert est.measured == {} and cal.tokens["tokens_per_second_source"] == "measured"
    assert "measured" in format_plan(cal)


def test_to_dict_has_the_issue_keys(tmp_path):
    d = plan(tmp_path, "2xA100-80GB", model="meta-llama/Llama-3.1-70B").to_dict()
    for key in (
        "fits",
        "engine",
        "gpus",
        "memory",
        "tokens",
        "estimate",
        "reasons",
        "alternatives",
        "num_processes",
        "device",
        "price_per_hour_eur",
        "total_steps",
        "measured",
    ):
        assert key in d
    assert set(d["gpus"]) >= {"name", "count", "memory_gb"}
    assert set(d["memory"]) >= {"per_gpu_gb", "total_gb", "breakdown_gb"}
    assert set(d["tokens"]) >= {"training_tokens", "tokens_per_second"}
    assert set(d["estimate"]) >= {"hours", "cost_eur", "setup_hours", "download", "total_hours", "total_cost_eur"}
    assert d["alternatives"] and set(d["alternatives"][0]) >= {"gpus", "hours", "cost_eur"}
    json.dumps(d)


def test_format_plan_explains_every_term_and_lists_alternatives(tmp_path):
    p = plan(tmp_path, "4xH100-80GB", method="full")
    text = format_plan(p)
    for term in p.memory["breakdown_gb"]:
        assert term in text
    assert "engine fsdp" in text and "Other boxes" in text and "EUR" in text


def test_plan_is_fast(tmp_path):
    start = time.perf_counter()
    plan(tmp_path, "8xB200", method="full", model="meta-llama/Llama-3.1-70B")
    with pytest.raises(PlanError):  # a refusal also sizes every catalog box for its advice
        plan(tmp_path, "8xH100-80GB", method="full-8bit", model="meta-llama/Llama-3.1-70B", engine="fsdp")
    assert time.perf_counter() - start < 2.0


def test_importing_the_planner_stays_light():
    code = (
        "import sys, launcher.plan.plan, launcher.plan.text, launcher.plan.hardware, launcher.plan.sizing, "
        "launcher.plan.models; "
        "heavy = [m for m in ('torch', 'transformers', 'trl', 'peft', 'pynvml', 'unsloth') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_detected_box_plans_without_error_or_refuses_cleanly(tmp_path, tiny_dir):
    p = make_plan(recipe(tmp_path, model=str(tiny_dir), method="lora", max_length=256), detect(), ARTICLE_DATA)
    assert p.fits


def test_the_plan_states_the_task_evaluations_time_and_cost_before_any_smoke_test(tmp_path):
    """On a catalog GPU: scorers x examples x max_new_tokens at the roofline rate of batched greedy decoding
    (weights read once a step, docs/BENCHMARKS.md section 7), with its cost; on a CPU the smoke test measures it."""
    from helpers import article_plan
    from launcher.plan import throughput
    from launcher.plan.hardware import catalog
    from launcher.plan.models import from_catalog

    assert all(g.memory_bandwidth_gb_s for g in catalog().values())  # every card's datasheet bandwidth
    plan = article_plan(tmp_path, "1xH100-80GB", eval={"fraction": 0.02}, export=["adapter", "merged"])
    t = plan.estimate["task_eval"]
    assert t["scorers"] == ["base model zero-shot", "with 3 examples", "fine-tuned", "merged"]
    assert t["new_tokens"] == 4 * 200 * 128 and t["examples"] == 200
    tps = throughput.generation_tokens_per_second(from_catalog("meta-llama/Llama-3.1-8B"), 3350, 989)
    assert t["generation_tokens_per_second"] == round(tps, 1)
    assert t["seconds"] == round(t["new_tokens"] / tps, 1) and t["cost_eur"] == round(t["seconds"] / 3600 * 3.9, 2)
    assert any(r.startswith("task evaluation: at most 4 scorers x 200 examples") for r in plan.reasons)
    # an 8B model's eager decode step is bound by its launches: more bandwidth buys nothing
    small, large = from_catalog("meta-llama/Llama-3.1-8B"), from_catalog("meta-llama/Llama-3.1-70B")
    assert throughput.decode_step_seconds(small, 3350, 989, 32)[1] == "launch"
    assert throughput.generation_tokens_per_second(small, 6700, 989) == tps
    # a 70B model's is bound by reading its weights: twice the bandwidth, twice the rate
    assert throughput.decode_step_seconds(large, 3350, 989, 32)[1] == "memory"
    assert throughput.generation_tokens_per_second(large, 6700, 989) == pytest.approx(
        2 * throughput.generation_tokens_per_second(large, 3350, 989)
    )
    assert article_plan(tmp_path, "1xH100-80GB").estimate["task_eval"] is None  # nothing held out, nothing scored


def test_the_task_evaluations_answers_count_the_base_scored_after_training_where_the_baseline_is_skipped():
    """Issue 46: with eval.task.baseline: skip a LoRA run scores the base after training with the adapter switched
    off; the plan's note said "answered greedily once (fine-tuned)" and its forecast left those answers out."""
    from types import SimpleNamespace

    from launcher.plan.task_eval_forecast import _task_eval_scorers

    def recipe(baseline: str, method: str = "lora", init_from=None):
        task = SimpleNamespace(baseline=baseline, shots=3)
        return SimpleNamespace(eval=SimpleNamespace(task=task), export=["adapter"], method=method, init_from=init_from)

    assert _task_eval_scorers(recipe("run")) == ["base model zero-shot", "with 3 examples", "fine-tuned"]
    skipped = _task_eval_scorers(recipe("skip"))
    assert len(skipped) == 3 and "adapter switched off" in skipped[0] and skipped[-1] == "fine-tuned"
    assert _task_eval_scorers(recipe("skip", method="full")) == ["fine-tuned"]  # no adapter to switch off
    assert _task_eval_scorers(recipe("skip", init_from="runs/sft")) == ["fine-tuned"]  # the parent cannot be
