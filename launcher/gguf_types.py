"""The GGUF types ftrun writes: one table (TYPES) with each type's llama.cpp name and file type, its bits per weight
and its parity tolerance; the recipe's values, the export's calls and checks and the smoke test's estimate derive from
it. What a type is, not which files an export makes (launcher/deliver/export_models.py). A root leaf: imports nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional


@dataclass(frozen=True)
class Tolerance:
    """How close the GGUF, read back in llama.cpp, must stay to the merged model in transformers (export.json)."""

    max_kl: float  # mean KL divergence per token, nats: the main bound
    min_top1: float  # share of positions whose most likely token agrees: a loose floor
    max_ppl: float  # relative perplexity difference
    min_greedy: float  # share of 16-token greedy continuations that repeat exactly

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class GgufType:
    name: str  # as llama.cpp names the file type (Q4_K_M)
    ftype: int  # enum llama_ftype (llama_cpp/llama_cpp.py)
    bits: float  # bits per weight of a large model, as llama.cpp's quantize tool lists them (ETA, disk)
    tolerance: Tolerance
    converter: Optional[str] = None  # written by convert_hf_to_gguf.py directly (--outtype), no quantizer pass
    advised_above: bool = False  # named as the fix when a type with fewer bits fails its check
    note: str = ""  # what the recipe's description says of it


# K-quants need rows a multiple of 256 long (QK_K), else fall back tensor by tensor to a 32-block type
# (llama-quant.cpp tensor_type_fallback); export.json lists the tensor types that came out.
# The tolerances (docs/BENCHMARKS.md section 5, both measurements): about four times llama.cpp's own KL scoreboard for
# LLaMA 3 8B (vendor/llama.cpp/tools/perplexity/README.md, llama-cpp-python 0.3.36) and 1.5 times the worst of
# scripts/bench_gguf.py's tiny models. Mean KL is the main bound (a broken conversion is off by whole nats); top-1 a
# loose floor (tiny random models have near ties); greedy continuations must repeat for 16-bit and f32 files only.
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
