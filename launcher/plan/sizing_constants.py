"""The constants the sizer's terms share: ftrun's GB, bytes per parameter, activation factors, the runtime's overheads,
the share of a card or of the box's RAM a plan may fill. docs/sizing.md derives each one.
"""

from __future__ import annotations

from launcher.methods import METHODS

GB = 2**30  # bytes in one GB as ftrun counts (GiB, as nvidia-smi and torch's memory counters)


# NF4 with double quantization: 4 bits + 0.127 bits of constants per weight (QLoRA paper, sec. 3).
NF4_BYTES = (4 + 0.127) / 8
# Bytes per trained parameter: launcher/methods.py. LoRA adapters in fp32 (PEFT autocast_adapter_dtype): 4 + 4 + 8.
ADAPTER_BYTES = METHODS["lora"].trained_bytes
# Allocator slack of gradients freed every step: lifts the article's 6 B/param (8-bit) to the 7-8 its table implies
GRADIENT_CHURN_BYTES = 1.0

# Unsloth's chunked fused cross-entropy: about an eighth of the bf16 logits alive at once (fitted: docs/sizing.md).
LOGIT_BYTES_UNSLOTH = 0.25
# One recomputed layer during backward holds its activations plus their gradients (about half of them alive at once).
LAYER_BACKWARD_FACTOR = 1.5
# Unsloth's fused RMSNorm / SwiGLU / RoPE kernels save ~40% of the per-layer activations.
UNSLOTH_LAYER_FACTOR = 0.6

CUDA_CONTEXT_GB = 0.6  # CUDA context, cuBLAS workspace, kernels (what nvidia-smi shows before any tensor)
NCCL_GB = 0.5  # NCCL communicator buffers per process when several GPUs train together
FRAGMENTATION = 0.05  # caching-allocator slack on the per-step tensors (activations, logits)
CPU_RUNTIME_GB = 1.0  # Python, torch and the tokenizer in the worker process

# Host time per kernel of an eager forward on a GPU (an assumption, not measured on a GPU: docs/sizing.md, "Sampling")
EAGER_OP_SECONDS = 10e-6

# Fraction of a card the plan may fill: the estimate's own error (docs/sizing.md: median ~10%) needs room.
USABLE_FRACTION = 0.97  # the estimate already counts context, NCCL and allocator slack; keep 3% for its own error
USABLE_RAM_FRACTION = 0.8  # leave the OS and the page cache their share
