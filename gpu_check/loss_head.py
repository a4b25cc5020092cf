"""The loss-head step: the LM head's loss at the shape, the model's own (whole logits) against TRL's fused LM head.

Issue 24's GPU measurement: one micro-batch of 2 x 2,048 tokens' hidden states through the frozen head of the shape
(Qwen3-8B: 4,096 x 151,936), loss and backward to the hidden states, the way the trl engine's loss runs; the peak
memory above what was allocated before and the time per step, beside the sizer's figure for each
(`loss_head.LOGIT_BYTES_HF`, `loss_head.fused_head_bytes`). The fused head is trl's own kernel,
`trl.kernels.chunked_logprob.ChunkedLogProbFunction` (Triton on CUDA), which imports with torch and transformers
alone: the lent box has no trl installed, so scripts/gpu_check.sh puts the wheels under `$FTRUN_DEVICE_WHEELS`
(default .cache/device-wheels: `pip download --no-deps trl==1.16.0 -d .cache/device-wheels`, carried with the call)
on the path. On the CPU (the dry run) ftrun's own kernel runs beside it (launcher/worker/cpu_logprob.py).
"""

from __future__ import annotations

import time
from typing import Any

from gpu_check.common import FUSED_OUTPUTS, Context, in_gb
from gpu_check.training import architecture

TOKENS = {"cuda": 4096, "cpu": 256}
STEPS = 3


def _fused_kernel():
    try:
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    except ImportError:
        return None
    return ChunkedLogProbFunction


def _run(variant: str, fn, hidden, weight, targets, device: str) -> dict[str, Any]:
    import torch

    def one():
        hidden.grad = None
        if variant == "model's own loss":
            loss = torch.nn.functional.cross_entropy((hidden @ weight.t()).float(), targets)
        else:
            logprobs = fn.apply(hidden, weight, None, targets, 1.0, 32768, None, 1.0, FUSED_OUTPUTS)[0]
            loss = -logprobs.mean()
        loss.backward()
        return float(loss.item())

    loss = one()  # warm-up: kernels compiled, workspaces allocated
    grad = hidden.grad.detach().float().clone()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        one()
    if device == "cuda":
        torch.cuda.synchronize()
    out = {"loss": round(loss, 5), "seconds_per_step": round((time.perf_counter() - t0) / STEPS, 5), "grad": grad}
    if device == "cuda":
        out["peak_above_gb"] = in_gb(torch.cuda.max_memory_allocated() - before)
    return out


def step_loss_head(ctx: Context) -> dict[str, Any]:
    """The model's own loss against TRL's fused LM head at the shape: memory above the inputs, time, equal loss."""
    import torch

    from launcher.plan import loss_head, sizing, sizing_constants
    from launcher.worker import cpu_logprob

    trl_kernel = _fused_kernel()
    if trl_kernel is None:
        return {
            "ok": None,
            "skipped": "trl not importable (carry its wheel: FTRUN_DEVICE_WHEELS)",
            "line": "skipped: trl's kernel not importable; pip download --no-deps trl==1.16.0 -d "
            ".cache/device-wheels and carry .cache/device-wheels",
        }
    arch = architecture(ctx)
    device = ctx.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t = TOKENS[device]
    g = torch.Generator(device="cpu").manual_seed(0)
    weight = (torch.randn(arch.vocab, arch.hidden, generator=g) * 0.02).to(device, dtype)  # frozen, as under LoRA
    hidden = torch.randn(t, arch.hidden, generator=g).to(device, dtype).requires_grad_(True)
    targets = torch.randint(0, arch.vocab, (t,), generator=g).to(device)
    variants = {"model's own loss": None, "trl fused LM head": trl_kernel}
    if device == "cpu":
        variants["ftrun CPU kernel"] = cpu_logprob.function()
    runs = {name: _run(name, fn, hidden, weight, targets, device) for name, fn in variants.items()}
    grads = {name: r.pop("grad") for name, r in runs.items()}
    reference = runs["model's own loss"]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4  # bf16 logits on the model's own path, fp32 accumulation in trl's
    agree = {
        name: abs(r["loss"] - reference["loss"]) <= tol * max(1.0, abs(reference["loss"]))
        and bool(torch.allclose(grads[name], grads["model's own loss"], rtol=10 * tol, atol=1e-3 * tol))
        for name, r in runs.items()
    }
    w = sizing.Workload("lora", t, 1, True, 16, "all-linear", "trl", 1, device)
    predicted = {
        "model's own loss": round(loss_head.whole_logits_bytes(t, arch.vocab, device) / sizing_constants.GB, 3),
        "trl fused LM head": round(loss_head.fused_head_bytes(arch, w) / sizing_constants.GB, 3),
    }
    parts = []
    for name, r in runs.items():
        mem = f"{r['peak_above_gb']:.2f} GB (sized {predicted.get(name, '-')})" if "peak_above_gb" in r else "-"
        parts.append(f"{name}: {mem}, {r['seconds_per_step'] * 1e3:.1f} ms")
    ok = all(agree.values()) and all(r["loss"] == r["loss"] for r in runs.values())
    return {
        "ok": ok,
        "shape": arch.name,
        "tokens": t,
        "vocab": arch.vocab,
        "hidden": arch.hidden,
        "dtype": str(dtype).replace("torch.", ""),
        "runs": runs,
        "predicted_gb": predicted,
        "agree": agree,
        "line": f"{arch.name}, {t:,} tokens x {arch.vocab:,}: "
        + "; ".join(parts)
        + ("" if ok else "; the losses or gradients differ"),
    }
