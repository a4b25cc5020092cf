"""DPO with images on the worker's rails: image preference pairs (the prompt with the square's image, chosen its
colour, rejected another) through `ftrun RECIPE` on the tiny vision-language model, trained by trl 1.16's DPOTrainer
with the processor (dpo_trainer.py DataCollatorForVisionPreference)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import ftrun, metrics
from tests.conftest import recipe_file

REPO = Path(__file__).parents[2]
COLOURS = ("red.", "green.", "blue.", "yellow.")


def _pairs(path: Path, n: int = 64) -> Path:
    """The vision demo's first n examples as pairs: its user turn the prompt, its answer chosen, another colour
    rejected."""
    rows = []
    for k, line in enumerate((REPO / "recipes" / "data" / "tiny-vision.jsonl").read_text().splitlines()[:n]):
        record = json.loads(line)
        user = record["messages"][0]
        for part in user["content"]:
            if part["type"] == "image":
                part["image"] = str(REPO / "recipes" / "data" / part["image"])
        answer = record["messages"][1]["content"]
        wrong = [c for c in COLOURS if c != answer][k % 3]
        rows.append({"prompt": [user], "chosen": answer, "rejected": wrong})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_dpo_on_image_pairs_trains_the_margin_up_and_the_loss_down(tmp_path, tiny_vlm):
    data = _pairs(tmp_path / "pairs.jsonl")
    recipe = recipe_file(
        tmp_path / "r.yaml",
        tiny_vlm,
        tmp_path / "run",
        data=str(data),
        objective="dpo",
        max_length=64,
        max_steps=12,
        micro_batch_size=4,
        learning_rate=5e-3,
        lora={"r": 8, "alpha": 16},
        logging_steps=3,
        eval=None,
        assistant_only_loss=None,
    )
    res = ftrun(recipe, "--foreground", "smoke.enabled=false", cwd=tmp_path, timeout=600)
    said = res.stdout + res.stderr
    assert res.returncode == 0, said[-3000:]
    assert "preference pairs with images, 64 pairs, 64 images" in said
    rows = [r for r in metrics(tmp_path / "run") if "rewards/margins" in r]
    assert len(rows) == 4
    first, last = rows[0], rows[-2:]
    # DPO's loss starts at ln 2 (the policy is its reference); it falls as the chosen colour's reward pulls ahead
    assert sum(r["loss"] for r in last) / 2 < first["loss"] < 0.6932
    assert sum(r["rewards/margins"] for r in last) / 2 > 2 * first["rewards/margins"] > 0
    assert (tmp_path / "run" / "final" / "adapter" / "preprocessor_config.json").is_file()
