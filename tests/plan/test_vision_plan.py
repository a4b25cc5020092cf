"""The vision tower in the plan: its parameters counted into the weights (checked against the weights themselves),
and what LoRA adapts said, with what vLLM can serve (launcher/plan/vision.py)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from launcher.data.stats import data_stats
from launcher.plan.models import load_architecture
from launcher.plan.vision import LANGUAGE_MODEL_ONLY, QWEN25_VL_7B, WITH_TOWER, notes, tower_params
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


# Published: Unsloth's Qwen2.5-VL (7B) vision notebook, as its output cells print it
# (github.com/unslothai/notebooks nb/Qwen2.5_VL_(7B)-Vision.ipynb; Unsloth 2025.3.19, transformers 4.50.0,
# torch 2.6.0, a Tesla T4 in fp16): unsloth/Qwen2.5-VL-7B-Instruct-bnb-4bit (QLoRA), LoRA r=16 on the attention and
# MLP of the language model and the vision tower ("Trainable parameters = 51,521,536"), batch 2, Unsloth's gradient
# checkpointing, max_length 2048, unsloth/LaTeX_OCR (formula crops: 68,686 images in a 344 MB parquet, about 5 KB
# each), 30 steps: "Peak reserved memory = 6.484 GB" (torch.cuda.max_memory_reserved() / 1024**3: GiB, ftrun's GB,
# without the CUDA context, which lives outside the allocator).
UNSLOTH_QLORA_PEAK_GB = 6.484
UNSLOTH_TRAINABLE = 51_521_536
TOLERANCE = 0.15  # issue 57: "the plan's 7B memory within 15% of the cited measurement"


def _plan_7b(tmp_path, tokens: int, patches: int, gpus: str = "T4", **fields):
    from types import SimpleNamespace

    from launcher.plan.hardware import from_spec
    from launcher.plan.plan import make_plan
    from launcher.recipe_loading import validate_recipe

    model = tmp_path / "qwen2.5-vl-7b"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN25_VL_7B))
    recipe = validate_recipe(
        {"model": str(model), "data": "d.jsonl", "max_length": 2048, "gradient_accumulation_steps": 4, **fields},
        tmp_path,
        "r",
    )
    stats = SimpleNamespace(
        examples=68_686,
        total_tokens=68_686 * tokens,
        mean_tokens=float(tokens),
        max_tokens=tokens,
        over_max_length=0,
        tokens_source="tokenizer",
        images={
            "images": 68_686,
            "image_tokens": 68_686 * patches // 4,
            "rule": "Qwen2VLImageProcessor: patch 14, merge 2",
            "longest_example": {"where": "LaTeX_OCR", "tokens": tokens, "image_tokens": patches // 4},
            "patches_longest": patches,
        },
    )
    return make_plan(recipe, from_spec(gpus), stats, unsloth_available=True)


def test_the_7b_qlora_memory_is_within_15_percent_of_unsloths_published_peak(tmp_path):
    """The plan for the notebook's settings (QLoRA, r=16 all-linear with the tower, micro-batch 2) against its
    printed peak. Engine auto trains a vision-language model with TRL (launcher/plan/engine.py
    UNSLOTH_VISION_OPT_IN; Unsloth's vision path, engine: unsloth, is sized with TRL's terms too), so the figure
    compared is TRL's; Unsloth's offloaded
    checkpointing makes its own peak the lower of the two. The rows' length is not published: a formula crop of about
    300 x 60 pixels is some 30 image tokens beside the prompt and the LaTeX answer; the plan is held at 128 and 256
    tokens a row (at 512, with 400 image tokens, far more than such a crop, it is +15%: docs/sizing.md). The plan
    counts the CUDA context (0.6 GB) that max_memory_reserved leaves out: compared without it."""
    from launcher.plan import vision
    from launcher.plan.models import from_config
    from launcher.plan.sizing_constants import ADAPTER_BYTES, CUDA_CONTEXT_GB, GB

    arch = from_config(QWEN25_VL_7B, "7b", "test")
    # the tower's LoRA counted: Unsloth's own count, plus the patch merger's two layers (ftrun's worker adapts them
    # under all-linear, launcher/worker/loading.py vision_targets; Unsloth leaves the merger out)
    trainable = arch.lora_params(16, "all-linear") + vision.lora_params(arch, 16, "all-linear")
    assert trainable == UNSLOTH_TRAINABLE + 16 * ((5120 + 5120) + (5120 + 3584))
    for tokens, patches in ((128, 200), (256, 400)):
        plan = _plan_7b(
            tmp_path,
            tokens,
            patches,
            method="qlora",
            micro_batch_size=2,
            gradient_checkpointing=True,
            lora={"r": 16, "target_modules": "all-linear", "vision_tower": True},
        )
        assert plan.engine == "trl"
        breakdown = plan.memory["breakdown_gb"]
        assert breakdown["adapters"] == round(trainable * ADAPTER_BYTES / GB, 2)
        allocator = sum(breakdown.values()) - CUDA_CONTEXT_GB
        ratio = allocator / UNSLOTH_QLORA_PEAK_GB
        assert abs(ratio - 1) <= TOLERANCE, (tokens, breakdown, ratio)


def test_the_7b_qlora_weights_count_the_towers_linear_layers_in_4_bit(tmp_path):
    """transformers' bitsandbytes quantizer converts every linear layer but the LM head (quantizers/base.py
    get_keys_to_not_convert): the tower's 0.63B linear weights are NF4, its patch embedding and norms 16-bit."""
    from launcher.plan.models import from_config
    from launcher.plan.sizing_constants import GB, NF4_BYTES
    from launcher.plan.vision import quantized_params

    arch = from_config(QWEN25_VL_7B, "7b", "test")
    assert 600e6 < quantized_params(arch) < arch.vision_params
    qlora = _plan_7b(tmp_path, 256, 400, method="qlora", engine="trl", micro_batch_size=1)
    four_bit = arch.linear_params + quantized_params(arch)
    want = (four_bit * NF4_BYTES + (arch.params - four_bit) * 2) / GB
    assert qlora.memory["breakdown_gb"]["weights"] == round(want, 2)
    assert "the vision tower's included" in qlora.memory["explanations"]["weights"]


def test_the_towers_activations_follow_checkpointing_and_what_trains(tmp_path):
    """Under gradient checkpointing each tower block keeps its input and one block is recomputed, frozen or not
    (transformers 5.24's enable_input_require_grads hooks the patch embedding, whose output is kept too, beside the
    merger's saved tensors); without it a frozen tower keeps nothing and a trained one every block's tensors and the
    merger's. The plan runs micro_batch x the longest example's patches. tests/plan/test_vision_activations.py
    measures these terms on the CPU."""
    from launcher.plan import sizing, vision
    from launcher.plan.models import from_config
    from launcher.plan.sizing_constants import GB, LAYER_BACKWARD_FACTOR

    arch = from_config(QWEN25_VL_7B, "7b", "test")
    h, i, depth, patches = 1280, 3420, 32, 8464  # 1,288 x 1,288 pixels: 92 x 92 patches
    frozen_block = 2 * 4 * h + 2 * 4 * h + 2 * 3 * i
    merger = 4 * h + 2 * h  # its RMSNorm's fp32 input, its GELU's input; + its two linear inputs where the tower trains
    assert vision.activation_bytes(arch, patches, True, False) == patches * (
        depth * h * 2 + 2 * h + merger + LAYER_BACKWARD_FACTOR * frozen_block
    )
    assert vision.activation_bytes(arch, patches, False, False) == 0.0
    trained = depth * (frozen_block + 2 * (4 * h + i)) + merger + 2 * 2 * h
    assert vision.activation_bytes(arch, patches, False, True) == patches * trained
    base = sizing.Workload("lora", 2048, 1)
    with_images = sizing.Workload("lora", 2048, 1, vision_patches=patches)
    grown = (
        sizing.memory(arch, with_images).breakdown_gb["activations"]
        - sizing.memory(arch, base).breakdown_gb["activations"]
    )
    assert abs(grown - vision.activation_bytes(arch, patches, True, False) / GB) < 1e-9
    plan = _plan_7b(
        tmp_path,
        1024,
        patches,
        "H100-80GB",
        method="lora",
        engine="trl",
        micro_batch_size=2,
        gradient_checkpointing=True,
    )
    assert f"the vision tower over {2 * patches:,} patches" in plan.memory["explanations"]["activations"]


# Published (a round figure in a comment, not a printed peak): ms-swift's examples/train/multimodal/caption.sh
# (github.com/modelscope/ms-swift), "# 22GiB": Qwen2.5-VL-7B-Instruct, LoRA r=8 alpha 32 all-linear on the language
# model, tower and aligner frozen, batch 1, max_length 2048, MAX_PIXELS 1,003,520, COCO 2014 captions (640 x 480
# images: 391 image tokens, about 440 tokens a row), ms-swift's default gradient checkpointing, bf16. ms-swift logs
# torch.cuda.max_memory_reserved() over the run (swift/trainers/mixin.py get_max_cuda_memory). The comment was written
# on 2024-12-05 (b40f31df7) for another job (train.sh: Qwen2-VL-7B, OK-VQA, no MAX_PIXELS, no max_length) and kept
# unchanged through four changes of these settings and the switch to Qwen2.5-VL (docs/sizing.md has the history).
SWIFT_LORA_GB = 22.0


@pytest.mark.xfail(
    strict=True,
    reason="docs/sizing.md: the plan for caption.sh's settings is 16.2 GB with ftrun's fused LM head (17.0 with the "
    "model's own loss, as ms-swift computes it) without the CUDA context, 0.74-0.77 of the 22 GiB. That figure is a"
    " reserved high-water mark written for another job (Qwen2-VL-7B on OK-VQA, 2024-12-05) and kept since through "
    "four changes of settings; "
    "in the ms-swift 3.0 / transformers 4.47 run it came from the frozen tower kept nothing (its "
    "enable_input_require_grads raised NotImplementedError, which ms-swift swallows), and ms-swift's same-day text "
    "figure for the same language model (tuners/lora/train.sh, 17.2 GiB at ~100-token rows) is itself 1.17 x the "
    "plan: no term of the plan or of that code path accounts for the rest. The GPU check's vision step measures the"
    " 7B LoRA peak. Strict: an unexpected pass fails the suite, and this becomes a plain test",
)
def test_the_7b_lora_memory_against_ms_swifts_caption_example(tmp_path):
    from launcher.plan.sizing_constants import CUDA_CONTEXT_GB

    plan = _plan_7b(
        tmp_path,
        440,
        1564,
        "A100-80GB",
        method="lora",
        engine="trl",
        micro_batch_size=1,
        gradient_checkpointing=True,
        lora={"r": 8, "alpha": 32, "target_modules": "all-linear"},
    )
    allocator = sum(plan.memory["breakdown_gb"].values()) - CUDA_CONTEXT_GB
    assert abs(allocator / SWIFT_LORA_GB - 1) <= TOLERANCE, plan.memory["breakdown_gb"]
