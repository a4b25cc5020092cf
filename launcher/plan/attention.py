"""The attention kernels a run uses: the implementation transformers loads the model with and, under SDPA, which of
torch's SDPA backends may serve a call. The plan states both in a Why line; the worker applies them
(launcher/worker/loading.py select_device) and records what torch reports. Why cuDNN's SDPA backend is off
(FTRUN_SDPA_BACKENDS takes it back) and which kernel serves padded, padding-free and decode batches: docs/engines.md,
"Attention on a GPU: SDPA's backends" and "Attention kernels".
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
# torch's FlashAttention-2 varlen kernel for padding-free rows, SDPA for the rest (launcher/worker/varlen.py)
VARLEN = "ftrun_varlen"
# The first torch whose varlen_attn takes a softmax scale and the causal window with a backward pass (varlen.py)
VARLEN_MIN_TORCH = (2, 11)
KERNEL_NAMES = {
    FLASH: "flash-attn's FlashAttention-2",
    VARLEN: "torch's FlashAttention-2 varlen kernel (torch.nn.attention.varlen.varlen_attn)",
    "sdpa": "SDPA",
}


def torch_version() -> Optional[str]:
    """The installed torch's version from its metadata (importing torch would make `ftrun plan` heavy), or None."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_has_varlen(version: Optional[str]) -> bool:
    """Whether a torch of this version has the varlen kernel the worker uses; None (no torch here): ftrun's image's."""
    if version is None:
        return True
    found = re.match(r"(\d+)\.(\d+)", version)
    return bool(found) and (int(found.group(1)), int(found.group(2))) >= VARLEN_MIN_TORCH


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def implementation(device: str, bf16: bool, flash_attn_installed: bool, torch_varlen: bool = False) -> str:
    """The attn_implementation the worker loads with: on a bf16 card (compute capability 8.0+) FLASH where flash-attn 2
    is installed, else VARLEN where torch has it; else SDPA."""
    if device == "cuda" and bf16:
        if flash_attn_installed:
            return FLASH
        if torch_varlen:
            return VARLEN
    return "sdpa"


def box_kernels(hardware: Any) -> dict[str, Any]:
    """What decides the attention kernel on a box: flash-attn installed, torch's release (as the Why line names it)
    and whether it has varlen, and the implementation a step loads with. This machine's installation where the box is
    this machine (or a CPU), else ftrun's image (engine_software.IMAGE_SOFTWARE: no flash-attn, torch with varlen)."""
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
    """Whether the step's attention carries a dense L x L mask: SDPA with padding-free rows (not Unsloth's own)."""
    return attn == "sdpa" and engine != "unsloth" and padding_free_rows


def sdpa_backends(environ: Optional[Mapping[str, str]] = None) -> tuple[tuple[str, ...], str]:
    """The SDPA backends left on and where that comes from ("default" or OVERRIDE); UsageError for a bad override."""
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
        cudnn = "builds a new execution graph for each new sequence length" if "cudnn" in backends else "is off"
        sdpa = f"SDPA with the backends {', '.join(backends)} ({OVERRIDE}); cuDNN's {cudnn}"
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
