"""Padding-free batches on torch's own FlashAttention-2 variable-length kernel, as a transformers attention function.

Where flash-attn is not installed, transformers' SDPA gets a padding-free row (one row of several examples, position
ids restarting at each) as a dense (1, 1, L, L) block mask (masking_utils.py create_causal_mask with
find_packed_sequence_indices); SDPA's flash kernel refuses any mask, so the memory-efficient kernel computes the whole
non-causal L x L block on every layer and saves the mask, turned into a 16-bit bias, for the backward. TRL's collator
already hands the model the examples' boundaries (trl 1.16 sft_trainer.py DataCollatorForLanguageModeling with
padding_free=True: cu_seq_lens_q/k int32 and max_length_q/k), and transformers passes them down to the attention
function in its kwargs (modeling_qwen3.py/modeling_llama.py: **kwargs from the model's forward to each attention
call). This module registers, under launcher/plan/attention.py VARLEN:
- an attention function (transformers modeling_utils.py AttentionInterface.register) that runs a padding-free row
  through `torch.nn.attention.varlen.varlen_attn` (torch 2.11 and newer; aten._flash_attention_forward and its
  backward, CUDA only, bf16/fp16): each example attends causally to itself, no L x L anything. Every other call
  (padded batches, evaluation, generation's prefill and decode) goes to transformers' sdpa_attention_forward with
  SDPA's own mask, as under attn_implementation="sdpa";
- a mask function (masking_utils.py AttentionMaskInterface.register) that builds nothing for a row without an
  attention mask and without a cache (the padding-free layout, training and evaluation alike): it hands the layers
  a DeferredMask that SDPA's mask comes from (sdpa_mask, once per forward) only where a layer takes the SDPA path.
  With an attention mask or a cache it returns sdpa_mask's result itself.

varlen_attn's signature changed between releases (read for each; CPU tests stub the kernel with each signature):
- torch 2.10: `is_causal` and no `scale` (pytorch/pytorch#164502, October 2025): not used, the plan requires 2.11;
- torch 2.11: `*, return_aux, scale, window_size`; causal is window_size=(-1, 0) (pytorch/pytorch#172238 and
  #172245, merged 2026-01-21, before 2.11's branch cut); the backward is registered on the custom op
  (_varlen_attn.register_autograd(_backward, ...), calling aten._flash_attention_backward); no `enable_gqa`, so the
  key/value heads are repeated to the query heads here, as transformers' SDPA path does (repeat_kv). Read from a
  pytorch/pytorch snapshot of varlen.py between those PRs and #179468 (the v2.11.0 tag could not be fetched);
  what runs is decided by the installed signature, not by the version;
- torch 2.12 and 2.13: `enable_gqa` as well (pytorch/pytorch#179468, 2026-04-06; 2.13's
  torch/nn/attention/varlen.py), which lets the kernel share each key/value head without the copy.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

from launcher.plan.attention import VARLEN

# torch's FlashAttention-2 takes head dimensions up to 256 in multiples of 8 (aten flash_api.cpp, mha_varlen_fwd);
# any other shape goes to SDPA.
MAX_HEAD_DIM = 256


def _kernel():
    """torch's varlen_attn, or None where this torch has none. Looked up at each call: the CPU tests stand a
    per-segment reference in for it (the one call that needs a GPU)."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    return getattr(varlen, "varlen_attn", None)


def kernel_parameters() -> Optional[frozenset[str]]:
    """The keyword parameters of this torch's varlen_attn (None without one)."""
    kernel = _kernel()
    if kernel is None:
        return None
    return frozenset(inspect.signature(kernel).parameters)


def usable_signature(params: Optional[frozenset[str]]) -> bool:
    """torch 2.11's signature or newer: a softmax scale and the causal window (window_size=(-1, 0))."""
    return params is not None and {"scale", "window_size"} <= params


def available(device: str, dtype) -> bool:
    """Whether the worker can train padding-free batches on varlen_attn here: a CUDA card of compute capability 8.0+
    in bf16 (the plan's rule for FlashAttention-2: launcher/plan/attention.py implementation), a torch whose
    varlen_attn has 2.11's signature, and torch's flash attention built in (torch.backends.cuda
    is_flash_attention_available: False for a build without it, such as ROCm's without aotriton's flash)."""
    import torch

    if device != "cuda" or dtype != torch.bfloat16 or not usable_signature(kernel_parameters()):
        return False
    probe = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    return bool(probe()) if probe is not None else True


class DeferredMask:
    """The SDPA mask a layer would have had, built only when a layer asks (once per forward: the layers share this
    object). sdpa_mask's own arguments, kept as masking_utils.py create_causal_mask passed them."""

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
    """The mask function registered under VARLEN. A row without an attention mask and without a cache (no offsets,
    keys as long as queries): a DeferredMask, nothing built (padding-free rows run on varlen_attn and never ask for
    it). Anything else (padding, a KV cache while generating): SDPA's own mask, as attn_implementation="sdpa" gets."""
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
    """The attention function registered under VARLEN: query (1, Hq, L, D), key and value (1, Hkv, L, D) of a
    padding-free row with the collator's cu_seq_lens go through varlen_attn; returns (1, L, Hq, D), None like
    transformers' sdpa_attention_forward. Anything else goes to sdpa_attention_forward with SDPA's mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = _varlen_arguments(kwargs)
    params = kernel_parameters()
    if (
        bounds is not None
        and usable_signature(params)
        and query.shape[0] == 1
        # the whole row, no cache in front of it (not read from cu_seq_lens: on the GPU that would wait for the card
        # in every layer, the device-to-host sync TRL computes the boundaries on the CPU to avoid)
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
    """The dtype the kernel runs in: on a GPU autocast's (the Trainer trains under bf16 autocast; Qwen3's q/k norms
    return fp32 where the weights are fp32 master weights, and SDPA, on autocast's lower-precision list, would cast
    them the same way), else the query's own, and None where that is not bf16 or fp16 (FlashAttention-2 has no
    fp32): such a call goes to SDPA. On the CPU (the tests' reference kernel) the query's own."""
    import torch

    if not query.is_cuda:
        return query.dtype
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else query.dtype
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


def _varlen(query, key, value, scaling, bounds, params):
    import torch

    cu_q, cu_k, max_q, max_k = bounds
    dtype = _kernel_dtype(query)
    # (L, heads, D), one copy each as transformers' own flash path makes (modeling_flash_attention_utils.py
    # _prepare_from_posids: .contiguous()): the kernel reads rows and heads by stride, the copy keeps that plain
    q, k, v = (x.transpose(1, 2)[0].to(dtype).contiguous() for x in (query, key, value))
    extra: dict[str, Any] = {"scale": scaling, "window_size": (-1, 0)}  # (-1, 0): causal inside each example
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:  # torch 2.11: no enable_gqa; the same mapping as transformers' repeat_kv (each key head to its group)
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = _kernel()(
        q,
        k,
        v,
        cu_q.to(device=q.device, dtype=torch.int32),
        cu_k.to(device=q.device, dtype=torch.int32),
        max_q,
        max_k,
        **extra,
    )
    return out.unsqueeze(0)


def register() -> None:
    """Make VARLEN a name transformers' from_pretrained(attn_implementation=...) and config._attn_implementation
    accept, in this process (both registries are class-level dicts: modeling_utils.py AttentionInterface,
    masking_utils.py AttentionMaskInterface). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, attention_forward)
    AttentionMaskInterface.register(VARLEN, mask)


def ran(model) -> Optional[str]:
    """The attention implementation the loaded model runs (config._attn_implementation), for worker.json."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) if config is not None else None
