"""How a fine-tuned vision-language model is served: the image tokens each server inserts, the commands (vLLM,
llama.cpp's llama-server and llama-mtmd-cli, Ollama), and which of them this architecture has, said per architecture.

Only the standard library at module level: `ftrun plan` and the default-tier tests read it.

Image tokens: the converter writes no pixel bounds (llama-cpp-python 0.3.36 conversion/base.py
MmprojModel.set_gguf_parameters); mtmd sets its own (tools/mtmd/clip.cpp `set_limit_image_tokens(8, 4096)`) with the
processor's resize arithmetic (mtmd-image.cpp calc_size_preserved_ratio): docs/evaluation.md, "The parity through
llama.cpp's multimodal path".
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

# llama.cpp's own image-token bounds per config.json model_type, from the pinned clip.cpp
LLAMACPP_IMAGE_TOKENS = {"qwen2_vl": (8, 4096), "qwen2_5_vl": (8, 4096), "qwen3_vl": (8, 4096)}

# Ollama, per architecture (config.json architectures[0]): `ollama create` converts these safetensors folders into its
# own GGUF with the tower inside (ollama/ollama convert/convert.go LoadModelMetadata); its engine does not load the
# llama.cpp pair for them (ollama PR #10162, issue #14730). An architecture not listed: not said to be served by Ollama.
OLLAMA = {
    "Qwen2_5_VLForConditionalGeneration": (
        "ollama create from the merged folder (Ollama converts Qwen2_5_VLForConditionalGeneration itself, "
        "ollama/ollama convert/convert.go, into its own qwen25vl format with the vision tower inside); not the "
        "llama.cpp GGUF + mmproj pair, which its engine does not load for this architecture (ollama issue #14730)"
    ),
    "Qwen3VLForConditionalGeneration": (
        "ollama create from the merged folder (convert/convert.go converts Qwen3VLForConditionalGeneration)"
    ),
    "Gemma3ForConditionalGeneration": (
        "ollama create from the merged folder (convert/convert.go converts Gemma3ForConditionalGeneration)"
    ),
    "MllamaForConditionalGeneration": (
        "ollama create from the merged folder (convert/convert.go converts MllamaForConditionalGeneration)"
    ),
}
OLLAMA_NOT = (
    "{arch} is not in the architectures `ollama create` converts (ollama/ollama convert/convert.go "
    "LoadModelMetadata); serve with vLLM or llama-server"
)


@dataclass(frozen=True)
class ImageBounds:
    """How many tokens an image may become in a server: the processor's bounds, in tokens of one merged patch."""

    min_tokens: int
    max_tokens: int
    exact: bool  # the processor's min/max pixels are whole multiples of one token's area: the counts agree exactly


def processor_bounds(min_pixels: int, max_pixels: int, patch: int, merge: int) -> ImageBounds:
    """The processor's pixel bounds as llama.cpp's token bounds (clip-model.h set_limit_image_tokens)."""
    area = (patch * merge) ** 2
    lo, hi = math.ceil(min_pixels / area), max(1, math.floor(max_pixels / area))
    return ImageBounds(lo, hi, min_pixels % area == 0 and max_pixels % area == 0)


def bounds_of(model_dir: Path) -> Optional[ImageBounds]:
    """The processor's bounds of a model folder (its preprocessor_config.json), None where it has none."""
    from launcher.data.image_tokens import read_rule

    rule = read_rule(model_dir)
    return rule and processor_bounds(rule.min_pixels, rule.max_pixels, rule.patch_size, rule.merge_size)


def llamacpp_flags(model_type: str, bounds: ImageBounds) -> list[str]:
    """The llama.cpp flags that size images as the processor does; none where its own bounds agree."""
    own = LLAMACPP_IMAGE_TOKENS.get(model_type)
    if own == (bounds.min_tokens, bounds.max_tokens):
        return []
    return ["--image-min-tokens", str(bounds.min_tokens), "--image-max-tokens", str(bounds.max_tokens)]


def limit_mm(images: int) -> str:
    """vLLM's --limit-mm-per-prompt value as vllm/config/multimodal.py takes it; video 0."""
    return json.dumps({"image": max(1, images), "video": 0}, separators=(",", ":"))


def lora_reach(adapter_dir: Path) -> dict[str, Any]:
    """What the adapter adapts (adapter_config.json), and whether vLLM serves it as LoRA."""
    from launcher.plan.vision import LANGUAGE_MODEL_ONLY, WITH_TOWER

    targets = json.loads((Path(adapter_dir) / "adapter_config.json").read_text()).get("target_modules") or []
    tower = "visual" in (targets if isinstance(targets, str) else " ".join(targets))
    return {"lora_reach": WITH_TOWER if tower else LANGUAGE_MODEL_ONLY, "served_by_vllm_as_lora": not tower}


def commands(
    *,
    merged: Optional[str],
    base: str,
    adapter: Optional[str],
    lora_servable: bool,
    lora_why: str,
    name: str,
    max_images: int,
    max_len: int,
    text_gguf: Optional[str],
    mmproj: Optional[str],
    model_type: str,
    architecture: str,
    bounds: Optional[ImageBounds],
) -> dict[str, Any]:
    """Every serving command of a vision-language export, and per server why it is offered or not."""
    q = shlex.quote
    limit = limit_mm(max_images)
    out: dict[str, Any] = {"limit_mm_per_prompt": json.loads(limit), "notes": []}
    if merged:
        out["vllm"] = (
            f"vllm serve {q(merged)} --served-model-name {q(name)} --max-model-len {max_len} "
            f"--limit-mm-per-prompt {q(limit)}"
        )
    if adapter and lora_servable:
        out["vllm_lora"] = (
            f"vllm serve {q(base)} --enable-lora --lora-modules {q(f'{name}={adapter}')} "
            f"--max-model-len {max_len} --limit-mm-per-prompt {q(limit)}"
        )
    elif adapter:
        out["notes"].append(f"no vLLM LoRA command: {lora_why}")
    if text_gguf and mmproj:
        flags = " ".join(llamacpp_flags(model_type, bounds)) if bounds else ""
        tail = f" {flags}" if flags else ""
        out["llama_server"] = f"llama-server -m {q(text_gguf)} --mmproj {q(mmproj)} --jinja -c {max_len}{tail}"
        out["llama_mtmd_cli"] = (
            f"llama-mtmd-cli -m {q(text_gguf)} --mmproj {q(mmproj)} --image IMAGE.png -p 'PROMPT' --temp 0{tail}"
        )
        if flags:
            out["notes"].append(
                f"llama.cpp sizes {model_type} images between {LLAMACPP_IMAGE_TOKENS.get(model_type)} tokens by "
                f"default (clip.cpp); {flags} give it the processor's bounds, so it inserts the tokens training saw"
                + ("" if bounds is None or bounds.exact else " (the processor's pixel bounds are not whole tokens)")
            )
    out["ollama"] = OLLAMA.get(architecture) or OLLAMA_NOT.format(arch=architecture)
    return out


def serving_md(run, recipe, report: dict[str, Any]) -> str:
    """SERVING.md of a vision-language export, from what export.json holds (report["serving_commands"])."""
    from launcher.data.images import load_images
    from launcher.model_files import local_file

    max_images = max((len(e["images"]) for e in load_images(recipe.data).examples), default=1)
    outputs = report["outputs"]
    merged = (outputs.get("merged") or outputs.get("model") or {}).get("path")
    adapter = outputs.get("adapter") or {}
    config = local_file(merged or recipe.model, "config.json")  # an adapter's: its base model's
    cfg = json.loads(config.read_text()) if config else {}
    gg = outputs.get("gguf") or {}
    cmds = commands(
        merged=merged,
        base=recipe.model,
        adapter=adapter.get("path"),
        lora_servable=adapter.get("served_by_vllm_as_lora", False),
        lora_why=adapter.get("lora_reach", "a full fine-tune has no adapter"),
        name=run.root.name,
        max_images=max_images,
        max_len=recipe.max_length,
        text_gguf=gg.get("path"),
        mmproj=gg.get("mmproj"),
        model_type=cfg.get("model_type", ""),
        architecture=(cfg.get("architectures") or [""])[0],
        bounds=bounds_of(Path(merged)) if merged else None,
    )
    if not merged:
        cmds["notes"].append(f"no merged folder in this export: `ftrun export {run.root} --merged` writes it")
    if gg.get("parity_through", "").startswith("the text GGUF alone"):
        cmds["notes"].append(f"the GGUF pair was not checked with images: {gg['parity_through']}")
    report["serving_commands"] = cmds
    return f"# Serving {run.root.name}\n\n" + serving_text(cmds)


def serving_text(cmds: dict[str, Any]) -> str:
    """SERVING.md's section for a vision-language export."""
    lines = ["## Vision-language model", ""]
    for key, title in (
        ("vllm", "vLLM (the merged model, its processor files beside it)"),
        ("vllm_lora", "vLLM with the adapter as LoRA (it adapts the language model only)"),
        ("llama_server", "llama-server (the text GGUF and its projector)"),
        ("llama_mtmd_cli", "llama-mtmd-cli (one image, one prompt)"),
    ):
        if key in cmds:
            lines += [f"{title}:", "", "```", cmds[key], "```", ""]
    lines.append(f"Ollama: {cmds['ollama']}")
    lines += [f"- {n}" for n in cmds["notes"]]
    return "\n".join(lines) + "\n"
