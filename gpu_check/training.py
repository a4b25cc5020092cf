"""What the benches share: the shape, a random-weight model built at it as the worker does, the timed steps."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gpu_check.common import Context, worker_recipe

# The shape measured on a GPU: a catalog entry of launcher/plan/models.py (GPU_CHECK_SHAPE picks another one).
GPU_SHAPE = "qwen3-8b"
# --dry-run: Qwen3-shaped (q/k norms), small enough for seconds per step on 2 cores.
TINY_SHAPE = dict(
    layers=2,
    hidden=128,
    intermediate=384,
    heads=4,
    kv_heads=2,
    head_dim=32,
    vocab=4096,
    tied_embeddings=False,
    qk_norm=True,
)

# Per-step settings, GPU / CPU. LoRA and full fine-tuning at the shapes a user runs (the plan's numbers for
# them: bench JSON); full fine-tuning falls back to a micro-batch of 1 when 2 runs out of memory.
BENCH = {
    "cuda": dict(seq=1024, lora_batch=4, full_batch=2, warmup=2, steps=4, pad_examples=8, pad_batches=4),
    "cpu": dict(seq=128, lora_batch=2, full_batch=2, warmup=1, steps=2, pad_examples=4, pad_batches=2),
}
LEARNING_RATE = 1e-4


def architecture(ctx: Context):
    from launcher.plan.models import Architecture, catalog_names, from_catalog

    if ctx.shape == "tiny":
        return Architecture(name="tiny (dry run)", source="gpu_check's dry-run shape", **TINY_SHAPE)
    arch = from_catalog(ctx.shape)
    if arch is None:
        raise ValueError(
            f"GPU_CHECK_SHAPE={ctx.shape!r} is not in launcher/plan/models.py's catalog; use one of "
            f"{', '.join(catalog_names())}"
        )
    if arch.qkv_bias or arch.experts > 1 or arch.norms_per_layer != 2:
        raise ValueError(f"shape {ctx.shape!r}: the bench builds Llama- and Qwen3-shaped models only")
    return arch


def _hf_config(arch):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=arch.vocab,
        hidden_size=arch.hidden,
        intermediate_size=arch.intermediate,
        num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads,
        num_key_value_heads=arch.kv_heads,
        head_dim=arch.head_dim,
        tie_word_embeddings=arch.tied_embeddings,
        use_cache=False,
        max_position_embeddings=8192,
    )
    return Qwen3Config(**common) if arch.qk_norm else LlamaConfig(**common)


def build_model(ctx: Context, arch, method: str, checkpointing: bool = True):
    """Random weights at the shape, built on the device (no download), stored and trained as the worker does:
    loading.weights_dtype (fp32 master weights for full fine-tuning on trl, the compute dtype for LoRA),
    loading.add_lora, non-reentrant gradient checkpointing, the attention kernel loading chooses."""
    import torch
    from transformers import AutoModelForCausalLM

    from launcher.worker import loading

    device, dtype = loading.select_device() if ctx.device == "cuda" else ("cpu", torch.float32)
    config = _hf_config(arch)
    attn = loading.attention_implementation(device, dtype)
    if attn:
        config._attn_implementation = attn
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=loading.weights_dtype(method, "trl", device, dtype))
    if method == "lora":
        model = loading.add_lora(model, worker_recipe(Path(arch.name)))
    if checkpointing:  # off: what the plan chooses where the card has room (launcher/plan/speed.py)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model, device, dtype, attn or getattr(model.config, "_attn_implementation", None) or "sdpa"


def make_optimizer(model, device: str):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    # the Trainer's default with torch >= 2.8 (transformers 5.24 training_args: adamw_torch_fused), on CPU too
    return params, torch.optim.AdamW(params, lr=LEARNING_RATE, fused=True)


def _train_step(model, params, opt, batch: dict[str, Any], device: str, dtype) -> float:
    import contextlib

    import torch

    # the Trainer trains under autocast with bf16/fp16 on a GPU (SFTConfig bf16/fp16) and in fp32 on the CPU
    auto = torch.autocast("cuda", dtype=dtype) if device == "cuda" else contextlib.nullcontext()
    with auto:
        loss = model(**batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)  # the Trainer's max_grad_norm
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.item())  # .item() synchronises: the step is done when it returns


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def measure(
    model, params, opt, batches: list[dict[str, Any]], tokens: list[int], warmup: int, device: str, dtype
) -> dict[str, Any]:
    """Warm-up steps, then timed steps; real tokens per second over the timed ones and the worker's peak."""
    from launcher.worker import memory

    losses = []
    for b in batches[:warmup]:
        losses.append(_train_step(model, params, opt, b, device, dtype))
    _sync(device)
    t0 = time.perf_counter()
    for b in batches[warmup:]:
        losses.append(_train_step(model, params, opt, b, device, dtype))
    _sync(device)
    seconds = time.perf_counter() - t0
    counted = sum(tokens[warmup:])
    return {
        "tokens_per_second": round(counted / seconds, 1),
        "timed_steps": len(batches) - warmup,
        "timed_seconds": round(seconds, 3),
        "timed_tokens": counted,
        "losses": [round(x, 4) for x in losses],
        "peak_memory_gb": round(memory.peak_memory_gb(device), 3),
    }


def no_peft() -> dict[str, Any]:
    return {"ok": None, "skipped": "peft not installed", "line": "skipped: peft not installed (LoRA needs it)"}
