"""The device step: the device and dtype each rank gets, what the plan's hardware detection sees, what's installed."""

from __future__ import annotations

import os
from typing import Any, Optional

from gpu_check.common import Context, in_gb


def _packages() -> dict[str, Optional[str]]:
    from importlib import metadata

    out = {}
    for name in (
        "torch",
        "transformers",
        "peft",
        "accelerate",
        "trl",
        "datasets",
        "bitsandbytes",
        "flash-attn",
        "nvidia-ml-py",
        "pydantic",
        "PyYAML",
        "safetensors",
        "psutil",
    ):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def step_device(ctx: Context) -> dict[str, Any]:
    """loading.select_device on every visible GPU (as LOCAL_RANK i): that GPU made current, the dtype by compute
    capability (bf16 from 8.0, fp16 below); and what the plan's hardware detection sees on this box."""
    import torch

    from launcher.plan.this_box import detect
    from launcher.worker.loading import compute_dtype, select_device

    packages = _packages()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = []
    saved = os.environ.get("LOCAL_RANK")
    try:
        for i in range(max(count, 1)):
            os.environ["LOCAL_RANK"] = str(i)
            device, dtype = select_device()
            row: dict[str, Any] = {"local_rank": i, "device": device, "dtype": str(dtype).replace("torch.", "")}
            if device == "cuda":
                cc = torch.cuda.get_device_capability(i)
                row.update(
                    name=torch.cuda.get_device_name(i),
                    capability=list(cc),
                    current=torch.cuda.current_device(),
                    total_gb=in_gb(torch.cuda.get_device_properties(i).total_memory),
                    bf16_supported_with_emulation=torch.cuda.is_bf16_supported(including_emulation=True),
                    expected_dtype=str(compute_dtype(cc)).replace("torch.", ""),
                )
                row["ok"] = (
                    row["current"] == i
                    and row["dtype"] == row["expected_dtype"]
                    and (row["dtype"] == "bfloat16") == (tuple(cc) >= (8, 0))
                )
            else:
                row["expected_dtype"] = "float32"
                row["ok"] = row["dtype"] == "float32"
            devices.append(row)
    finally:
        if saved is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = saved
    hw = detect()
    seen = {
        "describe": hw.describe(),
        "count": hw.count,
        "notes": list(hw.notes),
        "source": hw.source,
        "gpus": [g.to_dict() for g in hw.gpus],
    }
    expected_device = ctx.device
    ok = all(r["ok"] for r in devices) and all(r["device"] == expected_device for r in devices)
    # the plan must see the GPUs torch sees (without nvidia-ml-py too: hardware.py falls back to torch.cuda)
    plan_ok = hw.count == count
    first = devices[0]
    where = (
        f"{first['device']}:{first['local_rank']} {first.get('name', '')} cc {'.'.join(map(str, first['capability']))}"
        if first["device"] == "cuda"
        else "cpu"
    )
    missing = [
        k
        for k in ("peft", "accelerate", "trl", "datasets", "bitsandbytes", "flash-attn", "nvidia-ml-py")
        if packages.get(k) is None
    ]
    line = (
        f"{count} GPU(s); {where} -> {first['dtype']} (expected {first['expected_dtype']}); "
        f"plan sees {hw.describe()}{'' if plan_ok else ' (MISMATCH)'}; not installed: {', '.join(missing) or '-'}"
    )
    return {
        "ok": ok and plan_ok,
        "expected_device": expected_device,
        "cuda_devices": count,
        "devices": devices,
        "plan_hardware": seen,
        "plan_sees_gpus": plan_ok,
        "packages": packages,
        "torch_cuda": torch.version.cuda,
        "line": line,
    }
