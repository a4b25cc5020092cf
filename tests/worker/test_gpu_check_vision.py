"""The GPU check's vision step (gpu_check/vision_check.py): registered and priced like every step,
the 7B shape it builds on the card is the one the plan sizes, its image batch has the processor's layout, and its
verdicts read the plan's figures. The step itself runs on the CPU in the slow tier's dry run
(tests/worker/test_gpu_check_product.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.plan.vision import QWEN25_VL_7B
from gpu_check import preflight, product, runner, vision_check
from gpu_check.common import Context


def _ctx(tmp_path: Path, device: str = "cpu") -> Context:
    return Context(
        out=tmp_path, work=tmp_path, dry_run=device == "cpu", device=device, shape="tiny", progress=lambda **k: None
    )


def test_the_step_is_registered_with_its_timeout_preset_imports_and_estimate(tmp_path):
    assert "vision" in runner.STEPS and runner.STEP_FUNCS["vision"] is vision_check.step_vision
    assert set(runner.TIMEOUTS["vision"]) and runner.selected_steps("vision") == ["product-vision", "vision"]
    # `ftrun recipes/tiny-cpu-vision.yaml` itself, on the tiny VLM, as the product steps run the demo's recipes
    assert runner.STEP_FUNCS["product-vision"] is product.step_product_vision
    assert (
        product.RECIPE_OF["product-vision"].name == "tiny-cpu-vision.yaml"
        and "PIL" in preflight.NEEDS["product-vision"]
    )
    assert {"trl", "PIL", "peft"} <= set(preflight.NEEDS["vision"])
    box = {"process_seconds": 10.0}
    for device in ("cpu", "cuda"):
        est = preflight.estimate(_ctx(tmp_path, device), "vision", box, vision_check.__name__)
        assert est.seconds > 10 and len(est.parts) == 2, est  # the process start and the step's own price
    gpu = preflight.estimate(_ctx(tmp_path, "cuda"), "vision", box, vision_check.__name__)
    assert "7B shape's build" in gpu.parts[1]


def test_the_7b_shape_built_on_the_card_is_the_one_the_plan_sizes():
    """_hf_config turns the plan's config dict into transformers' Qwen2_5_VLConfig; the model built from it on the
    meta device has exactly the parameters the plan counts (8.29B, the tower's 676.6M among them)."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen2_5_VLForConditionalGeneration

    from launcher.plan.models import from_config

    config = vision_check._hf_config(QWEN25_VL_7B)
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config)
    built = sum(p.numel() for p in model.parameters())
    arch = from_config(QWEN25_VL_7B, "7b", "test")
    assert built == arch.params and 8.2e9 < built < 8.4e9
    assert config.image_token_id == QWEN25_VL_7B["image_token_id"] and config.vision_config.depth == 32


def test_the_image_batch_has_the_processors_layout():
    torch = pytest.importorskip("torch")
    b = vision_check.image_batch(QWEN25_VL_7B, 448, 1024, 2, "cpu", torch.bfloat16)
    # 448 px: 32 x 32 patches of 14 px, every 2 x 2 of them one <|image_pad|> token
    assert b["patches"] == 2 * 32 * 32 and b["image_tokens"] == 256
    assert b["input_ids"].shape == (2, 1024) and b["pixel_values"].shape == (2 * 1024, 3 * 2 * 14 * 14)
    assert b["image_grid_thw"].tolist() == [[1, 32, 32], [1, 32, 32]]
    row = b["input_ids"][0].tolist()
    assert row.count(QWEN25_VL_7B["image_token_id"]) == 256
    start = row.index(QWEN25_VL_7B["vision_start_token_id"])
    assert row[start + 257] == QWEN25_VL_7B["vision_end_token_id"]
    # the image tokens marked as the processor marks them, without which transformers computes no M-RoPE positions
    assert b["mm_token_type_ids"].sum(dim=1).tolist() == [256, 256]
    with pytest.raises(ValueError, match="no room for text"):
        vision_check.image_batch(QWEN25_VL_7B, 448, 200, 1, "cpu", torch.bfloat16)


def test_the_verdicts_read_the_plans_memory_within_15_percent():
    plan = {"memory_gb": 20.0, "tokens_per_second": 3000.0}
    near = vision_check._verdicts({"peak_memory_gb": 22.5, "tokens_per_second": 2500.0}, plan)
    assert near["vision-7b-memory"]["met"] is True and near["vision-7b-memory"]["value"]["ratio"] == 1.125
    far = vision_check._verdicts({"peak_memory_gb": 24.0, "tokens_per_second": 2500.0}, plan)
    assert far["vision-7b-memory"]["met"] is False
    speed = far["vision-7b-tokens-per-second"]
    assert speed["met"] is None and speed["value"]["ratio"] == round(2500 / 3000, 3)
