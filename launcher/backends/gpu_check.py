"""Engine checks a box runs on itself for scripts/gpu_check.sh: the worker's model on the device, FSDP2 via the generated accelerate config.

Needs only torch, transformers, peft and accelerate (what a bare GPU box has): no trl, datasets,
bitsandbytes or pydantic. Each command writes a JSON result and exits 1 when the outcome is not
the one expected on that device.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional


def _recipe(model: Path) -> SimpleNamespace:
    # the worker's recipe fields that loading reads; pydantic may be missing on a bare GPU box
    lora = SimpleNamespace(r=16, alpha=16, dropout=0.0, target_modules="all-linear")
    return SimpleNamespace(model=str(model), method="lora", gradient_checkpointing=True, lora=lora)


def _device(name: str):
    import torch

    from ..loading import select_device

    if name == "cuda":
        return select_device()  # the worker's own choice: this rank's GPU, dtype by compute capability
    return "cpu", torch.float32


def worker_step(model: Path, device_name: str) -> dict[str, Any]:
    """The worker's load_model_and_tokenizer on this device, then one LoRA forward/backward."""
    import torch

    from ..loading import load_model_and_tokenizer

    device, dtype = _device(device_name)
    m, _ = load_model_and_tokenizer(_recipe(model), device, dtype)
    ids = torch.randint(0, m.config.vocab_size, (2, 64), device=device)
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad for p in m.parameters() if p.requires_grad]
    ok = torch.isfinite(loss).item() and all(g is not None and torch.isfinite(g).all().item() for g in grads)
    return {"ok": bool(ok), "device": str(next(m.parameters()).device), "dtype": str(dtype),
            "loss": loss.item(), "trainable_tensors": len(grads)}


def fsdp_prepare(model: Path, device_name: str) -> dict[str, Any]:
    """Under `accelerate launch --config_file <generated FSDP2 config>`: prepare the worker's model and look at it.

    On a GPU the parameters must be DTensors of an FSDP2 module; on CPU accelerate silently makes
    it DDP/plain (the fallback the worker's check refuses), which is the expected CPU outcome.
    """
    import torch
    from accelerate import Accelerator
    from torch.distributed.fsdp import FSDPModule

    from ..loading import load_model_and_tokenizer
    from ..loading import load_kwargs
    from .fsdp import sharding_report

    device, dtype = _device(device_name)
    acc = Accelerator(cpu=device == "cpu")
    recipe = _recipe(model)
    m, _ = load_model_and_tokenizer(recipe, device, dtype, plan={"engine": "fsdp"})
    wrapped = acc.prepare(m)
    from torch.distributed.tensor import DTensor

    params = list(wrapped.parameters())
    dtensors = sum(isinstance(p, DTensor) for p in params)
    report = sharding_report(wrapped)
    is_fsdp = isinstance(wrapped, FSDPModule)
    ids = torch.randint(0, m.config.vocab_size if hasattr(m, "config") else 1024, (2, 64), device=acc.device)
    loss = wrapped(input_ids=ids, labels=ids).loss
    acc.backward(loss)
    result = {"device": device, "distributed_type": str(acc.distributed_type), "wrapper": type(wrapped).__name__,
              "fsdp2_module": is_fsdp, "dtensor_parameters": dtensors, "parameters": len(params),
              "world_size": acc.num_processes, "loss": loss.item(), "load_kwargs": {k: str(v) for k, v in load_kwargs(recipe, device, dtype, "fsdp").items()},
              **{f"report_{k}": v for k, v in report.items()}}
    # one GPU: FSDP2 wraps and turns every parameter into a DTensor, over a mesh of 1 (nothing to shard over)
    result["ok"] = (is_fsdp and dtensors == len(params)) if device == "cuda" else not is_fsdp
    result["expected"] = ("FSDP2 module with DTensor parameters" if device == "cuda"
                          else "not FSDP: accelerate on CPU falls back silently (the worker refuses this)")
    return result


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launcher.backends.gpu_check", description=__doc__)
    p.add_argument("check", choices=("worker", "fsdp-config", "fsdp-prepare"))
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", type=Path, required=True, help="JSON result (fsdp-config: the accelerate YAML)")
    ns = p.parse_args(argv)
    if ns.check == "fsdp-config":
        from .fsdp import accelerate_config

        import yaml

        cfg = accelerate_config({"num_processes": 1, "device": ns.device}, activation_checkpointing=False)
        ns.out.write_text(yaml.safe_dump(cfg, sort_keys=False))
        print(f"wrote {ns.out}")
        return 0
    result = worker_step(ns.model, ns.device) if ns.check == "worker" else fsdp_prepare(ns.model, ns.device)
    import os

    if int(os.environ.get("RANK", "0")) == 0:
        ns.out.write_text(json.dumps(result, indent=2))
        print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
