"""The constants the sizer's terms share: ftrun's GB, bytes per parameter, activation factors, the runtime's overheads,
the share of a card or of the box's RAM a plan may fill. docs/sizing.md derives each one.

Units: one GB is 2**30 bytes (a GiB) everywhere in ftrun, the unit cards are sold and nvidia-smi counts in:
an RTX 4090 is a 24 GB card (24,564 MiB), an H100 an 80 GB card (81,559 MiB = 79.6 GB).
"""

from __future__ import annotations

from launcher.methods import METHODS

GB = 2**30  # bytes in one GB as ftrun counts (GiB, as nvidia-smi and torch's memory counters)


# NF4 with double quantization: 4 bits + 0.127 bits of constants per weight (QLoRA paper, sec. 3).
NF4_BYTES = (4 + 0.127) / 8
# Bytes per trained parameter: the method table (launcher/methods.py). LoRA adapters are kept in fp32 (PEFT
# autocast_adapter_dtype): weight 4 + gradient 4 + AdamW m, v 8. Full fine-tuning, mixed precision AdamW: bf16 weight
# 2 + bf16 gradient 2 + fp32 master 4 + m, v 8; 8-bit AdamW (bitsandbytes) on bf16 weights, no master copy: m, v 1
# byte each.
ADAPTER_BYTES = METHODS["lora"].trained_bytes
# Gradients of a full fine-tune are freed and re-allocated every step between activations
# (zero_grad(set_to_none=True)); the caching allocator keeps about half a gradient's size reserved
# but unusable. This is what lifts the article's 6 B/param (8-bit) to the 7-8 its table implies.
GRADIENT_CHURN_BYTES = 1.0

# Unsloth's fused cross-entropy works on chunks of the logits and writes the gradient in place: about an
# eighth of the bf16 logits is alive at once (fitted on Unsloth's context-length table, docs/sizing.md).
LOGIT_BYTES_UNSLOTH = 0.25
# One recomputed layer during backward holds its activations plus their gradients (about half of them
# alive at once): 1.5 x the layer's activations.
LAYER_BACKWARD_FACTOR = 1.5
# Unsloth's fused RMSNorm / SwiGLU / RoPE kernels save ~40% of the per-layer activations, and its
# gradient checkpointing offloads the saved layer inputs to CPU RAM.
UNSLOTH_LAYER_FACTOR = 0.6

CUDA_CONTEXT_GB = 0.6  # CUDA context, cuBLAS workspace, kernels (what nvidia-smi shows before any tensor)
NCCL_GB = 0.5  # NCCL communicator buffers per process when several GPUs train together
FRAGMENTATION = 0.05  # caching-allocator slack on the per-step tensors (activations, logits)
CPU_RUNTIME_GB = 1.0  # Python, torch and the tokenizer in the worker process

# Host time per kernel of an eager PyTorch forward on a GPU box: Python (the module call, transformers' and peft's code
# around the op), torch's dispatcher and the CUDA launch; what bounds transformers' generate below ~30B parameters
# (throughput.decode_step_seconds). An assumption, not yet measured on a GPU: 10 us is what the review's 30-50 ms per
# Qwen3-8B LoRA decode step on an H100 (issue 55) implies at the ~3,700 kernels such a step launches (8-14 us). On this
# project's 2-core development VM a tiny model's decode step took 16 us per operation in fp32 (compute included,
# docs/sizing.md "Sampling"). The GPU check's product-grpo step (its sampling share) is what calibrates it; for the
# run itself the smoke test's measured tokens/s, which holds the sampling, replaces the forecast.
EAGER_OP_SECONDS = 10e-6

# Fraction of a card the plan may fill: the estimate's own error (docs/sizing.md: median ~10%) needs room.
USABLE_FRACTION = 0.97  # the estimate already counts context, NCCL and allocator slack; keep 3% for its own error
USABLE_RAM_FRACTION = 0.8  # leave the OS and the page cache their share
