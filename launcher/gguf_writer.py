"""Write a Hugging Face Llama/Qwen2/Qwen3 folder (safetensors + tokenizer.json) as one GGUF file with the `gguf` package.

What llama.cpp's convert_hf_to_gguf.py does for these families, and no more: the same tensor names
(gguf's TensorNameMap), Llama's rotary permutation of q/k, 1-D tensors kept in F32, Q8_0 falling back to
F16 where a row does not divide into blocks, the byte-level BPE vocabulary with token types, merges,
special tokens and the chat template. Anything else (sentencepiece vocabularies, llama3 rope scaling,
other architectures) is refused with a pointer to llama.cpp's own converter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import UsageError

# HF model_type -> (gguf MODEL_ARCH member name, llama.cpp architecture string)
ARCHS = {"qwen3": ("QWEN3", "qwen3"), "qwen2": ("QWEN2", "qwen2"), "llama": ("LLAMA", "llama"),
         "mistral": ("LLAMA", "llama")}

# The pre-tokenizer split regexes llama.cpp knows by name (tokenizer.ggml.pre). A byte-level BPE whose
# split is not one of these cannot be described in a GGUF: llama.cpp and Ollama would split text differently.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
KNOWN_SPLITS = {_QWEN2_SPLIT: "qwen2", _LLAMA3_SPLIT: "llama-bpe"}


def _refuse(what: str) -> UsageError:
    return UsageError(f"the built-in GGUF writer cannot convert this model: {what}",
                      fix="install llama.cpp on the box and set FTRUN_LLAMA_CPP to its folder (ftrun then uses its "
                      "convert_hf_to_gguf.py), or export without gguf.")


def tokenizer_pre(tokenizer_json: dict[str, Any]) -> str:
    """llama.cpp's name for how this tokenizer splits text before BPE (tokenizer.ggml.pre)."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"  # the GPT-2 regex inside ByteLevel
    if pre.get("type") == "Sequence":
        items = pre.get("pretokenizers", [])
        splits = [p for p in items if p.get("type") == "Split"]
        if len(splits) == 1 and any(p.get("type") == "ByteLevel" and not p.get("use_regex", True) for p in items):
            regex = splits[0].get("pattern", {}).get("Regex")
            if regex in KNOWN_SPLITS:
                return KNOWN_SPLITS[regex]
    raise _refuse("its tokenizer's pre-tokenizer is not one of GPT-2, Qwen2 or Llama 3")


def vocabulary(folder: Path, vocab_size: int):
    """(tokens, token types, pre) as llama.cpp writes a byte-level BPE vocabulary."""
    import gguf

    tj = json.loads((folder / "tokenizer.json").read_text())
    model = tj.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback") or (tj.get("decoder") or {}).get("type") != "ByteLevel":
        raise _refuse("only byte-level BPE tokenizers (Qwen, Llama 3, GPT-2 style) are supported")
    pre = tokenizer_pre(tj)
    by_id = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
        else:  # the embedding is larger than the vocabulary (Qwen pads to a multiple of 128)
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    return tokens, types, pre


def _permute(w, n_head: int, n_head_kv: int | None):
    # llama.cpp's Llama graph applies rotary embeddings to interleaved pairs; HF to halves.
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_theta(cfg: dict[str, Any]) -> float | None:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise _refuse(f"rope scaling {rope_type!r} (llama.cpp's converter writes its rope_freqs tensor)")
    return cfg.get("rope_theta", params.get("rope_theta"))


def write_gguf(folder: Path, out: Path, gguf_type: str, name: str) -> None:
    """Convert the HF folder (a merged 16-bit model) to one GGUF file of type f32/f16/bf16/q8_0."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    cfg = json.loads((folder / "config.json").read_text())
    model_type = cfg.get("model_type")
    if model_type not in ARCHS:
        raise _refuse(f"architecture {model_type!r} (built in: {', '.join(sorted(ARCHS))})")
    arch_member, arch = ARCHS[model_type]
    n_layers = cfg["num_hidden_layers"]
    n_head = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads", n_head)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    vocab_size = cfg["vocab_size"]
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[gguf_type]
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type]
    tokens, types, pre = vocabulary(folder, vocab_size)
    theta = _rope_theta(cfg)

    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(name)
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    if theta is not None:
        w.add_rope_freq_base(float(theta))
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
        w.add_vocab_size(vocab_size)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)

    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch_member), n_layers)
    tied = cfg.get("tie_word_embeddings", False)
    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if tied and key == "lm_head.weight":
                    continue  # llama.cpp reuses token_embd for a tied output
                new = names.get_name(key, try_suffixes=(".weight", ".bias"))
                if new is None:
                    raise _refuse(f"tensor {key!r} has no GGUF name for {arch}")
                data = st.get_tensor(key).float().numpy()
                if arch == "llama" and key.endswith("q_proj.weight"):
                    data = _permute(data, n_head, n_head)
                elif arch == "llama" and key.endswith("k_proj.weight"):
                    data = _permute(data, n_head, n_kv)
                _add(w, new, data, qtype, gguf, np)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add(w, name: str, data, qtype, gguf, np) -> None:
    # Norms and biases (1-D) stay F32 in every llama.cpp file type: they are tiny and precision-sensitive.
    if data.ndim <= 1 or qtype == gguf.GGMLQuantizationType.F32:
        w.add_tensor(name, data.astype(np.float32))
        return
    if qtype == gguf.GGMLQuantizationType.F16:
        w.add_tensor(name, data.astype(np.float16))
        return
    try:
        q = gguf.quants.quantize(data, qtype)
    except gguf.quants.QuantError:  # a row that does not divide into 32-value blocks: F16, as llama.cpp does
        w.add_tensor(name, data.astype(np.float16))
        return
    w.add_tensor(name, q, raw_dtype=qtype)


def read_metadata(path: Path) -> dict[str, Any]:
    """The GGUF's architecture, chat template, tensor types and counts (what export.json reports)."""
    import gguf

    r = gguf.GGUFReader(str(path))

    def field(key: str):
        f = r.fields.get(key)
        return None if f is None else f.contents()

    return {
        "architecture": field("general.architecture"),
        "key_length": field(f"{field('general.architecture')}.attention.key_length"),
        "chat_template": field("tokenizer.chat_template"),
        "tokenizer_pre": field("tokenizer.ggml.pre"),
        "tensors": len(r.tensors),
        "tensor_types": sorted({t.tensor_type.name for t in r.tensors}),
    }
