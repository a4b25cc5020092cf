"""The bench-padding step: padded vs padding-free micro-batches, and whether packed examples stay apart."""

from __future__ import annotations

from typing import Any

from launcher.worker.gpu_check.common import Context, has
from launcher.worker.gpu_check.training import BENCH, architecture, build_model, make_optimizer, measure, no_peft


def _examples(cfg: dict[str, Any], vocab: int) -> list[list[int]]:
    """Token sequences with a long tail of lengths (chat data's shape), the same for both batchings."""
    import random

    rng = random.Random(0)
    seq = cfg["seq"]
    lengths = [
        min(seq, max(16, int(rng.lognormvariate(0, 0.7) * seq / 5)))
        for _ in range(cfg["pad_examples"] * (cfg["pad_batches"] + 1))
    ]
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def padded_batch(examples: list[list[int]], device: str) -> dict[str, Any]:
    """Right-padded to the longest example, with an attention mask; padding is not a label."""
    import torch

    longest = max(len(e) for e in examples)
    ids = torch.zeros(len(examples), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        ids[i, : len(e)] = torch.tensor(e)
        mask[i, : len(e)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def padding_free_batch(examples: list[list[int]], device: str) -> dict[str, Any]:
    """One row, position_ids restarting at each example, no attention mask; each example's first token is not a
    label (it would be predicted from the previous example). The layout of trl's DataCollatorForLanguageModeling
    with padding_free=True (trl/trainer/sft_trainer.py), which the worker uses
    (launcher/worker/trainer_config.py, padding_free_collator)."""
    import torch

    ids = torch.tensor([t for e in examples for t in e]).unsqueeze(0)
    pos = torch.tensor([i for e in examples for i in range(len(e))]).unsqueeze(0)
    labels = ids.clone()
    labels[pos == 0] = -100
    return {"input_ids": ids.to(device), "position_ids": pos.to(device), "labels": labels.to(device)}


def _isolation(model, examples: list[list[int]], device: str, dtype) -> dict[str, Any]:
    """Padding-free must keep examples apart: the last example's logits in the packed row against the example
    alone, and a control (the same row with positions running on, so attention crosses examples)."""
    import contextlib

    import torch

    auto = torch.autocast("cuda", dtype=dtype) if device == "cuda" else contextlib.nullcontext()
    last = len(examples[-1])
    packed = padding_free_batch(examples, device)
    with torch.no_grad(), auto:
        alone = model(input_ids=torch.tensor([examples[-1]], device=device)).logits[0].float()
        inside = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits[0, -last:].float()
        n = packed["input_ids"].shape[1]
        running = torch.arange(n, device=device).unsqueeze(0)
        crossed = model(input_ids=packed["input_ids"], position_ids=running).logits[0, -last:].float()
        # the control's positions differ too; compare with the example alone at those positions
        alone_shifted = (
            model(input_ids=torch.tensor([examples[-1]], device=device), position_ids=running[:, -last:])
            .logits[0]
            .float()
        )
    diff = (inside - alone).abs().max().item()
    control = (crossed - alone_shifted).abs().max().item()
    return {
        "packed_vs_alone_max_abs": round(diff, 6),
        "control_attention_crossing_max_abs": round(control, 6),
        "isolated": diff < 0.1 * control,
    }


def step_bench_padding(ctx: Context) -> dict[str, Any]:
    """Item 13: real tokens/s and peak memory of padded vs padding-free (position_ids) micro-batches for LoRA at
    the shape, on the attention kernel loading chooses (SDPA unless flash-attn is installed), and whether the
    padding-free layout keeps the examples apart on that kernel."""
    import gc
    import importlib.util

    import torch

    from launcher.worker import memory

    if not has("peft"):
        return no_peft()
    cfg = BENCH[ctx.device]
    arch = architecture(ctx)
    model, device, dtype, attn = build_model(ctx, arch, "lora")
    examples = _examples(cfg, arch.vocab)
    k = cfg["pad_examples"]
    groups = [examples[i * k : (i + 1) * k] for i in range(cfg["pad_batches"] + 1)]
    result: dict[str, Any] = {
        "shape": arch.name,
        "attention": attn,
        "device": device,
        "flash_attn_installed": importlib.util.find_spec("flash_attn") is not None,
        "examples_per_micro_batch": k,
        "max_length": cfg["seq"],
        "mean_length": round(sum(map(len, examples)) / len(examples), 1),
    }
    result["isolation"] = _isolation(model, groups[0], device, dtype)
    ctx.progress(**result)
    real = [sum(map(len, g)) for g in groups]
    for name, make in (("padded", padded_batch), ("padding_free", padding_free_batch)):
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        memory.reset_peak(device)
        params, opt = make_optimizer(model, device)
        batches = [make(g, device) for g in groups]
        m = measure(model, params, opt, batches, real, 1, device, dtype)
        m["padded_tokens_per_micro_batch"] = [int(b["input_ids"].numel()) for b in batches]
        m["real_tokens_per_micro_batch"] = real
        result[name] = m
        ctx.progress(**result)
        del opt, params, batches
    a, b = result["padded"], result["padding_free"]
    result["padding_free_speedup"] = round(b["tokens_per_second"] / a["tokens_per_second"], 3)
    fill = sum(real) / sum(a["padded_tokens_per_micro_batch"])
    result["padded_fill"] = round(fill, 3)
    ok = result["isolation"]["isolated"] and all(x == x for x in a["losses"] + b["losses"])
    line = (
        f"{arch.name} lora, {k} examples/micro-batch (mean {result['mean_length']:.0f} tokens, padded fill "
        f"{fill:.0%}): padded {a['tokens_per_second']:.0f} tok/s {a['peak_memory_gb']:.1f} GB, padding-free "
        f"{b['tokens_per_second']:.0f} tok/s {b['peak_memory_gb']:.1f} GB ({result['padding_free_speedup']:.2f}x) "
        f"on {attn}; examples kept apart: {result['isolation']['isolated']}"
        f"{'' if result['flash_attn_installed'] else '; flash-attn not installed'}"
    )
    return {"ok": ok, **result, "line": line}
