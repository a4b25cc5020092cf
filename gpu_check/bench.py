"""The bench-lora and bench-full steps: the plan's predicted memory and tokens/s against measured, at a real shape."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from gpu_check.common import FUSED_OUTPUTS, Context, has, in_gb
from gpu_check.training import BENCH, architecture, build_model, make_optimizer, measure, no_peft


# Each bench step's (method, gradient checkpointing, micro-batch) on a device: what it trains and what the preflight
# sizes before it starts (bench-full: micro-batch 1, the least it falls back to).
STEP_SHAPES = {
    "bench-lora": lambda device: ("lora", True, BENCH[device]["lora_batch"]),
    "bench-lora-fast": lambda device: ("lora", False, 2 * BENCH[device]["lora_batch"]),
    "bench-full": lambda device: ("full", True, 1),
}
# The card the plan's MFU was calibrated on (launcher/methods.py, docs/sizing.md "Calibration"): bench-lora on any
# other card is issue 55's test of the plan's tokens/s on a card it was not calibrated on.
CALIBRATED_ON = "H200"
TOKENS_PER_SECOND_TOLERANCE = 0.10


def memory_rule(name: str) -> str:
    """How the preflight holds the step's sizer figure against the card: bench-lora-fast is what speed.py chooses
    where the card has room, so it is held to speed.py's own rule (HEADROOM); the others to the plan's fit."""
    return "speed" if name == "bench-lora-fast" else "fits"


def _plan_hardware(ctx: Context):
    """What the plan sizes for: this box as detected; where detection sees no GPU on a CUDA box, the catalog
    entry of torch's device name (and the step says so)."""
    from launcher.plan.hardware import catalog_box, lookup
    from launcher.plan.this_box import detect

    hw = detect()
    if ctx.device != "cuda" or not hw.is_cpu_only:
        return hw, f"detected: {hw.describe()}"
    import torch

    name = torch.cuda.get_device_name(0)
    entry = lookup(name)
    if entry is None:
        return None, f"detection saw no GPU ({'; '.join(hw.notes)}) and '{name}' is not in the catalog"
    return (
        catalog_box(entry.name, torch.cuda.device_count()),
        f"catalog {entry.name}: detection saw no GPU ({'; '.join(hw.notes)})",
    )


def predict(
    ctx: Context, arch, method: str, micro_batch: int, seq: int, fused: bool = True, checkpointing: bool = True
) -> dict[str, Any]:
    """The plan's memory and tokens/s for this job on this box (engine trl: one process, the worker's path). `fused`:
    the step computes the loss with TRL's fused LM head as the worker does; without trl on the box it runs the
    model's own loss, and memory_gb is the sizer's figure for that loss (the plan's own is plan_memory_gb)."""
    from launcher.plan import sizing
    from launcher.plan import throughput
    from launcher.errors import FtrunError
    from launcher.plan.plan import make_plan

    hw, source = _plan_hardware(ctx)
    out: dict[str, Any] = {"hardware": source}
    if hw is None:
        return out
    recipe = SimpleNamespace(
        model=arch.name,
        method=method,
        engine="trl",
        num_processes="auto",
        max_length=seq,
        packing=False,
        max_steps=None,
        epochs=1,
        micro_batch_size=micro_batch,
        gradient_accumulation_steps=1,
        gradient_checkpointing=checkpointing,
        lora=SimpleNamespace(r=16, target_modules="all-linear"),
        price_per_hour_eur=None,
        checkpoint_every_minutes=30,
    )
    # every example as long as the measured ones: the plan's seq_len and mean length are the bench's
    stats = SimpleNamespace(
        examples=1000, mean_tokens=seq, max_tokens=seq, total_tokens=1000 * seq, tokens_source="tokenizer"
    )
    try:
        plan = make_plan(recipe, hw, stats, arch=arch, unsloth_available=False)
        out.update(
            fits=True,
            memory_gb=plan.memory["estimated_per_gpu_gb"],
            breakdown_gb=plan.memory["breakdown_gb"],
            tokens_per_second=plan.tokens["estimated_tokens_per_second"],
            engine=plan.engine,
        )
        if not fused:
            device = "cpu" if hw.is_cpu_only else "cuda"
            est = sizing.memory(
                arch,
                sizing.Workload(
                    method, seq, micro_batch, True, 16, "all-linear", "trl", 1, device, loss=sizing.LOSS_MATERIALIZED
                ),
            )
            out.update(
                plan_memory_gb=out["memory_gb"],
                memory_gb=round(est.peak_gb, 1),
                breakdown_gb={k: round(v, 2) for k, v in est.breakdown_gb.items()},
            )
        out["loss"] = sizing.LOSS_FUSED if fused else sizing.LOSS_MATERIALIZED
    except FtrunError as exc:
        # the plan refuses: keep its reason, and the sizer's own figures for the comparison
        device = "cpu" if hw.is_cpu_only else "cuda"
        w = sizing.Workload(
            method,
            seq,
            micro_batch,
            True,
            16,
            "all-linear",
            "trl",
            1,
            device,
            loss="" if fused else sizing.LOSS_MATERIALIZED,
        )
        est = sizing.memory(arch, w)
        g = hw.gpu
        out.update(
            fits=False,
            refusal=exc.message[:400],
            memory_gb=round(est.per_gpu_gb, 1),
            breakdown_gb={k: round(v, 2) for k, v in est.breakdown_gb.items()},
            tokens_per_second=round(
                throughput.tokens_per_second(arch, w, g.tflops_bf16 if g else None, hw.interconnect, hw.cpu_count), 1
            ),
        )
    return out


def _fused_head_importable() -> bool:
    """trl's fused LM head as the worker adds it (trl.trainer.utils needs datasets and pandas besides trl)."""
    if not has("trl"):
        return False
    try:
        from trl.trainer.utils import add_fused_lm_head  # noqa: F401
    except ImportError:
        return False
    return True


def _allocator(device: str) -> dict[str, Any]:
    if device != "cuda":
        return {}
    import torch

    free, total = torch.cuda.mem_get_info()
    return {
        "allocated_gb": in_gb(torch.cuda.memory_allocated()),
        "reserved_gb": in_gb(torch.cuda.memory_reserved()),
        "max_allocated_gb": in_gb(torch.cuda.max_memory_allocated()),
        "max_reserved_gb": in_gb(torch.cuda.max_memory_reserved()),
        "device_used_gb": in_gb(total - free),
    }


def _fixed_batches(
    vocab: int, micro_batch: int, seq: int, n: int, device: str, fused: bool = False
) -> list[dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (micro_batch, seq), generator=g).to(device)
        out.append({"input_ids": ids, "labels": ids, **({"fused_lm_head": True} if fused else {})})
    return out


def _bench(ctx: Context, method: str, checkpointing: bool = True, micro_batch: int | None = None) -> dict[str, Any]:
    import gc

    import torch

    from launcher.worker import memory

    cfg = BENCH[ctx.device]
    arch = architecture(ctx)
    batch_sizes = [micro_batch or cfg[f"{method}_batch"]]
    if method == "full" and batch_sizes[0] > 1:
        batch_sizes.append(1)
    # the worker's loss, TRL's fused LM head (trl 1.16 SFTTrainer: add_fused_lm_head, fused_lm_head=True), where trl
    # is installed; the lent box has no trl, so there the step measures the model's own loss and predicts that
    fused = _fused_head_importable()
    result: dict[str, Any] = {
        "shape": arch.name,
        "params": arch.params,
        "method": method,
        "seq": cfg["seq"],
        "gradient_checkpointing": checkpointing,
        "predicted": predict(ctx, arch, method, batch_sizes[0], cfg["seq"], fused, checkpointing),
    }
    ctx.progress(**result)
    t0 = time.monotonic()
    model, device, dtype, attn = build_model(ctx, arch, method, checkpointing)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if fused:
        from trl.trainer.utils import add_fused_lm_head

        from launcher.worker import fused_head

        add_fused_lm_head(base, outputs=FUSED_OUTPUTS)
        fused_head.install()
    built = sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n)
    result.update(
        device=device,
        dtype=str(dtype).replace("torch.", ""),
        attention=attn,
        build_seconds=round(time.monotonic() - t0, 1),
        built_params=built,
        weights_dtype=str(next(base.parameters()).dtype).replace("torch.", ""),
        after_build=_allocator(device),
    )
    ctx.progress(**result)
    attempts = []
    for mb in batch_sizes:
        if mb != batch_sizes[0]:
            result["predicted_fallback"] = predict(ctx, arch, method, mb, cfg["seq"], fused, checkpointing)
        memory.reset_peak(device)
        batches = _fixed_batches(arch.vocab, mb, cfg["seq"], cfg["warmup"] + cfg["steps"], device, fused)
        params, opt = make_optimizer(model, device)
        failure = None
        try:
            measured = measure(
                model, params, opt, batches, [mb * cfg["seq"]] * len(batches), cfg["warmup"], device, dtype
            )
        except Exception as exc:  # noqa: BLE001 - only an out-of-memory is an answer here
            if not memory.is_out_of_memory(exc):
                raise
            failure = {
                "micro_batch": mb,
                "out_of_memory": memory.out_of_memory_text(exc)[:300],
                "peak_memory_gb_at_failure": memory.out_of_memory_peak_gb(device),
            }
        if failure is None:
            measured.update(micro_batch=mb, allocator=_allocator(device))
            attempts.append(measured)
            break
        attempts.append(failure)
        ctx.progress(**result, attempts=attempts)
        del opt, params, batches
        for p in model.parameters():
            p.grad = None
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    result["attempts"] = attempts
    done = attempts[-1] if "tokens_per_second" in attempts[-1] else None
    pred = result.get("predicted_fallback") if done and done["micro_batch"] != batch_sizes[0] else result["predicted"]
    result["measured"] = done
    if done:
        result["memory_ratio"] = (
            round(pred["memory_gb"] / done["peak_memory_gb"], 3)
            if pred.get("memory_gb") and done["peak_memory_gb"]
            else None
        )
        result["tps_ratio"] = (
            round(pred["tokens_per_second"] / done["tokens_per_second"], 3) if pred.get("tokens_per_second") else None
        )
    # a run that trained is the check (the loss is finite); the figures are what the step is for
    ok = done is not None and all(x == x and abs(x) < 1e4 for x in done["losses"]) and built == arch.params
    oom = "; ".join(f"mb {a['micro_batch']}: out of memory" for a in attempts if "out_of_memory" in a)
    if done:
        line = (
            f"{arch.name} {method} mb {done['micro_batch']} x {cfg['seq']} ({pred.get('loss')}): memory predicted "
            f"{pred.get('memory_gb')} GB{'' if pred.get('fits', True) else ' (plan refuses)'} measured "
            f"{done['peak_memory_gb']:.1f} GB; tokens/s predicted {pred.get('tokens_per_second')} measured "
            f"{done['tokens_per_second']:.0f} ({result['weights_dtype']} weights, {attn})" + (f"; {oom}" if oom else "")
        )
    else:
        line = f"{arch.name} {method}: {oom or 'no measurement'}"
    if built != arch.params:
        line += f"; built {built:,} params, sizing counts {arch.params:,}"
    return {"ok": ok, **result, "line": line}


def step_bench_lora(ctx: Context) -> dict[str, Any]:
    """LoRA (r=16, all linear layers) at the shape: the plan's prediction against the measured peak and tokens/s;
    on a card other than the calibration's, whether the plan's tokens/s holds there (issue 55)."""
    if not has("peft"):
        return no_peft()
    result = _bench(ctx, "lora")
    done, pred = result.get("measured"), result.get("predicted") or {}
    if done and pred.get("tokens_per_second") and ctx.device == "cuda":
        import torch

        from launcher.plan.hardware import lookup

        name = torch.cuda.get_device_name(0)
        entry = lookup(name)
        card = entry.name if entry else name
        error = pred["tokens_per_second"] / done["tokens_per_second"] - 1
        calibrated = card == CALIBRATED_ON
        result["decides"] = {
            "plan-tokens-per-second": {
                "value": {
                    "predicted": pred["tokens_per_second"],
                    "measured": done["tokens_per_second"],
                    "error": round(error, 3),
                    "card": card,
                    "calibrated_on_this_card": calibrated,
                },
                "target": f"within {TOKENS_PER_SECOND_TOLERANCE:.0%} on a card other than the {CALIBRATED_ON}",
                "met": None if calibrated else abs(error) <= TOKENS_PER_SECOND_TOLERANCE,
                "says": f"plan {pred['tokens_per_second']:,.0f} vs measured {done['tokens_per_second']:,.0f} tokens/s "
                f"({error:+.1%}) on the {card}" + (", the calibration's own card: not the test" if calibrated else ""),
            }
        }
    return result


def step_bench_full(ctx: Context) -> dict[str, Any]:
    """Full fine-tuning (fp32 master weights under bf16 autocast, fused AdamW) at the shape: predicted vs measured."""
    return _bench(ctx, "full")


def step_bench_lora_fast(ctx: Context) -> dict[str, Any]:
    """LoRA at the shape with what the plan chooses where the card has room (launcher/plan/speed.py): no gradient
    checkpointing, twice the bench's micro-batch; predicted vs measured, and the model FLOPs utilisation (forward and
    backward, no recomputation) against the card's dense bf16 peak (issue 43's target: 35% at 8B on an H200)."""
    if not has("peft"):
        return no_peft()
    _, checkpointing, micro_batch = STEP_SHAPES["bench-lora-fast"](ctx.device)
    result = _bench(ctx, "lora", checkpointing=checkpointing, micro_batch=micro_batch)
    done = result.get("measured")
    if done and ctx.device == "cuda":
        import torch

        from launcher.plan import throughput
        from launcher.plan.hardware import lookup

        entry = lookup(torch.cuda.get_device_name(0))
        if entry is not None:
            flops = throughput.flops_per_token(architecture(ctx), "lora", BENCH["cuda"]["seq"], False)
            result["mfu"] = round(done["tokens_per_second"] * flops / (entry.tflops_bf16 * 1e12), 3)
            result["line"] += f"; MFU {result['mfu']:.1%} of {entry.tflops_bf16:g} TFLOP/s"
    return result
