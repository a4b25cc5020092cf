"""launcher/plan/attention.py: the attention implementation, the SDPA backends a GPU run leaves on (cuDNN's off by
default), the override and its refusal, the plan's Why line; and that the worker's process applies them
(launcher/worker/loading.py). Which backend a GPU then runs, and its speed, only a GPU shows: the GPU check's
attention step (docs/BENCHMARKS.md)."""

from __future__ import annotations

import pytest

from helpers import article_plan, ftrun
from launcher.errors import UsageError
from launcher.plan import attention


@pytest.fixture
def torch_flags():
    """Put torch's process-wide SDPA flags back as they were (other tests in this process run attention)."""
    import torch

    b = torch.backends.cuda
    flags = {name: getattr(b, f"{flag}_enabled")() for name, flag in attention.SDPA_BACKENDS.items()}
    yield b
    for name, flag in attention.SDPA_BACKENDS.items():
        getattr(b, f"enable_{flag}")(flags[name])


def test_flash_attention_2_only_on_a_bf16_card_with_flash_attn():
    assert attention.implementation("cuda", True, True) == "flash_attention_2"
    assert attention.implementation("cuda", False, True) == "sdpa"  # fp16 cards: FlashAttention-2 needs 8.0
    assert attention.implementation("cuda", True, False) == "sdpa"
    assert attention.implementation("cpu", False, True) == "sdpa"


def test_cudnn_is_off_by_default_and_the_override_names_what_stays_on():
    assert attention.sdpa_backends({}) == (("flash", "efficient", "math"), "default")
    assert attention.sdpa_backends({attention.OVERRIDE: "MATH, cudnn,math"}) == (("cudnn", "math"), attention.OVERRIDE)
    assert attention.sdpa_backends({attention.OVERRIDE: " "}) == (attention.DEFAULT_BACKENDS, "default")


@pytest.mark.parametrize("value,named", [("cudnn,flsh", "'flsh'"), (",,", "no backend")])
def test_a_bad_override_is_refused_naming_the_variable_the_value_and_the_choices(value, named):
    with pytest.raises(UsageError) as err:
        attention.sdpa_backends({attention.OVERRIDE: value})
    text = err.value.render()
    assert f"{attention.OVERRIDE}={value!r}" in text and named in text
    assert all(name in text for name in attention.SDPA_BACKENDS) and "Fix:" in text


def test_the_gpu_plan_says_which_backends_and_why(tmp_path, monkeypatch):
    monkeypatch.delenv(attention.OVERRIDE, raising=False)
    plan = article_plan(tmp_path, "1xH200", model="Qwen/Qwen3-8B", method="lora")
    line = next(r for r in plan.reasons if r.startswith("attention:"))
    assert "cuDNN's backend is off" in line and "new sequence length" in line and attention.OVERRIDE in line
    monkeypatch.setenv(attention.OVERRIDE, "cudnn,flash,efficient,math")
    plan = article_plan(tmp_path, "1xH200", model="Qwen/Qwen3-8B", method="lora")
    line = next(r for r in plan.reasons if r.startswith("attention:"))
    assert "cudnn, flash, efficient, math" in line and "new execution graph" in line
    assert attention.reason("cpu", "sdpa", {}) is None


def test_ftrun_plan_refuses_a_bad_override_before_anything_runs(tmp_path):
    from conftest import recipe_file

    recipe = recipe_file(tmp_path / "r.yaml", tmp_path / "no-model", tmp_path / "run", model="Qwen/Qwen3-8B")
    res = ftrun("plan", "--gpus", "1xH200", recipe, cwd=tmp_path, env={attention.OVERRIDE: "fast"})
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stdout + res.stderr
    assert f"{attention.OVERRIDE}='fast'" in res.stdout + res.stderr


def test_the_worker_process_leaves_on_what_the_policy_names(monkeypatch, torch_flags):
    from launcher.worker import loading

    monkeypatch.delenv(attention.OVERRIDE, raising=False)
    torch_flags.enable_cudnn_sdp(True)
    assert loading.select_device()[0] == "cpu"  # every path that loads a model comes through here
    assert loading.sdpa_state() == {"cudnn": False, "flash": True, "efficient": True, "math": True, "source": "default"}
    assert not torch_flags.cudnn_sdp_enabled()
    monkeypatch.setenv(attention.OVERRIDE, "cudnn,math")
    state = loading.apply_sdpa_backends()
    assert state == {"cudnn": True, "flash": False, "efficient": False, "math": True, "source": attention.OVERRIDE}
    assert torch_flags.cudnn_sdp_enabled() and not torch_flags.flash_sdp_enabled()


def test_the_task_evaluation_generates_with_the_policy_and_records_it(monkeypatch, torch_flags, tiny_model, tmp_path):
    """The export's process scores the merged model without select_device: score_model applies the policy itself."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launcher.worker import task_eval

    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model)
    prompts = [
        {"index": i, "messages": [{"role": "user", "content": f"ticket {i}"}], "reference": "a"} for i in range(3)
    ]
    task = {"metric": "exact", "metric_reason": "labels", "prompts": prompts, "shots": [], "max_new_tokens": 3}
    monkeypatch.setenv(attention.OVERRIDE, "efficient,math")
    torch_flags.enable_flash_sdp(True)
    result = task_eval.score_model(model, tokenizer, tmp_path, task, "m")
    assert result["sdpa_backends"] == {
        "cudnn": False,
        "flash": False,
        "efficient": True,
        "math": True,
        "source": attention.OVERRIDE,
    }
    assert not torch_flags.flash_sdp_enabled()
    task_eval.record(tmp_path, task, "m", result)
    saved = json.loads((tmp_path / "task_eval.json").read_text())
    assert saved["generation"]["m"]["sdpa_backends"] == result["sdpa_backends"]
