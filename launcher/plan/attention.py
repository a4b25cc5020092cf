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
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

from launcher.errors import UsageError

# torch's SDPA backends: name -> the flag torch.backends.cuda sets with enable_<flag> and reads with <flag>_enabled
SDPA_BACKENDS = {"cudnn": "cudnn_sdp", "flash": "flash_sdp", "efficient": "mem_efficient_sdp", "math": "math_sdp"}
DEFAULT_BACKENDS = ("flash", "efficient", "math")
OVERRIDE = "FTRUN_SDPA_BACKENDS"


def implementation(device: str, bf16: bool, flash_attn_installed: bool) -> str:
    """The attn_implementation the worker loads with: flash_attention_2 where flash-attn 2 is installed on a bf16 card
    (FlashAttention-2 needs compute capability 8.0, the bf16 cards by the plan's rule), else transformers' SDPA.
    Padding-free batches then run as variable-length kernels without a mask instead of SDPA's dense block mask."""
    return "flash_attention_2" if device == "cuda" and bf16 and flash_attn_installed else "sdpa"


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


def reason(device: str, attn: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The plan's Why line about attention on a GPU (None on a CPU, whose SDPA has no cuDNN backend)."""
    backends, source = sdpa_backends(environ)  # a bad override is refused on any box, before anything trains
    if device != "cuda":
        return None
    if attn != "sdpa":
        return f"attention: {attn} (variable-length kernels, nothing built per sequence length)"
    if source != "default":
        return f"attention: SDPA with the backends {', '.join(backends)} ({OVERRIDE}); " + (
            "cuDNN's builds a new execution graph for each new sequence length"
            if "cudnn" in backends
            else "cuDNN's is off"
        )
    return (
        "attention: SDPA through flash attention (unmasked) and the memory-efficient kernel (masked: padded, "
        "padding-free, generation); cuDNN's backend is off: it builds a new execution graph for each new "
        f"sequence length, and real data has one nearly every step ({OVERRIDE} sets the backends)"
    )
