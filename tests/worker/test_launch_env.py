"""The workers' environment from plan.json: NCCL without P2P/IB on RTX 40-series cards with an old driver
(accelerate 1.15 raises in the worker otherwise), the user's own settings kept, CPU threads split."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.worker.engines import launch_env
from launcher.plan.hardware import from_spec
from launcher.plan.plan import make_plan
from launcher.recipe_loading import validate_recipe

REPO = Path(__file__).resolve().parents[2]

DATA = SimpleNamespace(
    examples=10_000,
    total_tokens=5_000_000,
    mean_tokens=500.0,
    max_tokens=2048,
    over_max_length=0,
    tokens_source="tokenizer",
)
NCCL = ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE")


@pytest.fixture(autouse=True)
def _no_user_nccl(monkeypatch):
    for var in (*NCCL, "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)


def plan_json(tmp_path, spec: str, driver: str | None, engine: str = "ddp") -> dict:
    """plan.json as make_plan writes it, for a detected box of `spec` cards on `driver`."""
    hw = replace(from_spec(spec), source="detected", driver_version=driver)
    recipe = validate_recipe(
        {
            "model": "meta-llama/Llama-3.1-8B",
            "method": "qlora",
            "data": "d.jsonl",
            "max_length": 2048,
            "engine": engine,
        },
        tmp_path,
        "r",
    )
    plan = make_plan(recipe, hw, DATA, unsloth_available=False).to_dict()
    assert plan["hardware"]["driver_version"] == driver  # what launch_env reads travels in plan.json
    return plan


def test_rtx4090_old_driver_ddp_turns_p2p_and_ib_off(tmp_path):
    plan = plan_json(tmp_path, "2xRTX4090", "535.129.03")
    assert (plan["engine"], plan["num_processes"]) == ("ddp", 2)
    env = launch_env(plan)
    assert {k: env.get(k) for k in NCCL} == {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}


def test_rtx4090_old_driver_single_process_too(tmp_path):
    """accelerate counts every card nvidia-smi lists, so one process on a 2-card box is stopped as well."""
    plan = plan_json(tmp_path, "2xRTX4090", "535.129.03", engine="trl")
    assert plan["num_processes"] == 1
    assert all(launch_env(plan).get(k) == "1" for k in NCCL)


@pytest.mark.parametrize(
    "spec,driver", [("2xRTX4090", "550.40.07"), ("2xRTX4090", "565.57.01"), ("2xH100-80GB", "535.129.03")]
)
def test_new_driver_or_other_card_leaves_nccl_alone(tmp_path, spec, driver):
    env = launch_env(plan_json(tmp_path, spec, driver))
    assert not set(NCCL) & set(env)


def test_users_own_setting_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")
    env = launch_env(plan_json(tmp_path, "2xRTX4090", "535.129.03"))
    assert "NCCL_P2P_DISABLE" not in env and env["NCCL_IB_DISABLE"] == "1"


def test_cpu_plan_sets_no_nccl():
    plan = {"device": "cpu", "num_processes": 2, "engine": "ddp", "hardware": {"gpus": [], "driver_version": None}}
    env = launch_env(plan)
    assert not set(NCCL) & set(env) and env["OMP_NUM_THREADS"]


def test_the_worker_keeps_known_notices_and_deprecations_out_of_the_log():
    """The worker's imports: bitsandbytes' CPU notice about the optional `kernels` package and FutureWarnings go
    nowhere; the same loggers' other messages still show. Real imports, in a child. The notice is raised by the
    probe itself on bitsandbytes' logger, in the wording older releases print (bitsandbytes 0.50.2 no longer prints
    it): the test proves the filter, not a library's wording, and a release that prints it again is caught too."""
    import subprocess

    probe = (
        "import logging, warnings\n"
        "{first}"
        "import bitsandbytes\n"
        "warnings.warn('gradient_checkpointing_enable is deprecated', FutureWarning)\n"
        "ops = logging.getLogger('bitsandbytes.backends.cpu.ops')\n"
        "ops.warning('Failed to load CPU gemm_4bit_forward from kernels-community: No module named kernels')\n"
        "ops.warning('a real bitsandbytes warning')\n"
        "logging.getLogger('DeepSpeed').warning('Setting accelerator to CPU')\n"
    )
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    bare = subprocess.run(
        [sys.executable, "-c", probe.format(first="")], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )
    assert bare.returncode == 0, bare.stderr
    assert "kernels-community" in bare.stderr and "FutureWarning" in bare.stderr  # what the filter is for
    assert "Setting accelerator to CPU" in bare.stderr
    worker = subprocess.run(
        [sys.executable, "-c", probe.format(first="import launcher.worker.train\n")],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert worker.returncode == 0, worker.stderr
    assert "kernels-community" not in worker.stderr and "FutureWarning" not in worker.stderr
    assert "Setting accelerator to CPU" not in worker.stderr and "a real bitsandbytes warning" in worker.stderr


# --- one process, one card (issue 21 item 1) -------------------------------------------------------------------


def _cuda_box(monkeypatch, cards: int) -> None:
    """torch.cuda as a box with `cards` GPUs answers, CUDA_VISIBLE_DEVICES applied the way CUDA applies it: the
    device queries are stubbed, everything above them (accelerate's state, TrainingArguments) is the real code."""
    import torch
    from accelerate.state import AcceleratorState  # noqa: F401 - imported before the stub, as on a real box
    from trl import SFTConfig  # noqa: F401

    def device_count() -> int:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return cards if visible is None else len([e for e in visible.split(",") if e.strip()])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", device_count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)


def _training_args(tmp_path, env: dict[str, str], monkeypatch):
    from accelerate.state import AcceleratorState
    from trl import SFTConfig

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        args = SFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, report_to=[])
        return args.n_gpu, args.train_batch_size
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("engine", ["trl", "unsloth"])
def test_a_single_process_engine_sees_only_its_planned_card(tmp_path, monkeypatch, engine):
    """One process on a 4-card box: without the launch's CUDA_VISIBLE_DEVICES the real TrainingArguments count 4
    GPUs and take a 4x batch (the Trainer then wraps the model in nn.DataParallel); with it, one card, the planned
    batch."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    plan = plan_json(tmp_path, "4xH100-80GB", "550.54.14", engine="trl")
    plan["engine"] = engine  # the single-process rule is the engine's, not the recipe's choice
    env = launch_env(plan)
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    _cuda_box(monkeypatch, 4)
    assert _training_args(tmp_path, {}, monkeypatch) == (4, 8)  # the defect the variable prevents
    assert _training_args(tmp_path, env, monkeypatch) == (1, 2)


@pytest.mark.parametrize(
    "visible,expected",
    [("2,3", "2"), ("GPU-8932f937,GPU-1c2b", "GPU-8932f937"), ("3", None), ("MIG-4f1a", None), ("", None)],
)
def test_the_users_card_choice_is_narrowed_not_replaced(tmp_path, monkeypatch, visible, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    plan = plan_json(tmp_path, "4xH100-80GB", "550.54.14", engine="trl")
    assert launch_env(plan).get("CUDA_VISIBLE_DEVICES") == expected


def test_multi_process_and_cpu_runs_keep_every_card(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert "CUDA_VISIBLE_DEVICES" not in launch_env(plan_json(tmp_path, "4xH100-80GB", "550.54.14", engine="ddp"))
    assert "CUDA_VISIBLE_DEVICES" not in launch_env({"device": "cpu", "engine": "trl", "num_processes": 1})


def test_the_worker_refuses_a_single_process_trainer_that_counts_several_gpus(tmp_path, monkeypatch):
    """engines.verify's single-process check reads the real TrainingArguments' n_gpu: 4 visible cards fail it."""
    from launcher.worker.engines.ddp import single_checks

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _cuda_box(monkeypatch, 4)
    n_gpu, _ = _training_args(tmp_path, {}, monkeypatch)
    trainer = SimpleNamespace(args=SimpleNamespace(n_gpu=n_gpu, train_batch_size=8))
    bad = [c for c in single_checks({"device": "cuda"}, trainer) if not c["ok"]]
    assert [c["check"] for c in bad] == ["one device (no nn.DataParallel)"] and "n_gpu 4" in bad[0]["seen"]
    one = SimpleNamespace(args=SimpleNamespace(n_gpu=1, train_batch_size=2))
    assert all(c["ok"] for c in single_checks({"device": "cuda"}, one))
    cpu = SimpleNamespace(args=SimpleNamespace(n_gpu=0, train_batch_size=2))
    assert all(c["ok"] for c in single_checks({"device": "cpu"}, cpu))


# --- CPU threads per process (issue 21 item 2) -----------------------------------------------------------------


def test_gpu_ranks_get_their_share_of_the_cores_not_one_thread(tmp_path, monkeypatch):
    """torchrun would set OMP_NUM_THREADS=1 for each of 2+ ranks; the launch gives each cores / processes."""
    import launcher.plan.hardware as hardware

    monkeypatch.setattr(hardware, "cpu_cores", lambda notes=None: 16)
    plan = plan_json(tmp_path, "2xRTX4090", "565.57.01", engine="ddp")
    assert launch_env(plan)["OMP_NUM_THREADS"] == "8"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "OMP_NUM_THREADS" not in launch_env(plan)  # the user's own setting reaches the ranks unchanged


def _probe_ctx(tmp_path, device: str):
    """The GPU check's context for its launch-env probes (gpu_check/launch.py), which the slow tier
    runs here rather than in the dry run (scripts/gpu_check.sh --dry-run skips them on the CPU, saying so)."""
    from gpu_check.common import Context

    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return Context(out=tmp_path, work=work, dry_run=False, device=device, shape="tiny", progress=lambda **kw: None)


@pytest.mark.slow
def test_torchrun_keeps_the_launchs_thread_count(tmp_path):
    """Real torchrun, 2 gloo-free ranks: each rank reports the OMP_NUM_THREADS it got and torch's thread count;
    launched with a GPU plan's environment through the GPU check's own probe (gpu_check/launch.py _threads, the code
    the launch-env step runs on a GPU box)."""
    import subprocess

    from launcher.plan.hardware import cpu_cores, threads_per_process
    from gpu_check import launch

    probe = tmp_path / "probe.py"
    # one os.write per line (launch._THREADS): print() under PYTHONUNBUFFERED=1 (CI) writes each piece apart, and
    # the two ranks' pieces interleaved in CI ("RANK 0" lost, 2026-12-03)
    probe.write_text(launch._THREADS)
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(probe)]
    bare = subprocess.run(cmd, capture_output=True, text=True, env=base, timeout=120)
    assert bare.returncode == 0, bare.stderr
    rows = sorted(m.split()[1:] for m in re.findall(r"RANK \d+ \S+ \d+\n", bare.stdout))  # whole lines
    assert rows == [["0", "1", "1"], ["1", "1", "1"]]  # torchrun's default
    env = launch_env({"device": "cuda", "engine": "ddp", "num_processes": 2, "hardware": {"gpus": []}})
    want = str(threads_per_process(cpu_cores(), 2))
    assert env["OMP_NUM_THREADS"] == want  # the launch's share of the cores
    launched = launch._threads(_probe_ctx(tmp_path, "cuda"))  # torchrun with launch_env's environment
    assert launched["ok"] and launched["ranks"] == [["0", want, want], ["1", want, want]], launched


# --- FSDP's rendezvous port (issue 21 item 5) ------------------------------------------------------------------


@pytest.mark.slow
def test_two_fsdp_launches_at_once_each_get_a_free_port(tmp_path):
    """The generated accelerate config, launched twice at the same moment by real `accelerate launch`: each job
    rendezvouses (gloo) on a free port of its own, never the default 29500. (accelerate 1.15 moves off 29500 only
    when it is taken at the moment it checks, utils/launch.py prepare_multi_gpu_env; two launches at once both
    find it free, and the second fails with "address already in use".) Through the GPU check's own probe
    (gpu_check/launch.py _ports, the code the launch-env step runs on a GPU box): the probe writes one line per rank
    with one os.write, since print() under PYTHONUNBUFFERED=1 interleaved two ranks' pieces ("PORT PORT43689
    \n43689\n": 111 of 300 launches in step on this box), and its ranks leave as the worker's do (leave_rank)."""
    from gpu_check import launch

    got = launch._ports(_probe_ctx(tmp_path, "cpu"))
    assert got["ok"] and got["exits"] == [0, 0], got
    # whole lines, both ranks of a job agreeing: one port per job, two different ones, neither the default
    [a], [b] = got["ports"]
    assert a != b and "29500" not in (a, b), got


# --- torch's allocator: expandable segments on a GPU (issue 55) ------------------------------------------------

ALLOCATOR = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def _allocator_settings(env: dict) -> str:
    """What torch's allocator configuration reads in a process started with `env` (c10's AllocatorConfig, the same
    parse on the CPU build as on CUDA's)."""
    import subprocess

    code = "import torch; print(torch._C._accelerator_getAllocatorSettings())"
    clean = {k: v for k, v in os.environ.items() if k not in ALLOCATOR}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_a_gpu_worker_gets_expandable_segments_that_torch_reads(tmp_path, monkeypatch):
    for var in ALLOCATOR:
        monkeypatch.delenv(var, raising=False)
    plan = plan_json(tmp_path, "1xH100-80GB", "550.54.14", engine="trl")
    env = launch_env(plan)
    assert env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    assert _allocator_settings(env) == "expandable_segments:True"
    assert not any(v in launch_env({"device": "cpu", "engine": "trl", "num_processes": 1}) for v in ALLOCATOR)
    # vLLM's sleep mode refuses expandable segments: a run that samples with vLLM leaves the allocator alone
    assert not any(v in launch_env(plan, vllm=True) for v in ALLOCATOR)


@pytest.mark.parametrize("var", ALLOCATOR[:2])
def test_the_users_allocator_setting_is_kept_under_either_name(tmp_path, monkeypatch, var):
    """torch 2.13 reads PYTORCH_CUDA_ALLOC_CONF before PYTORCH_ALLOC_CONF: a value ftrun added under the other name
    would override the user's in one torch or the other, so ftrun adds none."""
    for other in ALLOCATOR:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(var, "max_split_size_mb:64")
    env = launch_env(plan_json(tmp_path, "1xH100-80GB", "550.54.14", engine="trl"))
    assert not any(v in env for v in ALLOCATOR)
    assert _allocator_settings({var: "max_split_size_mb:64", **env}) == "max_split_size_mb:64"
    # the reason: with both names set, torch 2.13 takes the CUDA one
    both = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert _allocator_settings(both) == "max_split_size_mb:64"


def test_a_cpu_worker_s_openmp_threads_sleep_while_they_wait_and_a_users_policy_is_kept(tmp_path, monkeypatch):
    """Spinning OpenMP threads on a shared CPU box made the demo's GRPO steps 5-20x slower whenever other processes
    ran, and the smoke test's forecast followed the box's load (launcher/worker/engines CPU_WAIT_POLICY)."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # tests/conftest.py sets it for the tests' own processes
    cpu = {"device": "cpu", "engine": "trl", "num_processes": 1}
    assert launch_env(cpu)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert launch_env({**cpu, "num_processes": 2, "engine": "ddp"})["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in launch_env(plan_json(tmp_path, "1xH100-80GB", "550.54.14", engine="trl"))
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert "OMP_WAIT_POLICY" not in launch_env(cpu)  # the user's own, inherited unchanged
