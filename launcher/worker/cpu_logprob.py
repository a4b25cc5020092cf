"""The LM head's per-token log-probabilities on a CPU, a few tokens at a time, for TRL's fused LM head.

trl 1.16's kernel (trl/kernels/chunked_logprob.py, ChunkedLogProbFunction, called by add_fused_lm_head in
trl/trainer/utils.py) is built for CUDA: without Triton it holds about eight fp32 copies of each tile and recomputes
the projection in backward, about 3x slower than the model's own loss (scripts/bench_lean_loss.py, docs/BENCHMARKS.md).
Here a chunk of tokens is projected on the whole vocabulary, its log-softmax taken in place, and each token's gradient
with respect to its hidden state ((onehot - p) @ W) kept from the same pass: backward only scales it. This needs a
frozen head (LoRA, QLoRA); the worker routes only such CPU calls here (launcher/worker/fused_head.py).
"""

from __future__ import annotations

from functools import cache
from typing import Any

# about 8M logits per chunk, as the sizer counts (launcher/plan/loss_head.py)
from launcher.plan.loss_head import cpu_loss_chunk_tokens


@cache
def function() -> Any:
    """The autograd function, built on first use (torch is imported inside functions)."""
    import torch

    class CpuChunkedLogProb(torch.autograd.Function):
        """`ChunkedLogProbFunction.apply`'s signature and outputs (log_probs, entropy, log_sum_sq_probs, mean_logits,
        is_top1; those not in `outputs` are None), for a frozen head on the CPU."""

        @staticmethod
        def forward(
            ctx: Any,
            hidden: torch.Tensor,
            weight: torch.Tensor,
            bias: torch.Tensor | None,
            targets: torch.Tensor,
            temperature: float,
            chunk_size: int,
            final_logit_softcapping: float | None = None,
            logit_scale: float = 1.0,
            outputs: tuple[str, ...] = ("log_probs",),
        ):
            ctx.set_materialize_grads(False)
            n, vocab = hidden.shape[0], weight.shape[0]
            scale = logit_scale / temperature
            w = weight.to(hidden.dtype)
            logprobs = torch.empty(n, dtype=torch.float32)
            entropy = torch.empty(n, dtype=torch.float32) if "entropy" in outputs else None
            sq = torch.empty(n, dtype=torch.float32) if "log_sum_sq_probs" in outputs else None
            mean = torch.empty(n, dtype=torch.float32) if "mean_logits" in outputs else None
            top1 = torch.empty(n, dtype=torch.bool) if "is_top1" in outputs else None
            grad = torch.empty_like(hidden, dtype=torch.float32) if ctx.needs_input_grad[0] else None
            step = cpu_loss_chunk_tokens(vocab)
            with torch.no_grad():
                for s in range(0, n, step):
                    e = min(n, s + step)
                    z = hidden[s:e] @ w.t()
                    if bias is not None:
                        z += bias.to(z.dtype)
                    z = z.float()
                    if scale != 1.0:
                        z.mul_(scale)
                    tgt = targets[s:e]
                    rows = torch.arange(e - s)
                    if top1 is not None:
                        top1[s:e] = z.argmax(-1) == tgt  # the first maximum, as TRL's kernel counts it
                    if mean is not None:
                        mean[s:e] = z.mean(-1)
                    lse = torch.logsumexp(z, -1)
                    logprobs[s:e] = z[rows, tgt] - lse
                    z.sub_(lse.unsqueeze(-1))  # log p, in place
                    p = z.exp()
                    if entropy is not None:  # -sum p log p, as a batched dot product: no third buffer
                        entropy[s:e] = -torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).view(-1)
                    if sq is not None:
                        sq[s:e] = torch.log(torch.bmm(p.unsqueeze(1), p.unsqueeze(2)).view(-1))
                    if grad is not None:
                        # d log p_target / d z = onehot - p, so the hidden state's gradient is W[target] - p @ W
                        g = w[tgt].float() - (p.to(w.dtype) @ w).float()
                        grad[s:e] = g * scale if scale != 1.0 else g
                    del z, p
            ctx.save_for_backward(grad)
            ctx.hidden_dtype = hidden.dtype
            for t in (sq, mean, top1):
                if t is not None:
                    ctx.mark_non_differentiable(t)
            return logprobs, entropy, sq, mean, top1

        @staticmethod
        def backward(ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None, *_: Any):
            if grad_entropy is not None:
                raise RuntimeError(
                    "ftrun's CPU log-probabilities carry no entropy gradient (TRL's SFT logs the entropy "
                    "only); a loss on the entropy needs TRL's own kernel"
                )
            (saved,) = ctx.saved_tensors
            grad_hidden = None
            if saved is not None and grad_logprobs is not None:
                grad_hidden = (saved * grad_logprobs.float().unsqueeze(-1)).to(ctx.hidden_dtype)
            return grad_hidden, None, None, None, None, None, None, None, None

    return CpuChunkedLogProb
