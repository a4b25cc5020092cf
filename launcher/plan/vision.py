"""A vision-language model's vision tower in the plan: its parameters, what LoRA adapts, what serving can take of the
adapter; counted as transformers 5.24's models/qwen2_5_vl/modeling_qwen2_5_vl.py builds it (test_vision_plan.py)."""

from __future__ import annotations

from typing import Any

from launcher.errors import RecipeError
from launcher.methods import is_adapter
from launcher.plan.sizing_constants import LAYER_BACKWARD_FACTOR

# Model types whose vision tower this module counts (config.json model_type).
COUNTED = ("qwen2_5_vl",)

# Qwen2.5-VL-7B-Instruct's config.json as the plan reads it (docs/sizing.md; gpu_check/vision_check.py builds it)
QWEN25_VL_7B: dict[str, Any] = {
    "model_type": "qwen2_5_vl",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "max_position_embeddings": 128000,
    "rope_theta": 1000000.0,
    "mrope_section": [16, 24, 24],
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_config": {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
    },
}

# the tower blocks' attention layers (Qwen2_5_VLVisionAttention), which LoRA on the tower adapts too
TOWER_ATTENTION = ("qkv", "proj")

# LoRA's reach, as lora.vision_tower chooses it: vLLM ignores adapter weights on the vision blocks (issue 57)
LANGUAGE_MODEL_ONLY = (
    "LoRA adapts the language model only (the vision tower and its projector stay frozen): vLLM serves this adapter "
    "as LoRA (--enable-lora)"
)
WITH_TOWER = (
    "LoRA adapts the vision tower too (lora.vision_tower: true): vLLM applies LoRA to the language model only and "
    "ignores the tower's adapter weights, so this adapter cannot be served as LoRA by vLLM; serve the merged model"
)


def tower_params(cfg: dict[str, Any]) -> int:
    """Parameters of the vision tower and projector of a config.json dict; 0 where `counted` is False."""
    v = cfg.get("vision_config")
    if not counted(cfg):
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


def tower_linears(cfg: dict[str, Any]) -> tuple[tuple[str, int, int, int], ...]:
    """The tower's linear layers as (leaf, d_in, d_out, count); () where `counted` is False."""
    v = cfg.get("vision_config")
    if not counted(cfg):
        return ()
    h = int(v.get("hidden_size", 3584))
    i = int(v.get("intermediate_size", 3420))
    depth = int(v.get("depth", 32))
    wide = h * int(v.get("spatial_merge_size", 2)) ** 2
    out = int(v.get("out_hidden_size", 3584))
    blocks = [("qkv", h, 3 * h), ("proj", h, h), ("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)]
    return tuple((leaf, a, b, depth) for leaf, a, b in blocks) + (("0", wide, wide, 1), ("2", wide, out, 1))


def quantized_params(arch: Any) -> int:
    """The tower's weights QLoRA quantizes: every linear layer's (quantizers/base.py get_keys_to_not_convert)."""
    return sum(a * b * n for _, a, b, n in getattr(arch, "vision_linears", ()))


def lora_params(arch: Any, r: int, targets: Any) -> int:
    """LoRA's parameters in the tower where lora.vision_tower adapts it, by loading.vision_targets' rule."""
    return sum(
        r * (a + b) * n
        for leaf, a, b, n in getattr(arch, "vision_linears", ())
        if targets == "all-linear" or leaf in TOWER_ATTENTION or leaf in targets
    )


def activation_bytes(arch: Any, patches: int, checkpointing: bool, trains: bool) -> float:
    """What the tower keeps for the backward pass over `patches` patches, bf16: under gradient checkpointing even a
    frozen tower is checkpointed block by block (transformers 5.24 modeling_qwen2_5_vl.py _input_embed_layer;
    Qwen2_5_VLVisionBlock is a GradientCheckpointingLayer). tests/plan/test_vision_activations.py measures it."""
    linears = {leaf: (a, b) for leaf, a, b, _ in getattr(arch, "vision_linears", ())}
    if not patches or "qkv" not in linears or not (checkpointing or trains):
        return 0.0
    h, i = linears["qkv"][0], linears["gate_proj"][1]
    depth = next(n for leaf, _, _, n in arch.vision_linears if leaf == "qkv")
    block = 2 * 4 * h + 2 * 4 * h + 2 * 3 * i + (2 * (4 * h + i) if trains else 0)
    merger = 4 * h + 2 * h + (2 * 2 * h if trains else 0)
    if checkpointing:
        return patches * (depth * h * 2 + 2 * h + merger + LAYER_BACKWARD_FACTOR * block)
    return patches * (depth * block + merger)


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
            "vision tower (under gradient checkpointing each tower block's input is kept for the backward pass, "
            "frozen or not: the memory counts them; a GPU run measures the peak)"
        )
        from launcher.data.image_stats import MROPE_WHY

        # stats.with_data_defaults turns the padding_free default off for image data (an explicit true is refused)
        lines.append(f"image data trains in padded rows, not padding-free ones: {MROPE_WHY}")
    if is_adapter(getattr(recipe, "method", "")):
        lines.append(WITH_TOWER if getattr(recipe.lora, "vision_tower", False) else LANGUAGE_MODEL_ONLY)
    return lines


def refuse_sharded_without_images(engine: str, forced: str, stats: Any) -> None:
    """FSDP on image data in which some examples hold no image: refused, the ranks' gathers would stop matching
    (accelerate 1.15 fsdp2_prepare_auto_wrap_policy; docs/engines.md, "DDP and FSDP with the vision tower")."""
    facts = (getattr(stats, "images", None) if stats is not None else None) or {}
    if engine != "fsdp" or not facts.get("without_images"):
        return
    why = "engine: fsdp in the recipe" if forced == "fsdp" else "the plan's engine fsdp (no card holds the job alone)"
    raise RecipeError(
        f"{why} with image data in which {facts['without_images']:,} example(s) hold no image (the first at "
        f"{facts['first_without_image']}): FSDP shards each vision-tower block and every process gathers it in "
        "step, but a micro-batch without images skips the tower on its process, so the processes' collectives no "
        "longer match and the run aborts or hangs",
        fix="give every example an image (or train the text-only examples in a run of their own), or use "
        "engine: ddp on cards that each hold the model, whose unused-parameter search covers a skipped tower.",
    )
