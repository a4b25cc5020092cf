"""Padding-free batches on torch's own FlashAttention-2 variable-length kernel, as a transformers attention function
(docs/engines.md, "Attention kernels"): without flash-attn, SDPA would get a padding-free row as a dense L x L block
mask (masking_utils.py create_causal_mask) and compute it on the memory-efficient kernel.

Registered under launcher/plan/attention.py VARLEN:
- an attention function (modeling_utils.py AttentionInterface) that runs a padding-free row, with the boundaries
  TRL's collator passes down (trl 1.16 DataCollatorForLanguageModeling padding_free: cu_seq_lens_q/k, max_length_q/k),
  through `torch.nn.attention.varlen.varlen_attn` (CUDA, bf16/fp16): each example causal to itself. Every other
  call goes to transformers' sdpa_attention_forward with SDPA's mask, as under attn_implementation="sdpa";
- a mask function (masking_utils.py AttentionMaskInterface) that, for a row without attention mask or cache, builds
  nothing: a DeferredMask that a layer taking the SDPA path builds once.

varlen_attn's signature, read from the installed one: torch 2.11 `*, return_aux, scale, window_size` (causal is
window_size=(-1, 0); pytorch/pytorch#172238, #172245), no `enable_gqa` (key/value heads repeated here, as repeat_kv);
2.12 and 2.13 add `enable_gqa` (#179468; 2.13's torch/nn/attention/varlen.py). 2.10's `is_causal` form is not used.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

from launcher.plan.attention import VARLEN

# FlashAttention-2's head dimensions: up to 256, multiples of 8 (aten flash_api.cpp, mha_varlen_fwd); else SDPA
MAX_HEAD_DIM = 256


def _kernel():
    """torch's varlen_attn, or None; looked up at each call (the CPU tests stand a reference in for it)."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    return getattr(varlen, "varlen_attn", None)


def kernel_parameters() -> Optional[frozenset[str]]:
    """The keyword parameters of this torch's varlen_attn (None without one)."""
    kernel = _kernel()
    return None if kernel is None else frozenset(inspect.signature(kernel).parameters)


def usable_signature(params: Optional[frozenset[str]]) -> bool:
    """torch 2.11's signature or newer: a softmax scale and the causal window (window_size=(-1, 0))."""
    return params is not None and {"scale", "window_size"} <= params


def available(device: str, dtype) -> bool:
    """Whether padding-free batches can run on varlen_attn here: CUDA in bf16 (launcher/plan/attention.py), 2.11's
    signature or newer, and flash attention built in (torch.backends.cuda.is_flash_attention_available)."""
    import torch

    if device != "cuda" or dtype != torch.bfloat16 or not usable_signature(kernel_parameters()):
        return False
    probe = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    return bool(probe()) if probe is not None else True


class DeferredMask:
    """The SDPA mask (sdpa_mask's arguments as create_causal_mask passed them), built once, when a layer asks."""

    def __init__(self, arguments: dict[str, Any]):
        self.arguments = arguments
        self._built = False
        self._mask = None

    def build(self):
        if not self._built:
            from transformers.masking_utils import sdpa_mask

            self._mask, self._built = sdpa_mask(**self.arguments), True
        return self._mask


def mask(**arguments):
    """The mask function under VARLEN: a DeferredMask for a row without attention mask and cache, else SDPA's."""
    from transformers.masking_utils import sdpa_mask

    plain_row = (
        arguments.get("attention_mask") is None
        and arguments.get("batch_size") == 1
        and not _nonzero(arguments.get("q_offset", 0))
        and not _nonzero(arguments.get("kv_offset", 0))
        and arguments.get("q_length") == arguments.get("kv_length")
    )
    return DeferredMask(arguments) if plain_row else sdpa_mask(**arguments)


def _nonzero(offset) -> bool:
    return bool(offset != 0) if offset is not None else False


def _varlen_arguments(kwargs: dict[str, Any]) -> Optional[tuple[Any, Any, int, int]]:
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is None or cu_k is None or max_q is None or max_k is None:
        return None
    return cu_q, cu_k, int(max_q), int(max_k)


def attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    **kwargs,
):
    """The attention function under VARLEN: a padding-free row (1, H, L, D) with the collator's cu_seq_lens goes
    through varlen_attn, returning (1, L, Hq, D), None like sdpa_attention_forward; anything else goes to that."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = _varlen_arguments(kwargs)
    params = kernel_parameters()
    if (
        bounds is not None
        and usable_signature(params)
        and query.shape[0] == 1
        # the whole row, no cache (not read from cu_seq_lens: a device-to-host sync in every layer)
        and query.shape[2] == key.shape[2]
        and not dropout  # varlen_attn has no dropout
        and sliding_window is None
        and softcap is None
        and getattr(module, "is_causal", True)
        and query.shape[-1] <= MAX_HEAD_DIM
        and query.shape[-1] % 8 == 0
        and _kernel_dtype(query) is not None
    ):
        return _varlen(query, key, value, scaling, bounds, params), None
    if isinstance(attention_mask, DeferredMask):
        attention_mask = attention_mask.build()
    return sdpa_attention_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
        **kwargs,
    )


def _kernel_dtype(query):
    """The kernel's dtype: on a GPU autocast's (as SDPA would cast fp32 q/k norms' output), else the query's; None
    unless bf16 or fp16 (the call then goes to SDPA). On the CPU (the tests' reference) the query's own."""
    import torch

    if not query.is_cuda:
        return query.dtype
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else query.dtype
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


def _varlen(query, key, value, scaling, bounds, params):
    import torch

    cu_q, cu_k, max_q, max_k = bounds
    dtype = _kernel_dtype(query)
    # (L, heads, D), contiguous as transformers' flash path makes it (modeling_flash_attention_utils.py)
    q, k, v = (x.transpose(1, 2)[0].to(dtype).contiguous() for x in (query, key, value))
    extra: dict[str, Any] = {"scale": scaling, "window_size": (-1, 0)}  # (-1, 0): causal inside each example
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:  # torch 2.11: no enable_gqa; transformers' repeat_kv mapping
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    cu_q, cu_k = (c.to(device=q.device, dtype=torch.int32) for c in (cu_q, cu_k))
    out = _kernel()(q, k, v, cu_q, cu_k, max_q, max_k, **extra)
    return out.unsqueeze(0)


def register() -> None:
    """Make VARLEN an attn_implementation transformers accepts in this process (class-level registries). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, attention_forward)
    AttentionMaskInterface.register(VARLEN, mask)


def ran(model) -> Optional[str]:
    """The attention implementation the loaded model runs (config._attn_implementation), for worker.json."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) if config is not None else None
