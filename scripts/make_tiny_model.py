#!/usr/bin/env python3
"""Build a tiny random-init Qwen3-shaped model and ChatML tokenizer locally, so tests and the demo need no model hub."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

# Only the standard library at module level: tests import this file, and torch/transformers cost seconds.

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO_ROOT / "recipes" / "data" / "tiny-chat.jsonl"
MARKER = "ftrun_tiny.json"
# Bump when the build itself changes, so directories built by an older script are rebuilt.
BUILD_VERSION = 1

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

# ChatML as Qwen renders it, plus {% generation %} markers around the assistant reply so TRL's
# assistant_only_loss (return_assistant_tokens_mask) works without TRL patching the template.
# <|im_end|> sits inside the markers so the model is trained to stop (TRL checks for exactly that).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endgeneration %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _training_texts(data: Path) -> list[str]:
    """The text the tokenizer learns its merges from: every message rendered as ChatML."""
    texts = []
    with Path(data).open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            for m in json.loads(line)["messages"]:
                texts.append(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n")
    return texts


def _build_tokenizer(data: Path, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [ENDOFTEXT, IM_START, IM_END]
    tok = Tokenizer(models.BPE())
    # Byte-level like Qwen/GPT-2: any input string round-trips, no unknown token needed.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_texts(data), trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START, IM_END],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    out_dir,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = 1024,
    data=DEFAULT_DATA,
    seed: int = 0,
    model_vocab: int = 0,
    dtype: str = "float32",
) -> Path:
    """Build (or reuse) a tiny Qwen3 model + tokenizer in out_dir; same arguments give byte-identical files.

    `dtype`: the dtype the weights are saved in (and config.json says), e.g. "bfloat16" like a published model;
    the same random values rounded to it."""
    out = Path(out_dir)
    data = Path(data)
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}), and heads by kv_heads ({kv_heads})")
    spec = {
        "build_version": BUILD_VERSION,
        "hidden": hidden,
        "layers": layers,
        "heads": heads,
        "kv_heads": kv_heads,
        "intermediate": intermediate,
        "vocab": vocab,
        # The content hash, not the path: the same data in another checkout reuses the build, edited data does not.
        "data_sha256": _file_sha256(data),
        "seed": seed,
        "model_vocab": model_vocab,
    }
    if dtype != "float32":  # only when asked: float32 builds made before the option existed stay valid
        spec["dtype"] = dtype
    # One builder at a time (the test tiers run two pytest workers): the others wait, then find it built.
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        import fcntl

        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_locked(
            out, data, spec, hidden, layers, heads, kv_heads, intermediate, vocab, seed, model_vocab, dtype
        )


def _build_locked(
    out: Path,
    data: Path,
    spec: dict,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    seed: int,
    model_vocab: int,
    dtype: str,
) -> Path:
    marker = out / MARKER
    if marker.is_file() and (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        try:
            if json.loads(marker.read_text())["spec"] == spec:
                return out
        except (ValueError, KeyError):
            pass  # unreadable marker: rebuild
    if marker.exists():
        marker.unlink()  # removed first, so an interrupted rebuild is never taken for a finished one

    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = _build_tokenizer(data, vocab)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)

    config = Qwen3Config(
        # The trained vocabulary can come out smaller than asked if the data is tiny; the embedding matches it,
        # unless model_vocab pads it (as real models pad theirs): a big vocabulary makes the logits of a long
        # batch dominate memory, which the out-of-memory tests need.
        vocab_size=max(len(tokenizer), model_vocab),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=4096,
        # Fan-in scale (1/sqrt(hidden)) instead of Qwen's 0.02: the lm_head is the frozen, tied embedding, and
        # with 0.02 its logits stay near zero, so LoRA on a random model cannot move the loss at all (measured:
        # 6.89 -> 6.53 in 40 steps, against 6.69 -> 4.28 with this scale).
        initializer_range=hidden**-0.5,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        use_cache=True,  # for generation; the trainer turns it off itself under gradient checkpointing
        bos_token_id=None,
        eos_token_id=pad_id,
        pad_token_id=pad_id,
    )
    # Seeded CPU init; a fork keeps the caller's global RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.to(getattr(torch, dtype))
    # Like Qwen's chat models: generation stops at the end of the assistant turn.
    model.generation_config = GenerationConfig(eos_token_id=[im_end_id, pad_id], pad_token_id=pad_id, bos_token_id=None)

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # Written last: its presence means the directory is complete.
    marker.write_text(json.dumps({"spec": spec, "data": str(data)}, indent=2, sort_keys=True) + "\n")
    return out


def count_params(out_dir) -> int:
    """Parameter count of a built model, read from the safetensors header (no torch import)."""
    import struct

    with (Path(out_dir) / "model.safetensors").open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    total = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        size = 1
        for d in meta["shape"]:
            size *= d
        total += size
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out_dir")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-vocab", type=int, default=0, help="pad the embedding to this many rows")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="the dtype the weights are saved in",
    )
    a = p.parse_args(argv)
    from transformers.utils import logging as hf_logging

    # A one-shard progress bar is noise in the CLI; done here, not in build_tiny_model, as it is process-global.
    hf_logging.disable_progress_bar()
    out = build_tiny_model(
        a.out_dir,
        hidden=a.hidden,
        layers=a.layers,
        heads=a.heads,
        kv_heads=a.kv_heads,
        intermediate=a.intermediate,
        vocab=a.vocab,
        data=a.data,
        seed=a.seed,
        model_vocab=a.model_vocab,
        dtype=a.dtype,
    )
    print(f"tiny model ({count_params(out):,} parameters) in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
