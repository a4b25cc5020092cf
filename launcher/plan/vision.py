"""A vision-language model's vision tower in the plan: its parameters (counted into the model's weights), what LoRA
adapts, and what the serving side can take of the adapter.

The parameter count follows transformers 5.24's modules (models/qwen2_5_vl/modeling_qwen2_5_vl.py): the patch
embedding Conv3d (no bias), per block two RMSNorms, `qkv` and `proj` with biases and the gated MLP with biases, and
the patch merger (an RMSNorm, then Linear(h*m^2, h*m^2) and Linear(h*m^2, out_hidden), with biases).
tests/plan/test_vision_plan.py checks it against the tiny model's weights and a 7B-shaped model built on the meta
device.
"""

from __future__ import annotations

from typing import Any

from launcher.methods import is_adapter

# Model types whose vision tower this module counts (config.json model_type).
COUNTED = ("qwen2_5_vl",)

# LoRA's reach, as the recipe's lora.vision_tower chooses it. vLLM loads LoRA on the language model only and ignores
# (with a warning) adapter weights on the vision blocks (issue 57): an adapter that reaches the tower is served merged.
LANGUAGE_MODEL_ONLY = (
    "LoRA adapts the language model only (the vision tower and its projector stay frozen): vLLM serves this adapter "
    "as LoRA (--enable-lora)"
)
WITH_TOWER = (
    "LoRA adapts the vision tower too (lora.vision_tower: true): vLLM applies LoRA to the language model only and "
    "ignores the tower's adapter weights, so this adapter cannot be served as LoRA by vLLM; serve the merged model"
)


def tower_params(cfg: dict[str, Any]) -> int:
    """Parameters of the vision tower and projector of a config.json dict; 0 for a model without one (or one whose
    tower this module does not count: `counted` says which)."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict) or cfg.get("model_type") not in COUNTED:
        return 0
    h = int(v.get("hidden_size", 3584))
    i = int(v.get("intermediate_size", 3420))
    depth = int(v.get("depth", 32))
    patch = int(v.get("patch_size", 14))
    temporal = int(v.get("temporal_patch_size", 2))
    channels = int(v.get("in_channels", 3))
    merge = int(v.get("spatial_merge_size", 2))
    out = int(v.get("out_hidden_size", 3584))
    embed = channels * temporal * patch * patch * h
    block = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * (h * i + i) + (i * h + h)
    wide = h * merge * merge
    merger = h + (wide * wide + wide) + (wide * out + out)
    return embed + depth * block + merger


def counted(cfg: dict[str, Any]) -> bool:
    return isinstance(cfg.get("vision_config"), dict) and cfg.get("model_type") in COUNTED


def notes(arch: Any, recipe: Any, stats: Any) -> list[str]:
    """The plan's lines about the vision tower, the image tokens and what LoRA adapts; [] for a text model."""
    if not getattr(arch, "vision_tower", ""):
        return []
    lines = []
    if arch.vision_params:
        lines.append(f"vision tower and projector: {arch.vision_params:,} params, counted in the model's weights")
    else:
        lines.append(
            f"vision tower of model type {arch.vision_tower}: its parameters are not counted by this version "
            "(launcher/plan/vision.py COUNTED); the memory is the language model's"
        )
    facts = getattr(stats, "images", None) if stats is not None else None
    if facts:
        longest = facts["longest_example"]
        lines.append(
            f"images: {facts['images']:,} in the training examples, {facts['image_tokens']:,} image tokens "
            f"({facts['rule']}); the longest example, {longest['where']}, is {longest['tokens']:,} tokens of which "
            f"{longest['image_tokens']:,} image tokens; its images are {facts['patches_longest']:,} patches in the "
            "vision tower (frozen under LoRA: its activations are not kept for the backward pass; a GPU run measures "
            "the peak)"
        )
    if is_adapter(getattr(recipe, "method", "")):
        lines.append(WITH_TOWER if getattr(recipe.lora, "vision_tower", False) else LANGUAGE_MODEL_ONLY)
    return lines
