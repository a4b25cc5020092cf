#!/usr/bin/env python3
"""GGUF export per type on the tiny models: size, time and parity in llama.cpp against transformers.

    .venv/bin/python scripts/bench_gguf.py [--types q4_k_m,q8_0,...] [--out DIR] [--json FILE]

Two models, no downloads: the tiny Qwen3 of scripts/make_tiny_model.py (hidden size 64: every row is shorter than
the 256 values of a K-quant block, so K-quant types fall back tensor by tensor to 32-block types) and a tiny
Llama with Llama 3.1's rope scaling (rope_type llama3) and hidden size 256 / intermediate 512, whose matrices get
real Q4_K, Q5_K and Q6_K blocks. Each is converted once to a 16-bit GGUF by llama.cpp's converter and quantized
to every type by llama.cpp's quantizer (launcher/deliver/gguf_export.gguf_output), read back in llama.cpp and compared
with the
model in transformers (float32) on the parity prompts. docs/BENCHMARKS.md section 5 holds a run of it, and the
tolerances in launcher/gguf_types.py (each type's tolerance) were set from it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TINY_DATA = REPO / "recipes" / "data" / "tiny-chat.jsonl"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# ChatML with a tools block and a thinking prompt, as Qwen3's template has them (the Modelfile keeps both).
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_tiny_llama(out: Path, hidden: int = 256, intermediate: int = 512, layers: int = 2) -> Path:
    """A Llama 3.1-shaped tiny model (rope_type llama3, GQA, bf16 weights) with a byte-level BPE tokenizer that
    splits text with Llama 3's regex; built from scratch, byte-identical for the same arguments."""
    out = Path(out)
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    import torch
    from tokenizers import Regex, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    mtm = _script("make_tiny_model")
    tok = mtm._build_tokenizer(TINY_DATA, 1024)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.chat_template = TOOLS_TEMPLATE
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        tie_word_embeddings=False,
        initializer_range=0.08,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=eos[1],
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos[1])
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def reference(model_dir: Path, prompts_n: int = 3):
    """The parity prompts and the model's outputs in transformers (float32, CPU), as export computes them."""
    from launcher.notices import quiet_known_notices

    quiet_known_notices()  # as the export process does, before the libraries are imported
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launcher.deliver.parity import model_outputs, parity_prompts

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = parity_prompts(SimpleNamespace(data=str(TINY_DATA), eval=None), tok, prompts_n)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = model_outputs(model, prompts)
    del model
    return tok, prompts, outs


def measure(model_dir: Path, name: str, types: list[str], out_dir: Path) -> list[dict]:
    """Every type from one 16-bit conversion; a failed check is measured and reported, not raised."""
    from launcher.deliver import gguf_export
    from launcher.deliver import llamacpp_steps
    from launcher.plan import gguf_readiness

    tok, prompts, ref = reference(model_dir)
    rows = []
    dtype = (gguf_export._safetensors_dtypes(model_dir) & {"BF16", "F16"} or {"BF16"}).pop().lower()
    sixteen = out_dir / f"{name}-{dtype.upper()}-intermediate.gguf"
    t0 = time.monotonic()
    conv = llamacpp_steps.convert(gguf_readiness.converter(), model_dir, sixteen, dtype)
    for t in types:
        try:
            res = gguf_export.gguf_output(model_dir, out_dir, name, t, prompts, ref, tok, intermediate=sixteen)
        except gguf_export._GgufFailed as exc:
            res = exc.output
        par = res["parity_vs_merged"]
        rows.append(
            {
                "model": name,
                "type": t,
                "bytes": res["bytes"],
                "size": res["size"],
                "convert_seconds": res["steps"].get("convert", conv.to_dict())["seconds"],
                "convert_peak_rss_bytes": res["steps"].get("convert", conv.to_dict())["peak_rss_bytes"],
                "quantize_seconds": res["steps"].get("quantize", {}).get("seconds"),
                "quantize_peak_rss_bytes": res["steps"].get("quantize", {}).get("peak_rss_bytes"),
                "llama_cpp_seconds": res["steps"]["llama_cpp_prompts_seconds"],
                "tensor_types": res["tensor_types"],
                "top1": par["top1_agreement"],
                "ppl_ref": par["perplexity_reference"],
                "ppl": par["perplexity"],
                "ppl_rel": par["perplexity_rel_diff"],
                "greedy": par["greedy_identical"],
                "mean_kl": par["mean_kl"],
                "max_rel": par["max_rel_logit_diff"],
                "tokenizer_identical": res["tokenizer_identical"],
                "ok": par["ok"] and "error" not in res,
                "error": res.get("error"),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    rows.append(
        {
            "model": name,
            "type": f"{dtype} (intermediate)",
            "bytes": sixteen.stat().st_size,
            "convert_seconds": conv.seconds,
            "convert_peak_rss_bytes": conv.peak_rss_bytes,
            "wall_seconds": round(time.monotonic() - t0, 1),
        }
    )
    return rows


def main() -> int:
    from launcher import gguf_types

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default=",".join(gguf_types.TYPES))
    ap.add_argument("--out", type=Path, default=REPO / ".cache" / "bench-gguf")
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ns.out.mkdir(parents=True, exist_ok=True)
    # in bfloat16, as a merged model is: the 16-bit conversion then rounds nothing
    qwen = _script("make_tiny_model").build_tiny_model(REPO / ".cache" / "tiny-model-tests-bf16", dtype="bfloat16")
    llama = build_tiny_llama(ns.out / "tiny-llama31")
    types = ns.types.split(",")
    rows = measure(qwen, "tiny-qwen3", types, ns.out) + measure(llama, "tiny-llama31", types, ns.out)
    if ns.json:
        ns.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
