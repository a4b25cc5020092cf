"""The unsloth step: the demo recipe with engine unsloth (LoRA in 16 bit) beside product-lora's TRL run, where
Unsloth imports; on the lent box that is the second call, with scripts/device_wheels.sh --unsloth's wheels."""

from __future__ import annotations

from typing import Any

from gpu_check.common import Context, read_json
from gpu_check.product import SFT_RECIPE, VISION_RECIPE, _step

SECOND_CALL = (
    "scripts/device_wheels.sh --unsloth, then the second call of docs/BENCHMARKS.md "
    "(GPU_CHECK_STEPS=unsloth, carry .cache/device-wheels-unsloth)"
)


def attention_path() -> dict[str, Any]:
    """Which attention Unsloth's models run here: its xformers path where xformers imports (the image has xformers
    0.0.35, docker/requirements-unsloth.txt; scripts/device_wheels.sh --unsloth carries it), else SDPA, which with
    a padding mask takes enable_gqa and the memory-efficient or MATH kernel (cuDNN off by ftrun's policy)."""
    import importlib.util

    if importlib.util.find_spec("xformers") is None:
        return {"xformers": None, "says": "SDPA (xformers is not installed: not the image's path)"}
    try:
        import xformers

        version = xformers.__version__
    except Exception as exc:  # noqa: BLE001 - an xformers that does not import is the answer
        return {"xformers": None, "error": str(exc)[:300], "says": f"SDPA (xformers does not import: {exc})"[:300]}
    return {"xformers": version, "says": f"xformers {version}, as in the image"}


def step_unsloth(ctx: Context) -> dict[str, Any]:
    import importlib.util

    if importlib.util.find_spec("unsloth") is None:
        why = f"unsloth is not installed: its wheels (about 40 MB without bitsandbytes) come with {SECOND_CALL}"
        return {"ok": None, "skipped": why, "line": f"skipped: {why}"}
    if ctx.device != "cuda":
        # Unsloth trains on a CPU only with its own environment's patched torchvision (STACK-FACTS); the unsloth
        # test tier covers that, and the dry run has nothing to show here
        why = "the dry run: Unsloth is measured on a GPU (the unsloth test tier runs it on a CPU)"
        return {"ok": None, "skipped": why, "line": f"skipped: {why}"}
    result = _step(ctx, "unsloth", SFT_RECIPE, "engine=unsloth")
    result["attention_path"] = attention_path()
    result["line"] += f"; attention: {result['attention_path']['says']}"
    trl = read_json(ctx.out / "product-lora.json") or {}
    ours = (result.get("smoke") or {}).get("tokens_per_second")
    theirs = (trl.get("smoke") or {}).get("tokens_per_second")
    result["trl_smoke_tokens_per_second"] = theirs
    if ours and theirs:
        result["line"] += f"; smoke tok/s unsloth {ours:.0f} vs trl {theirs:.0f} (product-lora, the first call)"
    return result


def step_unsloth_vision(ctx: Context) -> dict[str, Any]:
    """Unsloth's vision path (FastVisionModel, UnslothVisionDataCollator: launcher/worker/engines/unsloth.py), which
    Unsloth's CPU backend does not have: the demo's fourth step with engine unsloth on the tiny VLM, beside
    product-vision's TRL run where the same call made it (GPU_CHECK_STEPS=unsloth; the box's torchvision, which the
    path needs, is the image's)."""
    import importlib.util

    from gpu_check.vision_check import tiny_vlm

    if importlib.util.find_spec("unsloth") is None:
        why = f"unsloth is not installed: its wheels (about 40 MB without bitsandbytes) come with {SECOND_CALL}"
        return {"ok": None, "skipped": why, "line": f"skipped: {why}"}
    if ctx.device != "cuda":
        why = "the dry run: Unsloth 2026.10.9's CPU backend has no vision path (docs/engines.md)"
        return {"ok": None, "skipped": why, "line": f"skipped: {why}"}
    result = _step(ctx, "unsloth-vision", VISION_RECIPE, "engine=unsloth", model=tiny_vlm(ctx))
    task = result.get("task_eval") or {}
    if result.get("exit") == 0 and task.get("scores"):
        said = ", ".join(f"{k} {v:.0%}" for k, v in task["scores"].items() if isinstance(v, (int, float)))
        result["line"] += f"; task score ({task.get('metric')}) {said}"
    trl = read_json(ctx.out / "product-vision.json") or {}
    ours, theirs = ((r.get("smoke") or {}).get("tokens_per_second") for r in (result, trl))
    if ours and theirs:
        result["line"] += f"; smoke tok/s unsloth {ours:.0f} vs trl {theirs:.0f} (product-vision)"
    return result
