"""The worker's memory: peak measurement, the --memory-limit cap, out-of-memory classification.

Each rank measures and caps its own device: the GPU of its LOCAL_RANK, passed explicitly (torch 2.13
set_per_process_memory_fraction(device=None) caps the current device, `torch/cuda/memory.py`), or its RAM on the CPU.

Out-of-memory failures that are not torch.OutOfMemoryError (torch 2.13, bitsandbytes 0.50; docs/engines.md item 14):
- CUDA runtime: "CUDA error: out of memory", torch.AcceleratorError error_code 2 (`c10/cuda/CUDAException.h`,
  c10_cuda_check_implementation; torch/csrc/Exceptions.cpp, _new_accelerator_error_object).
- cuBLAS (and cuSPARSE/cuSOLVER/cuDNN): RuntimeError "CUBLAS_STATUS_ALLOC_FAILED" (`ATen/cuda/Exceptions.h`).
- NCCL: DistBackendError whose "Last error:" holds "Failed to CUDA calloc", "Cuda failure 2 'out of memory'" or
  "Failed to malloc <n> bytes" (`c10d/NCCLUtils.hpp`, C10D_NCCL_CHECK; alloc.h); its first line, "unhandled cuda
  error", is any CUDA failure and not enough.
- bitsandbytes allocates through torch; its native CUDA_CHECK_RETURN exits (nothing to classify) and "cublasLt ran
  into an error!" has no status (`bitsandbytes/backends/cuda/ops.py`): not classified.
- The CPU allocator: "DefaultCPUAllocator: can't allocate memory", or Python's MemoryError.
"""

from __future__ import annotations

import re
import resource
import sys
from typing import Optional

from launcher.plan.sizing_constants import GB

# out-of-memory texts of a RuntimeError (module docstring)
_OOM_TEXTS = re.compile(
    r"\b(CUDA|HIP) out of memory"  # the caching allocator's text, when re-raised as another type
    r"|\b(CUDA|HIP) error: out of memory"  # C10_CUDA_CHECK with cudaErrorMemoryAllocation
    r"|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY"  # the runtime's and the driver's error names
    r"|\b(CUBLAS|CUSPARSE|CUSOLVER|CUDNN)_STATUS_ALLOC_FAILED\b"
    r"|Failed to CUDA calloc|Cuda failure \d+ 'out of memory'|Failed to malloc \d+ bytes"  # NCCL's last error
    r"|Triton Error \[CUDA\]: out of memory"  # Triton kernels (torch.compile, Unsloth)
    r"|can't allocate memory"  # torch's CPU allocator (alloc_cpu.cpp)
)


def _device_index() -> int:
    from launcher.worker.loading import local_rank

    return local_rank()


def is_out_of_memory(exc: BaseException) -> bool:
    """True when `exc` or its __cause__/__context__ chain is an out-of-memory: the worker's OOM path (exit 78), not
    a crash the supervisor would restart into the same out-of-memory."""
    return _oom_in_chain(exc) is not None


def out_of_memory_text(exc: BaseException) -> str:
    """One line: the line that says out of memory (NCCL's is below its first line), then the exception's first."""
    first = _first_line(exc)
    found = _oom_in_chain(exc)
    if found is None:
        return first
    culprit, line = found
    line = line or _first_line(culprit)
    if not line or line in first:
        return first or "out of memory"
    return f"{line} [raised as: {first}]" if first else line


def _oom_in_chain(exc: Optional[BaseException]) -> Optional[tuple[BaseException, str]]:
    """(the exception, the line that says out of memory) for the first out-of-memory in the chain, else None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        line = _oom_line(exc)
        if line is not None:
            return exc, line
        exc = exc.__cause__ or exc.__context__
    return None


def _oom_line(exc: BaseException) -> Optional[str]:
    if isinstance(exc, MemoryError) or _is_torch_oom(exc):
        return ""
    if isinstance(exc, RuntimeError):  # torch.AcceleratorError and torch.distributed.DistBackendError included
        text = str(exc)
        match = _OOM_TEXTS.search(text)
        if match is not None:
            start = text.rfind("\n", 0, match.start()) + 1
            end = text.find("\n", match.end())
            return text[start : end if end >= 0 else len(text)].strip()
    return None


def _is_torch_oom(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")  # an exception of torch's can only exist once torch is imported
    return torch is not None and isinstance(exc, torch.OutOfMemoryError)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


# --- peak measurement ---------------------------------------------------------------------------------


def peak_memory_gb(device: str) -> float:
    """This process's peak memory in GB (sizing_constants.GB). CUDA: the allocator's peak on this rank's GPU plus
    what the device holds outside it now (context, NCCL: total - free - reserved; mem_get_info is the whole device,
    `torch/cuda/memory.py`). CPU: the peak resident set (ru_maxrss, KiB on Linux)."""
    if device == "cuda":
        import torch

        index = _device_index()
        free, total = torch.cuda.mem_get_info(index)
        outside = max(0, total - free - torch.cuda.memory_reserved(index))
        return (torch.cuda.max_memory_reserved(index) + outside) / GB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB


def peak_memory_over_ranks_gb(device: str) -> float:
    """The largest peak_memory_gb over all ranks; a collective when a process group is initialised."""
    local = peak_memory_gb(device)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    import torch

    # NCCL reduces only tensors on this rank's GPU; gloo (the CPU) only CPU tensors
    where = torch.device("cuda", _device_index()) if device == "cuda" else torch.device("cpu")
    value = torch.tensor([local], dtype=torch.float64, device=where)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def reset_peak(device: str) -> None:
    """Start the allocator's peak from here (after loading, before training): CUDA only; RSS has no reset."""
    if device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(_device_index())


# --- the --memory-limit cap ---------------------------------------------------------------------------

_CAPPED_BASE_RSS = [0]  # resident bytes when the CPU cap was set: an out-of-memory reports its peak above them


def cap_memory(device: str, limit_gb: float) -> None:
    """--memory-limit: plan for a smaller card, or provoke a real OOM in tests. CUDA: the caching allocator fails at
    the limit (context and NCCL are not capped; peak_memory_gb counts them). CPU: RLIMIT_AS above what the imports
    mapped, so torch's CPU allocator fails for real."""
    if device == "cuda":
        import torch

        index = _device_index()
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit_gb * GB / total), device=index)
        where = f"GPU fraction of cuda:{index}"
    else:
        import psutil

        info = psutil.Process().memory_info()
        resource.setrlimit(resource.RLIMIT_AS, (info.vms + int(limit_gb * GB), resource.RLIM_INFINITY))
        _CAPPED_BASE_RSS[0] = info.rss
        where = "RLIMIT_AS above the imports"
    print(f"[ftrun worker] memory limited to {round(limit_gb, 2):g} GB ({where})", flush=True)


def out_of_memory_peak_gb(device: str) -> Optional[float]:
    """The peak to report with an out-of-memory, this rank only; on the CPU above the cap's base. None when the
    device cannot be queried any more."""
    try:
        peak = peak_memory_gb(device)
    except RuntimeError as exc:  # a CUDA context left unusable by the failure: say so rather than crash here
        print(f"[ftrun worker] peak memory not measurable after the failure: {_first_line(exc)}", flush=True)
        return None
    if device == "cpu" and _CAPPED_BASE_RSS[0]:
        peak = max(0.0, peak - _CAPPED_BASE_RSS[0] / GB)
    return peak
