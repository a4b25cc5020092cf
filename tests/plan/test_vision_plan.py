"""The vision tower in the plan: its parameters counted into the weights (checked against the weights themselves),
and what LoRA adapts said, with what vLLM can serve (launcher/plan/vision.py)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from launcher.data.stats import data_stats
from launcher.plan.models import load_architecture
from launcher.plan.vision import LANGUAGE_MODEL_ONLY, WITH_TOWER, notes, tower_params
from launcher.recipe_loading import load_recipe
from tests.conftest import recipe_file

VISION_DATA = Path(__file__).parents[2] / "recipes" / "data" / "tiny-vision.jsonl"


def _weights(folder: Path) -> dict[str, int]:
    with (folder / "model.safetensors").open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def test_the_tower_count_equals_the_tiny_models_weights_and_joins_the_models_params(tiny_vlm):
    weights = _weights(tiny_vlm)
    visual = sum(n for k, n in weights.items() if k.startswith(("visual.", "model.visual.")))
    cfg = json.loads((tiny_vlm / "config.json").read_text())
    assert visual > 0 and tower_params(cfg) == visual
    arch = load_architecture(str(tiny_vlm))
    assert arch.vision_tower == "qwen2_5_vl" and arch.vision_params == visual
    assert arch.params == sum(weights.values())  # the text side of the count holds for this model too


def test_the_tower_count_equals_a_7b_shaped_tower_built_on_the_meta_device():
    import torch
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    # Qwen2.5-VL-7B-Instruct's vision_config as published (config.json): hidden 1280, 32 blocks, out_hidden 3584
    vision = {
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
    }
    config = Qwen2_5_VLConfig(vision_config=vision)
    with torch.device("meta"):
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config.vision_config)
    built = sum(p.numel() for p in tower.parameters())
    assert tower_params({"model_type": "qwen2_5_vl", "vision_config": vision}) == built
    assert 600e6 < built < 700e6  # about 670M, as the 7B's tower is described


def test_the_plan_says_what_lora_adapts_and_counts_the_images(tmp_path, tiny_vlm):
    base = recipe_file(tmp_path / "r.yaml", tiny_vlm, tmp_path / "run", data=str(VISION_DATA), max_length=128)
    recipe = load_recipe(base)
    _, _, stats = data_stats(recipe)
    arch = load_architecture(str(tiny_vlm))
    lines = notes(arch, recipe, stats)
    assert LANGUAGE_MODEL_ONLY in lines and WITH_TOWER not in lines
    assert any(line.startswith(f"vision tower and projector: {arch.vision_params:,} params") for line in lines)
    images = next(line for line in lines if line.startswith("images: "))
    assert f"{stats.images['image_tokens']:,} image tokens" in images and "tiny-vision.jsonl line" in images
    tower = load_recipe(
        recipe_file(
            tmp_path / "t.yaml",
            tiny_vlm,
            tmp_path / "run",
            data=str(VISION_DATA),
            max_length=128,
            lora={"vision_tower": True},
        )
    )
    said = notes(arch, tower, stats)
    assert WITH_TOWER in said and "cannot be served as LoRA by vLLM" in WITH_TOWER
    # a text model: nothing about towers
    from dataclasses import replace

    assert notes(replace(arch, vision_tower="", vision_params=0), recipe, stats) == []
