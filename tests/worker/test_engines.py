"""Engines for real on CPU: DDP over 2 gloo processes end to end, the engine checks that stop a wrong launch,
trajectory equivalence (DDP 2 x g == 1 x 2g), kill -9 + resume under DDP, a DDP-2 checkpoint resumed on 1 process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import (
    REPO,
    ftrun,
    has_checkpoint,
    is_training,
    metrics,
    polled_status,
    prepared_run,
    read_state,
    run_in_slices,
    status,
    wait_for,
    wait_until_ended,
)

from launcher.errors import PlanError
from launcher.plan.hardware import from_spec
from launcher.plan.plan import make_plan
from launcher.recipe_loading import validate_recipe

# A quick run: no smoke test, no export (tested elsewhere), so the time goes to the engine.
QUICK = ("smoke.enabled=false", "export=[]")
DATA = SimpleNamespace(
    examples=400,
    total_tokens=400 * 120,
    mean_tokens=120.0,
    max_tokens=256,
    over_max_length=0,
    tokens_source="tokenizer",
)


def cpu_box(cores=2):
    return from_spec("cpu").__class__((), "none", cores, 24.0, "detected")


def _plan(tmp_path, tiny_model, hw, **fields):
    base = {
        "model": str(tiny_model),
        "method": "lora",
        "data": "d.jsonl",
        "max_length": 256,
        "micro_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "max_steps": 12,
    }
    base.update(fields)
    return make_plan(validate_recipe(base, tmp_path, "r"), hw, DATA, unsloth_available=False)


# --- the plan honours a forced engine and process count, or refuses with the reason ----------------


@pytest.mark.parametrize(
    "fields, engine, n",
    [
        ({"engine": "ddp"}, "ddp", 2),
        ({"engine": "ddp", "num_processes": 2}, "ddp", 2),
        ({"num_processes": 2}, "ddp", 2),  # auto with several processes means data parallel
        ({}, "trl", 1),
        ({"num_processes": 1}, "trl", 1),
    ],
)
def test_cpu_plan_honours_engine_and_process_count(tmp_path, tiny_model, fields, engine, n):
    p = _plan(tmp_path, tiny_model, cpu_box(), **fields)
    assert (p.engine, p.num_processes, p.device) == (engine, n, "cpu")
    if n > 1:
        assert any("gloo processes" in r for r in p.reasons)


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"engine": "ddp", "num_processes": 3}, "3 gloo processes need at least 3 CPU cores, this box has 2"),
        ({"engine": "ddp", "num_processes": 1}, "single-process training; use engine: trl"),
        ({"engine": "trl", "num_processes": 2}, "engine: trl is one process"),
        ({"engine": "fsdp"}, "silently becomes DDP"),
        ({"engine": "unsloth"}, "Unsloth needs an NVIDIA GPU"),
    ],
)
def test_cpu_plan_refuses_impossible_engines_with_the_reason(tmp_path, tiny_model, fields, why):
    with pytest.raises(PlanError) as err:
        _plan(tmp_path, tiny_model, cpu_box(), **fields)
    assert why in err.value.message


@pytest.mark.parametrize(
    "box, fields, counts",
    [
        (cpu_box(), {"num_processes": 8}, ("auto", "2")),
        (cpu_box(), {"num_processes": 8, "engine": "ddp"}, ("auto", "2")),
        (from_spec("4xH100-80GB"), {"num_processes": 8}, ("auto", "4")),
    ],
)
def test_a_process_count_refusal_advises_the_process_count(tmp_path, tiny_model, box, fields, counts):
    """The fix addresses the refusal's cause: num_processes, set to auto or to the box's count, each of which plans;
    nothing about method or batch (which fit only because they were tried with another process count), no empty
    Fix: line."""
    with pytest.raises(PlanError) as err:
        _plan(tmp_path, tiny_model, box, **fields)
    options = err.value.plan.refusal["options"]
    text = " ".join(options)
    for count in counts:
        assert f"num_processes={count}" in text, options
    assert not any(word in text for word in ("qlora", "micro_batch_size", "max_length", "rent ")), options
    lines = err.value.render().splitlines()
    assert not [line for line in lines if line.strip() == "Fix:"], lines
    for count in counts:
        assert _plan(tmp_path, tiny_model, box, **{**fields, "num_processes": count}).fits


def test_cpu_plan_refuses_deepspeed_when_not_installed(tmp_path, tiny_model, monkeypatch):
    from launcher.plan import engine_software

    monkeypatch.setattr(engine_software, "_deepspeed_installed", lambda: False)
    with pytest.raises(PlanError) as err:
        _plan(tmp_path, tiny_model, cpu_box(), engine="deepspeed")
    assert "pip install 'ftrun[deepspeed]'" in err.value.message


def test_gpu_plan_honours_process_count_or_refuses(tmp_path):
    llama = {
        "model": "meta-llama/Llama-3.1-8B",
        "method": "qlora",
        "max_length": 2048,
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 8,
        "max_steps": None,
    }
    p = _plan(tmp_path, "x", from_spec("4xH100-80GB"), **llama, engine="ddp", num_processes=2)
    assert (p.engine, p.num_processes) == ("ddp", 2)
    assert any("2 of the box's 4 cards stay idle" in r for r in p.reasons)
    p = _plan(tmp_path, "x", from_spec("4xH100-80GB"), **llama, num_processes=4)
    assert (p.engine, p.num_processes) == ("ddp", 4)
    with pytest.raises(PlanError, match="num_processes=8 needs 8 GPUs, this box has 4"):
        _plan(tmp_path, "x", from_spec("4xH100-80GB"), **llama, num_processes=8)
    with pytest.raises(PlanError, match="engine: trl is one process|engine trl runs 1 process"):
        _plan(tmp_path, "x", from_spec("4xH100-80GB"), **llama, engine="trl", num_processes=2)


# --- DDP end to end, recorded and verified ---------------------------------------------------------


@pytest.mark.slow  # two gloo processes under torchrun: the multi-process tests are the slow tier's
def test_ddp_two_gloo_processes_end_to_end(write_recipe, tmp_path):
    recipe = write_recipe(max_steps=6)
    t0 = time.monotonic()
    res = ftrun(recipe, "engine=ddp", "num_processes=2", "--foreground", *QUICK, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    run = tmp_path / "run"
    plan = json.loads((run / "plan.json").read_text())
    assert (plan["engine"], plan["num_processes"]) == ("ddp", 2)
    assert plan["launch_argv"][1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    st = read_state(run)
    assert st["engine"] == "ddp" and st["launch_argv"] == plan["launch_argv"]
    v = st["verification"]
    assert v["ok"] and v["world_size"] == 2
    assert {c["check"]: c["ok"] for c in v["checks"]} == {
        "world size": True,
        "process group timeout": True,
        "process group backend": True,
        "model wrapped in DistributedDataParallel": True,
    }
    s = status(run, tmp_path)
    assert s["state"] == "succeeded" and s["world_size"] == 2 and s["verification"]["ok"]
    text = ftrun("status", run, cwd=tmp_path).stdout
    assert "engine ddp x 2 process(es), verified: world size 2 process(es)" in text
    assert "launched: " in text and "--nproc_per_node=2" in text
    assert [r["step"] for r in metrics(run)] == list(range(1, 7))
    # both ranks' RNG states are in the checkpoint: every rank wrote before rank 0 sealed it
    files = json.loads((run / "checkpoints" / "step-000006" / "manifest.json").read_text())["files"]
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(files)
    print(f"DDP 2 procs, 6 steps, end to end: {time.monotonic() - t0:.1f}s")


def _worker_env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")


def test_plan_for_two_processes_launched_as_one_is_stopped_before_training(write_recipe, tmp_path):
    # accelerate's `--cpu --num_processes 2` silently starts ONE process (STACK-FACTS): the worker refuses.
    run = prepared_run(write_recipe(max_steps=6), "engine=ddp", "num_processes=2")
    t0 = time.monotonic()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--cpu",
            "--num_processes",
            "2",
            "-m",
            "launcher.worker.train",
            "--run-dir",
            str(run),
            "--mode",
            "full",
        ],
        cwd=REPO,
        env=_worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode != 0
    assert "the plan asks for 2 process(es) but 1 were started" in res.stderr
    assert not (run / "metrics.jsonl").exists()  # stopped before the first step
    info = json.loads((run / "worker.json").read_text())
    assert info["verification"]["ok"] is False and "1 were started" in info["error"]
    print(f"accelerate --cpu --num_processes 2 refused after {time.monotonic() - t0:.1f}s")

    # Through the supervisor: a plan saying 2 processes whose launch starts one fails, not restarts.
    plan = json.loads((run / "plan.json").read_text())
    plan["engine"] = "trl"  # launched as a single process, the plan still says 2
    (run / "plan.json").write_text(json.dumps(plan))
    (run / "worker.json").unlink()
    res = subprocess.run(
        [sys.executable, "-m", "launcher.run.supervisor", "--run-dir", str(run)],
        cwd=REPO,
        env=_worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 5, res.stdout + res.stderr
    st = read_state(run)
    assert st["state"] == "failed" and "the plan asks for 2 process(es) but 1 were started" in st["reason"]
    assert st.get("restarts", 0) == 0
    text = ftrun("status", run, cwd=tmp_path).stdout
    assert "NOT verified: world size 1 process(es), plan 2" in text


# --- same trajectory, kill -9, resume across world sizes (slow: several multi-process runs) ---------


def _run(write_recipe, tmp_path, name, *overrides, **fields):
    recipe = write_recipe(f"{name}.yaml", output_dir=str(tmp_path / name), **fields)
    t0 = time.monotonic()
    res = ftrun(recipe, "--foreground", *QUICK, *overrides, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    return tmp_path / name, time.monotonic() - t0


def _adapter(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "final" / "adapter" / "adapter_model.safetensors"))


def _step_seconds(run: Path) -> float:
    """Median wall time per optimizer step, from the metrics' timestamps (warm-up step excluded)."""
    t = [r["time"] for r in metrics(run)]
    d = sorted(b - a for a, b in zip(t[1:], t[2:]))
    return d[len(d) // 2]


@pytest.mark.slow
def test_ddp_two_processes_follow_the_single_process_trajectory(write_recipe, tmp_path):
    """DDP 2 x (micro-batch 8, accumulation 1) == 1 process x (micro-batch 8, accumulation 2)."""
    import torch

    fields = dict(max_steps=8, micro_batch_size=4, checkpoint_every_minutes=10)  # one save, at the end
    one, t_one = _run(write_recipe, tmp_path, "one", "gradient_accumulation_steps=2", **fields)
    ddp, t_ddp = _run(write_recipe, tmp_path, "ddp", "engine=ddp", "num_processes=2", **fields)
    a, b = metrics(one), metrics(ddp)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 9))
    diffs = [abs(x["loss"] - y["loss"]) for x, y in zip(a, b)]
    assert max(diffs) < 1e-4, diffs
    # the comparison can fail: one process with accumulation 1 sees half the data per step and drifts away
    half, _ = _run(write_recipe, tmp_path, "half", **fields)
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(metrics(half)[1:], b[1:])) > 1e-3
    assert a[-1]["loss"] < a[0]["loss"]  # it trained: the comparison is not between two flat lines
    ta, tb = _adapter(one), _adapter(ddp)
    worst = max((ta[k] - tb[k]).abs().max().item() for k in ta)
    assert worst < 1e-4, worst
    assert any(not torch.equal(ta[k], torch.zeros_like(ta[k])) for k in ta)
    print(
        f"loss max |diff| {max(diffs):.2e}, adapter max |diff| {worst:.2e}; "
        f"step time 1 proc {_step_seconds(one):.3f}s, DDP-2 {_step_seconds(ddp):.3f}s; "
        f"wall {t_one:.0f}s vs {t_ddp:.0f}s"
    )


def _kill_run_after_checkpoint(run: Path) -> None:
    """Machine loss: SIGKILL the supervisor's whole process group (torchrun and both ranks) after a checkpoint. Once
    it trains, the group runs in slices (helpers.run_in_slices): on a fast box the wall-clock checkpoint would
    otherwise be the final one."""
    wait_for(lambda: read_state(run).get("supervisor_pid") and is_training(run), 240, "training to start", 0.05)
    pgid = os.getpgid(read_state(run)["supervisor_pid"])
    run_in_slices((pgid,), lambda: has_checkpoint(run), "a checkpoint", 240, group=True)
    assert not (run / "final").exists(), "the run finished before it could be interrupted"
    os.killpg(pgid, signal.SIGKILL)


@pytest.mark.slow
def test_ddp_kill9_then_resume_is_exact(write_recipe, tmp_path):
    fields = dict(max_steps=24, checkpoint_every_minutes=0.02)
    ref, _ = _run(write_recipe, tmp_path, "ref", "engine=ddp", "num_processes=2", **fields)
    recipe = write_recipe(max_restarts=0, **fields)
    assert ftrun(recipe, "engine=ddp", "num_processes=2", *QUICK, cwd=tmp_path).returncode == 0
    run = tmp_path / "run"
    _kill_run_after_checkpoint(run)
    wait_for(lambda: polled_status(run)["state"] == "interrupted", 30, "state interrupted")
    res = ftrun(recipe, "engine=ddp", "num_processes=2", *QUICK, cwd=tmp_path)
    assert res.returncode == 0 and "continuing" in res.stdout, res.stdout + res.stderr
    wait_until_ended(run, tmp_path)
    assert "resuming from step-" in (run / "train.log").read_text()
    a, b = metrics(ref), metrics(run)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    ta, tb = _adapter(ref), _adapter(run)
    import torch

    assert all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.slow
def test_lora_checkpoint_from_ddp2_resumes_on_one_process(write_recipe, tmp_path):
    fields = dict(max_steps=24, checkpoint_every_minutes=0.02)
    recipe = write_recipe(max_restarts=0, **fields)
    assert ftrun(recipe, "engine=ddp", "num_processes=2", *QUICK, cwd=tmp_path).returncode == 0
    run = tmp_path / "run"
    _kill_run_after_checkpoint(run)
    wait_for(lambda: polled_status(run)["state"] == "interrupted", 30, "state interrupted")
    resumed_at = max(
        int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*") if (p / "manifest.json").is_file()
    )
    res = ftrun(recipe, "--foreground", *QUICK, cwd=tmp_path)  # engine auto: one process on this box
    assert res.returncode == 0, res.stdout + res.stderr
    log = (run / "train.log").read_text() + res.stdout  # --foreground: the worker prints to our stdout
    assert "was written by engine ddp on 2 process(es), resuming with trl on 1" in log
    assert read_state(run)["verification"]["world_size"] == 1
    steps = [r["step"] for r in metrics(run)]
    assert steps == list(range(1, 25)) and resumed_at < 24


# --- DeepSpeed ZeRO-3 ---------------------------------------------------------------------------------


def test_deepspeed_config_is_generated_from_the_plan(write_recipe, tmp_path):
    from launcher.worker.engines import launch_command, trainer_fields

    run = prepared_run(write_recipe(max_steps=6, gradient_accumulation_steps=3), "engine=ddp", "num_processes=2")
    plan = json.loads((run / "plan.json").read_text())
    plan["engine"] = "deepspeed"  # planned on a box without DeepSpeed too: only the file is checked here
    argv = launch_command(plan, run, "full")
    assert argv[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cfg = json.loads((run / "deepspeed.json").read_text())
    assert cfg["zero_optimization"]["stage"] == 3
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"]) == (
        8,
        3,
        8 * 3 * 2,
    )
    assert cfg["bf16"]["enabled"] == "auto"  # the worker's device decides, the Trainer fills it in
    assert trainer_fields(plan, run) == {"deepspeed": str(run / "deepspeed.json")}
    assert cfg["checkpoint"] == {"use_node_local_storage": False}

    # two boxes of 2 processes, each with its own disk: the batch counts every node's processes (DeepSpeed checks
    # train_batch_size = micro x accumulation x world), and each node keeps a complete checkpoint of its own
    plan["nodes"] = {"nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.1", "master_port": 29500}
    launch_command(plan, run, "full")
    cfg = json.loads((run / "deepspeed.json").read_text())
    assert cfg["train_batch_size"] == 8 * 3 * 4
    assert cfg["checkpoint"] == {"use_node_local_storage": True}
    assert trainer_fields(plan, run) == {"deepspeed": str(run / "deepspeed.json"), "save_on_each_node": True}


@pytest.mark.slow  # DeepSpeed is installed for the slow tier (.ci/run), after the default tier
def test_a_run_on_another_engine_does_not_import_deepspeed_to_unwrap_its_model(tiny_model):
    """TRL's trainers ask accelerate whether the model is a PEFT model inside a DeepSpeedEngine; a run on another
    engine answers without importing DeepSpeed, a DeepSpeed run keeps accelerate's own check."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed here: nothing to leave unimported")
    probe = (
        "import sys\n"
        "from transformers import AutoModelForCausalLM\n"
        "from peft import LoraConfig, get_peft_model\n"
        "from accelerate.utils import is_peft_model\n"
        "from launcher.worker.unused_libraries import skip_deepspeed_unwrapping\n"
        "skip_deepspeed_unwrapping(sys.argv[2])\n"
        "base = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "model = get_peft_model(base, LoraConfig(target_modules='all-linear'))\n"
        "print(is_peft_model(model), 'deepspeed' in sys.modules)\n"
    )
    seen = {}
    for engine in ("trl", "deepspeed"):
        res = subprocess.run(
            [sys.executable, "-c", probe, str(tiny_model), engine],
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        assert res.returncode == 0, res.stderr[-2000:]
        seen[engine] = res.stdout.split()[-2:]
    assert seen == {"trl": ["True", "False"], "deepspeed": ["True", "True"]}


def test_resume_across_world_sizes_is_allowed_for_trainer_checkpoints_and_refused_for_zero():
    from launcher.worker.engines import resume_compatibility

    note, refused = resume_compatibility(
        {"step": 20, "engine": "ddp", "world_size": 2}, {"engine": "trl", "num_processes": 1}
    )
    assert not refused and "loads on any count" in note and "global batch" in note
    assert resume_compatibility(
        {"step": 20, "engine": "ddp", "world_size": 2}, {"engine": "ddp", "num_processes": 2}
    ) == ("", False)
    note, refused = resume_compatibility(
        {"step": 20, "engine": "deepspeed", "world_size": 2}, {"engine": "deepspeed", "num_processes": 4}
    )
    assert refused and "does not load them on 4" in note and "engine=deepspeed num_processes=2" in note
    note, refused = resume_compatibility(
        {"step": 20, "engine": "ddp", "world_size": 2}, {"engine": "deepspeed", "num_processes": 2}
    )
    assert refused and "different layouts" in note
    # two nodes of one process each: the checkpoint's world of 2 is the same world
    assert resume_compatibility(
        {"step": 20, "engine": "deepspeed", "world_size": 2},
        {"engine": "deepspeed", "num_processes": 1, "nodes": {"nnodes": 2}},
    ) == ("", False)


@pytest.mark.slow
def test_deepspeed_zero3_two_processes_follows_ddp(write_recipe, tmp_path):
    pytest.importorskip("deepspeed")
    import torch

    fields = dict(max_steps=6, micro_batch_size=4, checkpoint_every_minutes=10)
    ddp, t_ddp = _run(write_recipe, tmp_path, "ddp", "engine=ddp", "num_processes=2", **fields)
    zero, t_zero = _run(write_recipe, tmp_path, "zero", "engine=deepspeed", "num_processes=2", **fields)
    v = read_state(zero)["verification"]
    assert v["ok"] and v["engine"] == "deepspeed" and v["world_size"] == 2
    part = next(c for c in v["checks"] if c["check"] == "parameters partitioned")
    assert part["ok"] and "this process holds" in part["seen"]
    # the group DeepSpeed's init_distributed created has the plan's timeout, not DeepSpeed's 10 minutes
    from launcher.plan.deadlines import process_group_timeout

    want = process_group_timeout(
        json.loads((zero / "plan.json").read_text()),
        json.loads((zero / "smoke.json").read_text()) if (zero / "smoke.json").is_file() else {},
    )
    timeout = next(c for c in v["checks"] if c["check"] == "process group timeout")
    assert timeout["ok"] and timeout["seen"] == f"{want:g} s (gloo), trainer ddp_timeout {want} s", timeout
    assert want != 600
    a, b = metrics(ddp), metrics(zero)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 7))
    diffs = [abs(x["loss"] - y["loss"]) for x, y in zip(a, b)]
    assert max(diffs) < 2e-3, diffs
    ta, tb = _adapter(ddp), _adapter(zero)
    assert ta.keys() == tb.keys()
    worst = max((ta[k] - tb[k].to(ta[k].dtype)).abs().max().item() for k in ta)
    assert worst < 1e-3, worst
    assert any(not torch.equal(ta[k], torch.zeros_like(ta[k])) for k in ta)
    print(
        f"ZeRO-3 vs DDP: loss max |diff| {max(diffs):.2e}, adapter max |diff| {worst:.2e}; step time DDP "
        f"{_step_seconds(ddp):.3f}s, ZeRO-3 {_step_seconds(zero):.3f}s; wall {t_ddp:.0f}s vs {t_zero:.0f}s"
    )


# --- FSDP2: sharding exercised for real with fully_shard; the accelerate/Trainer path caught on CPU ----


def test_fsdp_accelerate_config_is_generated_from_the_plan(write_recipe, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    from launcher.worker.engines import launch_command, trainer_fields

    run = prepared_run(write_recipe(max_steps=6), "engine=ddp", "num_processes=2")
    plan = json.loads((run / "plan.json").read_text())
    plan.update(engine="fsdp", device="cuda")
    argv = launch_command(plan, run, "full")
    assert argv[1:5] == ["-m", "accelerate.commands.launch", "--config_file", str(run / "accelerate_fsdp.yaml")]
    cfg = load_config_from_file(str(run / "accelerate_fsdp.yaml"))  # accelerate itself reads it
    assert cfg.distributed_type == "FSDP" and cfg.num_processes == 2 and cfg.mixed_precision == "bf16"
    fsdp = cfg.fsdp_config
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT" and fsdp["fsdp_cpu_ram_efficient_loading"]
    assert fsdp["fsdp_activation_checkpointing"] is True
    assert trainer_fields(plan, run) == {"activation_checkpointing": False}


@pytest.mark.slow  # two gloo processes: the multi-process tests are the slow tier's
@pytest.mark.parametrize("method", ["lora", "full"])
def test_fully_shard_on_gloo_shards_the_worker_model_and_trains_like_unsharded(write_recipe, tmp_path, method, request):
    """...and the worker's FSDP final save (launcher.worker.engines.fsdp.save_full, each tensor gathered on every rank,
    written by rank 0) writes what the unsharded model's own save_pretrained writes; a whole model in the base's
    dtype (the full case fine-tunes a bf16 base in fp32, as FSDP2's upcast does on a GPU)."""
    base = {"model": str(request.getfixturevalue("tiny_model_bf16"))} if method == "full" else {}
    run = prepared_run(write_recipe(max_steps=6, method=method, **base), "engine=ddp", "num_processes=2")
    out, final_dir = tmp_path / "fsdp.json", tmp_path / "final"
    t0 = time.monotonic()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(REPO / "tests" / "fsdp_exercise.py"),
            "--run-dir",
            str(run),
            "--steps",
            "4",
            "--out",
            str(out),
            "--final-dir",
            str(final_dir),
        ],
        cwd=REPO,
        env=_worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["ok"] and r["world_size"] == 2 and r["wrapped_layers"] == 2
    assert r["sharded"] == r["parameters"] > 0 and r["trainable"] > 0  # LoRA included
    assert r["local_values"] < r["global_values"]
    assert r["max_loss_diff"] < 1e-4 and r["losses_sharded"][-1] < r["losses_sharded"][0]
    f = r["final_save"]
    assert f["ok"] and f["same_keys"] and f["same_shapes"] and f["trained_values"] and f["verified_ok"], f
    assert f["dispatch"]  # is_sharded: true for the sharded model, false for the unsharded one
    # vs the unsharded training: float rounding only (cast to the saved dtype: at most one step of it); what
    # reloads is exactly what the sharded model holds, cast to the saved dtype
    assert f["within_rounding"] and f["reload_max_abs_diff"] == 0.0
    if method == "lora":  # the adapter, not the frozen base (nor the tied head under its second name)
        assert f["trainable_tensors"] == f["tensors"] > 0 and f["max_abs_diff"] <= 1e-4
        assert f["gathered_frozen"] == []
        assert f["tensor_dtypes"] == ["float32"]  # PEFT's fp32 adapter weights, as trl writes them
        assert {p.name for p in (final_dir / "sharded").iterdir()} >= {
            "adapter_config.json",
            "adapter_model.safetensors",
        }
    else:
        assert f["architectures"] == ["Qwen3ForCausalLM"] and f["tensors"] > 0
        # trained in fp32, written in the base's bf16, and config.json says so
        assert f["expected_dtype"] == "bfloat16" and f["tensor_dtypes"] == ["bfloat16"]
        assert f["config_dtype"] == "bfloat16" and f["dtype_ok"]
        assert f["values_unequal"] < f["values"] // 100  # most values round the same way in both trainings
    print(
        f"fully_shard 2 ranks ({method}): {r['sharded']}/{r['parameters']} sharded, {r['local_values']:,} of "
        f"{r['global_values']:,} values per rank, loss diff {r['max_loss_diff']:.1e}; final save: {f['tensors']} "
        f"tensors in {f['tensor_dtypes']}, max |diff| {f['max_abs_diff']:.1e} ({f['values_unequal']} of "
        f"{f['values']} values unequal), {f['verified']}; {time.monotonic() - t0:.0f}s"
    )


@pytest.mark.slow
def test_fsdp_through_accelerate_on_cpu_is_caught_as_not_sharded(write_recipe, tmp_path):
    """On CPU accelerate turns the FSDP2 config into DDP: the worker's check refuses to train."""
    run = prepared_run(write_recipe(max_steps=6), "engine=ddp", "num_processes=2")
    plan = json.loads((run / "plan.json").read_text())
    plan["engine"] = "fsdp"  # the CPU plan refuses fsdp; this is what a plan made for GPUs would launch
    (run / "plan.json").write_text(json.dumps(plan))
    res = subprocess.run(
        [sys.executable, "-m", "launcher.run.supervisor", "--run-dir", str(run)],
        cwd=REPO,
        env=_worker_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert res.returncode == 5, res.stdout[-3000:] + res.stderr[-3000:]
    st = read_state(run)
    assert st["state"] == "failed" and st.get("restarts", 0) == 0
    assert st["launch_argv"][1:3] == ["-m", "accelerate.commands.launch"]
    checks = {c["check"]: c for c in st["verification"]["checks"]}
    assert not checks["parameters sharded"]["ok"] and "0 of" in checks["parameters sharded"]["seen"]
    assert not checks["model wrapped by FSDP2 (fully_shard)"]["ok"]
    assert "NOT verified" in st["reason"]
    assert not (run / "metrics.jsonl").exists()  # stopped before the first step


@pytest.mark.gpu
@pytest.mark.skipif(
    not __import__("torch").cuda.is_available() or __import__("torch").cuda.device_count() < 2,
    reason="FSDP sharding through accelerate needs 2 or more CUDA GPUs",
)
def test_fsdp_on_gpus_end_to_end_is_verified_sharded(write_recipe, tmp_path):
    res = ftrun(write_recipe(max_steps=6), "engine=fsdp", "num_processes=2", "--foreground", *QUICK, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    v = read_state(tmp_path / "run")["verification"]
    assert v["ok"] and {c["check"] for c in v["checks"]} >= {
        "parameters sharded",
        "model wrapped by FSDP2 (fully_shard)",
    }
