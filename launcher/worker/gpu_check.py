"""The checks a GPU box runs on itself (scripts/gpu_check.sh): device and dtype, per-rank placement, the memory cap,
peak memory, out-of-memory classification, predicted vs measured memory and tokens/s at an 8B shape, FSDP2.

One step per process (`python -m launcher.worker.gpu_check step NAME --out DIR`): a step that crashes, hangs
or fills the GPU takes nothing else down, and its JSON (DIR/NAME.json) is written when it starts, as it
progresses and when it ends. `finish NAME` (no torch import) then records a step its process left unfinished
(timed out, killed, crashed), rewrites DIR/summary.json and prints the step's one-line result.

Needs only torch and transformers (peft for the LoRA steps, accelerate for FSDP): a bare GPU box has no trl,
datasets, bitsandbytes or pydantic, so nothing here imports launcher.recipe, and the training loop is plain torch
doing what the worker's Trainer does (fused AdamW, gradient clipping, bf16 autocast, non-reentrant checkpointing).
`--dry-run` runs every step on the CPU with the CPU's expectations and a tiny model shape.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

from launcher.plan.sizing import GB  # ftrun's one memory unit, 2**30 bytes: what launcher/worker/memory.py reports in

# Execution order. The torch-only checks come first (seconds each), the 8B measurements next (the figures the
# loan is for), FSDP (a distributed launch: the likeliest to hang) and the trl-based bench last.
STEPS = ("tiny-model", "device", "placement", "memory-cap", "peak-memory", "oom",
         "bench-lora", "bench-full", "bench-padding", "fsdp", "smoke-bench")

# The shape measured on a GPU: a catalog entry of launcher/plan/models.py (GPU_CHECK_SHAPE picks another one).
GPU_SHAPE = "qwen3-8b"
# --dry-run: Qwen3-shaped (q/k norms), small enough for seconds per step on 2 cores.
TINY_SHAPE = dict(layers=2, hidden=128, intermediate=384, heads=4, kv_heads=2, head_dim=32, vocab=4096,
                  tied_embeddings=False, qk_norm=True)

# Per-step settings, GPU / CPU. LoRA and full fine-tuning at the shapes a user runs (the plan's numbers for
# them: bench JSON); full fine-tuning falls back to a micro-batch of 1 when 2 runs out of memory.
BENCH = {
    "cuda": dict(seq=1024, lora_batch=4, full_batch=2, warmup=2, steps=4, pad_examples=8, pad_batches=4),
    "cpu": dict(seq=128, lora_batch=2, full_batch=2, warmup=1, steps=2, pad_examples=4, pad_batches=2),
}
LEARNING_RATE = 1e-4


# ---------------------------------------------------------------------------------------------
# Writing results

def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


class Context(SimpleNamespace):
    out: Path  # results (JSON, logs): what comes back from the box
    work: Path  # what the steps build (the tiny model, the FSDP final save): stays on the box
    dry_run: bool
    device: str  # "cuda" or "cpu": what this run expects to use
    shape: str
    progress: Callable[..., None]


def _gb(n: float) -> float:
    return round(n / GB, 3)


# ---------------------------------------------------------------------------------------------
# Steps. Each returns a dict with "ok" (True, False, or None for skipped), "line" (the one-line result) and
# whatever it measured; an exception is a failed step with its reason.

def step_tiny_model(ctx: Context) -> dict[str, Any]:
    """The tiny model (random weights, its own tokenizer) the loading steps use: built here, no download."""
    import importlib.util

    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("make_tiny_model", repo / "scripts" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target = ctx.work / "tiny-model"
    module.build_tiny_model(target)
    ok = (target / "config.json").is_file()
    return {"ok": ok, "path": str(target), "line": f"tiny model built at {target}"}


def _packages() -> dict[str, Optional[str]]:
    from importlib import metadata

    out = {}
    for name in ("torch", "transformers", "peft", "accelerate", "trl", "datasets", "bitsandbytes", "flash-attn",
                 "nvidia-ml-py", "pydantic", "PyYAML", "safetensors", "psutil"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def step_device(ctx: Context) -> dict[str, Any]:
    """loading.select_device on every visible GPU (as LOCAL_RANK i): that GPU made current, the dtype by compute
    capability (bf16 from 8.0, fp16 below); and what the plan's hardware detection sees on this box."""
    import torch

    from launcher.plan.hardware import detect
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
                row.update(name=torch.cuda.get_device_name(i), capability=list(cc), current=torch.cuda.current_device(),
                           total_gb=_gb(torch.cuda.get_device_properties(i).total_memory),
                           bf16_supported_with_emulation=torch.cuda.is_bf16_supported(including_emulation=True),
                           expected_dtype=str(compute_dtype(cc)).replace("torch.", ""))
                row["ok"] = row["current"] == i and row["dtype"] == row["expected_dtype"] and \
                    (row["dtype"] == "bfloat16") == (tuple(cc) >= (8, 0))
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
    seen = {"describe": hw.describe(), "count": hw.count, "notes": list(hw.notes), "source": hw.source,
            "gpus": [g.to_dict() for g in hw.gpus]}
    expected_device = ctx.device
    ok = all(r["ok"] for r in devices) and all(r["device"] == expected_device for r in devices)
    # the plan must see the GPUs torch sees (without nvidia-ml-py too: hardware.py falls back to torch.cuda)
    plan_ok = hw.count == count
    first = devices[0]
    where = (f"{first['device']}:{first['local_rank']} {first.get('name', '')} cc {'.'.join(map(str, first['capability']))}"
             if first["device"] == "cuda" else "cpu")
    missing = [k for k in ("peft", "accelerate", "trl", "datasets", "bitsandbytes", "flash-attn", "nvidia-ml-py")
               if packages.get(k) is None]
    line = (f"{count} GPU(s); {where} -> {first['dtype']} (expected {first['expected_dtype']}); "
            f"plan sees {hw.describe()}{'' if plan_ok else ' (MISMATCH)'}; not installed: {', '.join(missing) or '-'}")
    return {"ok": ok and plan_ok, "expected_device": expected_device, "cuda_devices": count, "devices": devices,
            "plan_hardware": seen, "plan_sees_gpus": plan_ok, "packages": packages,
            "torch_cuda": torch.version.cuda, "line": line}


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _recipe(model: Path, method: str = "lora") -> SimpleNamespace:
    # the recipe fields loading reads (launcher.recipe needs pydantic, which a bare GPU box may lack)
    lora = SimpleNamespace(r=16, alpha=16, dropout=0.0, target_modules="all-linear")
    return SimpleNamespace(model=str(model), method=method, gradient_checkpointing=True, lora=lora, seed=0)


def _module_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher.worker.gpu_check", *args]


def _child_env(**extra: str) -> dict[str, str]:
    repo = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": repo + (os.pathsep + path if path else ""), **extra}


def place_child(model: Path, out: Path, load: bool) -> int:
    """One rank (LOCAL_RANK from the environment or torchrun): select_device, then, with `load`, the worker's
    load_model_and_tokenizer (LoRA), and where its parameters and allocations landed."""
    import torch

    from launcher.worker.loading import load_model_and_tokenizer, local_rank, select_device
    from launcher.worker.engines import die_with_parent

    die_with_parent()  # torchrun starts ranks in their own sessions: a step killed on timeout must take them along
    rank = local_rank()
    result: dict[str, Any] = {"local_rank": rank, "rank": int(os.environ.get("RANK", "0")),
                              "visible": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    try:
        device, dtype = select_device()
    except RuntimeError as exc:
        result.update(error=str(exc), device=None)
        _write_json(out, result)
        return 0
    result.update(device=device, dtype=str(dtype).replace("torch.", ""))
    if device == "cuda":
        result["current_device"] = torch.cuda.current_device()
    if load:
        # LoRA as the worker loads it; full fine-tuning's loading where peft is missing
        model_obj, _ = load_model_and_tokenizer(_recipe(model, "lora" if _has("peft") else "full"), device, dtype)
        result["parameter_devices"] = sorted({str(p.device) for p in model_obj.parameters()})
        if device == "cuda":
            result["allocated_gb_per_device"] = [_gb(torch.cuda.memory_allocated(i))
                                                 for i in range(torch.cuda.device_count())]
    _write_json(out, result)
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
        proc = subprocess.run(_module_cmd("place-child", "--model", str(model), "--out", str(path),
                                          *(["--load"] if load else [])),
                              env=_child_env(LOCAL_RANK=str(local_rank)), capture_output=True, text=True, timeout=240)
        got = _read_json(path)
        if got is None:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
            return {"ok": False, "error": f"exit {proc.returncode}: {tail[0][:200]}"}
        return got

    r0 = child("rank0", 0, True)
    if ctx.device == "cuda":
        r0["ok"] = r0.get("device") == "cuda" and r0.get("current_device") == 0 and \
            r0.get("parameter_devices") == ["cuda:0"] and \
            all(gb == 0 for gb in r0.get("allocated_gb_per_device", [0])[1:])
    else:
        r0["ok"] = r0.get("device") == "cpu" and r0.get("parameter_devices") == ["cpu"]
    checks["local_rank_0"] = r0
    ctx.progress(checks=checks)

    beyond = child("beyond", max(count, 1), False)
    if ctx.device == "cuda":
        # loading.select_device: "LOCAL_RANK=<i> but this process sees <n> GPU(s) (CUDA_VISIBLE_DEVICES=...)"
        beyond["ok"] = beyond.get("device") is None and f"LOCAL_RANK={count}" in beyond.get("error", "") \
            and f"sees {count} GPU" in beyond.get("error", "")
    else:
        beyond["ok"] = beyond.get("device") == "cpu"  # no GPU to exceed: the CPU, as for any rank
    checks["local_rank_beyond"] = beyond
    ctx.progress(checks=checks)

    if count >= 2:
        for r in range(2):
            (ctx.out / f"placement-torchrun-{r}.json").unlink(missing_ok=True)
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", "29533", "-m", "launcher.worker.gpu_check", "place-child",
                               "--model", str(model), "--out", str(ctx.out / "placement-torchrun-{rank}.json"),
                               "--load"], env=_child_env(), capture_output=True, text=True, timeout=240)
        ranks = [_read_json(ctx.out / f"placement-torchrun-{r}.json") or {} for r in range(2)]
        ok = proc.returncode == 0 and all(
            rk.get("parameter_devices") == [f"cuda:{r}"] and rk.get("current_device") == r and
            all(gb == 0 for i, gb in enumerate(rk.get("allocated_gb_per_device", [])) if i != r)
            for r, rk in enumerate(ranks))
        checks["torchrun_2_ranks"] = {"ok": ok, "ranks": ranks, "exit": proc.returncode}
    else:
        checks["torchrun_2_ranks"] = {"ok": None, "skipped": f"{count} GPU(s): two ranks need two GPUs"}
    ok = all(c["ok"] is not False for c in checks.values())
    parts = [f"rank0 -> {','.join(r0.get('parameter_devices', [])) or r0.get('error', '?')}",
             ("beyond -> " + (f"error '{beyond['error'][:60]}'" if beyond.get("error") else str(beyond.get("device"))))]
    t = checks["torchrun_2_ranks"]
    parts.append("2 ranks: " + ("skipped (one GPU)" if t["ok"] is None else
                                ", ".join(",".join(rk.get("parameter_devices", ["?"])) for rk in t["ranks"])))
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
        result["beyond"] = _first_line(exc)
        result["beyond_type"] = type(exc).__name__
        result["is_out_of_memory"] = memory.is_out_of_memory(exc)
    ok = result["within_ok"] and caught is not None and result.get("is_out_of_memory") is True \
        and result.get("gpu0_uncapped", True)
    where = f"cuda:{result['capped_index']}" if device == "cuda" else "cpu"
    line = (f"cap {limit_gb:g} GB on {where}: {within:g} GB ok, {beyond:g} GB -> {result.get('beyond_type', 'no error')}"
            f" (is_out_of_memory={result.get('is_out_of_memory')})"
            + (f"; cuda:0 uncapped={result['gpu0_uncapped']}" if "gpu0_uncapped" in result else ""))
    return {"ok": ok, **result, "line": line}


def step_peak_memory(ctx: Context) -> dict[str, Any]:
    """memory.peak_memory_gb against torch's own counters and cudaMemGetInfo: a known allocation and a matmul
    (cuBLAS handle and workspace), then the worker's peak = allocator peak + what lives outside the allocator."""
    import resource

    import torch

    from launcher.worker import memory
    from launcher.worker.loading import select_device

    device, _ = select_device()
    size = int(GB) if device == "cuda" else int(4e8)
    if device == "cuda":
        idx = torch.cuda.current_device()
        free0, total = torch.cuda.mem_get_info(idx)
        memory.reset_peak(device)
        x = torch.ones(size, dtype=torch.uint8, device="cuda")
        a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
        (a @ a).sum().item()  # creates the cuBLAS handle and workspace
        del x
        torch.cuda.synchronize()
        peak = memory.peak_memory_gb(device)
        free, total = torch.cuda.mem_get_info(idx)
        reserved, max_reserved = torch.cuda.memory_reserved(idx), torch.cuda.max_memory_reserved(idx)
        outside = total - free - reserved
        r = {"device": device, "worker_peak_gb": round(peak, 3), "max_memory_reserved_gb": _gb(max_reserved),
             "max_memory_allocated_gb": _gb(torch.cuda.max_memory_allocated(idx)),
             "reserved_now_gb": _gb(reserved), "device_used_gb_mem_get_info": _gb(total - free),
             "outside_allocator_gb": _gb(outside), "used_before_first_tensor_gb": _gb(total - free0),
             "allocation_gb": _gb(size), "over_ranks_gb": round(memory.peak_memory_over_ranks_gb(device), 3)}
        # peak = allocator peak + outside (context, cuBLAS); sizing counts the context as CUDA_CONTEXT_GB
        from launcher.plan import sizing

        r["sizing_cuda_context_gb"] = sizing.CUDA_CONTEXT_GB
        ok = (max_reserved >= size and outside > 0 and abs(peak * GB - (max_reserved + outside)) < 64e6
              and peak * GB >= total - free and r["over_ranks_gb"] == round(peak, 3))
        line = (f"worker peak {peak:.2f} GB = allocator peak {max_reserved / GB:.2f} + outside the allocator "
                f"{outside / GB:.2f} (sizing counts {sizing.CUDA_CONTEXT_GB}); mem_get_info used {(total - free) / GB:.2f}")
    else:
        before = memory.peak_memory_gb(device)
        x = torch.ones(size, dtype=torch.uint8)
        peak = memory.peak_memory_gb(device)
        del x
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB
        r = {"device": device, "worker_peak_gb": round(peak, 3), "before_gb": round(before, 3),
             "allocation_gb": _gb(size), "ru_maxrss_gb": round(rss, 3),
             "over_ranks_gb": round(memory.peak_memory_over_ranks_gb(device), 3)}
        ok = peak - before >= 0.9 * size / GB and abs(peak - rss) < 0.05
        line = f"worker peak {before:.2f} -> {peak:.2f} GB after touching {size / GB:.1f} GB (ru_maxrss)"
    return {"ok": ok, **r, "line": line}


def step_oom(ctx: Context) -> dict[str, Any]:
    """Real out-of-memory failures and memory.is_out_of_memory on each: the caching allocator's, then (CUDA) a
    matmul's first cuBLAS handle created with the device full (cublasCreate or its workspace)."""
    import torch

    from launcher.worker import memory
    from launcher.worker.loading import select_device

    device, _ = select_device()
    cases: dict[str, Any] = {}

    def attempt(name: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
            cases[name] = {"raised": None}
        except BaseException as exc:  # noqa: BLE001
            cases[name] = {"raised": type(exc).__name__, "message": _first_line(exc),
                           "is_out_of_memory": memory.is_out_of_memory(exc),
                           "text": memory.out_of_memory_text(exc)[:300]}
        ctx.progress(cases=cases)

    if device == "cuda":
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)  # before the fill, no matmul yet
        attempt("allocator", lambda: torch.empty(2 * total, dtype=torch.uint8, device="cuda"))
        hold = []
        for chunk in (2**30, 2**26, 2**21):  # fill the device: 1 GiB, then 64 MiB, then 2 MiB blocks
            while True:
                try:
                    hold.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
                except torch.OutOfMemoryError:
                    break
        free, _ = torch.cuda.mem_get_info()
        cases["filled"] = {"held_gb": _gb(sum(t.numel() for t in hold)), "free_gb": _gb(free)}
        attempt("cublas_at_full_device", lambda: (a @ a).sum().item())
        del hold
        torch.cuda.empty_cache()
    else:
        import resource

        attempt("allocator", lambda: torch.empty(2 ** 62, dtype=torch.uint8))
        import psutil

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (psutil.Process().memory_info().vms + int(3e8), hard))
        attempt("allocator_under_rlimit", lambda: torch.ones(int(GB), dtype=torch.uint8))
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        cases["cublas_at_full_device"] = {"raised": None, "skipped": "no cuBLAS on the CPU"}
    raised = {k: v for k, v in cases.items() if v.get("raised")}
    ok = bool(raised) and all(v["is_out_of_memory"] for v in raised.values()) and "allocator" in raised
    cublas = cases.get("cublas_at_full_device", {})
    if device == "cuda" and cublas.get("raised") is None:
        cublas["note"] = "not provoked: the matmul found memory outside the filled allocator"
    line = "; ".join(f"{k}: {v['raised']} -> is_out_of_memory={v['is_out_of_memory']}" if v.get("raised")
                     else f"{k}: {v.get('skipped') or v.get('note') or 'no error'}"
                     for k, v in cases.items() if k != "filled")
    return {"ok": ok, "device": device, "cases": cases, "line": line}


# ---------------------------------------------------------------------------------------------
# Predicted vs measured at a real model's shape

def _arch(ctx: Context):
    from launcher.plan.models import Architecture, catalog_names, from_catalog

    if ctx.shape == "tiny":
        return Architecture(name="tiny (dry run)", source="gpu_check's dry-run shape", **TINY_SHAPE)
    arch = from_catalog(ctx.shape)
    if arch is None:
        raise ValueError(f"GPU_CHECK_SHAPE={ctx.shape!r} is not in launcher/plan/models.py's catalog; use one of "
                         f"{', '.join(catalog_names())}")
    if arch.qkv_bias or arch.experts > 1 or arch.norms_per_layer != 2:
        raise ValueError(f"shape {ctx.shape!r}: the bench builds Llama- and Qwen3-shaped models only")
    return arch


def _hf_config(arch):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=arch.vocab, hidden_size=arch.hidden, intermediate_size=arch.intermediate,
                  num_hidden_layers=arch.layers, num_attention_heads=arch.heads, num_key_value_heads=arch.kv_heads,
                  head_dim=arch.head_dim, tie_word_embeddings=arch.tied_embeddings, use_cache=False,
                  max_position_embeddings=8192)
    return Qwen3Config(**common) if arch.qk_norm else LlamaConfig(**common)


def _plan_hardware(ctx: Context):
    """What the plan sizes for: this box as detected; where detection sees no GPU on a CUDA box, the catalog
    entry of torch's device name (and the step says so)."""
    from launcher.plan.hardware import catalog_box, detect, lookup

    hw = detect()
    if ctx.device != "cuda" or not hw.is_cpu_only:
        return hw, f"detected: {hw.describe()}"
    import torch

    name = torch.cuda.get_device_name(0)
    entry = lookup(name)
    if entry is None:
        return None, f"detection saw no GPU ({'; '.join(hw.notes)}) and '{name}' is not in the catalog"
    return (catalog_box(entry.name, torch.cuda.device_count()),
            f"catalog {entry.name}: detection saw no GPU ({'; '.join(hw.notes)})")


def predict(ctx: Context, arch, method: str, micro_batch: int, seq: int) -> dict[str, Any]:
    """The plan's memory and tokens/s for this job on this box (engine trl: one process, the worker's path)."""
    from launcher.plan import sizing
    from launcher.errors import FtrunError
    from launcher.plan.plan import make_plan

    hw, source = _plan_hardware(ctx)
    out: dict[str, Any] = {"hardware": source}
    if hw is None:
        return out
    recipe = SimpleNamespace(model=arch.name, method=method, engine="trl", num_processes="auto", max_length=seq,
                             packing=False, max_steps=None, epochs=1, micro_batch_size=micro_batch,
                             gradient_accumulation_steps=1, gradient_checkpointing=True,
                             lora=SimpleNamespace(r=16, target_modules="all-linear"), price_per_hour_eur=None,
                             checkpoint_every_minutes=30)
    # every example as long as the measured ones: the plan's seq_len and mean length are the bench's
    stats = SimpleNamespace(examples=1000, mean_tokens=seq, max_tokens=seq, total_tokens=1000 * seq,
                            tokens_source="tokenizer")
    try:
        plan = make_plan(recipe, hw, stats, arch=arch, unsloth_available=False)
        out.update(fits=True, memory_gb=plan.memory["estimated_per_gpu_gb"],
                   breakdown_gb=plan.memory["breakdown_gb"],
                   tokens_per_second=plan.tokens["estimated_tokens_per_second"], engine=plan.engine)
    except FtrunError as exc:
        # the plan refuses: keep its reason, and the sizer's own figures for the comparison
        device = "cpu" if hw.is_cpu_only else "cuda"
        w = sizing.Workload(method, seq, micro_batch, True, 16, "all-linear", "trl", 1, device)
        est = sizing.memory(arch, w)
        g = hw.gpu
        out.update(fits=False, refusal=exc.message[:400], memory_gb=round(est.per_gpu_gb, 1),
                   breakdown_gb={k: round(v, 2) for k, v in est.breakdown_gb.items()},
                   tokens_per_second=round(sizing.tokens_per_second(arch, w, g.tflops_bf16 if g else None,
                                                                    hw.interconnect, hw.cpu_count), 1))
    return out


def _build(ctx: Context, arch, method: str):
    """Random weights at the shape, built on the device (no download), stored and trained as the worker does:
    loading.weights_dtype (fp32 master weights for full fine-tuning on trl, the compute dtype for LoRA),
    loading.add_lora, non-reentrant gradient checkpointing, the attention kernel loading chooses."""
    import torch
    from transformers import AutoModelForCausalLM

    from launcher.worker import loading

    device, dtype = loading.select_device() if ctx.device == "cuda" else ("cpu", torch.float32)
    config = _hf_config(arch)
    attn = loading.attention_implementation(device, dtype)
    if attn:
        config._attn_implementation = attn
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=loading.weights_dtype(method, "trl", device, dtype))
    if method == "lora":
        model = loading.add_lora(model, _recipe(Path(arch.name)), "trl")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model, device, dtype, attn or getattr(model.config, "_attn_implementation", None) or "sdpa"


def _optimizer(model, device: str):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    # the Trainer's default with torch >= 2.8 (transformers 5.24 training_args: adamw_torch_fused), on CPU too
    return params, torch.optim.AdamW(params, lr=LEARNING_RATE, fused=True)


def _train_step(model, params, opt, batch: dict[str, Any], device: str, dtype) -> float:
    import contextlib

    import torch

    # the Trainer trains under autocast with bf16/fp16 on a GPU (SFTConfig bf16/fp16) and in fp32 on the CPU
    auto = torch.autocast("cuda", dtype=dtype) if device == "cuda" else contextlib.nullcontext()
    with auto:
        loss = model(**batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)  # the Trainer's max_grad_norm
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.item())  # .item() synchronises: the step is done when it returns


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _measure(model, params, opt, batches: list[dict[str, Any]], tokens: list[int], warmup: int, device: str,
             dtype) -> dict[str, Any]:
    """Warm-up steps, then timed steps; real tokens per second over the timed ones and the worker's peak."""
    from launcher.worker import memory

    losses = []
    for b in batches[:warmup]:
        losses.append(_train_step(model, params, opt, b, device, dtype))
    _sync(device)
    t0 = time.perf_counter()
    for b in batches[warmup:]:
        losses.append(_train_step(model, params, opt, b, device, dtype))
    _sync(device)
    seconds = time.perf_counter() - t0
    counted = sum(tokens[warmup:])
    return {"tokens_per_second": round(counted / seconds, 1), "timed_steps": len(batches) - warmup,
            "timed_seconds": round(seconds, 3), "timed_tokens": counted, "losses": [round(x, 4) for x in losses],
            "peak_memory_gb": round(memory.peak_memory_gb(device), 3)}


def _allocator(device: str) -> dict[str, Any]:
    if device != "cuda":
        return {}
    import torch

    free, total = torch.cuda.mem_get_info()
    return {"allocated_gb": _gb(torch.cuda.memory_allocated()), "reserved_gb": _gb(torch.cuda.memory_reserved()),
            "max_allocated_gb": _gb(torch.cuda.max_memory_allocated()),
            "max_reserved_gb": _gb(torch.cuda.max_memory_reserved()), "device_used_gb": _gb(total - free)}


def _fixed_batches(vocab: int, micro_batch: int, seq: int, n: int, device: str) -> list[dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (micro_batch, seq), generator=g).to(device)
        out.append({"input_ids": ids, "labels": ids})
    return out


def _bench(ctx: Context, method: str) -> dict[str, Any]:
    import gc

    import torch

    from launcher.worker import memory

    cfg = BENCH[ctx.device]
    arch = _arch(ctx)
    batch_sizes = [cfg[f"{method}_batch"]]
    if method == "full" and batch_sizes[0] > 1:
        batch_sizes.append(1)
    result: dict[str, Any] = {"shape": arch.name, "params": arch.params, "method": method, "seq": cfg["seq"],
                              "predicted": predict(ctx, arch, method, batch_sizes[0], cfg["seq"])}
    ctx.progress(**result)
    t0 = time.monotonic()
    model, device, dtype, attn = _build(ctx, arch, method)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    built = sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n)
    result.update(device=device, dtype=str(dtype).replace("torch.", ""), attention=attn,
                  build_seconds=round(time.monotonic() - t0, 1), built_params=built,
                  weights_dtype=str(next(base.parameters()).dtype).replace("torch.", ""),
                  after_build=_allocator(device))
    ctx.progress(**result)
    attempts = []
    for mb in batch_sizes:
        if mb != batch_sizes[0]:
            result["predicted_fallback"] = predict(ctx, arch, method, mb, cfg["seq"])
        memory.reset_peak(device)
        batches = _fixed_batches(arch.vocab, mb, cfg["seq"], cfg["warmup"] + cfg["steps"], device)
        params, opt = _optimizer(model, device)
        failure = None
        try:
            measured = _measure(model, params, opt, batches, [mb * cfg["seq"]] * len(batches), cfg["warmup"],
                                device, dtype)
        except Exception as exc:  # noqa: BLE001 - only an out-of-memory is an answer here
            if not memory.is_out_of_memory(exc):
                raise
            failure = {"micro_batch": mb, "out_of_memory": memory.out_of_memory_text(exc)[:300],
                       "peak_memory_gb_at_failure": memory.out_of_memory_peak_gb(device)}
        if failure is None:
            measured.update(micro_batch=mb, allocator=_allocator(device))
            attempts.append(measured)
            break
        attempts.append(failure)
        ctx.progress(**result, attempts=attempts)
        del opt, params, batches
        for p in model.parameters():
            p.grad = None
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    result["attempts"] = attempts
    done = attempts[-1] if "tokens_per_second" in attempts[-1] else None
    pred = result.get("predicted_fallback") if done and done["micro_batch"] != batch_sizes[0] else result["predicted"]
    result["measured"] = done
    if done:
        result["memory_ratio"] = round(pred["memory_gb"] / done["peak_memory_gb"], 3) \
            if pred.get("memory_gb") and done["peak_memory_gb"] else None
        result["tps_ratio"] = round(pred["tokens_per_second"] / done["tokens_per_second"], 3) \
            if pred.get("tokens_per_second") else None
    # a run that trained is the check (the loss is finite); the figures are what the step is for
    ok = done is not None and all(x == x and abs(x) < 1e4 for x in done["losses"]) and built == arch.params
    oom = "; ".join(f"mb {a['micro_batch']}: out of memory" for a in attempts if "out_of_memory" in a)
    if done:
        line = (f"{arch.name} {method} mb {done['micro_batch']} x {cfg['seq']}: memory predicted "
                f"{pred.get('memory_gb')} GB{'' if pred.get('fits', True) else ' (plan refuses)'} measured "
                f"{done['peak_memory_gb']:.1f} GB; tokens/s predicted {pred.get('tokens_per_second')} measured "
                f"{done['tokens_per_second']:.0f} ({result['weights_dtype']} weights, {attn})"
                + (f"; {oom}" if oom else ""))
    else:
        line = f"{arch.name} {method}: {oom or 'no measurement'}"
    if built != arch.params:
        line += f"; built {built:,} params, sizing counts {arch.params:,}"
    return {"ok": ok, **result, "line": line}


def _no_peft() -> dict[str, Any]:
    return {"ok": None, "skipped": "peft not installed", "line": "skipped: peft not installed (LoRA needs it)"}


def step_bench_lora(ctx: Context) -> dict[str, Any]:
    """LoRA (r=16, all linear layers) at the shape: the plan's prediction against the measured peak and tokens/s."""
    return _bench(ctx, "lora") if _has("peft") else _no_peft()


def step_bench_full(ctx: Context) -> dict[str, Any]:
    """Full fine-tuning (fp32 master weights under bf16 autocast, fused AdamW) at the shape: predicted vs measured."""
    return _bench(ctx, "full")


def _examples(cfg: dict[str, Any], vocab: int) -> list[list[int]]:
    """Token sequences with a long tail of lengths (chat data's shape), the same for both batchings."""
    import random

    rng = random.Random(0)
    seq = cfg["seq"]
    lengths = [min(seq, max(16, int(rng.lognormvariate(0, 0.7) * seq / 5)))
               for _ in range(cfg["pad_examples"] * (cfg["pad_batches"] + 1))]
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def padded_batch(examples: list[list[int]], device: str) -> dict[str, Any]:
    """Right-padded to the longest example, with an attention mask; padding is not a label."""
    import torch

    longest = max(len(e) for e in examples)
    ids = torch.zeros(len(examples), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        ids[i, :len(e)] = torch.tensor(e)
        mask[i, :len(e)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def padding_free_batch(examples: list[list[int]], device: str) -> dict[str, Any]:
    """One row, position_ids restarting at each example, no attention mask; each example's first token is not a
    label (it would be predicted from the previous example). The layout of trl's DataCollatorForLanguageModeling
    with padding_free=True (trl/trainer/sft_trainer.py), which the worker uses (train.padding_free_collator)."""
    import torch

    ids = torch.tensor([t for e in examples for t in e]).unsqueeze(0)
    pos = torch.tensor([i for e in examples for i in range(len(e))]).unsqueeze(0)
    labels = ids.clone()
    labels[pos == 0] = -100
    return {"input_ids": ids.to(device), "position_ids": pos.to(device), "labels": labels.to(device)}


def _isolation(model, examples: list[list[int]], device: str, dtype) -> dict[str, Any]:
    """Padding-free must keep examples apart: the last example's logits in the packed row against the example
    alone, and a control (the same row with positions running on, so attention crosses examples)."""
    import contextlib

    import torch

    auto = torch.autocast("cuda", dtype=dtype) if device == "cuda" else contextlib.nullcontext()
    last = len(examples[-1])
    packed = padding_free_batch(examples, device)
    with torch.no_grad(), auto:
        alone = model(input_ids=torch.tensor([examples[-1]], device=device)).logits[0].float()
        inside = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits[0, -last:].float()
        n = packed["input_ids"].shape[1]
        running = torch.arange(n, device=device).unsqueeze(0)
        crossed = model(input_ids=packed["input_ids"], position_ids=running).logits[0, -last:].float()
        # the control's positions differ too; compare with the example alone at those positions
        alone_shifted = model(input_ids=torch.tensor([examples[-1]], device=device),
                              position_ids=running[:, -last:]).logits[0].float()
    diff = (inside - alone).abs().max().item()
    control = (crossed - alone_shifted).abs().max().item()
    return {"packed_vs_alone_max_abs": round(diff, 6), "control_attention_crossing_max_abs": round(control, 6),
            "isolated": diff < 0.1 * control}


def step_bench_padding(ctx: Context) -> dict[str, Any]:
    """Item 13: real tokens/s and peak memory of padded vs padding-free (position_ids) micro-batches for LoRA at
    the shape, on the attention kernel loading chooses (SDPA unless flash-attn is installed), and whether the
    padding-free layout keeps the examples apart on that kernel."""
    import gc
    import importlib.util

    import torch

    from launcher.worker import memory

    if not _has("peft"):
        return _no_peft()
    cfg = BENCH[ctx.device]
    arch = _arch(ctx)
    model, device, dtype, attn = _build(ctx, arch, "lora")
    examples = _examples(cfg, arch.vocab)
    k = cfg["pad_examples"]
    groups = [examples[i * k:(i + 1) * k] for i in range(cfg["pad_batches"] + 1)]
    result: dict[str, Any] = {"shape": arch.name, "attention": attn, "device": device,
                              "flash_attn_installed": importlib.util.find_spec("flash_attn") is not None,
                              "examples_per_micro_batch": k, "max_length": cfg["seq"],
                              "mean_length": round(sum(map(len, examples)) / len(examples), 1)}
    result["isolation"] = _isolation(model, groups[0], device, dtype)
    ctx.progress(**result)
    real = [sum(map(len, g)) for g in groups]
    for name, make in (("padded", padded_batch), ("padding_free", padding_free_batch)):
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        memory.reset_peak(device)
        params, opt = _optimizer(model, device)
        batches = [make(g, device) for g in groups]
        m = _measure(model, params, opt, batches, real, 1, device, dtype)
        m["padded_tokens_per_micro_batch"] = [int(b["input_ids"].numel()) for b in batches]
        m["real_tokens_per_micro_batch"] = real
        result[name] = m
        ctx.progress(**result)
        del opt, params, batches
    a, b = result["padded"], result["padding_free"]
    result["padding_free_speedup"] = round(b["tokens_per_second"] / a["tokens_per_second"], 3)
    fill = sum(real) / sum(a["padded_tokens_per_micro_batch"])
    result["padded_fill"] = round(fill, 3)
    ok = result["isolation"]["isolated"] and all(x == x for x in a["losses"] + b["losses"])
    line = (f"{arch.name} lora, {k} examples/micro-batch (mean {result['mean_length']:.0f} tokens, padded fill "
            f"{fill:.0%}): padded {a['tokens_per_second']:.0f} tok/s {a['peak_memory_gb']:.1f} GB, padding-free "
            f"{b['tokens_per_second']:.0f} tok/s {b['peak_memory_gb']:.1f} GB ({result['padding_free_speedup']:.2f}x) "
            f"on {attn}; examples kept apart: {result['isolation']['isolated']}"
            f"{'' if result['flash_attn_installed'] else '; flash-attn not installed'}")
    return {"ok": ok, **result, "line": line}


def fsdp_child(model: Path, out_dir: Path, work: Path, device_name: str) -> int:
    """Under `accelerate launch --config_file <generated FSDP2 config>`: the worker's model and an optimizer
    prepared together, one training step, then the worker's final save (backends/fsdp.save_full) and the
    adapter reloaded onto a fresh base with the trained values.

    accelerate 1.15 `Accelerator.prepare` refuses a model without its optimizer under FSDP2 ("a model and
    optimizer must be passed together"): `_prepare_fsdp2` swaps the optimizer's parameters for the DTensors
    fully_shard creates. On CPU accelerate silently makes the config DDP/plain (STACK-FACTS), the expected
    CPU outcome; the step and the save still run.
    """
    import torch
    from accelerate import Accelerator
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from launcher.worker.loading import is_main_process, load_kwargs, load_model_and_tokenizer, select_device
    from launcher.worker.engines import die_with_parent
    from launcher.worker.engines import fsdp

    die_with_parent()  # accelerate launch's ranks run in their own sessions: a timed-out step takes them along

    device, dtype = select_device() if device_name == "cuda" else ("cpu", torch.float32)
    acc = Accelerator(cpu=device == "cpu")
    recipe = _recipe(model)
    torch.manual_seed(0)
    m, _ = load_model_and_tokenizer(recipe, device, dtype, plan={"engine": "fsdp"})
    m.config.use_cache = False
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    wrapped, opt = acc.prepare(m, opt)
    params = list(wrapped.parameters())
    dtensors = sum(isinstance(p, DTensor) for p in params)
    model_params = {id(p) for p in params}
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    optimizer_follows = all(id(p) in model_params for p in opt_params) and len(opt_params) > 0
    is_fsdp = isinstance(wrapped, FSDPModule)
    vocab = fsdp._base(m).config.vocab_size
    ids = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(0)).to(acc.device)
    loss = wrapped(input_ids=ids, labels=ids).loss
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    result: dict[str, Any] = {
        "device": device, "distributed_type": str(acc.distributed_type), "wrapper": type(wrapped).__name__,
        "fsdp2_module": is_fsdp, "dtensor_parameters": dtensors, "parameters": len(params),
        "optimizer_holds_model_parameters": optimizer_follows, "world_size": acc.num_processes,
        "loss": loss.item(),
        "load_kwargs": {k: str(v) for k, v in load_kwargs(recipe, device, dtype, "fsdp").items()},
        **{f"report_{k}": v for k, v in fsdp.sharding_report(wrapped).items()}}
    final_dir = work / "fsdp-final"
    save_full = getattr(fsdp, "save_full", None)
    if save_full is None:
        result["final_save"] = {"ok": False, "error": "launcher/worker/engines/fsdp.py has no save_full yet"}
    else:
        # FSDP2 shards in place (unwrap_model returns the model itself); on CPU it unwraps accelerate's DDP
        target = acc.unwrap_model(wrapped)
        trained = _trained_lora(target)  # every rank: gathering a DTensor is a collective
        gathered = save_full(target, final_dir, write=is_main_process())
        result["final_save"] = {"gathered_tensors": len(gathered) if isinstance(gathered, (list, tuple)) else gathered,
                                "sharded": fsdp.is_sharded(target)
                                if hasattr(fsdp, "is_sharded") else None}
        if is_main_process():
            result["final_save"].update(_reload_adapter(recipe, trained, final_dir))
    acc.wait_for_everyone()
    if is_main_process():
        on_gpu = is_fsdp and dtensors == len(params)
        result["expected"] = ("FSDP2 module with DTensor parameters" if device == "cuda"
                              else "not FSDP: accelerate on CPU falls back silently (the worker refuses this)")
        result["ok"] = (on_gpu if device == "cuda" else not is_fsdp) and optimizer_follows \
            and result["final_save"].get("ok") is True
        _write_json(out_dir / "fsdp-child.json", result)
    acc.end_training()
    return 0


def _trained_lora(model) -> dict[str, Any]:
    """The LoRA tensors as trained, whole (a DTensor gathered: every rank must call this)."""
    from torch.distributed.tensor import DTensor

    trained = {}
    for name, p in model.named_parameters():
        if "lora_" in name and p.requires_grad:
            full = p.full_tensor() if isinstance(p, DTensor) else p
            trained[name] = full.detach().float().cpu()
    return trained


def _reload_adapter(recipe, trained: dict[str, Any], final_dir: Path) -> dict[str, Any]:
    """The saved adapter onto a fresh base: its LoRA tensors equal the trained ones, and the supervisor's
    verification (launcher/store/final.py, where present) accepts the folder."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(recipe.model, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(final_dir))
    mine = {n: p.detach().float() for n, p in loaded.named_parameters() if "lora_" in n}

    def key(n: str) -> str:  # wrappers' prefixes (FSDP, checkpointing) differ; the module path after them does not
        return n.split("base_model.model.", 1)[-1].replace("_checkpoint_wrapped_module.", "").replace(".default", "")

    a, b = {key(n): v for n, v in trained.items()}, {key(n): v for n, v in mine.items()}
    same = sorted(a) == sorted(b) and len(a) > 0
    diff = max(((a[k] - b[k]).abs().max().item() for k in a), default=float("inf")) if same else float("inf")
    moved = any(v.abs().sum().item() > 0 for k, v in b.items() if "lora_B" in k)
    out = {"adapter_files": sorted(p.name for p in final_dir.iterdir()), "tensors_saved": len(b),
           "tensors_trained": len(a), "same_names": same, "reload_max_abs_diff": diff, "trained_values": moved}
    verified = None
    try:
        from launcher.store import final
    except ImportError:
        out["verified"] = "launcher/store/final.py not present"
    else:
        verdict = final.verify_adapter(final_dir, recipe.lora.target_modules, final.base_weights(recipe.model))
        verified = verdict.ok
        out["verified"] = verdict.reason
    out["ok"] = same and diff <= 1e-6 and moved and verified is not False
    return out


def step_fsdp(ctx: Context) -> dict[str, Any]:
    """FSDP2 through the worker's generated accelerate config (one process: a mesh of 1), model and optimizer
    prepared together, one step, the final full-state-dict save, the adapter reloaded."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("accelerate") is None or importlib.util.find_spec("peft") is None:
        return {"ok": None, "skipped": "accelerate or peft not installed", "line": "skipped: accelerate or peft missing"}
    import yaml

    from launcher.worker.engines.fsdp import accelerate_config

    cfg = accelerate_config({"num_processes": 1, "device": ctx.device}, activation_checkpointing=True)
    config_path = ctx.out / "accelerate_fsdp.yaml"
    config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    child_out = ctx.out / "fsdp-child.json"
    child_out.unlink(missing_ok=True)
    env = _child_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_path),
                           "--main_process_port", "29534", "-m", "launcher.worker.gpu_check", "fsdp-child",
                           "--model", str(ctx.work / "tiny-model"), "--out", str(ctx.out), "--work", str(ctx.work),
                           "--device", ctx.device],
                          env=env, capture_output=True, text=True, timeout=400)
    (ctx.out / "fsdp-child.log").write_text(proc.stdout + proc.stderr)
    got = _read_json(child_out)
    if got is None:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
        return {"ok": False, "exit": proc.returncode, "error": tail[0][:300],
                "line": f"accelerate launch exit {proc.returncode}: {tail[0][:160]}"}
    save = got.get("final_save", {})
    line = (f"{got['wrapper']} ({got['distributed_type']}), {got['dtensor_parameters']}/{got['parameters']} DTensor "
            f"params, optimizer follows: {got['optimizer_holds_model_parameters']}, loss {got['loss']:.3f}; final "
            f"save: {save.get('tensors_saved', '?')} adapter tensors, reload diff {save.get('reload_max_abs_diff', '?')}"
            f", {save.get('verified') or save.get('error', '')}")
    return {**got, "exit": proc.returncode, "line": line}


def step_smoke_bench(ctx: Context) -> dict[str, Any]:
    """scripts/gpu_bench.py (ftrun plan + smoke through the real worker): only where trl and datasets are
    installed; in --dry-run only with GPU_CHECK_SMOKE_BENCH=1 (it takes minutes on 2 cores)."""
    import importlib.util

    missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
    if missing:
        return {"ok": None, "skipped": f"{', '.join(missing)} not installed",
                "line": f"skipped: {', '.join(missing)} not installed (the smoke test needs them)"}
    if ctx.dry_run and os.environ.get("GPU_CHECK_SMOKE_BENCH") != "1":
        return {"ok": None, "skipped": "dry run (GPU_CHECK_SMOKE_BENCH=1 runs it)",
                "line": "skipped in --dry-run (GPU_CHECK_SMOKE_BENCH=1 runs it)"}
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    budget = float(os.environ.get("GPU_CHECK_STEP_BUDGET", "300"))
    args = [sys.executable, str(repo / "scripts" / "gpu_bench.py"), "--json", str(ctx.out / "gpu_bench.json"),
            "--deadline-seconds", str(max(30, int(budget) - 15))]
    if ctx.dry_run:
        args += ["--dry-run", "--methods", "lora"]
    proc = subprocess.run(args, env=_child_env(), capture_output=True, text=True, timeout=budget)
    (ctx.out / "smoke-bench.log").write_text(proc.stdout + proc.stderr)
    rows = (_read_json(ctx.out / "gpu_bench.json") or {}).get("rows", [])
    line = "; ".join(f"{r['size']} {r['method']}: " + (f"failed ({r['error'][:60]})" if "error" in r else
                                                       f"{r['measured_gb']:.1f} GB, {r['measured_tokens_per_second']:.0f} tok/s")
                     for r in rows) or "no rows"
    return {"ok": proc.returncode == 0, "rows": rows, "line": line}


STEP_FUNCS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "tiny-model": step_tiny_model, "device": step_device, "placement": step_placement,
    "memory-cap": step_memory_cap, "peak-memory": step_peak_memory, "oom": step_oom,
    "bench-lora": step_bench_lora, "bench-full": step_bench_full, "bench-padding": step_bench_padding,
    "fsdp": step_fsdp, "smoke-bench": step_smoke_bench,
}


# ---------------------------------------------------------------------------------------------
# Running a step, finishing it, the summary

def _status(result: dict[str, Any]) -> str:
    return {True: "passed", False: "failed", None: "skipped"}[result.get("ok")]


def run_step(name: str, ctx_args: dict[str, Any]) -> int:
    """Run one step in this process; its JSON says "running" until it ends (so a kill leaves that behind)."""
    out = Path(ctx_args["out"])
    path = out / f"{name}.json"
    started = time.time()
    base = {"step": name, "status": "running", "started": started, "mode": "dry-run" if ctx_args["dry_run"] else "gpu"}
    _write_json(path, base)
    ctx = Context(progress=lambda **kw: _write_json(path, {**base, "partial": kw}), **ctx_args)
    try:
        result = STEP_FUNCS[name](ctx)
    except Exception as exc:  # noqa: BLE001 - a failed step is a result, recorded with its reason
        result = {"ok": False, "error": _first_line(exc), "traceback": traceback.format_exc()[-3000:],
                  "line": f"error: {_first_line(exc)}"}
        partial = (_read_json(path) or {}).get("partial")
        if partial:
            result["partial"] = partial
    import resource

    cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    result = {**base, **result, "status": _status(result), "seconds": round(time.time() - started, 1),
              "cpu_seconds": round(cpu, 1)}
    _write_json(path, result)
    return 0 if result["ok"] is not False else 1


def finish(out: Path, name: str, rc: int, limit: Optional[float], not_run: Optional[str] = None) -> str:
    """After a step's process ended (or was not started, `not_run` saying why): record what it could not,
    rewrite the summary, and return the step's one-line result."""
    path = out / f"{name}.json"
    data = _read_json(path)
    if not_run is not None:
        data = {"step": name, "status": "not run", "ok": False, "error": not_run, "line": f"not run: {not_run}"}
        _write_json(path, data)
    elif data is None or data.get("status") == "running":
        data = data or {"step": name}
        log = out / f"{name}.log"
        tail = ""
        if log.is_file():
            lines = [x for x in log.read_text(errors="replace").strip().splitlines() if x.strip()]
            tail = lines[-1][:200] if lines else ""
        if rc in (124, 137):  # timeout(1): 124 after SIGTERM, 128+9 after its SIGKILL
            why = f"timed out after {limit:g} s" if limit else "timed out"
            data.update(status="timed out")
        else:
            why = f"ended with exit {rc} without a result" + (f": {tail}" if tail else "")
            data.update(status="crashed")
        if data.get("partial"):
            why += f" (what it measured before is kept in {name}.json)"
        data.update(ok=False, error=why, log_tail=tail, line=why, seconds=round(time.time() - data.get("started", time.time()), 1))
        _write_json(path, data)
    elif rc != 0 and data.get("ok") is not False:
        data.update(ok=False, status="failed", error=f"exit {rc}", line=f"{data.get('line', '')} (exit {rc})")
        _write_json(path, data)
    write_summary(out)
    mark = {"passed": "ok", "failed": "FAIL", "skipped": "skip", "timed out": "TIMEOUT", "crashed": "CRASH",
            "not run": "NOT RUN"}
    secs = f" [{data['seconds']:.0f} s]" if isinstance(data.get("seconds"), (int, float)) else ""
    return f"{mark.get(data['status'], data['status']):>7} {name}: {data.get('line', '')}{secs}"


def write_summary(out: Path) -> dict[str, Any]:
    steps = []
    selected = [x for x in os.environ.get("GPU_CHECK_STEPS", "").split(",") if x]
    for name in STEPS:
        data = _read_json(out / f"{name}.json")
        if selected and name not in selected:
            steps.append({"step": name, "status": "not selected"})
            continue
        if data is None:
            steps.append({"step": name, "status": "pending"})
            continue
        steps.append({"step": name, "status": data.get("status"), "ok": data.get("ok"),
                      "seconds": data.get("seconds"), "line": data.get("line")})
    counts: dict[str, int] = {}
    for s in steps:
        counts[s["status"]] = counts.get(s["status"], 0) + 1
    started = float(os.environ.get("GPU_CHECK_STARTED", "0") or 0)
    summary = {"mode": os.environ.get("GPU_CHECK_MODE", ""), "updated": time.time(),
               "elapsed_seconds": round(time.time() - started, 1) if started else None,
               "budget_seconds": float(os.environ.get("GPU_CHECK_BUDGET_S", "0") or 0) or None,
               "counts": counts, "all_passed": all(s["status"] in ("passed", "skipped", "not selected") for s in steps),
               "steps": steps}
    _write_json(out / "summary.json", summary)
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launcher.worker.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("step", help="run one step, writing OUT/NAME.json")
    s.add_argument("name", choices=STEPS)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--dry-run", action="store_true", help="on the CPU, with CPU expectations and a tiny shape")
    f = sub.add_parser("finish", help="record a step's end (timeout, crash, skip), rewrite the summary, print its line")
    f.add_argument("name", choices=STEPS)
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("--rc", type=int, default=0)
    f.add_argument("--limit", type=float)
    f.add_argument("--not-run", help="the step was not started, for this reason")
    st = sub.add_parser("start", help="remove step results of an earlier run from OUT, write the first summary")
    st.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("place-child", help=argparse.SUPPRESS)
    c.add_argument("--model", type=Path, required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--load", action="store_true")
    d = sub.add_parser("fsdp-child", help=argparse.SUPPRESS)
    d.add_argument("--model", type=Path, required=True)
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--work", type=Path, required=True)
    d.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ns = p.parse_args(argv)
    if ns.command == "step":
        ns.out.mkdir(parents=True, exist_ok=True)
        work = Path(os.environ.get("GPU_CHECK_WORK") or ns.out / "work")
        work.mkdir(parents=True, exist_ok=True)
        shape = os.environ.get("GPU_CHECK_SHAPE") or ("tiny" if ns.dry_run else GPU_SHAPE)
        return run_step(ns.name, {"out": ns.out, "work": work, "dry_run": ns.dry_run,
                                  "device": "cpu" if ns.dry_run else "cuda", "shape": shape})
    if ns.command == "start":
        ns.out.mkdir(parents=True, exist_ok=True)
        for name in STEPS:
            (ns.out / f"{name}.json").unlink(missing_ok=True)
        write_summary(ns.out)
        return 0
    if ns.command == "finish":
        print(finish(ns.out, ns.name, ns.rc, ns.limit, ns.not_run), flush=True)
        return 0
    if ns.command == "place-child":
        return place_child(ns.model, Path(ns.out.replace("{rank}", os.environ.get("RANK", "0"))), ns.load)
    return fsdp_child(ns.model, ns.out, ns.work, ns.device)


if __name__ == "__main__":
    sys.exit(main())
