"""Training a vision-language model on image data: TRL's SFTTrainer with the model's processor, LoRA on the language
model (the vision tower too where the recipe says lora.vision_tower), and the task score of the held-out examples
before and after, answered greedily with their images in the prompt.

The data, its split and its checks are the plan's (launcher/data/image_stats.py, launcher/data/split.py); the metric
is the task evaluation's own (launcher/data/task_metrics.py). trl 1.16 takes images through `processing_class=` a
ProcessorMixin (sft_trainer.py: `_is_vlm`) and a dataset with an `images` column (`_is_vision_dataset`), collated on
the fly by DataCollatorForVisionLanguageModeling (`remove_unused_columns` must stay off so the images reach it, as
the collator's docstring says). Run: `python -m launcher.worker.vision_train RECIPE.yaml`; it writes the adapter
and the processor files to OUTPUT_DIR/final/adapter, the merged model with them to final/merged, and the
scores to OUTPUT_DIR/final/task_eval.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Callable

from launcher.data import split, task_metrics
from launcher.data.image_stats import image_stats
from launcher.methods import is_adapter

# The language model's linear layers, by their module path in transformers 5.24's Qwen2-VL family
# (Qwen2_5_VLForConditionalGeneration: model.language_model.layers.N.self_attn.q_proj, ...; the tower is model.visual);
# PEFT matches a string target_modules as a full regular expression (peft tuners_utils.py check_target_module_exists).
LANGUAGE_MODEL = r"language_model"
VISION_TOWER = r"visual"


def lora_targets(model: Any, recipe: Any) -> str:
    """A regular expression over module names: the recipe's target modules, in the language model only unless the
    recipe adapts the vision tower too (then its blocks' linear layers as well)."""
    import torch

    wanted = recipe.lora.target_modules
    parts = [LANGUAGE_MODEL] + ([VISION_TOWER] if recipe.lora.vision_tower else [])
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or not re.search(rf"(^|\.)({'|'.join(parts)})\.", name):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if wanted == "all-linear" or leaf in wanted or leaf in ("qkv", "proj") and recipe.lora.vision_tower:
            names.append(re.escape(name))
    if not names:
        raise ValueError(f"no linear layer of the model matches lora.target_modules {wanted}")
    return "^(" + "|".join(names) + ")$"


def load(recipe: Any, say: Callable[[str], None] = print):
    """The model (float32 on the CPU) with LoRA where the recipe asks, and its processor."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from launcher.worker.processor import load_processor

    processor = load_processor(recipe.model, say=say)
    model = AutoModelForImageTextToText.from_pretrained(recipe.model, dtype=torch.float32)
    if is_adapter(recipe.method):
        lora = recipe.lora
        config = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora_targets(model, recipe),
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, config)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        tower = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and ".visual." in n)
        say(f"LoRA: {trainable:,} trainable parameters, {tower:,} of them in the vision tower")
    return model, processor


def _prompt_and_reference(example: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """The turns before the last assistant turn, and that turn's text (the task evaluation's rule)."""
    msgs = example["messages"]
    last = msgs[-1]
    text = last["content"] if isinstance(last["content"], str) else "".join(p.get("text", "") for p in last["content"])
    return msgs[:-1], text


def answers(model: Any, processor: Any, examples: list[dict[str, Any]], max_new_tokens: int) -> list[str]:
    """Greedy answers to each example's prompt, its images in it, as the chat template renders a generation prompt."""
    import torch
    from trl.data_utils import prepare_multimodal_messages

    out = []
    model.eval()
    eos = model.generation_config.eos_token_id
    for ex in examples:
        prompt, _ = _prompt_and_reference(ex)
        n = sum(1 for m in prompt for p in m["content"] if isinstance(p, dict) and p.get("type") == "image")
        msgs = prepare_multimodal_messages(prompt, images=ex["images"][:n])
        inputs = processor.apply_chat_template(
            [msgs], tokenize=True, return_dict=True, return_tensors="pt", add_generation_prompt=True
        )
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos)
        out.append(processor.tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip())
    return out


def score(model: Any, processor: Any, examples: list[dict[str, Any]], max_new_tokens: int) -> dict[str, Any]:
    """The task score of `examples`: the metric chosen from the references, as the task evaluation chooses it."""
    references = [_prompt_and_reference(e)[1] for e in examples]
    metric, why = task_metrics.choose(references)
    got = answers(model, processor, examples, max_new_tokens)
    return {"metric": metric, "why": why, **task_metrics.score(metric, got, references), "answers": got}


def train(recipe: Any, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Train the recipe's image data; the before/after task scores and the loss rows, also in OUTPUT_DIR/final/."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    from datasets import Dataset
    from transformers import set_seed
    from trl import SFTConfig, SFTTrainer

    examples, _, stats = image_stats(recipe)
    say(f"data: {stats.description}")
    parts = split.for_recipe(examples, recipe)
    train_rows = [examples[i] for i in parts.train]
    held = [examples[i] for i in parts.held_out][: recipe.eval.task.examples or None]
    set_seed(recipe.seed)
    model, processor = load(recipe, say)
    max_new = recipe.eval.max_new_tokens or 16
    before = score(model, processor, held, max_new) if held else None
    if before:
        say(f"task score before: {before['score']:.0%} {before['metric']} on {len(held)} held-out examples")
    out = Path(recipe.output_dir)
    args = SFTConfig(
        output_dir=str(out / "checkpoints"),
        max_length=recipe.max_length,
        per_device_train_batch_size=recipe.micro_batch_size,
        gradient_accumulation_steps=recipe.gradient_accumulation_steps,
        learning_rate=recipe.learning_rate,
        num_train_epochs=recipe.epochs,
        max_steps=recipe.max_steps or -1,
        logging_steps=recipe.logging_steps,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,  # the loss rows are said at the end, and kept in final/task_eval.json
        use_cpu=True,
        seed=recipe.seed,
        gradient_checkpointing=False,  # a model this small gains nothing from it on a CPU
        assistant_only_loss=bool(recipe.assistant_only_loss),
        padding_free=False,  # image data trains in padded rows (launcher/data/image_stats.py MROPE_WHY)
        remove_unused_columns=False,  # the images reach the collator (trl DataCollatorForVisionLanguageModeling)
        dataset_kwargs={"skip_prepare_dataset": True},
    )
    rows = Dataset.from_list([{"messages": e["messages"], "images": e["images"]} for e in train_rows])
    trainer = SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=processor)
    started = time.monotonic()
    trainer.train()
    seconds = time.monotonic() - started
    losses = [r for r in trainer.state.log_history if "loss" in r]
    say(
        f"trained {trainer.state.global_step} steps in {seconds:.0f} s: "
        f"loss {losses[0]['loss']:.3f} -> {losses[-1]['loss']:.3f}"
    )
    after = score(model, processor, held, max_new) if held else None
    if after:
        say(f"task score after: {after['score']:.0%} {after['metric']} (before {before['score']:.0%})")
    final = out / "final"
    model.save_pretrained(final / "adapter")
    _save_processor_files(recipe.model, final / "adapter")  # as the model folder has them (no torchvision needed)
    if is_adapter(recipe.method):
        # the merged model with its processor files: what a server loads where the adapter reaches the vision tower
        # (vLLM serves LoRA on the language model only), and what llama.cpp's converter would read
        model.merge_and_unload().save_pretrained(final / "merged")
        _save_processor_files(recipe.model, final / "merged")
    result = {
        "steps": trainer.state.global_step,
        "train_seconds": round(seconds, 1),
        "losses": [{"step": r["step"], "loss": r["loss"]} for r in losses],
        "before": before,
        "after": after,
        "held_out": len(held),
    }
    (final / "task_eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


# The processor's files as the model folder has them: what a server loads beside the adapter or merged weights.
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "video_preprocessor_config.json",
)


def _save_processor_files(model_dir: str, dest: Path) -> None:
    import shutil

    dest.mkdir(parents=True, exist_ok=True)
    for name in PROCESSOR_FILES:
        if (Path(model_dir) / name).is_file():
            shutil.copyfile(Path(model_dir) / name, dest / name)


def main(argv: list[str] | None = None) -> int:
    from launcher.recipe_loading import load_recipe

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe")
    a = p.parse_args(argv)
    train(load_recipe(a.recipe))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
