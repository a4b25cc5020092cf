"""The workers' environment from plan.json: NCCL without P2P/IB on RTX 40-series cards with an old driver
(accelerate 1.15 raises in the worker otherwise), the user's own settings kept, CPU threads split."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.worker.engines import launch_env
from launcher.plan.hardware import from_spec
from launcher.plan.plan import make_plan
from launcher.recipe import validate_recipe

REPO = Path(__file__).resolve().parents[2]

DATA = SimpleNamespace(examples=10_000, total_tokens=5_000_000, mean_tokens=500.0, max_tokens=2048,
                       over_max_length=0, tokens_source="tokenizer")
NCCL = ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE")


@pytest.fixture(autouse=True)
def _no_user_nccl(monkeypatch):
    for var in (*NCCL, "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)


def plan_json(tmp_path, spec: str, driver: str | None, engine: str = "ddp") -> dict:
    """plan.json as make_plan writes it, for a detected box of `spec` cards on `driver`."""
    hw = replace(from_spec(spec), source="detected", driver_version=driver)
    recipe = validate_recipe({"model": "meta-llama/Llama-3.1-8B", "method": "qlora", "data": "d.jsonl",
                              "max_length": 2048, "engine": engine}, tmp_path, "r")
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


@pytest.mark.parametrize("spec,driver", [("2xRTX4090", "550.40.07"), ("2xRTX4090", "565.57.01"),
                                         ("2xH100-80GB", "535.129.03")])
def test_new_driver_or_other_card_leaves_nccl_alone(tmp_path, spec, driver):
    env = launch_env(plan_json(tmp_path, spec, driver))
    assert not set(NCCL) & set(env)


def test_users_own_setting_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")
    env = launch_env(plan_json(tmp_path, "2xRTX4090", "535.129.03"))
    assert "NCCL_P2P_DISABLE" not in env and env["NCCL_IB_DISABLE"] == "1"


def test_cpu_plan_sets_no_nccl():
    plan = {"device": "cpu", "num_processes": 2, "engine": "ddp",
            "hardware": {"gpus": [], "driver_version": None}}
    env = launch_env(plan)
    assert not set(NCCL) & set(env) and env["OMP_NUM_THREADS"]


def test_the_worker_keeps_known_notices_and_deprecations_out_of_the_log():
    """The worker's imports: bitsandbytes' CPU notice about the optional `kernels` package and FutureWarnings go
    nowhere; the same loggers' other messages still show. Real imports, in a child. The notice is raised by the
    probe itself on bitsandbytes' logger, in the wording older releases print (bitsandbytes 0.50.2 no longer prints
    it): the test proves the filter, not a library's wording, and a release that prints it again is caught too."""
    import subprocess

    probe = ("import logging, warnings\n"
             "{first}"
             "import bitsandbytes\n"
             "warnings.warn('gradient_checkpointing_enable is deprecated', FutureWarning)\n"
             "ops = logging.getLogger('bitsandbytes.backends.cpu.ops')\n"
             "ops.warning('Failed to load CPU gemm_4bit_forward from kernels-community: No module named kernels')\n"
             "ops.warning('a real bitsandbytes warning')\n"
             "logging.getLogger('DeepSpeed').warning('Setting accelerator to CPU')\n")
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    bare = subprocess.run([sys.executable, "-c", probe.format(first="")], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)
    assert bare.returncode == 0, bare.stderr
    assert "kernels-community" in bare.stderr and "FutureWarning" in bare.stderr  # what the filter is for
    assert "Setting accelerator to CPU" in bare.stderr
    worker = subprocess.run([sys.executable, "-c", probe.format(first="import launcher.worker.train\n")],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert worker.returncode == 0, worker.stderr
    assert "kernels-community" not in worker.stderr and "FutureWarning" not in worker.stderr
    assert "Setting accelerator to CPU" not in worker.stderr and "a real bitsandbytes warning" in worker.stderr
