"""The peak-memory and oom steps: the worker's peak against torch's counters, real out-of-memory errors classified."""

from __future__ import annotations

from typing import Any, Callable

from launcher.plan.sizing_constants import GB
from gpu_check.common import Context, first_line, in_gb


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
        r = {
            "device": device,
            "worker_peak_gb": round(peak, 3),
            "max_memory_reserved_gb": in_gb(max_reserved),
            "max_memory_allocated_gb": in_gb(torch.cuda.max_memory_allocated(idx)),
            "reserved_now_gb": in_gb(reserved),
            "device_used_gb_mem_get_info": in_gb(total - free),
            "outside_allocator_gb": in_gb(outside),
            "used_before_first_tensor_gb": in_gb(total - free0),
            "allocation_gb": in_gb(size),
            "over_ranks_gb": round(memory.peak_memory_over_ranks_gb(device), 3),
        }
        # peak = allocator peak + outside (context, cuBLAS); sizing counts the context as CUDA_CONTEXT_GB
        from launcher.plan import sizing_constants

        r["sizing_cuda_context_gb"] = sizing_constants.CUDA_CONTEXT_GB
        ok = (
            max_reserved >= size
            and outside > 0
            and abs(peak * GB - (max_reserved + outside)) < 64e6
            and peak * GB >= total - free
            and r["over_ranks_gb"] == round(peak, 3)
        )
        line = (
            f"worker peak {peak:.2f} GB = allocator peak {max_reserved / GB:.2f} + outside the allocator "
            f"{outside / GB:.2f} (sizing counts {sizing_constants.CUDA_CONTEXT_GB}); mem_get_info used "
            f"{(total - free) / GB:.2f}"
        )
    else:
        before = memory.peak_memory_gb(device)
        x = torch.ones(size, dtype=torch.uint8)
        peak = memory.peak_memory_gb(device)
        del x
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB
        r = {
            "device": device,
            "worker_peak_gb": round(peak, 3),
            "before_gb": round(before, 3),
            "allocation_gb": in_gb(size),
            "ru_maxrss_gb": round(rss, 3),
            "over_ranks_gb": round(memory.peak_memory_over_ranks_gb(device), 3),
        }
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
            cases[name] = {
                "raised": type(exc).__name__,
                "message": first_line(exc),
                "is_out_of_memory": memory.is_out_of_memory(exc),
                "text": memory.out_of_memory_text(exc)[:300],
            }
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
        cases["filled"] = {"held_gb": in_gb(sum(t.numel() for t in hold)), "free_gb": in_gb(free)}
        attempt("cublas_at_full_device", lambda: (a @ a).sum().item())
        del hold
        torch.cuda.empty_cache()
    else:
        import resource

        attempt("allocator", lambda: torch.empty(2**62, dtype=torch.uint8))
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
    line = "; ".join(
        f"{k}: {v['raised']} -> is_out_of_memory={v['is_out_of_memory']}"
        if v.get("raised")
        else f"{k}: {v.get('skipped') or v.get('note') or 'no error'}"
        for k, v in cases.items()
        if k != "filled"
    )
    return {"ok": ok, "device": device, "cases": cases, "line": line}
