"""What the LM head's loss holds in memory for one micro-batch: the model's own loss over whole logits, TRL's fused
head's tiles, ftrun's CPU kernel's chunks (no torch, no I/O). launcher/plan/sizing.py adds it to a step's peak.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from launcher.methods import is_adapter

if TYPE_CHECKING:  # for the annotations only
    from launcher.plan.models import Architecture as Arch

# Loss on the HF path (transformers ForCausalLMLoss), bytes per token per vocabulary entry at the peak of backward:
# bf16 logits 2 + fp32 upcast 4 + fp32 log-softmax gradient 4 + bf16 gradient 2. Only the published rows use it.
LOGIT_BYTES_HF = 12
# The same on the CPU (fp32 logits): 4 + 4 + 4 (measured 10.9: docs/BENCHMARKS.md, section 6).
LOGIT_BYTES_HF_CPU = 12
# TRL's fused LM head, ftrun's engines' loss (docs/engines.md, "Lean engines"): trl 1.16 trl/kernels/chunked_logprob.py
# ChunkedLogProbFunction projects TOKEN_CHUNK_SIZE x _CHUNKED_LOGPROB_CHUNK_SIZE (trl/trainer/utils.py) at a time.
FUSED_TOKEN_TILE = 4096
FUSED_VOCAB_TILE = 32768
# Without Triton (the CPU), trl's _backward_tile holds the tile and about eight fp32 temporaries of its size.
FUSED_CPU_TILE_COPIES = 9
# So the CPU worker routes a frozen head through launcher/worker/cpu_logprob.py's chunks of fp32 logits
CPU_LOSS_CHUNK_ELEMENTS = 2**23
CPU_LOSS_MIN_TOKENS = 16
CPU_LOSS_BUFFERS = 3


def whole_logits_bytes(tokens: int, vocab: int, device: str) -> float:
    """What the model's own loss holds for `tokens` x `vocab` logits (LOGIT_BYTES_HF, on a CPU LOGIT_BYTES_HF_CPU)."""
    return tokens * vocab * (LOGIT_BYTES_HF_CPU if device == "cpu" else LOGIT_BYTES_HF)


def cpu_loss_chunk_tokens(vocab: int, tokens: int | None = None) -> int:
    """Tokens per chunk of launcher/worker/cpu_logprob.py (capped at the micro-batch's tokens when given)."""
    c = max(CPU_LOSS_MIN_TOKENS, CPU_LOSS_CHUNK_ELEMENTS // max(1, vocab))
    return c if tokens is None else min(c, tokens)


def fused_head_bytes(arch: Arch, w: Any) -> float:
    """Bytes TRL's fused LM head holds at its peak (the start of backward) for one micro-batch (`w`, a sizing.Workload).
    CUDA: the bf16 tile, the saved hidden states, their fp32 gradient and its 16-bit copy; a trainable head adds its
    fp32 gradient accumulator and, sharded, the head gathered whole (FSDP2 `weight.full_tensor()`, ZeRO-3). CPU: a
    frozen head's cpu_logprob.py chunks, or trl's torch fallback's tiles; the hidden states' fp32 gradients."""
    t = w.tokens_per_micro_batch
    trainable_head = not is_adapter(w.method)
    if w.device == "cpu" and not trainable_head:
        return CPU_LOSS_BUFFERS * cpu_loss_chunk_tokens(arch.vocab, t) * arch.vocab * 4 + t * arch.hidden * (4 + 4)
    tile = min(t, FUSED_TOKEN_TILE) * min(arch.vocab, FUSED_VOCAB_TILE)
    if w.device == "cpu":
        return tile * 4 * FUSED_CPU_TILE_COPIES + t * arch.hidden * (4 + 4 + 4) + arch.vocab * arch.hidden * 4
    b = tile * 2 + t * arch.hidden * (2 + 4 + 2)
    if trainable_head:
        b += arch.vocab * arch.hidden * 4
    if w.sharded:
        b += arch.vocab * arch.hidden * 2
    return b
