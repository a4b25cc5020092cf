"""DeepSpeed ZeRO-3 with CPU offload: the config written from the plan, the engine's own checks, and (slow tier) the
real
worker on 2 gloo processes with the optimizer offloaded, against the same run without offload."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import ftrun, metrics, read_state

from launcher.worker.engines import deepspeed as ds

QUICK = ("smoke.enabled=false", "export=[]")


def _plan(**fields) -> dict:
    base = {
        "engine": "deepspeed",
        "device": "cuda",
        "num_processes": 8,
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 8,
        "model": {"hidden": 8192},
    }
    base.update(fields)
    return base


def test_the_config_offloads_what_the_plan_says():
    plain = ds.config(_plan())
    z = plain["zero_optimization"]
    assert z["offload_optimizer"] == {"device": "none"} and z["offload_param"] == {"device": "none"}
    assert "optimizer" not in plain  # the Trainer's own optimizer (8-bit AdamW for full-8bit) is used

    opt = ds.config(_plan(offload_optimizer=True))
    z = opt["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert z["offload_param"] == {"device": "none"}
    # DeepSpeed refuses a client optimizer under offload; with this section it builds DeepSpeedCPUAdam (AdamW mode)
    # and the Trainer fills the "auto" hyperparameters from its own arguments
    assert opt["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    }
    assert "scheduler" not in opt  # the Trainer's scheduler drives DeepSpeed's optimizer

    both = ds.config(_plan(offload_optimizer=True, offload_params=True))["zero_optimization"]
    assert both["offload_param"] == {"device": "cpu", "pin_memory": True}
    # FSDP's parameter offload flag alone (a QLoRA plan) never turns on DeepSpeed's
    assert ds.config(_plan(offload_params=True))["zero_optimization"]["offload_param"] == {"device": "none"}


def test_deepspeed_accepts_the_offload_config():
    """DeepSpeed's own config classes read the generated sections (runtime/zero/config.py, offload_config.py)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    z = DeepSpeedZeroConfig(**ds.config(_plan(offload_optimizer=True, offload_params=True))["zero_optimization"])
    assert z.offload_optimizer.device == OffloadDeviceEnum.cpu and z.offload_optimizer.pin_memory
    assert z.offload_param.device == OffloadDeviceEnum.cpu
    z = DeepSpeedZeroConfig(**ds.config(_plan())["zero_optimization"])
    assert z.offload_optimizer.device == OffloadDeviceEnum.none


def _engine(opt_dev: str, param_dev: str, optimizer: str):
    basic = type(optimizer, (), {})()
    return SimpleNamespace(
        zero_offload_optimizer=lambda: SimpleNamespace(device=opt_dev),
        zero_offload_param=lambda: SimpleNamespace(device=param_dev),
        basic_optimizer=basic,
    )


def test_the_worker_check_refuses_an_engine_that_does_not_offload_as_planned():
    ok = ds.offload_checks(_plan(offload_optimizer=True), _engine("cpu", "none", "DeepSpeedCPUAdam"))
    assert all(c["ok"] for c in ok) and "DeepSpeedCPUAdam" in ok[0]["seen"]
    # offload planned, the engine kept the optimizer on the card (a config without the sections)
    bad = ds.offload_checks(_plan(offload_optimizer=True), _engine("none", "none", "AdamW"))
    assert not bad[0]["ok"] and "device none" in bad[0]["seen"]
    # offload the plan did not ask for
    assert not ds.offload_checks(_plan(), _engine("cpu", "none", "DeepSpeedCPUAdam"))[0]["ok"]
    assert not ds.offload_checks(
        _plan(offload_optimizer=True, offload_params=True), _engine("cpu", "none", "DeepSpeedCPUAdam")
    )[1]["ok"]


def _run(write_recipe, tmp_path: Path, name: str, *overrides: str, **fields) -> tuple[Path, float]:
    recipe = write_recipe(f"{name}.yaml", output_dir=str(tmp_path / name), **fields)
    t0 = time.monotonic()
    res = ftrun(recipe, "--foreground", *QUICK, *overrides, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    return tmp_path / name, time.monotonic() - t0


@pytest.mark.slow  # two gloo processes under torchrun, twice; DeepSpeedCPUAdam compiled on first use (~4 min here)
def test_optimizer_offload_on_two_gloo_processes_follows_zero3_without_offload(write_recipe, tmp_path):
    pytest.importorskip("deepspeed")
    fields = dict(
        method="full",
        max_steps=6,
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        checkpoint_every_minutes=10,
        logging_steps=1,
    )
    zero, t_zero = _run(write_recipe, tmp_path, "zero", "engine=deepspeed", "num_processes=2", **fields)
    off, t_off = _run(
        write_recipe, tmp_path, "off", "engine=deepspeed", "num_processes=2", "offload=optimizer", **fields
    )

    plan = json.loads((off / "plan.json").read_text())
    assert plan["offload_optimizer"] and not plan["offload_params"]
    assert any("DeepSpeedCPUAdam" in r for r in plan["reasons"])
    cfg = json.loads((off / "deepspeed.json").read_text())
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu" and cfg["optimizer"]["type"] == "AdamW"
    v = read_state(off)["verification"]
    assert v["ok"] and v["engine"] == "deepspeed" and v["world_size"] == 2
    check = next(c for c in v["checks"] if c["check"].startswith("optimizer offload"))
    assert check["ok"] and "device cpu" in check["seen"] and "DeepSpeedCPUAdam" in check["seen"], check
    plain = next(c for c in read_state(zero)["verification"]["checks"] if c["check"].startswith("optimizer offload"))
    assert plain["ok"] and "device none" in plain["seen"], plain

    a, b = metrics(zero), metrics(off)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 7))
    diffs = [abs(x["loss"] - y["loss"]) for x, y in zip(a, b)]
    assert a[0]["loss"] == pytest.approx(b[0]["loss"], abs=1e-6)  # the same model and batch before any step
    assert max(diffs) < 2e-3, diffs  # the same AdamW, on the CPU in DeepSpeed's kernel instead of torch's
    assert b[-1]["loss"] < b[0]["loss"]
    print(
        f"ZeRO-3 offload vs ZeRO-3: loss max |diff| {max(diffs):.2e} over {len(diffs)} steps "
        f"({[round(r['loss'], 4) for r in b]}); wall {t_zero:.0f}s vs {t_off:.0f}s"
    )
