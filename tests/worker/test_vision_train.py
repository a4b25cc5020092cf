"""Training on image data (launcher/worker/vision_train.py): LoRA's reach in the model, and the tiny vision model
learning the square's colour on a CPU, its task score measured before and after with the images in the prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.recipe_loading import load_recipe
from tests.conftest import recipe_file

VISION_DATA = Path(__file__).parents[2] / "recipes" / "data" / "tiny-vision.jsonl"


def _recipe(tmp_path: Path, tiny_vlm: Path, **fields):
    base = {"data": str(VISION_DATA), "max_length": 64, "eval": {"fraction": 0.2, "max_new_tokens": 4}}
    return load_recipe(recipe_file(tmp_path / "r.yaml", tiny_vlm, tmp_path / "run", **{**base, **fields}))


@pytest.mark.parametrize("tower", [False, True])
def test_lora_adapts_the_language_model_only_unless_the_recipe_names_the_tower(tmp_path, tiny_vlm, tower):
    from launcher.worker.vision_train import load

    recipe = _recipe(tmp_path, tiny_vlm, lora={"r": 4, "vision_tower": tower})
    said = []
    model, _ = load(recipe, say=said.append)
    adapted = [n for n, p in model.named_parameters() if p.requires_grad]
    assert adapted and all("lora_" in n for n in adapted)
    in_tower = [n for n in adapted if ".visual." in n]
    in_language = [n for n in adapted if ".language_model." in n]
    assert in_language
    assert bool(in_tower) == tower
    assert any(
        f"{sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and '.visual.' in n):,} of "
        "them in the vision tower" in line
        for line in said
    )


@pytest.mark.slow
def test_the_tiny_vision_model_learns_the_colour_and_its_task_score_rises(tmp_path, tiny_vlm):
    from launcher.worker.vision_train import train

    recipe = _recipe(
        tmp_path,
        tiny_vlm,
        epochs=2,
        max_steps=None,
        learning_rate=1e-2,
        lora={"r": 8, "alpha": 16},
        logging_steps=4,
        micro_batch_size=8,
    )
    result = train(recipe, say=lambda _: None)
    saved = json.loads((tmp_path / "run" / "final" / "task_eval.json").read_text())
    assert saved["after"]["score"] == result["after"]["score"]
    assert result["held_out"] == 32 and result["before"]["metric"] == "exact"
    # the random model names no colour; trained, it reads the square (measured 0% -> 94% at 4 epochs; 2 here)
    assert result["after"]["score"] >= result["before"]["score"] + 0.3
    assert result["losses"][-1]["loss"] < result["losses"][0]["loss"] / 2
    adapter = tmp_path / "run" / "final" / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "preprocessor_config.json").is_file()
    assert (adapter / "chat_template.jinja").is_file()
    # the merged model with its processor files answers the held-out images as the trained adapter did
    from transformers import AutoModelForImageTextToText

    from launcher.data import split
    from launcher.data.image_stats import image_stats
    from launcher.worker.processor import load_processor
    from launcher.worker.vision_train import answers

    merged = tmp_path / "run" / "final" / "merged"
    assert (merged / "preprocessor_config.json").is_file() and not list(merged.glob("adapter_*"))
    model = AutoModelForImageTextToText.from_pretrained(merged)
    examples, _, _ = image_stats(recipe)
    held = [examples[i] for i in split.for_recipe(examples, recipe).held_out]
    assert answers(model, load_processor(merged, say=lambda _: None), held, 4) == result["after"]["answers"]
