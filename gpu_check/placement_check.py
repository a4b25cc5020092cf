"""The placement and memory-cap steps: each rank loads onto, and caps, its own GPU (place_child: one rank)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from launcher.plan.sizing_constants import GB
from gpu_check.common import (
    Context,
    child_env,
    first_line,
    has,
    in_gb,
    module_cmd,
    read_json,
    worker_recipe,
    write_json,
)


def place_child(model: Path, out: Path, load: bool) -> int:
    """One rank (LOCAL_RANK from the environment or torchrun): select_device, then, with `load`, the worker's
    load_model_and_tokenizer (LoRA), and where its parameters and allocations landed."""
    import torch

    from launcher.worker.loading import load_model_and_tokenizer, local_rank, select_device
    from launcher.worker.engines import die_with_parent

    die_with_parent()  # torchrun starts ranks in their own sessions: a step killed on timeout must take them along
    rank = local_rank()
    result: dict[str, Any] = {
        "local_rank": rank,
        "rank": int(os.environ.get("RANK", "0")),
        "visible": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    try:
        device, dtype = select_device()
    except RuntimeError as exc:
        result.update(error=str(exc), device=None)
        write_json(out, result)
        return 0
    result.update(device=device, dtype=str(dtype).replace("torch.", ""))
    if device == "cuda":
        result["current_device"] = torch.cuda.current_device()
    if load:
        # LoRA as the worker loads it; full fine-tuning's loading where peft is missing
        model_obj, _ = load_model_and_tokenizer(worker_recipe(model, "lora" if has("peft") else "full"), device, dtype)
        result["parameter_devices"] = sorted({str(p.device) for p in model_obj.parameters()})
        if device == "cuda":
            result["allocated_gb_per_device"] = [
                in_gb(torch.cuda.memory_allocated(i)) for i in range(torch.cuda.device_count())
            ]
    write_json(out, result)
    return 0


def step_placement(ctx: Context) -> dict[str, Any]:
    """LOCAL_RANK=0 loads onto cuda:0; LOCAL_RANK beyond the device count fails with the clear error; with two
    GPUs, two torchrun ranks load onto cuda:0 and cuda:1 (each allocating on its own GPU only)."""
    import subprocess

    import torch

    model = ctx.work / "tiny-model"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    checks: dict[str, Any] = {}

    def child(name: str, local_rank: int, load: bool) -> dict[str, Any]:
        path = ctx.out / f"placement-{name}.json"
        path.unlink(missing_ok=True)
        proc = subprocess.run(
            module_cmd("place-child", "--model", str(model), "--out", str(path), *(["--load"] if load else [])),
            env=child_env(LOCAL_RANK=str(local_rank)),
            capture_output=True,
            text=True,
            timeout=240,
        )
        got = read_json(path)
        if got is None:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
            return {"ok": False, "error": f"exit {proc.returncode}: {tail[0][:200]}"}
        return got

    r0 = child("rank0", 0, True)
    if ctx.device == "cuda":
        r0["ok"] = (
            r0.get("device") == "cuda"
            and r0.get("current_device") == 0
            and r0.get("parameter_devices") == ["cuda:0"]
            and all(gb == 0 for gb in r0.get("allocated_gb_per_device", [0])[1:])
        )
    else:
        r0["ok"] = r0.get("device") == "cpu" and r0.get("parameter_devices") == ["cpu"]
    checks["local_rank_0"] = r0
    ctx.progress(checks=checks)

    beyond = child("beyond", max(count, 1), False)
    if ctx.device == "cuda":
        # loading.select_device: "LOCAL_RANK=<i> but this process sees <n> GPU(s) (CUDA_VISIBLE_DEVICES=...)"
        beyond["ok"] = (
            beyond.get("device") is None
            and f"LOCAL_RANK={count}" in beyond.get("error", "")
            and f"sees {count} GPU" in beyond.get("error", "")
        )
    else:
        beyond["ok"] = beyond.get("device") == "cpu"  # no GPU to exceed: the CPU, as for any rank
    checks["local_rank_beyond"] = beyond
    ctx.progress(checks=checks)

    if count >= 2:
        for r in range(2):
            (ctx.out / f"placement-torchrun-{r}.json").unlink(missing_ok=True)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "2",
                "--master_port",
                "29533",
                "-m",
                "gpu_check",
                "place-child",
                "--model",
                str(model),
                "--out",
                str(ctx.out / "placement-torchrun-{rank}.json"),
                "--load",
            ],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=240,
        )
        ranks = [read_json(ctx.out / f"placement-torchrun-{r}.json") or {} for r in range(2)]
        ok = proc.returncode == 0 and all(
            rk.get("parameter_devices") == [f"cuda:{r}"]
            and rk.get("current_device") == r
            and all(gb == 0 for i, gb in enumerate(rk.get("allocated_gb_per_device", [])) if i != r)
            for r, rk in enumerate(ranks)
        )
        checks["torchrun_2_ranks"] = {"ok": ok, "ranks": ranks, "exit": proc.returncode}
    else:
        checks["torchrun_2_ranks"] = {"ok": None, "skipped": f"{count} GPU(s): two ranks need two GPUs"}
    ok = all(c["ok"] is not False for c in checks.values())
    parts = [
        f"rank0 -> {','.join(r0.get('parameter_devices', [])) or r0.get('error', '?')}",
        ("beyond -> " + (f"error '{beyond['error'][:60]}'" if beyond.get("error") else str(beyond.get("device")))),
    ]
    t = checks["torchrun_2_ranks"]
    parts.append(
        "2 ranks: "
        + (
            "skipped (one GPU)"
            if t["ok"] is None
            else ", ".join(",".join(rk.get("parameter_devices", ["?"])) for rk in t["ranks"])
        )
    )
    return {"ok": ok, "checks": checks, "line": "; ".join(parts)}


def step_memory_cap(ctx: Context) -> dict[str, Any]:
    """memory.cap_memory on this rank's device: an allocation within the cap succeeds, one beyond it fails with
    a real out-of-memory that is_out_of_memory recognises. On two or more GPUs the capped rank is the last one,
    and GPU 0 stays uncapped."""
    import torch

    from launcher.worker import memory
    from launcher.worker.loading import select_device

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count:
        os.environ["LOCAL_RANK"] = str(count - 1)
    device, _ = select_device()
    limit_gb = 2.0 if device == "cuda" else 1.0
    within, beyond = 0.5 * limit_gb, 1.5 * limit_gb
    memory.cap_memory(device, limit_gb)
    result: dict[str, Any] = {"device": device, "limit_gb": limit_gb}
    keep = []
    if device == "cuda":
        index = count - 1
        result["capped_index"] = index
        result["fraction"] = torch.cuda.get_per_process_memory_fraction(index)
        keep.append(torch.empty(int(within * GB), dtype=torch.uint8, device=f"cuda:{index}"))
        result["within_ok"] = True
        if count >= 2:  # the cap must not touch another rank's GPU
            other = torch.empty(int(beyond * GB), dtype=torch.uint8, device="cuda:0")
            result["gpu0_uncapped"] = other.numel() > 0
            del other
    else:
        keep.append(torch.ones(int(within * GB), dtype=torch.uint8))
        result["within_ok"] = True
    try:
        keep.append(torch.ones(int(beyond * GB), dtype=torch.uint8, device=keep[0].device))
        result["beyond"] = "allocated: the cap did not hold"
        caught = None
    except BaseException as exc:  # noqa: BLE001 - the point is to see which type an out-of-memory has
        caught = exc
        result["beyond"] = first_line(exc)
        result["beyond_type"] = type(exc).__name__
        result["is_out_of_memory"] = memory.is_out_of_memory(exc)
    ok = (
        result["within_ok"]
        and caught is not None
        and result.get("is_out_of_memory") is True
        and result.get("gpu0_uncapped", True)
    )
    where = f"cuda:{result['capped_index']}" if device == "cuda" else "cpu"
    line = (
        f"cap {limit_gb:g} GB on {where}: {within:g} GB ok, {beyond:g} GB -> {result.get('beyond_type', 'no error')}"
        f" (is_out_of_memory={result.get('is_out_of_memory')})"
        + (f"; cuda:0 uncapped={result['gpu0_uncapped']}" if "gpu0_uncapped" in result else "")
    )
    return {"ok": ok, **result, "line": line}
