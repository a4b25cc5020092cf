"""What the LM head's loss holds in memory for one micro-batch: the model's own loss over whole logits, TRL's fused
head's tiles, ftrun's CPU kernel's chunks (no torch, no I/O). launcher/plan/sizing.py adds it to a step's peak.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from launcher.methods import is_adapter

if TYPE_CHECKING:  # for the annotations only
    from launcher.plan.models import Architecture as Arch

# Loss on the HF path (transformers ForCausalLMLoss): bf16 logits 2 + fp32 upcast 4 + fp32 log-softmax
# gradient 4 + bf16 gradient 2 = 12 bytes per token per vocabulary entry at the peak of backward. ftrun's engines no
# longer take this path (LOSS_FUSED below); the published rows measured on it do (docs/sizing.md).
LOGIT_BYTES_HF = 12
# The same loss on the CPU (fp32 logits): log-softmax output 4 + its gradient 4 + the logits' gradient 4 at the start of
# backward (measured 10.9 with scripts/bench_lean_loss.py: docs/BENCHMARKS.md, section 6).
LOGIT_BYTES_HF_CPU = 12
# The loss ftrun's trl, ddp, fsdp and deepspeed engines compute: TRL's fused LM head. trl 1.16's SFTTrainer patches the
# model (sft_trainer.py __init__: add_fused_lm_head, outputs log_probs, entropy, is_top1) and calls it with
# fused_lm_head=True in compute_loss; trl/kernels/chunked_logprob.py (ChunkedLogProbFunction) projects TOKEN_CHUNK_SIZE
# 4096 tokens x _CHUNKED_LOGPROB_CHUNK_SIZE 32768 vocabulary entries (trl/trainer/utils.py) at a time into one buffer
# in the compute dtype, folds each tile into per-token statistics (online logsumexp), and in backward recomputes each
# tile, turns it into the logits' gradient in place (a Triton kernel on CUDA) and accumulates the hidden states'
# gradient in fp32. The (tokens x vocabulary) logits never exist.
FUSED_TOKEN_TILE = 4096
FUSED_VOCAB_TILE = 32768
# Without Triton (the CPU), trl folds a tile with torch ops: _backward_tile holds the tile and about eight fp32
# temporaries of its size at once (y, z, log_p, p, grad, the target mask as float, their difference and product).
FUSED_CPU_TILE_COPIES = 9
# So the CPU worker routes a frozen head (LoRA, QLoRA) through launcher/worker/cpu_logprob.py instead: a chunk of
# tokens on the whole vocabulary, about CPU_LOSS_CHUNK_ELEMENTS logits, with three fp32 buffers of that size alive (the
# logits turned log-probabilities in place, the probabilities, their product for the entropy), and the hidden states'
# gradient kept from the forward (tokens x hidden, fp32).
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
    """What TRL's fused LM head holds at its peak (the start of backward) for one micro-batch (`w`, a sizing.Workload:
    sizing imports this module), in bytes.

    CUDA (Triton): the tile buffer in bf16, the hidden states it saved (the positions with a label: at most all of
    them, 2 B), their fp32 gradient and its 16-bit copy; a trainable head (full fine-tuning) adds its fp32 gradient
    accumulator (V x H x 4) and, sharded, the head gathered whole (`weight.full_tensor()` under FSDP2, gathered by
    ZeRO-3: V x H x 2). CPU: a frozen head goes through launcher/worker/cpu_logprob.py (CPU_LOSS_BUFFERS fp32 chunks
    of the whole vocabulary and the hidden states' fp32 gradients), a trainable one through trl's torch fallback
    (FUSED_CPU_TILE_COPIES fp32 tiles, the gradients, the head's fp32 gradient accumulator)."""
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
