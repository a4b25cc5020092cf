"""Model FLOPs utilization (docs/BENCHMARKS.md, "MFU"): the basis the plan records, the figure of a measured rate."""

from __future__ import annotations

from typing import Any

from launcher.plan import throughput
from launcher.plan.choice import Choice
from launcher.plan.job import Job


def _mfu_basis(job: Job, choice: Choice, g: Any) -> dict[str, Any]:
    """What model FLOPs utilization is computed from (docs/BENCHMARKS.md, "MFU"): the model's training FLOPs per
    token without recomputation, at the data's mean length, and the dense 16-bit peak of one card (catalog); on a
    GPU with a catalog rate only."""
    if choice.device != "cuda" or g is None or not g.tflops_bf16:
        return {}
    flops = throughput.flops_per_token(
        job.arch, job.method, max(1, round(job.mean_tokens)), gradient_checkpointing=False
    )
    return {"model_flops_per_token": round(flops), "peak_tflops_per_gpu": g.tflops_bf16, "gpus_used": choice.processes}


def model_flops_utilization(plan: dict[str, Any], tokens_per_second: float | None) -> float | None:
    """MFU of a measured rate: tokens/s x model FLOPs per token / (cards used x the card's dense 16-bit peak).
    None on a CPU, for a card without a catalog rate, or without a rate."""
    t = plan.get("tokens") or {}
    if not tokens_per_second or not t.get("model_flops_per_token") or not t.get("peak_tflops_per_gpu"):
        return None
    peak = max(1, int(t.get("gpus_used") or 1)) * t["peak_tflops_per_gpu"] * 1e12
    return tokens_per_second * t["model_flops_per_token"] / peak
