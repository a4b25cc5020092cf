"""The attention kernels a run uses: the implementation transformers loads the model with and, under SDPA, which of
torch's SDPA backends may serve a call. The plan states both in a Why line; the worker applies them
(launcher/worker/loading.py select_device) and records what torch then reports in worker.json and task_eval.json.

cuDNN's SDPA backend is off by default (torch 2.11 and 2.13, the versions of the lent GPU box and the image):
- on compute capability 9.x and 10.x with cuDNN newer than 9.15 torch tries cuDNN attention first
  (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, check_prefer_cudnn_attention; the wheels bundle cuDNN
  9.19 and 9.20). cuDNN takes a mask, so it serves padded batches, padding-free batches (transformers hands SDPA a
  4-D block-diagonal mask) and every decode step of generation;
- it keeps one execution graph per shape: batch, heads, both lengths, strides and the mask's shape make the key
  (aten/src/ATen/native/cudnn/MHA.cpp, MHAParams), and a miss builds a new graph, hundreds of milliseconds by public
  reports. Real data brings a new length nearly every step and generation a new key length every token: the first
  H200 run (2026-12-04) paid up to ~1 s per new length and generated 74 tokens/s;
- without it torch takes flash attention where there is no mask and the memory-efficient kernel where there is one
  (sdp_utils.cpp's default order); neither builds anything per shape.
`TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1` is no way out here: it covers calls without a mask only. The GPU check's
attention step times each backend's first and repeated call per length (docs/BENCHMARKS.md); `FTRUN_SDPA_BACKENDS`
(a comma list of SDPA_BACKENDS) names the backends to leave on instead, to compare or to take cuDNN back.

Padding-free batches (one row of several examples; TRL's collator with padding_free=True, and BFD packing) need a
variable-length kernel, or transformers hands SDPA a dense (1, 1, L, L) block mask for the whole row: with L the
micro-batch's tokens, attention then costs L^2 per layer instead of the sum of each example's own, and the mask is
saved per layer for the backward. The kernels, best first (implementation): flash-attn's FlashAttention-2
(flash_attention_2) where the package is installed; else torch's own FlashAttention-2 varlen kernel
(torch.nn.attention.varlen.varlen_attn, torch 2.11+), which launcher/worker/varlen.py registers as VARLEN; else SDPA
with the dense mask, whose L^2 FLOPs and memory the plan counts (launcher/plan/sizing.py dense_mask_bytes,
launcher/plan/throughput.py flops_per_token) and whose micro-batch the plan does not raise (launcher/plan/speed.py).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from typing import Any, Mapping, Optional

from launcher.errors import UsageError

# torch's SDPA backends: name -> the flag torch.backends.cuda sets with enable_<flag> and reads with <flag>_enabled
SDPA_BACKENDS = {"cudnn": "cudnn_sdp", "flash": "flash_sdp", "efficient": "mem_efficient_sdp", "math": "math_sdp"}
DEFAULT_BACKENDS = ("flash", "efficient", "math")
OVERRIDE = "FTRUN_SDPA_BACKENDS"

FLASH = "flash_attention_2"
# torch's FlashAttention-2 varlen kernel for padding-free rows, SDPA for the rest (launcher/worker/varlen.py registers
# it with transformers under this name)
VARLEN = "ftrun_varlen"
# The first torch whose varlen_attn takes a softmax scale and the causal window with a backward pass (2.10's has
# is_causal and no scale): launcher/worker/varlen.py's docstring has the history.
VARLEN_MIN_TORCH = (2, 11)
KERNEL_NAMES = {
    FLASH: "flash-attn's FlashAttention-2",
    VARLEN: "torch's FlashAttention-2 varlen kernel (torch.nn.attention.varlen.varlen_attn)",
    "sdpa": "SDPA",
}


def torch_version() -> Optional[str]:
    """The installed torch's version from its metadata (importing torch would make `ftrun plan` heavy); None where
    torch is not installed (the light install)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_has_varlen(version: Optional[str]) -> bool:
    """Whether a torch of this version has the varlen kernel the worker uses. None (no torch where the plan runs):
    the run's box is assumed to have ftrun's image's torch, which has it."""
    if version is None:
        return True
    found = re.match(r"(\d+)\.(\d+)", version)
    return bool(found) and (int(found.group(1)), int(found.group(2))) >= VARLEN_MIN_TORCH


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def implementation(device: str, bf16: bool, flash_attn_installed: bool, torch_varlen: bool = False) -> str:
    """The attn_implementation the worker loads with, on a bf16 card (FlashAttention-2 needs compute capability 8.0,
    the bf16 cards by the plan's rule): flash_attention_2 where flash-attn 2 is installed, else VARLEN where torch has
    its varlen kernel; else (a CPU, an fp16 card, an older torch) transformers' SDPA, whose padding-free rows carry a
    dense block mask."""
    if device == "cuda" and bf16:
        if flash_attn_installed:
            return FLASH
        if torch_varlen:
            return VARLEN
    return "sdpa"


def box_kernels(hardware: Any) -> dict[str, Any]:
    """What decides the attention kernel on a box (launcher/plan/hardware.py Hardware): flash-attn installed, torch's
    release (as the Why line names it) and whether it has the varlen kernel, and the implementation a training step
    loads with. This machine's installation where the box is this machine (or a CPU); ftrun's image for a rented box
    named with --gpus or box: (engine_software.IMAGE_SOFTWARE: no flash-attn, a torch with varlen_attn)."""
    from launcher.plan.throughput import training_precision

    here = hardware.is_cpu_only or hardware.is_this_machine
    flash = flash_attn_installed() if here else False
    release = torch_version() if here else None
    varlen = torch_has_varlen(release)
    device = "cpu" if hardware.is_cpu_only else "cuda"
    bf16 = training_precision(device, None if hardware.gpu is None else hardware.gpu.compute_capability) == "bf16"
    return {
        "flash_attn": flash,
        "torch": torch_label(release),
        "torch_varlen": varlen,
        "implementation": implementation(device, bf16, flash, varlen),
    }


def dense_mask(attn: str, engine: str, padding_free_rows: bool) -> bool:
    """Whether the training step's attention carries a dense L x L mask over a row of several examples: SDPA with
    padding-free rows (Unsloth brings its own attention)."""
    return attn == "sdpa" and engine != "unsloth" and padding_free_rows


def sdpa_backends(environ: Optional[Mapping[str, str]] = None) -> tuple[tuple[str, ...], str]:
    """The SDPA backends left on and where that comes from ("default" or the override's name); a UsageError for an
    override that names no backend or one torch does not have."""
    env = os.environ if environ is None else environ
    given = env.get(OVERRIDE, "").strip()
    if not given:
        return DEFAULT_BACKENDS, "default"
    names = tuple(dict.fromkeys(x.strip().lower() for x in given.split(",") if x.strip()))
    unknown = [x for x in names if x not in SDPA_BACKENDS]
    if unknown or not names:
        raise UsageError(
            f"{OVERRIDE}={given!r} names {', '.join(map(repr, unknown)) or 'no backend'}: it lists the "
            f"SDPA backends torch may use, from {', '.join(SDPA_BACKENDS)}",
            fix=f"set it to a comma list such as {','.join(SDPA_BACKENDS)} (cuDNN included), or unset it "
            f"for the default {','.join(DEFAULT_BACKENDS)}.",
        )
    return tuple(x for x in SDPA_BACKENDS if x in names), OVERRIDE


def reason(
    device: str,
    attn: str,
    environ: Optional[Mapping[str, str]] = None,
    padding_free_rows: bool = False,
    torch_label: str = "torch",
    why_not_varlen: str = "",
) -> Optional[str]:
    """The plan's Why line about attention: which kernel runs padded, padding-free and decode batches. None on a CPU
    without padding-free rows (its SDPA has no cuDNN backend and no varlen kernel)."""
    backends, source = sdpa_backends(environ)  # a bad override is refused on any box, before anything trains
    dense = (
        "padding-free rows carry a dense L x L mask over the micro-batch's tokens (the kernel computes the whole "
        "L x L block; the plan counts its L^2 FLOPs and memory and does not raise the micro-batch)"
    )
    if device != "cuda":
        return f"attention: SDPA on the CPU; {dense}" if padding_free_rows else None
    if attn == FLASH:
        return (
            f"attention: {attn} ({KERNEL_NAMES[FLASH]}): padded batches unpadded into its variable-length kernel, "
            "padding-free rows on their boundaries, generation on it too; no mask, nothing built per sequence length"
        )
    if source != "default":
        sdpa = f"SDPA with the backends {', '.join(backends)} ({OVERRIDE}); " + (
            "cuDNN's builds a new execution graph for each new sequence length"
            if "cudnn" in backends
            else "cuDNN's is off"
        )
    else:
        sdpa = (
            "SDPA through flash attention (unmasked) and the memory-efficient kernel (masked); cuDNN's backend is "
            "off: it builds a new execution graph for each new sequence length, and real data has one nearly every "
            f"step ({OVERRIDE} sets the backends)"
        )
    if attn == VARLEN:
        return (
            f"attention: {VARLEN}: padding-free rows on the FlashAttention-2 varlen kernel of {torch_label} "
            "(torch.nn.attention.varlen.varlen_attn, fed the collator's cu_seq_lens: each example attends to itself, "
            f"no L x L mask; flash-attn not installed); padded batches and generation through {sdpa}"
        )
    if padding_free_rows:
        return f"attention: {sdpa}; {dense}: {why_not_varlen or 'no variable-length kernel here'}"
    return f"attention: {sdpa}"


def torch_label(release: Optional[str]) -> str:
    """How the Why line names the torch it assumes: this machine's release, or ftrun's image's where none is here."""
    return f"torch {release}" if release else "the torch of ftrun's image"


def why_not_varlen(bf16: bool, torch_label: str) -> str:
    """Why a GPU run has no variable-length kernel (implementation returned "sdpa")."""
    if not bf16:
        return "FlashAttention-2 (flash-attn's and torch's) needs compute capability 8.0"
    return (
        f"flash-attn is not installed and {torch_label} has no varlen_attn with a causal window "
        f"(torch {'.'.join(map(str, VARLEN_MIN_TORCH))} or newer)"
    )
