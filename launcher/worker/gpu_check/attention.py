"""The attention step: torch's scaled_dot_product_attention forward and backward at 8 new sequence lengths for each
SDPA backend and three mask cases, the default dispatch beside them, and the decode case generation runs: the first
call's cost against a repeat's, which is what a backend that builds a plan per new shape (cuDNN) shows."""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any, Callable

from launcher.worker.gpu_check.common import Context, child_env, first_line, last_line, module_cmd, read_json

# Qwen3-8B's attention (launcher/plan/models.py): 32 query heads, 8 key/value heads, head_dim 128; the dry run a
# tiny GQA shape. Lengths: 8 distinct ones, none a multiple of another's plan, as a padding-free step's totals.
SHAPES = {
    "cuda": dict(
        heads=32,
        kv_heads=8,
        head_dim=128,
        batch=4,
        lengths=(517, 803, 1029, 1301, 1610, 1877, 2113, 2390),
        decode_batch=32,
        decode_keys=64,
        repeats=3,
    ),
    "cpu": dict(
        heads=4,
        kv_heads=2,
        head_dim=32,
        batch=2,
        lengths=(17, 23, 31, 37, 41, 47, 53, 61),
        decode_batch=4,
        decode_keys=8,
        repeats=2,
    ),
}
BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", "default")
CASES = ("causal", "padded", "padding-free")


def _inputs(case: str, length: int, s: dict[str, Any], device: str, dtype):
    """(q, k, v, mask, is_causal) as transformers 5.x hands them to SDPA: GQA through enable_gqa only without a mask
    on CUDA, else the key/value heads repeated (transformers/integrations/sdpa_attention.py, use_gqa_in_sdpa and
    repeat_kv); a bool mask where True attends (transformers/masking_utils.py, sdpa_mask)."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(length)
    batch = 1 if case == "padding-free" else s["batch"]
    total = length * s["batch"] if case == "padding-free" else length  # padding-free: the batch's examples in a row

    def rand(heads: int):
        return torch.randn(batch, heads, total, s["head_dim"], generator=g).to(device, dtype).requires_grad_()

    q, k, v = rand(s["heads"]), rand(s["kv_heads"]), rand(s["kv_heads"])
    if case == "causal":
        return q, k, v, None, True
    pos = torch.arange(total)
    causal = pos[:, None] >= pos[None, :]
    if case == "padded":  # each row's own length, right-padded to the longest
        lens = [length - (length * i) // (2 * s["batch"]) for i in range(batch)]
        keep = torch.stack([pos < n for n in lens])  # (batch, keys)
        mask = causal[None, None] & keep[:, None, None, :]
    else:  # block-diagonal: each example sees itself only (position ids restart per example)
        parts = [length - (length * i) // (2 * s["batch"]) for i in range(s["batch"])]
        parts[-1] += total - sum(parts)
        doc = torch.repeat_interleave(torch.arange(len(parts)), torch.tensor(parts))
        mask = (causal & (doc[:, None] == doc[None, :]))[None, None]
    rep = s["heads"] // s["kv_heads"]
    k = k.detach().repeat_interleave(rep, dim=1).requires_grad_()
    v = v.detach().repeat_interleave(rep, dim=1).requires_grad_()
    return q, k, v, mask.to(device), False


def _context(backend: str):
    import contextlib

    if backend == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, backend)])


def _timer(device: str) -> Callable[[Callable[[], None]], float]:
    import torch

    def timed(fn: Callable[[], None]) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return round((time.perf_counter() - t0) * 1000, 3)

    return timed


def _train_case(case: str, backend: str, s: dict[str, Any], device: str, dtype) -> dict[str, Any]:
    """Forward and backward at each length: the first call's milliseconds and the best repeat's."""
    import torch.nn.functional as F

    timed = _timer(device)
    rows = []
    for length in s["lengths"]:
        q, k, v, mask, causal = _inputs(case, length, s, device, dtype)
        gqa = dict(enable_gqa=True) if k.shape[1] != q.shape[1] else {}

        def once(q=q, k=k, v=v, mask=mask, causal=causal, gqa=gqa) -> None:
            with _context(backend):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, **gqa)
            out.float().sum().backward()

        try:
            first = timed(once)
            repeat = min(timed(once) for _ in range(s["repeats"]))
        except (RuntimeError, NotImplementedError) as exc:
            return {"supported": False, "error": first_line(exc), "at_length": length}
        rows.append({"length": length, "tokens": q.shape[0] * q.shape[2], "first_ms": first, "repeat_ms": repeat})
        del q, k, v, mask, once
    ratio = sum(r["first_ms"] for r in rows) / max(1e-9, sum(r["repeat_ms"] for r in rows))
    return {"supported": True, "lengths": rows, "first_over_repeat": round(ratio, 2)}


def _decode_case(backend: str, s: dict[str, Any], device: str, dtype) -> dict[str, Any]:
    """Generation's attention: batch 32, one query, the keys growing by one each token, a padding mask."""
    import torch
    import torch.nn.functional as F

    timed = _timer(device)
    rep = s["heads"] // s["kv_heads"]
    g = torch.Generator(device="cpu").manual_seed(1)
    ms = []
    with torch.no_grad():
        for keys in range(1, s["decode_keys"] + 1):
            q = torch.randn(s["decode_batch"], s["heads"], 1, s["head_dim"], generator=g).to(device, dtype)
            k = torch.randn(s["decode_batch"], s["kv_heads"], keys, s["head_dim"], generator=g).to(device, dtype)
            k = k.repeat_interleave(rep, dim=1)
            mask = torch.ones(s["decode_batch"], 1, 1, keys, dtype=torch.bool, device=device)
            mask[::2, ..., 0] = keys == 1  # left padding on every other row (never a row without a key)

            def once() -> None:
                with _context(backend):
                    F.scaled_dot_product_attention(q, k, k, attn_mask=mask)

            try:
                ms.append(timed(once))
            except (RuntimeError, NotImplementedError) as exc:
                return {"supported": False, "error": first_line(exc), "at_keys": keys}
    return {
        "supported": True,
        "tokens": len(ms),
        "total_ms": round(sum(ms), 2),
        "first_ms": ms[0],
        "median_ms": sorted(ms)[len(ms) // 2],
        "max_ms": max(ms),
    }


def _varlen(s: dict[str, Any], device: str) -> dict[str, Any]:
    """flash-attn's varlen kernel (the padding-free layout without a mask) where installed."""
    import importlib.util

    if device != "cuda":
        return {"skipped": "needs a CUDA device"}
    if importlib.util.find_spec("flash_attn") is None:
        return {"skipped": "flash-attn is not installed (nor carried: its wheels are hundreds of MB)"}
    import torch
    from flash_attn import flash_attn_varlen_func

    timed = _timer(device)
    rows = []
    for length in s["lengths"]:
        parts = [length - (length * i) // (2 * s["batch"]) for i in range(s["batch"])]
        cu = torch.tensor([0, *torch.tensor(parts).cumsum(0).tolist()], dtype=torch.int32, device=device)
        total = int(cu[-1])

        def rand(h):
            return torch.randn(total, h, s["head_dim"], device=device, dtype=torch.bfloat16, requires_grad=True)

        q, k, v = rand(s["heads"]), rand(s["kv_heads"]), rand(s["kv_heads"])

        def once() -> None:
            flash_attn_varlen_func(q, k, v, cu, cu, max(parts), max(parts), causal=True).float().sum().backward()

        rows.append(
            {
                "length": length,
                "tokens": total,
                "first_ms": timed(once),
                "repeat_ms": min(timed(once) for _ in range(s["repeats"])),
            }
        )
    return {"supported": True, "lengths": rows}


def attention_child(out: str) -> int:
    """One pass over every backend and case, in its own process: each backend's first call at each length is a
    first call for this process (cuDNN's plan cache and torch's dispatch state are per process)."""
    import importlib.util
    import json

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    s = SHAPES[device]
    result: dict[str, Any] = {
        "device": device,
        "dtype": str(dtype).replace("torch.", ""),
        "shape": s,
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "training": {},
        "decode": {},
    }
    only = os.environ.get("GPU_CHECK_ATTENTION_ONLY")  # the cache-debug run: one backend
    for backend in (only,) if only else BACKENDS:
        result["training"][backend] = {case: _train_case(case, backend, s, device, dtype) for case in CASES}
        result["decode"][backend] = _decode_case(backend, s, device, dtype)
    result["flash_attn_varlen"] = _varlen(s, device)
    # transformers' Hub kernels (attn_implementation="kernels-community/...") need the `kernels` package and the
    # kernel's download: a lent box has no network, so only a kernel already in its Hub cache could run
    result["hub_kernel"] = {
        "skipped": "the kernels package is not installed"
        if importlib.util.find_spec("kernels") is None
        else "no network on the box to fetch a Hub kernel, and none is carried"
    }
    with open(out, "w") as fh:
        json.dump(result, fh, indent=2)
    return 0


def _line(result: dict[str, Any]) -> str:
    parts = []
    for backend, cases in result.get("training", {}).items():
        said = []
        for case, r in cases.items():
            said.append(f"{case} x{r['first_over_repeat']}" if r.get("supported") else f"{case} n/a")
        decode = result.get("decode", {}).get(backend, {})
        said.append(f"decode {decode['total_ms']:.0f} ms" if decode.get("supported") else "decode n/a")
        parts.append(f"{backend.split('_')[0].lower()}: {', '.join(said)}")
    return "first/repeat " + "; ".join(parts)


def step_attention(ctx: Context) -> dict[str, Any]:
    """Two child processes: the measurement, and the same with TORCH_CUDNN_SDPA_CACHE_DEBUG=1 for cuDNN alone
    (the cache's hits and misses, if this torch prints them)."""
    budget = float(os.environ.get("GPU_CHECK_STEP_BUDGET", "120"))
    path = ctx.out / "attention.child.json"
    proc = subprocess.run(
        module_cmd("attention-child", "--out", str(path)),
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=budget * 0.7,
    )
    result = read_json(path)
    if proc.returncode != 0 or result is None:
        why = last_line(proc)
        return {"ok": False, "error": why, "line": f"attention child failed: {why[:200]}"}
    path.unlink()
    debug: dict[str, Any] = {"skipped": "no CUDA device"}
    if ctx.device == "cuda":
        env = child_env(TORCH_CUDNN_SDPA_CACHE_DEBUG="1", GPU_CHECK_ATTENTION_ONLY="CUDNN_ATTENTION")
        try:
            dbg = subprocess.run(
                module_cmd("attention-child", "--out", os.devnull),
                env=env,
                capture_output=True,
                text=True,
                timeout=budget * 0.25,
            )
            lines = [x for x in (dbg.stdout + dbg.stderr).splitlines() if "cache" in x.lower() or "cudnn" in x.lower()]
            debug = {
                "exit": dbg.returncode,
                "cache_lines": len(lines),
                "first_lines": lines[:20],
                "last_lines": lines[-10:],
            }
            if not lines:
                debug["note"] = "this torch printed nothing for TORCH_CUDNN_SDPA_CACHE_DEBUG=1"
        except subprocess.TimeoutExpired:
            debug = {"error": "the cache-debug run timed out"}
    result["cudnn_cache_debug"] = debug
    return {"ok": True, **result, "line": _line(result)}
