"""scripts/gpu_check.sh's product steps (issue 43): the presets, what each step reads from a run directory, the
attention cases and the resume comparison on the CPU; in the slow tier the script's whole dry run, once, shared by
the tests that read its results."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from launcher.worker.gpu_check import attention, product, resume_check, runner, vs_trl

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
NEW = (
    "attention",
    "product-lora",
    "generation",
    "vs-trl",
    "resume-exact",
    "product-dpo",
    "product-grpo",
    "product-qlora",
    "unsloth",
)


def _ctx(tmp_path: Path, **kw):
    from launcher.worker.gpu_check.common import Context

    return Context(
        **{
            "out": tmp_path,
            "work": tmp_path,
            "dry_run": True,
            "device": "cpu",
            "shape": "tiny",
            "progress": lambda **k: None,
            **kw,
        }
    )


def test_the_product_preset_is_one_calls_selection_in_the_scripts_order():
    steps = runner.selected_steps("product")
    assert steps[0] == "tiny-model" and {"bench-lora", "bench-full"} <= set(steps)
    assert set(NEW) - {"unsloth"} <= set(steps)
    # presets and names mix, each step once
    assert runner.selected_steps("product,device,tiny-model").count("tiny-model") == 1
    with pytest.raises(ValueError, match="'nope' is no step or preset"):
        runner.selected_steps("device,nope")
    # the script runs the steps in runner.STEPS's order, each with its GPU and dry-run timeouts
    listed = [line.split()[1] for line in SCRIPT.read_text().splitlines() if line.startswith("step ")]
    assert listed == list(runner.STEPS)
    assert set(runner.STEP_FUNCS) == set(runner.STEPS)


def test_a_run_directorys_speed_record(tmp_path):
    run = tmp_path / "run"
    (run / "final" / "task_eval").mkdir(parents=True)
    rows = [{"step": 0, "eval_loss": 7.0, "time": 99.0}] + [
        {
            "step": s,
            "loss": 7.0 - s / 10,
            "tokens_seen": 100 * s,
            "time": 100.0 + 0.5 * s,
            "peak_memory_gb": 0.5 + s / 100,
        }
        for s in range(1, 7)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "state.json").write_text(
        json.dumps(
            {
                "state": "succeeded",
                "history": [
                    {"state": "planned", "at": 10.0},
                    {"state": "smoking", "at": 12.0},
                    {"state": "running", "at": 20.0},
                    {"state": "succeeded", "at": 50.0},
                ],
                "export": {"seconds": 7.5},
            }
        )
    )
    (run / "smoke.json").write_text(json.dumps({"tokens_per_second": 612.0, "seconds_per_step": 0.3}))
    plan = {"tokens": {"estimated_tokens_per_second": 67188}, "micro_batch_size": 8}
    (run / "plan.json").write_text(json.dumps(plan))
    attention = {"implementation": "ftrun_varlen", "kernels": {"padding_free": "torch's varlen_attn"}}
    (run / "worker.json").write_text(
        json.dumps({"device": "cuda", "sdpa_backends": {"cudnn": False}, "attention": attention})
    )
    answers = [{"index": i, "new_tokens": 24, "seconds": 0.5} for i in range(4)]
    (run / "final" / "task_eval" / "fine_tuned.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
    record = product.run_record(run, started=5.0)
    assert record["phases_seconds"] == {
        "plan and data check": 5.0,
        "base-model task evaluation": 2.0,
        "smoke test": 8.0,
        "training and task evaluation": 30.0,
        "export": 7.5,
    }
    assert record["steps"] == [1, 2, 3, 4, 5, 6] and record["step_seconds"] == [0.5] * 5
    assert record["peak_memory_gb"] == 0.56 and record["sdpa_backends"] == {"cudnn": False}
    assert record["attention"] == attention  # the kernel the run's worker recorded
    assert record["generation"] == {
        "final/fine_tuned": {"answers": 4, "new_tokens": 96, "seconds": 2.0, "tokens_per_second": 48.0}
    }
    assert record["plan"]["tokens"]["estimated_tokens_per_second"] == 67188
    line = product.summary_line({**record, "exit": 0, "wall_seconds": 50.0})
    assert "6 steps, median 0.5 s/step" in line and "smoke 612.0 tok/s (plan 67188)" in line


def test_steps_without_their_packages_or_their_parent_run_say_skipped(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    for step in (product.step_product_lora, resume_check.step_resume_exact, vs_trl.step_vs_trl):
        result = step(_ctx(tmp_path))
        assert result["ok"] is None and "trl not installed" in result["line"] and "device_wheels.sh" in result["line"]
    monkeypatch.setattr(importlib.util, "find_spec", real)
    dpo = product.step_product_dpo(_ctx(tmp_path))
    assert dpo["ok"] is None and "run product-lora first" in dpo["line"]
    from launcher.worker.gpu_check import unsloth_check

    if importlib.util.find_spec("unsloth") is None:
        skipped = unsloth_check.step_unsloth(_ctx(tmp_path))
        assert skipped["ok"] is None and "device_wheels.sh --unsloth" in skipped["line"]


def test_the_resume_comparison_says_exact_or_how_far(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    def run(name: str, losses: list[float], weight: float) -> Path:
        d = tmp_path / name
        (d / "final" / "adapter").mkdir(parents=True)
        (d / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": i + 1, "loss": x, "grad_norm": 1.0}) + "\n" for i, x in enumerate(losses))
        )
        adapter = d / "final" / "adapter" / "adapter_model.safetensors"
        save_file({"a.lora_A.weight": torch.full((2, 2), weight)}, str(adapter))
        return d

    a = run("a", [3.0, 2.5, 2.0], 1.0)
    same = resume_check.compare(a, run("b", [3.0, 2.5, 2.0], 1.0))
    assert same["exact"] and same["max_loss_difference"] == 0 and same["max_adapter_difference"] == 0
    off = resume_check.compare(a, run("c", [3.0, 2.5, 2.001], 1.0 + 2**-10))
    assert not off["exact"] and off["first_differing_step"] == 3
    assert off["max_loss_difference"] == pytest.approx(0.001) and off["max_adapter_difference"] == pytest.approx(2**-10)


def test_attention_cases_on_the_cpu():
    """Each mask case's layout as transformers hands it to SDPA, timed; a backend the CPU lacks is "not supported"
    with torch's own first line, not a crash."""
    torch = pytest.importorskip("torch")
    s = {**attention.SHAPES["cpu"], "lengths": (9, 13), "decode_keys": 3}
    q, k, v, mask, causal = attention._inputs("padding-free", 9, s, "cpu", torch.float32)
    assert q.shape == (1, s["heads"], 9 * s["batch"], s["head_dim"]) and k.shape[1] == s["heads"] and not causal
    # block-diagonal: no token sees another example's, and each sees its own earlier tokens
    assert mask.shape == (1, 1, 18, 18) and not mask[0, 0, 9, 0] and mask[0, 0, 8, 0] and not mask[0, 0, 0, 1]
    q, k, v, mask, causal = attention._inputs("causal", 9, s, "cpu", torch.float32)
    assert mask is None and causal and k.shape[1] == s["kv_heads"]  # GQA through enable_gqa, as without a mask
    math = attention._train_case("padded", "MATH", s, "cpu", torch.float32)
    assert math["supported"] and [r["length"] for r in math["lengths"]] == [9, 13]
    assert all(r["first_ms"] > 0 and r["repeat_ms"] > 0 for r in math["lengths"])
    refused = attention._train_case("causal", "CUDNN_ATTENTION", s, "cpu", torch.float32)
    assert refused["supported"] is False and refused["error"].startswith("RuntimeError: ")
    decode = attention._decode_case("default", s, "cpu", torch.float32)
    assert decode["supported"] and decode["tokens"] == 3


def test_tokens_per_second_over_the_same_steps():
    points = [(1, 0.0, 0), (2, 1.0, 100), (3, 1.5, 300), (4, 2.5, 500)]
    got = vs_trl.rate(points, warmup=2)
    # steps 3 and 4, timed from the end of step 2: 400 tokens in 1.5 s
    assert got["tokens_per_second"] == 266.7 and got["timed_steps"] == 2 and got["step_seconds"] == [0.5, 1.0]
    assert vs_trl.rate(points[:2], warmup=2)["tokens_per_second"] is None


def test_results_are_packed_into_one_tarball_beside_the_summary(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    env.update(
        OUT=str(tmp_path / "out"),
        GPU_CHECK_WORK=str(tmp_path / "work"),
        GPU_CHECK_BUDGET_S="5",
        GPU_CHECK_STEPS="product",
    )
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # out of time: not run is not passed
    out = tmp_path / "out"
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"{n}.json" for n in runner.selected_steps("product")} <= names and "summary.json" not in names
    summary = json.loads((out / "summary.json").read_text())
    assert {s["step"]: s["status"] for s in summary["steps"]}["product-lora"] == "not run"
    assert (out / "product-lora.json").is_file()  # kept on the CPU; a GPU run leaves the two files alone


# ---------------------------------------------------------------------------------------------
# The dry run of every new step through the script, once (minutes on 2 cores: the slow tier)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> Path:
    """The whole `scripts/gpu_check.sh --dry-run`, every step, as CI ran it on its own before (.ci/run): once here,
    where the tests below read what each new step recorded."""
    tmp = tmp_path_factory.mktemp("gpu-check-product")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    env.update(OUT=str(tmp / "out"), GPU_CHECK_WORK=str(tmp / "work"), GPU_CHECK_BUDGET_S="1800")
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env, capture_output=True, text=True, timeout=2000)
    (tmp / "out" / "stdout.txt").write_text(proc.stdout + proc.stderr)
    (tmp / "out" / "rc.txt").write_text(str(proc.returncode))
    return tmp / "out"


@pytest.mark.slow
def test_the_whole_dry_run_passes(dry_run):
    """Every step passed or was skipped for a missing package (the script's own exit status says so)."""
    summary = json.loads((dry_run / "summary.json").read_text())
    assert (dry_run / "rc.txt").read_text() == "0" and summary["all_passed"], (dry_run / "stdout.txt").read_text()
    assert {s["step"] for s in summary["steps"]} >= set(NEW)


def _result(out: Path, name: str) -> dict:
    data = json.loads((out / f"{name}.json").read_text())
    assert data["status"] in ("passed", "skipped"), (out / "stdout.txt").read_text()
    return data


@pytest.mark.slow
@pytest.mark.parametrize("name", ["product-lora", "product-qlora", "product-dpo", "product-grpo"])
def test_the_demo_recipe_through_the_cli_records_its_phases_and_speeds(dry_run, name):
    data = _result(dry_run, name)
    if data["status"] == "skipped":
        pytest.skip(data["line"])
    assert data["state"] == "succeeded" and data["steps"] == list(range(1, product.STEPS["cpu"] + 1))
    assert len(data["step_seconds"]) == len(data["steps"]) - 1 and data["smoke"]["tokens_per_second"] > 0
    assert data["plan"]["tokens"]["estimated_tokens_per_second"] > 0 and data["peak_memory_gb"] > 0
    assert "smoke test" in data["phases_seconds"] and data["worker"]["device"] == "cpu"
    assert data["export"]["state"] == "succeeded"


@pytest.mark.slow
def test_the_killed_run_resumes_exactly_on_the_cpu(dry_run):
    data = _result(dry_run, "resume-exact")
    assert data["ok"] and data["resume"]["exact"], data["line"]
    killed = data["runs"]["killed"]
    assert killed["relaunch_said_continuing"] and killed["ended"] == "succeeded"
    assert 1 <= killed["killed_after_checkpoint"] < resume_check.STEPS["cpu"]


@pytest.mark.slow
def test_ftrun_and_plain_trl_side_by_side_and_the_other_cpu_steps(dry_run):
    versus = _result(dry_run, "vs-trl")
    assert versus["shape"] == "tiny" and versus["sides"]["ftrun"]["tokens_per_second"] > 0
    assert versus["sides"]["trl"]["tokens_per_second"] > 0
    assert versus["sides"]["ftrun"]["timed_steps"] == versus["sides"]["trl"]["timed_steps"]
    assert versus["settings"]["padding_free"] is True
    gen = _result(dry_run, "generation")
    assert gen["variants"]["default"]["passes"][-1]["tokens_per_second"] > 0
    att = _result(dry_run, "attention")
    training = att["training"]
    assert training["MATH"]["causal"]["supported"] and not training["CUDNN_ATTENTION"]["causal"]["supported"]
    assert _result(dry_run, "unsloth")["status"] == "skipped"


@pytest.mark.slow
def test_the_grpo_step_records_its_sampling_share_and_rewards(dry_run):
    data = _result(dry_run, "product-grpo")
    if data["status"] == "skipped":
        pytest.skip(data["line"])
    assert data["rewards"] and all(len(r) == 3 for r in data["rewards"])
    assert 0 < data["sampling_share"] <= 1 and "sampling" in data["line"]
