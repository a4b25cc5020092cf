"""The export of a vision-language run: the adapter (what LoRA reached), the merged model with its processor files,
the text GGUF plus its projector (launcher/deliver/vision_gguf.py) checked through llama.cpp's mtmd on the held-out
images, the task score of each servable output, and SERVING.md with each server's command
(launcher/deliver/vision_serving.py).

launcher/deliver/export.py export_run hands a run here when its model has a vision tower (config.json
vision_config); the run's final/merged is the one training wrote with its processor files (or is merged here from
final/adapter when it is missing).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from launcher.deliver.messages import ExportError, _say, human_size
from launcher.store.checkpoint import tree_bytes

# Files of a model folder that are its weights or configuration, not its processor: everything else a vision model
# folder holds as .json or .jinja (preprocessor_config.json, processor_config.json, chat_template.jinja, tokenizer
# files) is copied beside merged weights, so that vLLM and llama.cpp's converter read the processor training used.
NOT_PROCESSOR = ("config.json", "generation_config.json", "model.safetensors.index.json", "adapter_config.json")


def is_vision_model(model_dir: str) -> bool:
    from launcher.model_files import local_file

    cfg = local_file(model_dir, "config.json")
    return cfg is not None and isinstance(json.loads(cfg.read_text()).get("vision_config"), dict)


def lora_reach(adapter_dir: Path) -> tuple[bool, str]:
    """(servable by vLLM as LoRA, why): vLLM applies LoRA to the language model only (launcher/plan/vision.py)."""
    from launcher.plan.vision import LANGUAGE_MODEL_ONLY, WITH_TOWER

    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    targets = cfg.get("target_modules") or []
    text = targets if isinstance(targets, str) else " ".join(targets)
    tower = "visual" in text
    return (not tower, WITH_TOWER if tower else LANGUAGE_MODEL_ONLY)


def copy_processor_files(src: Path, dest: Path) -> list[str]:
    copied = []
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and f.suffix in (".json", ".jinja") and f.name not in NOT_PROCESSOR:
            shutil.copyfile(f, dest / f.name)
            copied.append(f.name)
    return copied


def _merge(base: str, adapter: Path, dest: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(str(tmp))
    copy_processor_files(Path(base), tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def export_vision(inp, report: dict[str, Any]) -> None:
    """Every requested output of a vision-language run, each checked; SERVING.md. Fills report (export.json)."""
    from launcher.data import task_metrics
    from launcher.deliver import vision_gguf, vision_serving
    from launcher.deliver.gguf_export import _GgufFailed

    final, recipe, outputs = inp.run.final, inp.recipe, report["outputs"]
    report["vision"] = True
    adapter = inp.source if inp.is_adapter else None
    servable, why = lora_reach(adapter) if adapter else (False, "a full fine-tune has no adapter")
    if adapter:
        size = tree_bytes(adapter / "adapter_model.safetensors")
        outputs["adapter"] = {
            "path": str(adapter),
            "bytes": size,
            "size": human_size(size),
            "lora_reach": why,
            "served_by_vllm_as_lora": servable,
        }
        _say(f"adapter {human_size(size)}: {why}")
    merged = final / "merged" if adapter else inp.source
    needs_merged = "merged" in inp.formats or "gguf" in inp.formats
    if needs_merged and adapter and not (merged / "config.json").is_file():
        _say(f"merging the adapter into {recipe.model} (float32) with its processor files")
        _merge(recipe.model, adapter, merged)
    cfg = json.loads((merged / "config.json").read_text()) if needs_merged else {}
    if needs_merged:
        missing = [n for n in ("preprocessor_config.json",) if not (merged / n).is_file()]
        if missing:
            raise ExportError(
                f"{merged} has no {', '.join(missing)}: a server would not know how to size the images",
                fix=f"copy the processor files of {recipe.model} beside the merged weights, then export again.",
            )
        size = tree_bytes(merged)
        outputs["merged" if adapter else "model"] = {
            "path": str(merged),
            "bytes": size,
            "size": human_size(size),
            "processor_files": sorted(
                f.name for f in merged.iterdir() if f.suffix in (".json", ".jinja") and f.name not in NOT_PROCESSOR
            ),
        }
    max_new = getattr(getattr(recipe, "eval", None), "max_new_tokens", None) or 16
    limit = getattr(getattr(getattr(recipe, "eval", None), "task", None), "examples", None) or 16
    examples = vision_gguf.held_out(recipe, limit)
    report["held_out_image_prompts"] = len(examples)
    max_images = max((len(e["images"]) for e in examples), default=1)
    if "gguf" in inp.formats:
        if not examples:
            raise ExportError(
                "the recipe holds out no examples: the GGUF pair cannot be held to the merged model on images",
                fix="set eval.fraction (e.g. 0.1) so that some images are held out, then export again.",
            )
        ref = vision_gguf.transformers_side(merged, examples, max_new)
        try:
            outputs["gguf"] = vision_gguf.vision_gguf_output(
                merged, final / "gguf", inp.run.root.name, inp.gguf_type, examples, max_new, reference=ref
            )
        except _GgufFailed as exc:
            outputs["gguf"] = exc.output
            raise
        references = [vision_gguf._prompt(e)[2] for e in examples]
        metric, metric_why = task_metrics.choose(references)
        texts = outputs["gguf"].pop("answer_texts")
        report["task_scores"] = {
            "metric": metric,
            "why": metric_why,
            "merged": task_metrics.score(metric, [r["answer"] for r in ref], references)["score"],
            f"gguf-{inp.gguf_type}": task_metrics.score(metric, texts, references)["score"],
            "held_out": len(examples),
        }
        _say(
            f"task score on {len(examples)} held-out images ({metric}): merged "
            f"{report['task_scores']['merged']:.0%}, GGUF pair {report['task_scores'][f'gguf-{inp.gguf_type}']:.0%}"
        )
    gg = outputs.get("gguf") or {}
    from launcher.data.image_tokens import read_rule

    rule = read_rule(merged) if needs_merged else None
    bounds = (
        vision_serving.processor_bounds(rule.min_pixels, rule.max_pixels, rule.patch_size, rule.merge_size)
        if rule
        else None
    )
    cmds = vision_serving.commands(
        merged=str(merged) if needs_merged else None,
        base=recipe.model,
        adapter=str(adapter) if adapter else None,
        lora_servable=servable,
        lora_why=why,
        name=inp.run.root.name,
        max_images=max_images,
        max_len=recipe.max_length,
        text_gguf=gg.get("path"),
        mmproj=gg.get("mmproj"),
        model_type=cfg.get("model_type", ""),
        architecture=(cfg.get("architectures") or [""])[0],
        bounds=bounds,
    )
    if gg.get("parity_through", "").startswith("the text GGUF alone"):
        cmds["notes"].append(f"the GGUF pair was not checked with images: {gg['parity_through']}")
    report["serving_commands"] = cmds
    (final / "SERVING.md").write_text(f"# Serving {inp.run.root.name}\n\n" + vision_serving.serving_text(cmds))
    report["serving"] = str(final / "SERVING.md")
