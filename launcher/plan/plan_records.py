"""The plan's choice as plan.json records it: the GPUs, the model, the memory, the smoke test's measurements applied."""

from __future__ import annotations

from typing import Any

from launcher.plan import sizing_constants
from launcher.plan.choice import Choice
from launcher.plan.figures import UNIT
from launcher.plan.hardware import Hardware
from launcher.plan.models import Architecture


def _gpus_dict(hardware: Hardware, choice: Choice) -> dict[str, Any]:
    g = hardware.gpu
    return {
        "name": g.name if g else "cpu",
        "count": choice.processes if g else 0,
        "memory_gb": round(g.memory_gb, 1) if g else round(hardware.ram_gb, 1),
        "box_count": hardware.count,
        "interconnect": hardware.interconnect,
        "source": hardware.source,
    }


def _model_dict(arch: Architecture, est: Any) -> dict[str, Any]:
    return {
        "name": arch.name,
        "params": arch.params,
        "trainable_params": est.trainable_params if est else None,
        "source": arch.source,
        "layers": arch.layers,
        "hidden": arch.hidden,
        "vocab": arch.vocab,
    }


def _memory_dict(est: Any, choice: Choice, measured: dict[str, Any]) -> dict[str, Any]:
    fraction = sizing_constants.USABLE_FRACTION if choice.device == "cuda" else sizing_constants.USABLE_RAM_FRACTION
    return {
        "unit": UNIT,
        "per_gpu_gb": round(measured.get("peak_memory_gb", est.per_gpu_gb), 1),
        "estimated_per_gpu_gb": round(est.per_gpu_gb, 1),
        "peak_gb": round(est.peak_gb, 1),
        "total_gb": round(est.total_gb, 1),
        "capacity_gb": round(choice.capacity_gb, 1),
        "usable_gb": round(choice.capacity_gb * fraction, 1),
        "breakdown_gb": {k: round(v, 2) for k, v in est.breakdown_gb.items()},
        "explanations": dict(est.explanations),
        "offloaded_ram_gb": round(est.offloaded_ram_gb, 1),
        "offloaded_params_gb": round(est.offloaded_params_gb, 1),
        "load_peak_gb": round(est.load_peak_gb, 1),
        "load_ram_gb": round(est.load_ram_gb, 1),
        "load_explanation": est.load_explanation,
        "train_ram_gb": round(est.train_ram_gb, 1),
        "offload_explanation": est.offload_explanation,
        "source": "measured" if "peak_memory_gb" in measured else "estimated",
    }


def _apply_smoke(smoke: dict[str, Any], choice: Choice) -> dict[str, Any]:
    engine, procs = smoke.get("engine"), smoke.get("num_processes")
    if (engine and engine != choice.engine) or (procs and int(procs) != choice.processes):
        note = (
            f"smoke test ran with engine {engine} x {procs} processes, the plan chose {choice.engine} x "
            f"{choice.processes}: its measurements are not used"
        )
        return {"measured": {}, "notes": [note]}
    measured = {k: float(smoke[k]) for k in ("tokens_per_second", "peak_memory_gb") if smoke.get(k)}
    if measured:
        measured["source"] = "smoke test"
    return {"measured": measured, "notes": []}
