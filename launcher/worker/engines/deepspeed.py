"""DeepSpeed ZeRO-3: the JSON config generated from the plan, partitioned loading, and the checks that it runs."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from launcher.engine_kinds import ENGINES

CONFIG_NAME = ENGINES["deepspeed"].config_file
# Under optimizer offload DeepSpeed refuses a client optimizer that is not its CPU Adam (runtime/engine.py
# _configure_optimizer: zero_force_ds_cpu_optimizer). With this section the Trainer passes a DummyOptim (transformers
# integrations/deepspeed.py deepspeed_optim_sched) and DeepSpeed builds DeepSpeedCPUAdam in AdamW mode; "auto" takes
# the Trainer's values (trainer_config_process), and the Trainer's scheduler still drives it.
OFFLOAD_OPTIMIZER = {
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
}


def config(plan: dict[str, Any]) -> dict[str, Any]:
    """The ZeRO-3 config: batch shape and offload from the plan; precision and clipping "auto" (the Trainer's)."""
    offload_optimizer = bool(plan.get("offload_optimizer"))
    offload_param = offload_optimizer and bool(plan.get("offload_params"))
    mb = int(plan["micro_batch_size"])
    acc = int(plan["gradient_accumulation_steps"])
    nnodes = int((plan.get("nodes") or {}).get("nnodes", 1))
    world = int(plan.get("num_processes", 1)) * nnodes  # every node's processes: DeepSpeed checks the product
    hidden = int((plan.get("model") or {}).get("hidden") or 4096)
    cpu = plan.get("device") == "cpu"
    return {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": acc,
        "train_batch_size": mb * acc * world,
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            # gloo on CPU has no separate communication stream to overlap with
            "overlap_comm": not cpu,
            "contiguous_gradients": True,
            # HF's defaults for these "auto" sizes, computed here so the file is complete by itself
            "reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden,
            # the final save gathers the full 16-bit weights (or adapter) on rank 0
            "stage3_gather_16bit_weights_on_model_save": True,
            # CPU offload (docs/engines.md, "CPU offload"; deepspeed runtime/zero/stage3.py _configure_offloading,
            # the fields runtime/zero/offload_config.py's)
            "offload_optimizer": {"device": "cpu", "pin_memory": True} if offload_optimizer else {"device": "none"},
            "offload_param": {"device": "cpu", "pin_memory": True} if offload_param else {"device": "none"},
        },
        **(OFFLOAD_OPTIMIZER if offload_optimizer else {}),
        "steps_per_print": 10**9,  # ftrun logs the loss itself
        # several boxes, each with its own disk: every node's checkpoint is complete by itself (runtime/engine.py)
        "checkpoint": {"use_node_local_storage": nnodes > 1},
        "wall_clock_breakdown": False,
    }


def write_config(plan: dict[str, Any], run_dir: Path) -> Path:
    """deepspeed.json in the run directory (atomically; the same plan always writes the same file)."""
    from launcher.store.checkpoint import atomic_write_json

    path = Path(run_dir) / CONFIG_NAME
    atomic_write_json(path, config(plan))
    return path


@contextlib.contextmanager
def partitioned_loading(plan: dict[str, Any], run_dir: Path):
    """While active, from_pretrained creates each weight already partitioned (deepspeed.zero.Init)."""
    import torch
    from transformers.integrations import HfDeepSpeedConfig

    cfg = json.loads((Path(run_dir) / CONFIG_NAME).read_text())
    from launcher.worker.loading import compute_dtype

    # the worker's choice (launcher/worker/loading.py): bf16 from compute capability 8.0, not is_bf16_supported()
    bf16 = torch.cuda.is_available() and compute_dtype(torch.cuda.get_device_capability()) == torch.bfloat16
    cfg["bf16"]["enabled"] = bf16
    cfg["fp16"]["enabled"] = torch.cuda.is_available() and not bf16
    cfg["gradient_clipping"] = 1.0  # not used while loading
    for key, value in (cfg.get("optimizer") or {}).get("params", {}).items():  # not used while loading either
        cfg["optimizer"]["params"][key] = {"betas": [0.9, 0.999]}.get(key, 0.0) if value == "auto" else value
    import deepspeed

    # zero.Init partitions over the process group, which the Trainer would only create later
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    keep_alive = HfDeepSpeedConfig(cfg)  # transformers holds only a weak reference
    try:
        yield keep_alive
    finally:
        del keep_alive


def checks(plan: dict[str, Any], trainer: Any) -> list[dict[str, Any]]:
    """The trainer runs a DeepSpeed engine at ZeRO stage 3 and the weights are partitioned."""
    wrapped = trainer.model_wrapped
    name = type(wrapped).__name__
    is_engine = name == "DeepSpeedEngine"
    stage = wrapped.zero_optimization_stage() if is_engine else None
    params = list(trainer.model.parameters())
    # ZeRO-3 replaces each parameter's data by an empty placeholder and records the full shape in ds_shape.
    partitioned = [p for p in params if hasattr(p, "ds_id") and p.numel() < getattr(p, "ds_numel", 0)]
    total = sum(getattr(p, "ds_numel", p.numel()) for p in params)
    local = sum(getattr(p, "ds_tensor", p).numel() for p in params)
    return [
        {"check": "model wrapped in a DeepSpeed engine", "ok": is_engine, "seen": name},
        {"check": "ZeRO stage 3", "ok": stage == 3, "seen": f"stage {stage}"},
        {
            "check": "parameters partitioned",
            "ok": len(partitioned) > 0 and local < total,
            "seen": f"{len(partitioned)} of {len(params)} tensors partitioned; this process holds {local:,} of "
            f"{total:,} values",
        },
    ] + offload_checks(plan, wrapped if is_engine else None)


def offload_checks(plan: dict[str, Any], engine: Any) -> list[dict[str, Any]]:
    """The CPU offload the plan asked for (optimizer with DeepSpeed's CPU Adam, parameters) is what runs."""
    want_opt = bool(plan.get("offload_optimizer"))
    want_param = want_opt and bool(plan.get("offload_params"))
    if engine is None:
        return []

    def device(cfg: Any) -> str:  # an OffloadDeviceEnum (runtime/zero/offload_config.py), or no section at all
        dev = getattr(cfg, "device", None) or "none"
        return str(getattr(dev, "value", dev))

    opt_dev, param_dev = device(engine.zero_offload_optimizer()), device(engine.zero_offload_param())
    basic = type(getattr(engine, "basic_optimizer", None)).__name__
    return [
        {
            "check": "optimizer offload " + ("to the CPU" if want_opt else "off"),
            "ok": (opt_dev == "cpu") == want_opt and (basic == "DeepSpeedCPUAdam") == want_opt,
            "seen": f"offload_optimizer device {opt_dev}, optimizer {basic}",
        },
        {
            "check": "parameter offload " + ("to the CPU" if want_param else "off"),
            "ok": (param_dev == "cpu") == want_param,
            "seen": f"offload_param device {param_dev}",
        },
    ]
