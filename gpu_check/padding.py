"""The bench-padding step: variable-length micro-batches at the shape on each attention kernel, against the fixed shape.

Cases, each a LoRA training step at the shape (Qwen3-8B on a GPU, the tiny shape in the dry run) on the same
examples with a long tail of lengths:
- varlen: the padding-free row (TRL's collator layout, with its cu_seq_lens) on torch's FlashAttention-2 varlen kernel
  (launcher/worker/varlen.py, attn_implementation ftrun_varlen); a GPU only;
- dense: the same row on SDPA, which gets transformers' dense (1, 1, L, L) block mask (what runs without flash-attn
  and without the varlen kernel);
- padded: the examples right-padded to the longest, with the attention mask, on the implementation loading chooses
  (SDPA with the padding mask under ftrun_varlen or sdpa);
- fixed: rows of one length (the examples' mean), no padding and no mask (SDPA's flash kernel, is_causal): the
  tokens/s the others are held against (the target: padding-free at 85% or more of it).
Each at micro-batch 8 (the dry run: BENCH's pad_examples) and at the micro-batch launcher/plan/speed.py chooses on this
box for a recipe that leaves it to the plan, with gradient checkpointing on and off. A case the plan's sizer says the
card cannot hold (launcher/plan/sizing.py memory, the dense mask's L^2 included) is skipped before it starts. Every
case starts from the same LoRA weights, so their first losses must agree (the varlen kernel computes what SDPA does);
the padding-free layout must keep the examples apart. On a GPU one step of each case at the first micro-batch runs
under torch's profiler, and the attention kernels it launched are recorded by name.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from gpu_check.common import Context, first_line, has
from gpu_check.training import BENCH, architecture, build_model, make_optimizer, measure, no_peft

KERNELS = ("varlen", "dense", "padded", "fixed")
# first losses of the cases on the same batch and weights: bf16 on a GPU (different summation orders), fp32 on a CPU
LOSS_AGREEMENT = {"cuda": 0.05, "cpu": 1e-4}
# issue 55's target for padding-free steps: this share of the fixed shape's tokens/s at the same micro-batch and
# checkpointing (the kernel the worker would use: varlen where the box has it, else SDPA's dense mask)
PADDING_FREE_TARGET = 0.85
# CUDA kernel names of attention in a profile: FlashAttention-2 (torch's flash kernels, flash-attn's), the
# memory-efficient (cutlass fmha) kernel, cuDNN's, the math path's softmax
ATTENTION_KERNEL = ("flash", "fmha", "attention", "cudnn", "softmax", "efficient")


def _examples(cfg: dict[str, Any], vocab: int, count: int) -> list[list[int]]:
    """Token sequences with a long tail of lengths (chat data's shape)."""
    import random

    rng = random.Random(0)
    seq = cfg["seq"]
    lengths = [min(seq, max(16, int(rng.lognormvariate(0, 0.7) * seq / 5))) for _ in range(count)]
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
    label (it would be predicted from the previous example); the examples' boundaries as cu_seq_lens_q/k (int32)
    and max_length_q/k. The layout of trl 1.16's DataCollatorForLanguageModeling with padding_free=True
    (trl/trainer/sft_trainer.py, torch_call), which the worker uses (launcher/worker/trainer_config.py,
    padding_free_collator); built here without trl, which a bare GPU box may lack
    (tests/worker/test_gpu_check.py compares the two)."""
    import torch

    ids = torch.tensor([t for e in examples for t in e]).unsqueeze(0)
    pos = torch.tensor([i for e in examples for i in range(len(e))]).unsqueeze(0)
    labels = ids.clone()
    labels[pos == 0] = -100
    cu = torch.tensor([0, *[len(e) for e in examples]]).cumsum(0).to(torch.int32)
    longest = max(len(e) for e in examples)
    return {
        "input_ids": ids.to(device),
        "position_ids": pos.to(device),
        "labels": labels.to(device),
        "cu_seq_lens_q": cu.to(device),
        "cu_seq_lens_k": cu.to(device),
        "max_length_q": longest,
        "max_length_k": longest,
    }


def dense_batch(examples: list[list[int]], device: str) -> dict[str, Any]:
    """The padding-free row without its boundaries: what SDPA gets (it builds the block mask from position_ids)."""
    return {
        k: v for k, v in padding_free_batch(examples, device).items() if k in ("input_ids", "position_ids", "labels")
    }


def fixed_batch(examples: list[list[int]], device: str) -> dict[str, Any]:
    """As many rows as examples, all of the examples' mean length (their own tokens, cut or repeated), no mask."""
    import torch

    n = max(1, round(sum(map(len, examples)) / len(examples)))
    rows = [(e * math.ceil(n / len(e)))[:n] for e in examples]
    ids = torch.tensor(rows)
    return {"input_ids": ids.to(device), "labels": ids.clone().to(device)}


BATCHES = {"varlen": padding_free_batch, "dense": dense_batch, "padded": padded_batch, "fixed": fixed_batch}


def _isolation(model, examples: list[list[int]], device: str, dtype) -> dict[str, Any]:
    """Padding-free must keep examples apart: the last example's logits in the packed row (with the collator's
    boundaries, on whatever kernel the model loaded with) against the example alone, and a control (the same row
    with positions running on and one boundary, so attention crosses examples)."""
    import contextlib

    import torch

    auto = torch.autocast("cuda", dtype=dtype) if device == "cuda" else contextlib.nullcontext()
    last = len(examples[-1])
    packed = padding_free_batch(examples, device)
    inputs = {k: v for k, v in packed.items() if k != "labels"}
    n = packed["input_ids"].shape[1]
    running = torch.arange(n, device=device).unsqueeze(0)
    one = torch.tensor([0, n], dtype=torch.int32, device=device)
    crossing = {**inputs, "position_ids": running, "cu_seq_lens_q": one, "cu_seq_lens_k": one}
    crossing.update(max_length_q=n, max_length_k=n)
    with torch.no_grad(), auto:
        alone = model(input_ids=torch.tensor([examples[-1]], device=device)).logits[0].float()
        inside = model(**inputs).logits[0, -last:].float()
        crossed = model(**crossing).logits[0, -last:].float()
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


def _speed_choice(ctx: Context, arch, examples: list[list[int]], dense: bool) -> tuple[int, str]:
    """The micro-batch launcher/plan/speed.py chooses on this box for a LoRA recipe at these examples that leaves the
    micro-batch and the accumulation to the plan (the recipe's defaults otherwise), and where it comes from."""
    from launcher.plan import speed
    from launcher.plan.engine import choose
    from launcher.plan.job import Job
    from launcher.recipe import Recipe
    from gpu_check.bench import _plan_hardware

    micro = Recipe.model_fields["micro_batch_size"].default
    accumulation = Recipe.model_fields["gradient_accumulation_steps"].default
    hw, source = _plan_hardware(ctx)
    if hw is None:
        return micro, f"the recipe's default ({source})"
    mean = sum(map(len, examples)) / len(examples)
    longest = max(map(len, examples))
    job = Job(
        arch,
        "lora",
        longest,
        mean,
        1000,
        1000 * mean,
        "gpu check",
        micro,
        accumulation,
        1,
        None,
        True,
        16,
        "all-linear",
        False,
        padding_free=True,
        dense_mask=dense,
    )
    choice = choose(job, hw, "trl", False)
    if not choice.fits:
        return micro, "the recipe's default (the plan does not fit this box)"
    sped = speed.faster(job, choice, set(speed.LEFT_TO_PLAN), lambda j: choose(j, hw, "trl", False))
    chosen = sped.job.micro_batch if sped else micro
    return chosen, f"launcher/plan/speed.py on {source}: {'; '.join(sped.reasons) if sped else 'nothing to change'}"


def _predicted_gb(arch, kernel: str, batch: dict[str, Any], micro_batch: int, checkpointing: bool, device: str):
    """The sizer's peak for this case: the row's tokens spread over the micro-batch (padding-free), the padded or
    fixed rows as they are; the dense case with its mask."""
    from launcher.plan import sizing

    rows, length = batch["input_ids"].shape
    seq = length if rows > 1 else math.ceil(length / micro_batch)
    w = sizing.Workload(
        "lora", seq, micro_batch if rows == 1 else rows, checkpointing, device=device, dense_mask=kernel == "dense"
    )
    return sizing.memory(arch, w).peak_gb


def _capacity_gb(device: str) -> Optional[float]:
    """What the plan may fill of this card (USABLE_FRACTION of its memory); None on a CPU."""
    if device != "cuda":
        return None
    import torch

    from launcher.plan.sizing_constants import GB, USABLE_FRACTION

    return torch.cuda.mem_get_info()[1] / GB * USABLE_FRACTION


def _profile_kernels(model, batch, device: str, dtype) -> list[str]:
    """The attention kernels one forward and backward of this batch launches on the GPU (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.autocast("cuda", dtype=dtype):
            loss = model(**batch).loss
        loss.backward()
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    names = {e.key for e in prof.key_averages() if any(k in e.key.lower() for k in ATTENTION_KERNEL)}
    return sorted(names)[:12]


def _set_kernel(model, name: str) -> None:
    """Switch the attention implementation of an already built model (transformers reads config._attn_implementation
    at every forward: the attention function and the mask function alike)."""
    model.config._attn_implementation = name
    base = getattr(model, "get_base_model", None)
    if base is not None:
        base().config._attn_implementation = name


def step_bench_padding(ctx: Context) -> dict[str, Any]:
    """Tokens/s and peak memory of padding-free micro-batches on torch's varlen kernel and on SDPA's dense mask, of
    padded ones, against the fixed shape; at micro-batch 8 and at speed.py's choice, checkpointing on and off."""
    import gc

    import torch

    from launcher.plan import attention
    from launcher.worker import memory

    if not has("peft"):
        return no_peft()
    cfg = BENCH[ctx.device]
    arch = architecture(ctx)
    model, device, dtype, chosen = build_model(ctx, arch, "lora", checkpointing=True)
    from launcher.worker import varlen

    varlen_here = device == "cuda" and varlen.available(device, dtype)
    if varlen_here:
        varlen.register()
    first = cfg["pad_examples"]
    steps = cfg["pad_batches"] + 1
    sample = _examples(cfg, arch.vocab, first * steps)
    speed_mb, speed_source = _speed_choice(ctx, arch, sample, dense=not varlen_here and chosen == "sdpa")
    micro_batches = list(dict.fromkeys((first, speed_mb)))
    examples = _examples(cfg, arch.vocab, max(micro_batches) * steps)
    result: dict[str, Any] = {
        "shape": arch.name,
        "device": device,
        "implementation_loaded": chosen,
        "kernels": {
            "varlen": attention.VARLEN if varlen_here else None,
            "dense": "sdpa",
            "padded": chosen,
            "fixed": chosen,
        },
        "varlen_available": varlen_here,
        "torch": torch.__version__,
        "flash_attn_installed": has("flash_attn"),
        "micro_batches": micro_batches,
        "speed_choice": {"micro_batch": speed_mb, "source": speed_source},
        "max_length": cfg["seq"],
        "mean_length": round(sum(map(len, examples)) / len(examples), 1),
        "cases": {},
    }
    _set_kernel(model, attention.VARLEN if varlen_here else chosen)
    try:  # a kernel that fails here fails its cases below too, each with its own error; the others still measure
        result["isolation"] = _isolation(model, examples[:first], device, dtype)
    except Exception as exc:  # noqa: BLE001 (recorded: the step's JSON says what failed)
        result["isolation"] = {"isolated": False, "error": first_line(exc)}
    ctx.progress(**result)
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    capacity = _capacity_gb(device)
    for checkpointing in (True, False):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        for mb in micro_batches:
            groups = [examples[i * mb : (i + 1) * mb] for i in range(steps)]
            real = [sum(map(len, g)) for g in groups]
            for kernel in KERNELS:
                key = f"{kernel} mb{mb} {'ckpt' if checkpointing else 'no-ckpt'}"
                case: dict[str, Any] = {"kernel": kernel, "micro_batch": mb, "checkpointing": checkpointing}
                result["cases"][key] = case
                implementation = result["kernels"][kernel]
                if implementation is None:
                    case["skipped"] = "torch's varlen kernel needs a CUDA card of compute capability 8.0 in bf16"
                    continue
                batches = [BATCHES[kernel](g, device) for g in groups]
                predicted = max(_predicted_gb(arch, kernel, b, mb, checkpointing, device) for b in batches)
                case.update(implementation=implementation, predicted_gb=round(predicted, 1))
                if capacity is not None and predicted > capacity:
                    case["skipped"] = f"the sizer predicts {predicted:.1f} GB, more than the {capacity:.1f} GB usable"
                    ctx.progress(**result)
                    continue
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        if n in start:
                            p.copy_(start[n])
                _set_kernel(model, implementation)
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
                memory.reset_peak(device)
                params, opt = make_optimizer(model, device)
                try:
                    case.update(measure(model, params, opt, batches, real, 1, device, dtype))
                    if device == "cuda" and checkpointing and mb == micro_batches[0]:
                        case["attention_kernels"] = _profile_kernels(model, batches[0], device, dtype)
                except torch.cuda.OutOfMemoryError as exc:
                    case["error"] = f"out of memory: {first_line(exc)}"
                except Exception as exc:  # noqa: BLE001 (a kernel that refuses: recorded, the next case runs)
                    case["error"], case["failed"] = first_line(exc), True
                case["tokens_per_micro_batch"] = [int(b["input_ids"].numel()) for b in batches]
                del opt, params, batches
                ctx.progress(**result)
    _set_kernel(model, chosen)
    return _summary(result, device)


def _summary(result: dict[str, Any], device: str) -> dict[str, Any]:
    """Each padding-free and padded case's tokens/s as a share of the fixed shape's at the same micro-batch and
    checkpointing; whether the cases' first losses agree; the step's line."""
    cases = result["cases"]
    agree = True
    parts = []
    for key, case in cases.items():
        fixed = cases.get(key.replace(case["kernel"], "fixed", 1))
        if "tokens_per_second" in case and fixed and "tokens_per_second" in fixed:
            case["of_fixed"] = round(case["tokens_per_second"] / fixed["tokens_per_second"], 3)
    for mb in result["micro_batches"]:
        for ckpt in ("ckpt", "no-ckpt"):
            firsts = [
                cases[f"{k} mb{mb} {ckpt}"]["losses"][0]
                for k in ("varlen", "dense", "padded")
                if "losses" in cases.get(f"{k} mb{mb} {ckpt}", {})
            ]
            if len(firsts) > 1 and max(firsts) - min(firsts) > LOSS_AGREEMENT[device]:
                agree = False
            shown = []
            for k in KERNELS:
                c = cases.get(f"{k} mb{mb} {ckpt}", {})
                if "tokens_per_second" in c:
                    share = f" ({c['of_fixed']:.0%})" if "of_fixed" in c and k != "fixed" else ""
                    shown.append(f"{k} {c['tokens_per_second']:.0f}{share} {c['peak_memory_gb']:.1f} GB")
                elif "skipped" in c:
                    shown.append(f"{k} skipped")
                elif "error" in c:
                    shown.append(f"{k} {'failed' if c.get('failed') else 'OOM'}")
            parts.append(f"mb{mb} {ckpt}: " + ", ".join(shown))
    result["first_losses_agree"] = agree
    finite = all(x == x for c in cases.values() for x in c.get("losses", []))
    failed = [k for k, c in cases.items() if c.get("failed")]
    ok = result["isolation"]["isolated"] and agree and finite and not failed
    line = (
        f"{result['shape']} lora, mean {result['mean_length']:.0f} tokens, tok/s (share of the fixed shape) and peak: "
        + "; ".join(parts)
        + f"; speed.py's micro-batch {result['speed_choice']['micro_batch']}; examples kept apart: "
        f"{result['isolation']['isolated']}; first losses agree: {agree}"
        + (f"; failed: {cases[failed[0]]['error']}" if failed else "")
    )
    out = {"ok": ok, **result, "line": line}
    verdict = _padding_free_verdict(result) if device == "cuda" else None
    if verdict:
        out["decides"] = {"padding-free": verdict}
    return out


def _padding_free_verdict(result: dict[str, Any]) -> Optional[dict[str, Any]]:
    """What the step decides (runner.DECIDING): the padding-free kernel's worst share of the fixed shape's tokens/s
    over the micro-batches and checkpointing it measured; None where no such case measured."""
    kernel = "varlen" if result.get("varlen_available") else "dense"
    shares = {k: c["of_fixed"] for k, c in result["cases"].items() if c["kernel"] == kernel and "of_fixed" in c}
    if not shares:
        return None
    worst = min(shares, key=shares.get)
    return {
        "value": shares[worst],
        "target": f">= {PADDING_FREE_TARGET:.0%} of the fixed shape's tokens/s",
        "met": shares[worst] >= PADDING_FREE_TARGET,
        "says": f"padding-free ({result['kernels'][kernel]}) at {shares[worst]:.0%} of the fixed shape at worst "
        f"({worst}); " + ", ".join(f"{k} {v:.0%}" for k, v in shares.items()),
    }
