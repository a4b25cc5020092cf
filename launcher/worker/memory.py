"""The worker's memory: peak measurement, the --memory-limit cap, out-of-memory classification.

Each rank measures and caps its own device: the GPU of its LOCAL_RANK, its index passed explicitly (torch 2.13
set_per_process_memory_fraction(device=None) caps the *current* device, `torch/cuda/memory.py`), or the process's
RAM on the CPU.

Sources relied on (torch 2.13, bitsandbytes 0.50; NCCL as bundled with torch's CUDA builds):
- Failures that are out-of-memory without being torch.OutOfMemoryError (the caching allocator's
  "CUDA out of memory. Tried to allocate ..." is):
  * a CUDA runtime call that fails with cudaErrorMemoryAllocation: C10_CUDA_CHECK ->
    c10_cuda_check_implementation throws c10::AcceleratorError with "CUDA error: " + cudaGetErrorString(err),
    i.e. "CUDA error: out of memory" (`torch/include/c10/cuda/CUDAException.h`, c10/cuda/CUDAException.cpp);
    Python sees torch.AcceleratorError (a RuntimeError) with error_code 2 (torch/csrc/Exceptions.cpp,
    _new_accelerator_error_object; `torch/include/c10/util/Exception.h`, class AcceleratorError).
  * cuBLAS: TORCH_CUDABLAS_CHECK raises a plain RuntimeError "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling
    `cublasCreate(handle)`" (`torch/include/ATen/cuda/Exceptions.h`); cuSPARSE/cuSOLVER/cuDNN follow the same
    <LIB>_STATUS_ALLOC_FAILED naming.
  * NCCL: C10D_NCCL_CHECK raises torch.distributed.DistBackendError (a RuntimeError) "NCCL error in: ...,
    unhandled cuda error ..." followed by getNcclErrorDetailStr's "ncclUnhandledCudaError: Call to CUDA function
    failed." or "ncclSystemError: ..." and "Last error:\\n" + ncclGetLastError(), which for an allocation holds
    NCCL's own WARN "Failed to CUDA calloc <n> bytes" (alloc.h, ncclCudaCallocDebug; "Failed to CUDA calloc
    async ..." for the async variant), "Cuda failure 2 'out of memory'" (CUDACHECK) or, for host memory,
    "Failed to malloc <n> bytes" (`torch/include/torch/csrc/distributed/c10d/NCCLUtils.hpp`, C10D_NCCL_CHECK).
    The first line alone ("unhandled cuda error") is not enough: NCCL reports other CUDA failures the same way.
  * bitsandbytes 0.50 allocates its tensors through torch (torch.OutOfMemoryError above). Its own native CUDA
    checks print "Error <cudaGetErrorString> at line .. in file .." and exit(1) (strings of
    libbitsandbytes_cuda*.so, CUDA_CHECK_RETURN in csrc/ops.cuh): no Python exception to classify. Its cublasLt
    path raises "cublasLt ran into an error!" without the status (`bitsandbytes/backends/cuda/ops.py`,
    int8_linear_matmul): not classified, it may be any cuBLAS failure.
  * the CPU allocator: "DefaultCPUAllocator: can't allocate memory" (a RuntimeError), or Python's MemoryError.
"""

from __future__ import annotations

import re
import resource
import sys
from typing import Optional

from launcher.plan.sizing_constants import GB

# Texts of out-of-memory failures that arrive as a RuntimeError (AcceleratorError, DistBackendError or plain)
# rather than as torch.OutOfMemoryError; where each comes from is in the module docstring.
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
    """True when `exc` or anything it was raised from (__cause__) or during (__context__) is an out-of-memory.

    The worker turns these into the OOM path (exit 78: the smoke test re-plans, a full run stops with the
    reason) instead of a crash, which the supervisor would restart into the same out-of-memory.
    """
    return _oom_in_chain(exc) is not None


def out_of_memory_text(exc: BaseException) -> str:
    """One line for the user: the line that says out of memory first (NCCL states it below its own first line,
    a wrapper in its cause), then the failing exception's first line."""
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
    if isinstance(exc, MemoryError):
        return ""
    if _is_torch_oom(exc):
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
    """This process's peak memory in GB (2**30 bytes, sizing_constants.GB).

    CUDA: the caching allocator's peak on this rank's GPU plus what the device holds outside the allocator
    now (CUDA context, library handles, NCCL buffers: total - free - reserved; mem_get_info is cudaMemGetInfo,
    the whole device, `torch/cuda/memory.py`); a card runs out when the two together exceed it. Another process
    on the same GPU would be counted too (the worker runs one rank per GPU). CPU: the peak resident set
    (ru_maxrss, KiB on Linux).
    """
    if device == "cuda":
        import torch

        index = _device_index()
        free, total = torch.cuda.mem_get_info(index)
        outside = max(0, total - free - torch.cuda.memory_reserved(index))
        return (torch.cuda.max_memory_reserved(index) + outside) / GB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB


def peak_memory_over_ranks_gb(device: str) -> float:
    """The largest peak_memory_gb over all ranks (the card that runs out first is the one that counts).

    A collective when a process group is initialised: every rank must call it at the same point.
    """
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
    """--memory-limit: plan for a smaller card than this one, or provoke a real OOM in tests.

    CUDA: the caching allocator then fails for real at the limit (torch.OutOfMemoryError). What lives outside
    the allocator (context, NCCL) is not capped, as on a real card of that size it would count: peak_memory_gb
    reports it.
    CPU: address space above what the imports already mapped, so torch's CPU allocator fails for real
    ("can't allocate memory") when the training needs more.
    """
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
    """The peak to report with an out-of-memory, on this rank only (the others may be gone or stuck): on the
    CPU counted from where the cap starts, like the cap. None when the device cannot be queried any more."""
    try:
        peak = peak_memory_gb(device)
    except RuntimeError as exc:  # a CUDA context left unusable by the failure: say so rather than crash here
        print(f"[ftrun worker] peak memory not measurable after the failure: {_first_line(exc)}", flush=True)
        return None
    if device == "cpu" and _CAPPED_BASE_RSS[0]:
        peak = max(0.0, peak - _CAPPED_BASE_RSS[0] / GB)
    return peak
