#!/usr/bin/env python3
"""Build a tiny random-init Qwen2.5-VL-shaped vision-language model with its processor (image processor, tokenizer,
chat template with the image placeholders) locally, so the vision tests and recipe need no model hub.

The language model is the tiny text model's shape (scripts/make_tiny_model.py); the vision tower is Qwen2.5-VL's
(patch 14, spatial merge 2, windowed attention with full-attention blocks), two blocks of width 32. The image
processor is transformers' PIL one (no torchvision on this machine): an image is resized to multiples of
patch x merge = 28 pixels within [min_pixels, max_pixels], and each 28 x 28 square becomes one <|image_pad|> token.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

# Only the standard library at module level: tests import this file, and torch/transformers cost seconds.

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO_ROOT / "recipes" / "data" / "tiny-vision.jsonl"
MARKER = "ftrun_tiny.json"
BUILD_VERSION = 1

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
SPECIALS = [ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

# Qwen2-VL's published template, reduced to what the tiny model needs (text and image parts, string content too),
# with {% generation %} markers around the assistant reply for TRL's assistant_only_loss, as in make_tiny_model.py.
# An image part renders as Qwen's <|vision_start|><|image_pad|><|vision_end|>; the processor repeats <|image_pad|>
# once per merged patch (processing_qwen2_5_vl.py replace_image_token).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}{%- generation %}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endgeneration %}"
    "{%- else %}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or 'image' in part %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The image processor's bounds: small images keep a CPU step short (56 x 56 is 4 image tokens, 112 x 112 is 16).
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _training_texts(data: Path) -> list[str]:
    """Every message's text rendered as ChatML (image parts left out): what the tokenizer learns its merges from."""
    texts = []
    with Path(data).open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            for m in json.loads(line)["messages"]:
                content = m["content"]
                if not isinstance(content, str):
                    content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
                texts.append(f"{IM_START}{m['role']}\n{content}{IM_END}\n")
    return texts


def _build_tokenizer(data: Path, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_texts(data), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        extra_special_tokens=SPECIALS[1:],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_vlm(
    out_dir,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vision_hidden: int = 32,
    vision_layers: int = 2,
    vocab: int = 512,
    data=DEFAULT_DATA,
    seed: int = 0,
) -> Path:
    """Build (or reuse) a tiny Qwen2.5-VL model + processor in out_dir; the same arguments reuse the build."""
    out = Path(out_dir)
    data = Path(data)
    head_dim = hidden // heads
    if hidden % heads or heads % kv_heads or head_dim % 4:
        raise ValueError(f"hidden ({hidden}) / heads ({heads}) must be a multiple of 4, heads divide by kv_heads")
    spec = {
        "build_version": BUILD_VERSION,
        "hidden": hidden,
        "layers": layers,
        "heads": heads,
        "kv_heads": kv_heads,
        "intermediate": intermediate,
        "vision_hidden": vision_hidden,
        "vision_layers": vision_layers,
        "vocab": vocab,
        "data_sha256": _file_sha256(data),
        "seed": seed,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        import fcntl

        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others find it built
        marker = out / MARKER
        if marker.is_file() and (out / "model.safetensors").is_file():
            try:
                if json.loads(marker.read_text())["spec"] == spec:
                    return out
            except (ValueError, KeyError):
                pass
        if marker.exists():
            marker.unlink()
        _build(out, data, spec)
        marker.write_text(json.dumps({"spec": spec, "data": str(data)}, indent=2, sort_keys=True) + "\n")
    return out


def _build(out: Path, data: Path, spec: dict) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = _build_tokenizer(data, spec["vocab"])
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    hidden, heads = spec["hidden"], spec["heads"]
    half = hidden // heads // 2  # M-RoPE splits each head's rotary half into (time, height, width) sections
    mrope = [half - 2 * (half // 3), half // 3, half // 3]
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden,
            "intermediate_size": spec["intermediate"],
            "num_hidden_layers": spec["layers"],
            "num_attention_heads": heads,
            "num_key_value_heads": spec["kv_heads"],
            "max_position_embeddings": 4096,
            # fan-in scale, as make_tiny_model.py says why: LoRA on a random model must be able to move the loss
            "initializer_range": hidden**-0.5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": mrope},
            "tie_word_embeddings": True,
            "bos_token_id": None,
            "eos_token_id": ids[ENDOFTEXT],
            "pad_token_id": ids[ENDOFTEXT],
        },
        vision_config={
            "depth": spec["vision_layers"],
            "hidden_size": spec["vision_hidden"],
            "intermediate_size": 2 * spec["vision_hidden"],
            "num_heads": 2,
            "out_hidden_size": hidden,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [spec["vision_layers"] - 1],
        },
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[ids[IM_END], ids[ENDOFTEXT]], pad_token_id=ids[ENDOFTEXT], bos_token_id=None
    )
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    # The processor's files as a published Qwen2.5-VL has them, written part by part: Qwen2_5_VLProcessor itself
    # cannot be built without torchvision (its video processor; launcher/worker/processor.py says why).
    image_processor.save_pretrained(out)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    (out / "processor_config.json").write_text(
        json.dumps({"processor_class": Qwen2_5_VLProcessor.__name__}, indent=2) + "\n", encoding="utf-8"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = build_tiny_vlm(a.out_dir, data=a.data, seed=a.seed)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_tiny_model import count_params

    print(f"tiny vision-language model ({count_params(out):,} parameters) in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
