"""The statistics of image data that the plan and the run use, and its refusals at plan time: image data for a model
without a vision tower or under an objective that takes none, an image whose tokens alone fill max_length, and the
batch layouts the model's position ids do not allow.

An example's tokens are its text as the model's chat template renders it (each image part one placeholder token, as
Qwen's templates write <|vision_start|><|image_pad|><|vision_end|>) with each placeholder widened to the image's
own token count (launcher/data/image_tokens.py): what the processor hands the model (tests/data/test_image_data.py
compares the two on the tiny model).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from launcher import methods
from launcher.data import images as image_data
from launcher.data import loss_view
from launcher.data import formats
from launcher.data import split
from launcher.data.dataset import compute_stats, token_counter
from launcher.data.image_tokens import ImageRule, read_rule
from launcher.data.tokenizer import tokenizer_dir
from launcher.errors import DataError, RecipeError

# Why packing and padding-free rows are refused: M-RoPE gives image tokens (time, height, width) positions, computed
# per row from the image grids (modeling_qwen2_5_vl.py get_rope_index), which transformers does not restart inside a
# packed row; trl 1.16 refuses both for vision data (sft_trainer.py: "Packing is not supported for vision datasets").
MROPE_WHY = (
    "the model's M-RoPE position ids (time, height, width for each image token) are computed per row from its "
    "image grids and do not restart inside a packed row; TRL's SFTTrainer refuses both for image data"
)


def vision_config(model: str) -> Optional[dict[str, Any]]:
    """The model's vision_config (config.json), or None for a model without a vision tower or not on this machine."""
    folder, _ = tokenizer_dir(model)
    path = (folder or Path(model)) / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    vision = cfg.get("vision_config")
    return vision if isinstance(vision, dict) else None


def check_recipe(recipe: Any) -> None:
    """The recipe's settings that image data cannot train with, refused before anything is read."""
    objective = methods.OBJECTIVES[recipe.objective]
    if not objective.images:
        takes = ", ".join(o.name for o in methods.OBJECTIVES.values() if o.images)
        raise DataError(
            f"the data holds images (first at {image_data.first_image_record(recipe.data)}), but objective "
            f"{recipe.objective} takes none in ftrun yet",
            fix=f"use objective {takes} for image data, or remove the images from the data.",
        )
    if recipe.packing:
        raise RecipeError(
            f"packing: true with image data: {MROPE_WHY}",
            fix="remove packing: true (each example trains in its own padded row).",
        )
    # refused where the recipe asks for it; left to its default (on for sft), with_data_defaults turns it off
    if recipe.padding_free and "padding_free" in recipe.model_fields_set:
        raise RecipeError(
            f"padding_free: true with image data: {MROPE_WHY}",
            fix="remove padding_free (image data trains in padded rows).",
        )


def image_stats(recipe: Any):
    """(examples, lengths, DataStats) of image data, as stats.data_stats returns them for text."""
    folder, why = tokenizer_dir(recipe.model)  # None without transformers too: the model's own folder is read then
    folder = folder or (Path(recipe.model) if Path(recipe.model).is_dir() else None)
    if vision_config(recipe.model) is None:
        if folder is None:
            raise DataError(
                f"the data holds images, and the model {recipe.model} is not on this machine ({why}): its vision "
                "tower and image processor cannot be read to count the image tokens",
                fix="download the model first (hf download MODEL), or point model at its folder.",
            )
        image_data.refuse_text_model(recipe.model, recipe.data)
    check_recipe(recipe)
    rule = read_rule(folder)
    if rule is None:
        raise DataError(
            f"the model {recipe.model} has a vision tower but no preprocessor_config.json in {folder}: the image "
            "processor that sizes each image is missing",
            fix="copy the model's processor files (preprocessor_config.json, chat_template) beside its weights.",
        )
    data = image_data.load_images(recipe.data)
    _fits_objective(recipe, data)
    _refuse_oversized(data, rule, recipe.max_length)
    counter, _ = token_counter(recipe.model)
    per_image = [[rule.tokens(w, h) for w, h in sizes] for sizes in data.sizes]
    # each image part renders as one placeholder, widened to the image's tokens; a preference pair trains as two
    # sequences (the prompt, with its images, before each answer: formats.sides), its tokens both sequences'
    if counter is not None:
        lengths = [
            sum(counter(seq) - len(n) + sum(n) for seq in formats.sequences(ex))
            for ex, n in zip(data.examples, per_image)
        ]
        source = "tokenizer"
    else:  # a light install (no transformers): the text estimated as the text data's is (4 characters a token)
        lengths = [
            sum(_characters(seq) + sum(n) for seq in formats.sequences(ex)) for ex, n in zip(data.examples, per_image)
        ]
        source = "characters"
    parts = split.for_recipe(data.examples, recipe)
    train = parts.train
    # "tokenizer": counted with the model's own tokenizer and template (the DataStats.tokens_source values)
    stats = compute_stats([data.examples[i] for i in train], [lengths[i] for i in train], source, recipe.max_length)
    longest = max(train, key=lambda i: lengths[i])
    # a pair's prompt, with its images, runs once per answer (trl 1.16 DataCollatorForVisionPreference: `images * 2`)
    runs = [len(formats.sequences(ex)) for ex in data.examples]
    image_tokens = [sum(per_image[i]) * runs[i] for i in train]
    facts = {
        "images": sum(len(per_image[i]) for i in train),
        "image_tokens": sum(image_tokens),
        "most_image_tokens": max(image_tokens),
        "longest_example": {
            "where": data.where[longest],
            "tokens": lengths[longest],
            "image_tokens": sum(per_image[longest]) * runs[longest],
        },
        "rule": rule.describe(),
        "patches_longest": sum(rule.patches(w, h) for w, h in data.sizes[longest]) * runs[longest],
        # held-out examples too: the evaluation's micro-batches run on every rank as well (plan/vision.py)
        "without_images": sum(not sizes for sizes in data.sizes),
        "first_without_image": next((data.where[i] for i, sizes in enumerate(data.sizes) if not sizes), None),
    }
    # the loss view shows conversations (a preference pair's loss is on its answers, as for text pairs)
    seen = (
        None
        if data.pairs
        else loss_view.check(
            recipe.model,
            loss_view.Settings.of(recipe),
            [data.examples[i] for i in train],
            [data.where[i] for i in train],
        )
    )
    if seen:
        seen.pop("trained_each", None)
        seen = _with_image_markers(seen, folder, {data.where[i]: per_image[i] for i in train})
        widened = [lengths[i] for i in train]  # the lengths with each image's tokens (the view's own count one each)
        seen["stats"].update({f"p{q}": loss_view.percentile(widened, q) for q in (50, 90, 99)}, max=max(widened))
    stats = replace(
        stats,
        loss_view=seen,
        description=data.describe(),
        sources=tuple(data.sources),
        sha256=data.sha256,
        held_out=len(parts.held_out),
        held_out_lines=len(data.examples) - len(train),
        images=facts,
    )
    return data.examples, lengths, stats


def _characters(example: dict[str, Any]) -> int:
    """The text of an example (or one side of a pair) in tokens, estimated as launcher/data/dataset.py does without a
    tokenizer."""
    turns = example["messages"] if "messages" in example else example["prompt"] + example["completion"]
    text = sum(len(image_data.text_of(m["content"])) for m in turns)
    return text // 4 + 4 * len(turns)


def _fits_objective(recipe: Any, data: image_data.ImageData) -> None:
    """Conversations train under sft, preference pairs under dpo (the objectives that take images): the other way
    round is refused with the first record; so is DPO's precomputed reference, which trl 1.16 refuses for image data
    (dpo_trainer.py: "precompute_ref_log_probs=True is not supported for vision datasets")."""
    objective = methods.OBJECTIVES[recipe.objective]
    wants_pairs = "preference" in objective.forms
    if data.pairs != wants_pairs:
        what = "preference pairs (prompt, chosen, rejected)" if data.pairs else "conversations"
        takes = [o.name for o in methods.OBJECTIVES.values() if o.images and ("preference" in o.forms) == data.pairs]
        raise DataError(
            f"the image data holds {what} (first at {data.where[0]}), and objective {recipe.objective} trains "
            f"{'preference pairs' if wants_pairs else 'examples, not pairs'}",
            fix=f"use objective {', '.join(takes)} for this data, or give the data the objective's form "
            "(docs/data.md, Images).",
        )
    if data.pairs and getattr(recipe.preference, "reference", None) == "precomputed":
        raise RecipeError(
            "preference.reference: precomputed with image data: trl 1.16's DPOTrainer runs no reference pass over "
            "image data ahead (dpo_trainer.py refuses precompute_ref_log_probs for vision datasets)",
            fix="remove preference.reference: precomputed (the reference runs beside each step).",
        )


def _refuse_oversized(data: image_data.ImageData, rule: ImageRule, max_length: int) -> None:
    """An image whose tokens alone reach max_length leaves no room for the text (and TRL's truncation would cut
    through its placeholders, which the model refuses): every such image, with its line and path."""
    over = []
    for where, example, sizes in zip(data.where, data.examples, data.sizes):
        for path, (w, h) in zip(example["images"], sizes):
            n = rule.tokens(w, h)
            if n >= max_length:
                over.append((where, path, w, h, n))
    if not over:
        return
    shown = "; ".join(f"{w}: {p} ({iw} x {ih} pixels, {n:,} image tokens)" for w, p, iw, ih, n in over[:4])
    more = f" and {len(over) - 4} more" if len(over) > 4 else ""
    most = max(n for *_, n in over)
    raise DataError(
        f"{len(over)} image{'s' if len(over) > 1 else ''} alone reach max_length {max_length:,}: {shown}{more} "
        f"(the processor's rule: {rule.describe()})",
        fix=f"raise max_length above {most:,} plus the text, or shrink those images (at most {rule.max_pixels:,} "
        "pixels become the most tokens; a smaller image becomes fewer).",
    )


def _with_image_markers(seen: dict[str, Any], folder: Path, per_image: dict[str, list[int]]) -> dict[str, Any]:
    """The loss view of image data as the processor widens it: the chat template writes each image as one
    placeholder token (Qwen's <|image_pad|>, config.json image_token_id) and the processor repeats it once per image
    token (processing_qwen2_5_vl.py replace_image_token); the shown example gets one marker per image with its
    token count, and the statistics count the widened rows (the image tokens train where the whole conversation
    does: trl 1.16's vision collator masks only padding and, with assistant_only_loss, the other turns)."""
    from launcher.data.tokenizer import read_tokenizer

    cfg = json.loads((folder / "config.json").read_text())
    token_id = cfg.get("image_token_id")
    read = read_tokenizer(folder) if token_id is not None else None
    token = read.tokenizer.id_to_token(int(token_id)) if read is not None else None
    if not token:
        return seen
    for shown in seen["examples"]:
        counts = iter(per_image.get(shown["where"], []))
        segments = []
        for text, trained in shown["segments"]:
            parts = text.split(token)
            widened = parts[0]
            for rest in parts[1:]:
                n = next(counts, None)
                widened += (f"[image: {n:,} tokens]" if n is not None else token) + rest
                if n is not None:
                    shown["tokens"] += n - 1
                    shown["trained"] += (n - 1) if trained else 0
            segments.append([widened, trained])
        shown["segments"] = segments
    extra = sum(n - 1 for counts in per_image.values() for n in counts)
    stats = seen["stats"]
    stats["tokens"] += extra
    if not seen.get("assistant_only_loss"):
        stats["trained_tokens"] += extra
    stats["trained_share"] = round(stats["trained_tokens"] / stats["tokens"], 4) if stats["tokens"] else 0.0
    stats["image_tokens"] = extra + sum(len(c) for c in per_image.values())
    return seen
