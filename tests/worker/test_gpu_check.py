"""scripts/gpu_check.sh and gpu_check/: a step that fails, crashes, hangs or is left out for
lack of time is recorded with its reason and the next step runs; the summary is rewritten after every step; the
padded and padding-free micro-batches have the worker's layout.

The whole `--dry-run` (every step on CPU) runs once in the slow tier (tests/worker/test_gpu_check_product.py);
these tests cover the run's bookkeeping.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from gpu_check import common, padding, runner

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    return {**env, "OUT": str(tmp_path / "out"), "GPU_CHECK_WORK": str(tmp_path / "work"), **extra}


def test_finish_records_what_a_step_process_could_not(tmp_path, monkeypatch):
    monkeypatch.delenv("GPU_CHECK_STEPS", raising=False)
    out = tmp_path
    # killed by timeout(1) while running, after reporting a partial measurement
    (out / "bench-full.json").write_text(
        json.dumps({"step": "bench-full", "status": "running", "started": time.time() - 3, "partial": {"predicted": 1}})
    )
    line = runner.finish(out, "bench-full", 124, 150)
    data = json.loads((out / "bench-full.json").read_text())
    assert data["status"] == "timed out" and data["ok"] is False and data["partial"] == {"predicted": 1}
    assert "timed out after 150 s" in line and "TIMEOUT" in line
    # died before writing anything: the log's last line is the reason
    (out / "oom.log").write_text("loading\nSegmentation fault (core dumped)\n")
    line = runner.finish(out, "oom", 139, 60)
    data = json.loads((out / "oom.json").read_text())
    assert data["status"] == "crashed" and "Segmentation fault" in data["error"] and "CRASH" in line
    # a step that passed stays passed; one that ran out of the budget is a failure, not a skip
    (out / "device.json").write_text(json.dumps({"step": "device", "status": "passed", "ok": True, "line": "fine"}))
    assert "ok device: fine" in runner.finish(out, "device", 0, 45)
    runner.finish(out, "fsdp", 0, None, not_run="out of time (budget 450 s)")
    summary = json.loads((out / "summary.json").read_text())
    by_name = {s["step"]: s["status"] for s in summary["steps"]}
    assert [s["step"] for s in summary["steps"]] == list(runner.STEPS)
    assert by_name == {
        **{n: "pending" for n in runner.STEPS},
        "bench-full": "timed out",
        "oom": "crashed",
        "device": "passed",
        "fsdp": "not run",
    }
    assert summary["all_passed"] is False


def test_children_find_the_repository_and_the_module():
    """The children (place-child, fsdp-child) run the package as a module, with the repository on PYTHONPATH."""
    assert common.REPO == REPO and (common.REPO / "scripts" / "make_tiny_model.py").is_file()
    assert common.module_cmd("place-child")[1:] == ["-m", "gpu_check", "place-child"]
    assert common.child_env()["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)


def test_budget_spent_steps_are_not_run_and_fail_the_script(tmp_path):
    """No time left: every step is recorded as not run (no torch is imported for that), the exit code says so."""
    env = _env(tmp_path, GPU_CHECK_BUDGET_S="5", GPU_CHECK_STEPS="device,oom")
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "NOT RUN device: not run: out of time (budget 5 s)" in proc.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    statuses = {s["step"]: s["status"] for s in summary["steps"]}
    assert statuses["device"] == statuses["oom"] == "not run"
    assert statuses["placement"] == "not selected"


def test_batch_layouts():
    torch = pytest.importorskip("torch")
    examples = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    padded = padding.padded_batch(examples, "cpu")
    assert padded["input_ids"].shape == (3, 4)
    assert padded["attention_mask"].sum().item() == 9
    assert padded["labels"][1].tolist() == [8, 9, -100, -100]
    free = padding.padding_free_batch(examples, "cpu")
    assert free["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13]]
    assert free["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    # each example's first token is not predicted from the previous example (trl's padding-free collator)
    assert free["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, 11, 12, 13]]
    assert "attention_mask" not in free
    assert torch.equal(free["labels"][free["labels"] != -100], padded["labels"][:, 1:][padded["labels"][:, 1:] != -100])
    assert free["cu_seq_lens_q"].tolist() == [0, 3, 5, 9] and free["max_length_q"] == 4
    # the same layout as trl's own padding-free collator, boundaries included (what the worker trains with)
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    trl = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)([{"input_ids": e} for e in examples])
    for key, value in free.items():
        assert (
            (torch.equal(value, trl[key]) and value.dtype == trl[key].dtype)
            if torch.is_tensor(value)
            else (value == trl[key])
        ), key
    dense = padding.dense_batch(examples, "cpu")
    assert set(dense) == {"input_ids", "position_ids", "labels"}
    fixed = padding.fixed_batch(examples, "cpu")
    assert fixed["input_ids"].shape == (3, 3) and "attention_mask" not in fixed  # the mean length, no mask


def test_the_padding_step_measures_each_kernel_against_the_fixed_shape(tmp_path, monkeypatch):
    """The bench-padding step as the dry run runs it (CPU, tiny shape): every case but the GPU-only varlen kernel
    measured at the bench's micro-batch and at speed.py's choice, checkpointing on and off; the cases' first losses
    agree, the examples stay apart; a case the sizer says the card cannot hold is skipped before it starts."""
    pytest.importorskip("peft")
    from gpu_check.common import Context

    from gpu_check import training

    # the dry run's settings with one timed step per case instead of two (this test's time; the dry run keeps them)
    monkeypatch.setitem(training.BENCH, "cpu", {**training.BENCH["cpu"], "pad_batches": 1})
    seen = []
    ctx = Context(
        out=tmp_path, work=tmp_path, dry_run=True, device="cpu", shape="tiny", progress=lambda **k: seen.append(k)
    )
    result = padding.step_bench_padding(ctx)
    assert result["ok"], result["line"]
    assert (
        result["micro_batches"] == [4, 2] and result["speed_choice"]["micro_batch"] == 2
    )  # the CPU keeps the recipe's
    cases = result["cases"]
    assert len(cases) == 4 * 2 * 2 and seen  # progress after each case
    for key, case in cases.items():
        if case["kernel"] == "varlen":
            assert "CUDA" in case["skipped"]
            continue
        assert case["tokens_per_second"] > 0 and case["predicted_gb"] > 0, key
        if case["kernel"] != "fixed":
            assert case["of_fixed"] > 0
    assert result["isolation"]["isolated"] and result["first_losses_agree"]
    # the dense case on the padding-free row: SDPA; its sizer figure counts the mask
    assert cases["dense mb4 ckpt"]["implementation"] == "sdpa"
    assert cases["dense mb4 no-ckpt"]["predicted_gb"] >= cases["fixed mb4 no-ckpt"]["predicted_gb"]
    assert "mb4 ckpt: varlen skipped, dense" in result["line"]

    # a card the sizer says holds only the dense cases: the others are skipped before they start; a kernel that
    # fails (here: token ids past the vocabulary) is recorded per case and fails the step, the next case still runs
    monkeypatch.setattr(padding, "_capacity_gb", lambda device: 1.0)
    monkeypatch.setattr(padding, "_predicted_gb", lambda arch, kernel, *a: 0.5 if kernel == "dense" else 2.0)
    broken = padding.dense_batch
    monkeypatch.setitem(
        padding.BATCHES,
        "dense",
        lambda g, device: {**broken(g, device), "input_ids": broken(g, device)["input_ids"] + 10**6},
    )
    small = padding.step_bench_padding(ctx)
    assert not small["ok"] and "failed: IndexError" in small["line"]
    for key, case in small["cases"].items():
        if case["kernel"] == "dense":
            assert case["failed"] and case["error"].startswith("IndexError"), key
        else:
            assert "skipped" in case and "tokens_per_second" not in case, key


@pytest.mark.slow
def test_failed_and_hung_steps_are_recorded_and_the_next_step_runs(tmp_path):
    """Real steps: one killed by its timeout while building, then one passing, then one failing with its reason."""
    env = _env(
        tmp_path,
        GPU_CHECK_STEPS="tiny-model,bench-lora,peak-memory",
        GPU_CHECK_TIMEOUTS="tiny-model=1",
        GPU_CHECK_SHAPE="no-such-model",
    )
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    lines = [x for x in out.splitlines() if x.strip().split(" ")[0] in ("ok", "FAIL", "TIMEOUT", "CRASH")]
    assert [x.split()[1].rstrip(":") for x in lines] == ["tiny-model", "peak-memory", "bench-lora"], out
    assert lines[0].split()[0] == "TIMEOUT" and "timed out after 1 s" in lines[0]
    assert lines[1].split()[0] == "ok"
    assert lines[2].split()[0] == "FAIL" and "GPU_CHECK_SHAPE='no-such-model'" in lines[2]
    results = tmp_path / "out"
    summary = json.loads((results / "summary.json").read_text())
    statuses = {s["step"]: s["status"] for s in summary["steps"]}
    assert (statuses["tiny-model"], statuses["bench-lora"], statuses["peak-memory"]) == (
        "timed out",
        "failed",
        "passed",
    )
    assert json.loads((results / "bench-lora.json").read_text())["traceback"]
    assert "2 step(s) failed" in out


def test_the_loss_head_step_compares_the_losses_and_skips_without_trls_kernel(tmp_path, monkeypatch):
    """The loss-head step on the dry run's shape: the model's own loss, trl's fused head and ftrun's CPU kernel agree
    (loss and gradients); without trl's kernel importable it is skipped with the carry it needs."""
    from gpu_check import loss_head

    ctx = common.Context(
        out=tmp_path, work=tmp_path, dry_run=True, device="cpu", shape="tiny", progress=lambda **k: None
    )
    result = loss_head.step_loss_head(ctx)
    assert result["ok"] is True and set(result["agree"]) == {
        "model's own loss",
        "trl fused LM head",
        "ftrun CPU kernel",
    }
    assert len({r["loss"] for r in result["runs"].values()}) == 1
    monkeypatch.setattr(loss_head, "_fused_kernel", lambda: None)
    skipped = loss_head.step_loss_head(ctx)
    assert skipped["ok"] is None and ".cache/device-wheels" in skipped["line"]


def test_bench_padding_decides_the_padding_free_share_on_a_gpu_from_its_worst_case():
    """The call's report reads bench-padding's `decides` (runner.DECIDING): the kernel a padding-free run uses on the
    box (varlen where it is there), its worst share of the fixed shape; nothing decided on a CPU."""
    from gpu_check import padding

    def case(kernel, mb, ckpt, tps):
        return {
            "kernel": kernel,
            "micro_batch": mb,
            "checkpointing": ckpt,
            "tokens_per_second": tps,
            "peak_memory_gb": 1.0,
            "losses": [2.0],
        }

    def result(varlen):
        cases = {}
        for mb, ckpt, fixed, vl, dense in ((8, True, 1000.0, 900.0, 600.0), (8, False, 1200.0, 960.0, 700.0)):
            key = "ckpt" if ckpt else "no-ckpt"
            cases[f"fixed mb{mb} {key}"] = case("fixed", mb, ckpt, fixed)
            cases[f"dense mb{mb} {key}"] = case("dense", mb, ckpt, dense)
            if varlen:
                cases[f"varlen mb{mb} {key}"] = case("varlen", mb, ckpt, vl)
        return {
            "shape": "8b",
            "mean_length": 500,
            "micro_batches": [8],
            "speed_choice": {"micro_batch": 8},
            "isolation": {"isolated": True},
            "varlen_available": varlen,
            "cases": cases,
            "kernels": {
                "varlen": "ftrun_varlen" if varlen else None,
                "dense": "sdpa",
                "padded": "sdpa",
                "fixed": "sdpa",
            },
        }

    got = padding._summary(result(True), "cuda")["decides"]["padding-free"]
    assert got["value"] == 0.8 and got["met"] is False and "varlen mb8 no-ckpt" in got["says"]
    dense = padding._summary(result(False), "cuda")["decides"]["padding-free"]
    assert dense["value"] == round(700 / 1200, 3) and "sdpa" in dense["says"]
    assert "decides" not in padding._summary(result(True), "cpu")
