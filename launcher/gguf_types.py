"""The GGUF types ftrun writes: one table (TYPES) with each type's llama.cpp name and file type, its bits per weight
and its parity tolerance. Everything else derives from it: the recipe's allowed `gguf_type` values and their
description, `ftrun export --gguf`'s help, llama.cpp's converter and quantizer calls
(launcher/deliver/llamacpp_steps.py), the export's check (launcher/deliver/parity.py and gguf_export.py), the smoke
test's disk and time estimate (launcher/run/smoke.py).

This table says what a type is, not which files an export makes: that (one GGUF per run today, of the recipe's
`gguf_type`) is launcher/deliver/export_models.py's `outputs["gguf"]`, read by deliver/serving.py, deliver/publish.py
and run/smoke.py's export estimate.

It sits at the root, beside the recipe, because the recipe (a root leaf every stage imports) validates against it;
it imports nothing. A type added here without a tolerance fails to construct, and tests/test_tables.py walks every
type through the code that uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Tolerance:
    """How close the GGUF, read back in llama.cpp, must stay to the merged model in transformers (export.json)."""

    max_kl: float  # mean KL divergence per token, nats: the main bound
    min_top1: float  # share of positions whose most likely token agrees: a loose floor
    max_ppl: float  # relative perplexity difference
    min_greedy: float  # share of 16-token greedy continuations that repeat exactly

    def as_dict(self) -> dict[str, float]:
        return {
            "max_kl": self.max_kl,
            "min_top1": self.min_top1,
            "max_ppl": self.max_ppl,
            "min_greedy": self.min_greedy,
        }


@dataclass(frozen=True)
class GgufType:
    name: str  # as llama.cpp names the file type (Q4_K_M)
    ftype: int  # enum llama_ftype (llama_cpp/llama_cpp.py)
    bits: float  # bits per weight of a large model, as llama.cpp's quantize tool lists them (ETA, disk)
    tolerance: Tolerance
    converter: Optional[str] = None  # written by convert_hf_to_gguf.py directly (--outtype), no quantizer pass
    advised_above: bool = False  # named as the fix when a type with fewer bits fails its check
    note: str = ""  # what the recipe's description says of it


# K-quants work in blocks of 256 values along a row (QK_K): a tensor whose rows are not a multiple of 256 long falls
# back, tensor by tensor, to a 32-block type (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; llama-quant.cpp
# tensor_type_fallback); export.json lists the tensor types that came out.
#
# The tolerances: a GGUF is read back in llama.cpp (the runtime Ollama uses) and compared with the merged model in
# transformers. llama.cpp computes in its own way even for a 16-bit file (activations rounded to the weights' type
# in its CPU matrix products, other kernels), and each quantization type rounds more: the tolerances widen with
# fewer bits. How they were chosen (docs/BENCHMARKS.md section 5 has both sets of numbers): each type's bounds sit
# above two measurements, with room: (a) llama.cpp's own scoreboard for LLaMA 3 8B in the pinned version
# (vendor/llama.cpp/tools/perplexity/README.md of llama-cpp-python 0.3.36: mean KL divergence against FP16 q8_0
# 0.0014, q6_K 0.0055, q5_K_M 0.011, q4_K_M 0.031; same top token 97.7% / 96.0% / - / 91.9%; perplexity +0.04% /
# +0.35% / +0.9% / +2.8%), at about four times its KL; (b) scripts/bench_gguf.py on the two tiny models of
# tests/deliver/test_gguf.py (a Qwen3 of hidden size 64 whose rows are too short for K-quants, and a Llama 3.1-style
# model of hidden size 256 with real Q4_K/Q5_K/Q6_K tensors), at about 1.5 times the worst value there.
# The mean KL divergence is the main bound: a broken conversion (a wrong rope, a tensor mapped wrong, another
# tokenizer) is off by whole nats. Top-1 agreement is a loose floor: random-initialised tiny models have flat
# next-token distributions with many near ties, so a 4-bit quant flips half their top tokens (measured 0.46 for
# Q4_K_M) where a real model keeps about 92%; chance is 1/vocabulary. Greedy continuations of 16 tokens drift
# apart at some token for any quantized type (first divergence is recorded), so only 16-bit and f32 files must
# reproduce them.
TYPES: dict[str, GgufType] = {
    "q4_k_m": GgufType("Q4_K_M", 15, 4.89, Tolerance(0.2, 0.35, 0.10, 0.0), note="Ollama's default, about 0.3 of f16"),
    "q5_k_m": GgufType("Q5_K_M", 17, 5.70, Tolerance(0.06, 0.50, 0.06, 0.0)),
    "q6_k": GgufType("Q6_K", 18, 6.56, Tolerance(0.025, 0.65, 0.03, 0.0), advised_above=True),
    "q8_0": GgufType("Q8_0", 7, 8.50, Tolerance(0.006, 0.80, 0.02, 0.33), advised_above=True, note="about half of f16"),
    "f16": GgufType("F16", 1, 16.0, Tolerance(0.001, 0.90, 0.01, 0.66), converter="f16"),
    "bf16": GgufType("BF16", 32, 16.0, Tolerance(0.001, 0.90, 0.01, 0.66), converter="bf16", advised_above=True),
    "f32": GgufType("F32", 0, 32.0, Tolerance(0.0005, 0.98, 0.005, 1.0), converter="f32"),
}
DEFAULT_TYPE = "q4_k_m"  # what Ollama's library serves by default


def bytes_per_param(gguf_type: str) -> float:
    return TYPES[gguf_type].bits / 8 if gguf_type in TYPES else 2.0


def listed(sep: str = ", ") -> str:
    return sep.join(TYPES)


def described() -> str:
    return ", ".join(f"{k} ({t.note})" if t.note else k for k, t in TYPES.items())


def advised_above(gguf_type: str) -> Optional[str]:
    """The type to try when `gguf_type` fails its check: the first advised type with more bits, else None."""
    bits = TYPES[gguf_type].bits
    return next((k for k, t in TYPES.items() if t.advised_above and t.bits > bits), None)
