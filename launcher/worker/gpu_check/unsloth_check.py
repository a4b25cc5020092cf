"""The unsloth step: the demo recipe with engine unsloth (LoRA in 16 bit) beside product-lora's TRL run, where
Unsloth imports; on the lent box that is the second call, with scripts/device_wheels.sh --unsloth's wheels."""

from __future__ import annotations

from typing import Any

from launcher.worker.gpu_check.common import Context, read_json
from launcher.worker.gpu_check.product import SFT_RECIPE, _step

SECOND_CALL = (
    "scripts/device_wheels.sh --unsloth, then the second call of docs/BENCHMARKS.md "
    "(GPU_CHECK_STEPS=unsloth, carry .cache/device-wheels-unsloth)"
)


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
    trl = read_json(ctx.out / "product-lora.json") or {}
    ours = (result.get("smoke") or {}).get("tokens_per_second")
    theirs = (trl.get("smoke") or {}).get("tokens_per_second")
    result["trl_smoke_tokens_per_second"] = theirs
    if ours and theirs:
        result["line"] += f"; smoke tok/s unsloth {ours:.0f} vs trl {theirs:.0f} (product-lora, the first call)"
    return result
