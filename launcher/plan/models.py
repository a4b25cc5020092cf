"""A model's architecture and parameter count, found offline: local config.json, HF cache, built-in catalog, then the
Hub."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from launcher.errors import ModelError
from launcher.methods import is_quantized
from launcher.model_files import cached_file, not_a_model
from launcher.plan import vision

# Module names that LoRA can target in a Llama-shaped decoder layer, with (d_in, d_out) from the architecture.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LINEAR_MODULES = ATTENTION_MODULES + MLP_MODULES
# Model types whose attention carries a bias on q, k and v (Qwen2/2.5, and Qwen2-VL's, nested or flat)
QKV_BIAS_TYPES = ("qwen2", "qwen2_moe", "qwen2_vl_text", "qwen2_5_vl_text", "qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True)
class Architecture:
    """What sizing needs of a decoder-only transformer (Llama, Qwen2/3, Mistral, Gemma 2/3 shapes)."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool = False  # Qwen2/2.5 carry a bias on q, k and v
    qk_norm: bool = False  # Qwen3 and Gemma 3 normalise q and k per head
    norms_per_layer: int = 2  # Gemma 2/3 have four RMSNorms per layer
    experts: int = 1  # mixture-of-experts: experts per layer (1 = dense)
    experts_per_token: int = 1
    source: str = ""  # where the numbers came from, shown in the plan
    # max_position_embeddings (None: unknown) and the RoPE scaling (rope_type, factor, original max or None)
    max_positions: Optional[int] = None
    rope_scaling: Optional[tuple] = None
    # a vision-language model: its model_type ("" for text), the tower's and projector's parameters (part of
    # `params`), and its linear layers (leaf, d_in, d_out, count) (launcher/plan/vision.py)
    vision_tower: str = ""
    vision_params: int = 0
    vision_linears: tuple = ()

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of each targetable linear layer in one decoder layer (one expert for MoE)."""
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @property
    def attention_params_per_layer(self) -> int:
        shapes = self.linear_shapes()
        n = sum(shapes[m][0] * shapes[m][1] for m in ATTENTION_MODULES)
        if self.qkv_bias:
            n += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    @property
    def mlp_params_per_layer(self) -> int:
        """All experts' MLP weights (what must be held in memory)."""
        return 3 * self.hidden * self.intermediate * self.experts + (
            self.hidden * self.experts if self.experts > 1 else 0
        )

    @property
    def linear_params(self) -> int:
        """Weights of the decoder layers' linear layers: what 4-bit quantization applies to."""
        shapes = self.linear_shapes()
        attn = sum(shapes[m][0] * shapes[m][1] for m in ATTENTION_MODULES)
        mlp = 3 * self.hidden * self.intermediate * self.experts
        return self.layers * (attn + mlp)

    @property
    def params(self) -> int:
        per_layer = self.attention_params_per_layer + self.mlp_params_per_layer + self.norms_per_layer * self.hidden
        text = self.embedding_params + self.lm_head_params + self.layers * per_layer + self.hidden
        return text + self.vision_params

    @property
    def active_params(self) -> int:
        """Parameters a token passes through (MoE: only its experts); drives FLOPs, not memory."""
        if self.experts == 1:
            return self.params
        inactive = 3 * self.hidden * self.intermediate * (self.experts - self.experts_per_token) * self.layers
        return self.params - inactive

    def lora_params(self, r: int, target_modules: str | list[str] | tuple[str, ...] = "all-linear") -> int:
        """Trainable LoRA parameters: r x (d_in + d_out) per targeted matrix per layer (per expert for MoE)."""
        shapes = self.linear_shapes()
        per_layer = sum(
            r * sum(shapes[m]) * (self.experts if m in MLP_MODULES else 1) for m in self.resolve_targets(target_modules)
        )
        return self.layers * per_layer

    def resolve_targets(self, target_modules: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
        if target_modules == "all-linear":
            return LINEAR_MODULES
        names = (target_modules,) if isinstance(target_modules, str) else tuple(target_modules)
        unknown = [n for n in names if n not in LINEAR_MODULES]
        if unknown:
            raise ModelError(
                f"lora.target_modules {unknown} are not linear layers ftrun can size for {self.name}",
                fix=f"use 'all-linear' or names from {', '.join(LINEAR_MODULES)}.",
            )
        return names


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    # Multimodal checkpoints (Gemma 3 4B+, Llama 3.2 Vision) nest the language model's config.
    text = cfg.get("text_config")
    if isinstance(text, dict) and "hidden_size" in text:
        merged = dict(text)
        merged.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", text.get("tie_word_embeddings")))
        merged.setdefault("model_type", text.get("model_type") or cfg.get("model_type"))
        return merged
    return cfg


def from_config(cfg: dict[str, Any], name: str, source: str) -> Architecture:
    """An `Architecture` from a Hugging Face config.json dict; ModelError if it is not a decoder we can size."""
    c = _text_config(cfg)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size") if k not in c]
    if missing:
        raise ModelError(
            f"config.json of {name} ({source}) lacks {', '.join(missing)}; it does not look like a decoder-only LLM",
            fix="point `model` at a causal language model (Llama, Qwen, Mistral, Gemma shapes).",
        )
    model_type = str(c.get("model_type", ""))
    hidden = int(c["hidden_size"])
    heads = int(c["num_attention_heads"])
    experts = int(c.get("num_experts") or c.get("num_local_experts") or 1)
    # MoE configs give the per-expert width separately; dense ones only intermediate_size.
    moe = c.get("moe_intermediate_size") if experts > 1 else None
    intermediate = int(moe or c.get("intermediate_size", 4 * hidden))
    tied = c.get("tie_word_embeddings")  # None: True, transformers' PretrainedConfig default
    return Architecture(
        name=name,
        layers=int(c["num_hidden_layers"]),
        hidden=hidden,
        intermediate=intermediate,
        heads=heads,
        kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads),
        vocab=int(c["vocab_size"]),
        tied_embeddings=tied is None or bool(tied),
        qkv_bias=bool(c.get("attention_bias", model_type in QKV_BIAS_TYPES)),
        qk_norm=model_type.startswith(("qwen3", "gemma3")),
        norms_per_layer=4 if model_type.startswith(("gemma2", "gemma3")) else 2,
        experts=experts,
        experts_per_token=int(c.get("num_experts_per_tok") or 1),
        source=source,
        max_positions=int(c["max_position_embeddings"]) if c.get("max_position_embeddings") else None,
        rope_scaling=_rope_scaling(c),
        vision_tower=str(cfg.get("model_type", "")) if isinstance(cfg.get("vision_config"), dict) else "",
        vision_params=vision.tower_params(cfg),
        vision_linears=vision.tower_linears(cfg),
    )


def _rope_scaling(c: dict[str, Any]) -> Optional[tuple]:
    """(rope_type, factor, original_max_position_embeddings) of a config's RoPE scaling (transformers 5's
    rope_parameters, or the older rope_scaling), None for plain RoPE ("default") or none."""
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    kind = (rope.get("rope_type") or rope.get("type")) if isinstance(rope, dict) else None
    if not kind or kind == "default":
        return None
    factor = rope.get("factor")
    original = rope.get("original_max_position_embeddings")
    return (str(kind), float(factor) if factor else None, int(original) if original else None)


# Built-in catalog: config.json values of popular models by `catalog_key` (base, instruct and 4-bit re-uploads)
_FIELDS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab", "tied_embeddings")


def _a(*values: Any, **kw: Any) -> dict[str, Any]:
    return dict(zip(_FIELDS, values, strict=True), **kw)


_QWEN3 = dict(qk_norm=True)
_QWEN25 = dict(qkv_bias=True)
_GEMMA2 = dict(norms_per_layer=4)
_GEMMA3 = dict(norms_per_layer=4, qk_norm=True)

CATALOG: dict[str, dict[str, Any]] = {
    # Qwen3 (dense)
    "qwen3-0.6b": _a(28, 1024, 3072, 16, 8, 128, 151936, True, **_QWEN3),
    "qwen3-1.7b": _a(28, 2048, 6144, 16, 8, 128, 151936, True, **_QWEN3),
    "qwen3-4b": _a(36, 2560, 9728, 32, 8, 128, 151936, True, **_QWEN3),
    "qwen3-8b": _a(36, 4096, 12288, 32, 8, 128, 151936, False, **_QWEN3),
    "qwen3-14b": _a(40, 5120, 17408, 40, 8, 128, 151936, False, **_QWEN3),
    "qwen3-32b": _a(64, 5120, 25600, 64, 8, 128, 151936, False, **_QWEN3),
    # Qwen2.5
    "qwen2.5-0.5b": _a(24, 896, 4864, 14, 2, 64, 151936, True, **_QWEN25),
    "qwen2.5-1.5b": _a(28, 1536, 8960, 12, 2, 128, 151936, True, **_QWEN25),
    "qwen2.5-3b": _a(36, 2048, 11008, 16, 2, 128, 151936, True, **_QWEN25),
    "qwen2.5-7b": _a(28, 3584, 18944, 28, 4, 128, 152064, False, **_QWEN25),
    "qwen2.5-14b": _a(48, 5120, 13824, 40, 8, 128, 152064, False, **_QWEN25),
    "qwen2.5-32b": _a(64, 5120, 27648, 40, 8, 128, 152064, False, **_QWEN25),
    "qwen2.5-72b": _a(80, 8192, 29568, 64, 8, 128, 152064, False, **_QWEN25),
    # Llama 3.x
    "llama-3.2-1b": _a(16, 2048, 8192, 32, 8, 64, 128256, True),
    "llama-3.2-3b": _a(28, 3072, 8192, 24, 8, 128, 128256, True),
    "llama-3.1-8b": _a(32, 4096, 14336, 32, 8, 128, 128256, False),
    "llama-3-8b": _a(32, 4096, 14336, 32, 8, 128, 128256, False),
    "llama-3.1-70b": _a(80, 8192, 28672, 64, 8, 128, 128256, False),
    "llama-3.3-70b": _a(80, 8192, 28672, 64, 8, 128, 128256, False),
    "llama-3-70b": _a(80, 8192, 28672, 64, 8, 128, 128256, False),
    # Mistral
    "mistral-7b-v0.3": _a(32, 4096, 14336, 32, 8, 128, 32768, False),
    "mistral-7b-v0.1": _a(32, 4096, 14336, 32, 8, 128, 32000, False),
    # Gemma 2 / 3 (Gemma 3 4B+: the text model's numbers, the ~0.4B vision tower not counted)
    "gemma-2-2b": _a(26, 2304, 9216, 8, 4, 256, 256000, True, **_GEMMA2),
    "gemma-2-9b": _a(42, 3584, 14336, 16, 8, 256, 256000, True, **_GEMMA2),
    "gemma-2-27b": _a(46, 4608, 36864, 32, 16, 128, 256000, True, **_GEMMA2),
    "gemma-3-1b": _a(26, 1152, 6912, 4, 1, 256, 262144, True, **_GEMMA3),
    "gemma-3-4b": _a(34, 2560, 10240, 8, 4, 256, 262208, True, **_GEMMA3),
    "gemma-3-12b": _a(48, 3840, 15360, 16, 8, 256, 262208, True, **_GEMMA3),
    "gemma-3-27b": _a(62, 5376, 21504, 32, 16, 128, 262208, True, **_GEMMA3),
}

_ALIASES = {"mistral-7b": "mistral-7b-v0.3", "llama-3.1-8b-base": "llama-3.1-8b"}

# Name parts that mark a variant with the same architecture (instruct tunes, 4-bit re-uploads, dates).
_VARIANT_PARTS = set("instruct it chat base hf pt bnb 4bit unsloth dynamic awq gptq fp8 int4 2507".split())


def catalog_key(model: str) -> str:
    """'unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit' -> 'llama-3.1-8b'."""
    name = model.rstrip("/").rsplit("/", 1)[-1].lower().removeprefix("meta-")
    name = "-".join(part for part in name.split("-") if part not in _VARIANT_PARTS)
    return _ALIASES.get(name, name)


def from_catalog(model: str) -> Architecture | None:
    key = catalog_key(model)
    values = CATALOG.get(key)
    return None if values is None else Architecture(name=model, source=f"built-in catalog ({key})", **values)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read {path}: {exc}", fix="check that the file is a valid config.json.") from None


def _offline() -> str | None:
    """Why the Hub is not asked (offline by setting, or it did not answer the plan's probe), else None."""
    from launcher import hub_access

    return hub_access.offline_reason()


def _from_hub(model: str, timeout: float = 5.0) -> Architecture:
    """Fetch config.json only (a few KB) from the Hub into the Hugging Face cache (hf_hub_download: the user's
    token, HF_ENDPOINT and the cache location as huggingface_hub has them); raises ModelError when not found."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        path = hf_hub_download(model, "config.json", etag_timeout=timeout)
    except GatedRepoError:
        raise _unknown_model(
            model,
            "the Hub answered that it is gated (accept its licence on the Hub, then `hf auth login` or set HF_TOKEN)",
        ) from None
    except RepositoryNotFoundError:
        raise _unknown_model(
            model,
            "the Hub has no such repository (or it is private and no token with access "
            "to it is set: `hf auth login` or HF_TOKEN)",
        ) from None
    except RemoteEntryNotFoundError:
        raise _unknown_model(model, "its repository on the Hub has no config.json") from None
    except HfHubHTTPError as exc:
        raise _unknown_model(model, f"the Hub answered {exc.response.status_code} for its config.json") from None
    except (LocalEntryNotFoundError, OSError) as exc:
        raise _unknown_model(model, f"the Hub could not be reached ({type(exc).__name__})") from None
    try:
        cfg = json.loads(Path(path).read_text())
    except json.JSONDecodeError:
        raise _unknown_model(model, "the Hub's config.json is not valid JSON") from None
    return from_config(cfg, model, f"Hugging Face Hub ({model}/config.json)")


def _unknown_model(model: str, why: str) -> ModelError:
    return ModelError(
        f"cannot find the architecture of '{model}': not a local directory, not in the Hugging Face cache, "
        f"not in ftrun's built-in catalog, and {why}",
        fix=(
            "one of: (1) set `model` to a local directory that holds its config.json (weights not needed); "
            f"(2) put it in the HF cache while online: `hf download {model} config.json`; "
            f"(3) use a model from the built-in catalog ({', '.join(sorted(CATALOG))}), "
            "or run with network access so ftrun can fetch config.json from the Hub."
        ),
    )


def load_architecture(model: str, allow_network: bool = True) -> Architecture:
    path = Path(model).expanduser()
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise ModelError(
                f"model directory {path} has no config.json",
                fix="point `model` at a folder with the model's config.json (from `save_pretrained` or the Hub).",
            )
        return from_config(_read_config(cfg), path.name, f"local config.json ({cfg})")
    wrong = not_a_model(model)  # a file (a GGUF above all) where a folder or a Hub id belongs
    if wrong:
        raise ModelError(*wrong)
    if model.startswith(("/", ".", "~")):
        raise ModelError(
            f"model directory {path} does not exist",
            fix="check the path (a recipe's relative paths resolve against its folder, a model= on the "
            "command line against the working directory).",
        )
    cfg = cached_file(model, "config.json")
    known = from_config(_read_config(cfg), model, f"Hugging Face cache ({cfg})") if cfg else from_catalog(model)
    if known is not None:
        return known
    offline = _offline()
    if not allow_network or offline:
        # "... and the Hub at URL did not answer ...", or the setting that keeps it off
        raise _unknown_model(
            model,
            offline
            if allow_network and offline.startswith("the Hub")
            else "network access is off (HF_HUB_OFFLINE / FTRUN_OFFLINE)",
        )
    return _from_hub(model)


def catalog_names() -> list[str]:
    return sorted(CATALOG)


# Download size: what a run fetches before its first step, at what datacenter boxes typically get from the Hub's CDN.
DOWNLOAD_MB_S = 100.0
# Bytes per weight of a bitsandbytes 4-bit checkpoint: 4 bits, a blocksize-64 absmax and quant_state entries
BNB_4BIT_BYTES = 0.53
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass(frozen=True)
class Download:
    repo: str
    bytes: int | None
    source: str  # "Hub metadata", "estimated from the architecture (offline: ...)", "local folder", "cached"
    cached: bool = False

    def seconds(self, mb_s: float = DOWNLOAD_MB_S) -> float:
        return 0.0 if self.cached or not self.bytes else self.bytes / (mb_s * 1e6)

    def to_dict(self) -> dict[str, Any]:
        return {
            "repo": self.repo,
            "bytes": self.bytes,
            "gb": round(self.bytes / 2**30, 1) if self.bytes else None,
            "source": self.source,
            "cached": self.cached,
            "bandwidth_mb_s": DOWNLOAD_MB_S,
            "seconds": round(self.seconds()),
        }


def _weights_bytes(sizes: dict[str, int]) -> int:
    """The weight files of a repository listing: safetensors when there are any, else the other formats
    (a repo with both ships the same weights twice; from_pretrained loads only the safetensors)."""
    safetensors = [n for n in sizes if n.endswith(".safetensors")]
    names = safetensors or [n for n in sizes if n.endswith(WEIGHT_SUFFIXES) and "/" not in n]
    return sum(sizes[n] for n in names)


def _hub_weights_bytes(repo: str, timeout: float = 5.0) -> int:
    """The sizes the Hub lists for the repository's files (huggingface_hub 2.3, HfApi.model_info with
    files_metadata=True: each sibling carries .size). Raises when offline or unreachable."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)  # read now; None: huggingface_hub's default
    info = api.model_info(repo, files_metadata=True, timeout=timeout)  # the token: huggingface_hub.get_token
    return _weights_bytes({s.rfilename: int(s.size or 0) for s in (info.siblings or [])})


def estimated_weights_bytes(arch: Architecture, four_bit: bool) -> int:
    """The checkpoint's size from the architecture: bf16 weights (2 B each), or a bitsandbytes 4-bit one
    (linear weights at BNB_4BIT_BYTES, embeddings, head and norms in bf16)."""
    if not four_bit:
        return int(arch.params * 2)
    return int(arch.linear_params * BNB_4BIT_BYTES + (arch.params - arch.linear_params) * 2)


def download_size(model: str, arch: Architecture, repo: str | None = None, allow_network: bool = True) -> Download:
    """What a run downloads for `model` (or `repo`, a pre-quantized 4-bit copy the engine loads instead):
    nothing for a local folder or a cached snapshot; the Hub's listing when online; else an estimate from
    the architecture, saying so."""
    source_repo = repo or model
    path = Path(model).expanduser()
    if repo is None and path.is_dir():
        sizes = {p.name: p.stat().st_size for p in path.iterdir() if p.is_file()}
        return Download(str(path), _weights_bytes(sizes), "local folder", cached=True)
    if cached_file(source_repo, "config.json") is not None and any(
        cached_file(source_repo, n) for n in ("model.safetensors", "model.safetensors.index.json")
    ):
        return Download(source_repo, 0, "in the Hugging Face cache already", cached=True)
    four_bit = repo is not None and "4bit" in repo.lower()
    why = _offline() or "offline (HF_HUB_OFFLINE / FTRUN_OFFLINE)"
    if allow_network and not _offline():
        try:
            return Download(source_repo, _hub_weights_bytes(source_repo), "Hub metadata (file sizes)")
        except Exception as exc:  # noqa: BLE001 - any Hub failure falls back to the estimate, announced in source
            why = f"the Hub did not answer: {type(exc).__name__}"
    return Download(
        source_repo,
        estimated_weights_bytes(arch, four_bit),
        f"estimated from the architecture ({'4-bit' if four_bit else 'bf16'} weights; {why})",
    )


# Unsloth's NF4 uploads of the catalog's models for QLoRA (checked against unsloth.models.mapper: test_unsloth.py)
PREQUANTIZED: dict[str, str] = {
    # Qwen3
    "qwen/qwen3-0.6b": "unsloth/Qwen3-0.6B-bnb-4bit",
    "qwen/qwen3-1.7b": "unsloth/Qwen3-1.7B-bnb-4bit",
    "qwen/qwen3-4b": "unsloth/Qwen3-4B-bnb-4bit",
    "qwen/qwen3-8b": "unsloth/Qwen3-8B-bnb-4bit",
    "qwen/qwen3-14b": "unsloth/Qwen3-14B-bnb-4bit",
    "qwen/qwen3-32b": "unsloth/Qwen3-32B-bnb-4bit",
    # Qwen2.5
    "qwen/qwen2.5-0.5b-instruct": "unsloth/Qwen2.5-0.5B-Instruct-bnb-4bit",
    "qwen/qwen2.5-1.5b-instruct": "unsloth/Qwen2.5-1.5B-Instruct-bnb-4bit",
    "qwen/qwen2.5-3b-instruct": "unsloth/Qwen2.5-3B-Instruct-bnb-4bit",
    "qwen/qwen2.5-7b-instruct": "unsloth/Qwen2.5-7B-Instruct-bnb-4bit",
    "qwen/qwen2.5-14b-instruct": "unsloth/Qwen2.5-14B-Instruct-bnb-4bit",
    "qwen/qwen2.5-32b-instruct": "unsloth/Qwen2.5-32B-Instruct-bnb-4bit",
    "qwen/qwen2.5-72b-instruct": "unsloth/Qwen2.5-72B-Instruct-bnb-4bit",
    "qwen/qwen2.5-7b": "unsloth/Qwen2.5-7B-bnb-4bit",
    # Llama 3.x
    "meta-llama/llama-3.2-1b": "unsloth/Llama-3.2-1B-bnb-4bit",
    "meta-llama/llama-3.2-1b-instruct": "unsloth/Llama-3.2-1B-Instruct-bnb-4bit",
    "meta-llama/llama-3.2-3b": "unsloth/Llama-3.2-3B-bnb-4bit",
    "meta-llama/llama-3.2-3b-instruct": "unsloth/Llama-3.2-3B-Instruct-bnb-4bit",
    "meta-llama/llama-3.1-8b": "unsloth/Meta-Llama-3.1-8B-bnb-4bit",
    "meta-llama/llama-3.1-8b-instruct": "unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit",
    "meta-llama/meta-llama-3.1-8b": "unsloth/Meta-Llama-3.1-8B-bnb-4bit",
    "meta-llama/meta-llama-3.1-8b-instruct": "unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit",
    "meta-llama/meta-llama-3-8b": "unsloth/llama-3-8b-bnb-4bit",
    "meta-llama/meta-llama-3-8b-instruct": "unsloth/llama-3-8b-Instruct-bnb-4bit",
    "meta-llama/llama-3.1-70b-instruct": "unsloth/Meta-Llama-3.1-70B-Instruct-bnb-4bit",
    "meta-llama/llama-3.3-70b-instruct": "unsloth/Llama-3.3-70B-Instruct-bnb-4bit",
    # Mistral
    "mistralai/mistral-7b-v0.3": "unsloth/mistral-7b-v0.3-bnb-4bit",
    "mistralai/mistral-7b-instruct-v0.3": "unsloth/mistral-7b-instruct-v0.3-bnb-4bit",
    # Gemma 2 / 3
    "google/gemma-2-2b": "unsloth/gemma-2-2b-bnb-4bit",
    "google/gemma-2-9b": "unsloth/gemma-2-9b-bnb-4bit",
    "google/gemma-2-9b-it": "unsloth/gemma-2-9b-it-bnb-4bit",
    "google/gemma-2-27b": "unsloth/gemma-2-27b-bnb-4bit",
    "google/gemma-3-1b-it": "unsloth/gemma-3-1b-it-bnb-4bit",
    "google/gemma-3-4b-it": "unsloth/gemma-3-4b-it-bnb-4bit",
    "google/gemma-3-12b-it": "unsloth/gemma-3-12b-it-bnb-4bit",
    "google/gemma-3-27b-it": "unsloth/gemma-3-27b-it-bnb-4bit",
}


def prequantized_repo(model: str, method: str) -> str | None:
    """Unsloth's 4-bit repo for a QLoRA run of a Hub id it has one for; None for local folders and LoRA."""
    if not is_quantized(method) or Path(model).expanduser().exists():
        return None
    return PREQUANTIZED.get(model.strip().rstrip("/").lower())
