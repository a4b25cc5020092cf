"""launcher/worker/varlen.py: torch's FlashAttention-2 varlen kernel registered as a transformers attention function.

End to end on CPU: the tiny Qwen3-shaped model (grouped-query attention: 4 query heads, 2 key/value heads) loaded
with the registered implementation, TRL's real padding-free collator, transformers' real mask and attention
dispatch. The one call that needs a GPU, torch.nn.attention.varlen.varlen_attn (aten._flash_attention_forward),
is stood in for by a per-segment reference: plain causal SDPA over each example alone, with the signature of the
torch it stands for. The loss, every example's logits and every parameter's gradient must equal the padded batch's
through SDPA with its mask; no mask is built for the padding-free row; padded batches, a packed row without the
collator's boundaries and generation take SDPA's path with SDPA's mask.
"""

from __future__ import annotations

import functools
import inspect

import pytest

torch = pytest.importorskip("torch")

from launcher.plan.attention import VARLEN  # noqa: E402
from launcher.worker import varlen  # noqa: E402

# fp32 on CPU: the same attention per example, summed in another order over a longer row
TOLERANCE = 2e-5


def _reference(
    calls,
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    **unused,
):
    """varlen_attn's result computed per example with plain SDPA: (T, H, D) in, (T, H, D) out."""
    calls.append(
        {
            "heads": (query.shape[1], key.shape[1]),
            "enable_gqa": enable_gqa,
            "window_size": window_size,
            "cu": cu_seq_q.tolist(),
            "max": (max_q, max_k),
            "dtype": cu_seq_q.dtype,
        }
    )
    # a tuple: varlen_attn tests `window_size == (-1, 0)` for causality (a list would run non-causal)
    assert torch.equal(cu_seq_q, cu_seq_k) and window_size == (-1, 0) and isinstance(window_size, tuple)
    out = []
    for a, b in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        q, k, v = (x[a:b].transpose(0, 1) for x in (query, key, value))
        out.append(
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
            ).transpose(0, 1)
        )
    return torch.cat(out)


def _torch_2_11_signature(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    k_cache=None,
    v_cache=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    page_table=None,
    seqused_k=None,
):
    """torch 2.11's varlen_attn signature (no enable_gqa; torch/nn/attention/varlen.py between pytorch#172245 and
    #179468)."""


@pytest.fixture
def kernel(request, monkeypatch):
    """The reference in place of varlen_attn, with the signature of this torch (2.13: enable_gqa; the default) or of
    2.11 (indirect parametrization)."""
    from torch.nn.attention import varlen as torch_varlen

    flavour = getattr(request, "param", "installed")
    calls: list[dict] = []
    reference = functools.partial(_reference, calls)
    model = torch_varlen.varlen_attn if flavour == "installed" else _torch_2_11_signature
    stub = functools.wraps(model)(lambda *a, **k: reference(*a, **k))
    assert inspect.signature(stub) == inspect.signature(model)
    monkeypatch.setattr(torch_varlen, "varlen_attn", stub)
    return flavour, calls


@pytest.fixture
def mask_builds(monkeypatch):
    """Every SDPA mask transformers builds (a spy around masking_utils.sdpa_mask, which still builds it)."""
    from transformers import masking_utils

    built = []
    original = masking_utils.sdpa_mask

    def spy(*args, **kwargs):
        mask = original(*args, **kwargs)
        built.append(None if mask is None else tuple(mask.shape))
        return mask

    monkeypatch.setattr(masking_utils, "sdpa_mask", spy)
    return built


def _models(tiny_model):
    from transformers import AutoModelForCausalLM

    varlen.register()
    a = AutoModelForCausalLM.from_pretrained(str(tiny_model), attn_implementation=VARLEN, dtype=torch.float32)
    b = AutoModelForCausalLM.from_pretrained(str(tiny_model), attn_implementation="sdpa", dtype=torch.float32)
    assert a.config._attn_implementation == VARLEN and varlen.ran(a) == VARLEN
    return a, b


def _examples():
    return [[5 + (7 * i + 3 * j) % 200 for j in range(n)] for i, n in enumerate((9, 4, 13, 6))]


def _batches():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    rows = [{"input_ids": e} for e in _examples()]
    free = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(rows)
    padded = DataCollatorForLanguageModeling(pad_token_id=0)(rows)
    assert {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"} <= set(free)
    assert "attention_mask" not in free and "attention_mask" in padded
    return free, padded


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch, use_cache=False)  # TRL's compute_loss passes use_cache=False
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kernel", ["installed", "2.11"], indirect=True)
def test_padding_free_rows_on_the_varlen_kernel_equal_the_padded_batch(tiny_model, kernel, mask_builds):
    flavour, calls = kernel
    model, _ = _models(tiny_model)
    free, padded = _batches()
    mask_builds.clear()
    out_free, grads_free = _step(model, free)
    assert mask_builds == []  # no mask of any shape for the padding-free row
    layers = model.config.num_hidden_layers
    assert len(calls) == layers  # every layer's attention ran on the kernel
    lengths = [len(e) for e in _examples()]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    for call in calls:
        assert call["cu"] == bounds and call["max"] == (max(lengths), max(lengths)) and call["dtype"] == torch.int32
        # grouped-query attention: the kernel shares the key/value heads (enable_gqa), or torch 2.11 gets them
        # repeated to the query heads
        assert call["heads"] == ((4, 2) if flavour == "installed" else (4, 4))
        assert call["enable_gqa"] is (flavour == "installed")

    out_pad, grads_pad = _step(model, padded)
    assert mask_builds and mask_builds[0][-2:] == (max(lengths), max(lengths))  # padded: SDPA's own mask
    assert len(calls) == layers  # and not the kernel
    assert abs(out_free.loss.item() - out_pad.loss.item()) < TOLERANCE
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        assert torch.allclose(out_free.logits[0, a:b], out_pad.logits[i, : b - a], atol=TOLERANCE)
    assert grads_free.keys() == grads_pad.keys()
    for name in grads_free:
        assert torch.allclose(grads_free[name], grads_pad[name], atol=TOLERANCE, rtol=1e-4), name


def test_the_kernel_path_is_what_makes_the_difference(tiny_model, kernel):
    """A control: the same row with the examples' boundaries taken away (one sequence) changes the loss, so the
    equality above is the kernel keeping the examples apart."""
    model, _ = _models(tiny_model)
    free, padded = _batches()
    n = free["input_ids"].shape[1]
    crossed = {**free, "cu_seq_lens_q": torch.tensor([0, n], dtype=torch.int32), "max_length_q": n}
    crossed.update(cu_seq_lens_k=crossed["cu_seq_lens_q"], max_length_k=n)
    with torch.no_grad():
        a = model(**free, use_cache=False).loss.item()
        b = model(**crossed, use_cache=False).loss.item()
    assert abs(a - b) > 100 * TOLERANCE


def test_without_the_collators_boundaries_a_packed_row_gets_sdpas_mask(tiny_model, kernel, mask_builds):
    """position_ids alone (no cu_seq_lens): the deferred mask is built, once per forward, and SDPA keeps the
    examples apart exactly as attn_implementation="sdpa" does."""
    model, sdpa = _models(tiny_model)
    free, _ = _batches()
    plain = {k: free[k] for k in ("input_ids", "position_ids", "labels")}
    mask_builds.clear()
    with torch.no_grad():
        a = model(**plain, use_cache=False).logits
        assert len(mask_builds) == 1 and mask_builds[0] == (
            1,
            1,
            plain["input_ids"].shape[1],
            plain["input_ids"].shape[1],
        )
        b = sdpa(**plain, use_cache=False).logits
    assert kernel[1] == [] and torch.equal(a, b)


def test_padded_batches_and_generation_take_sdpas_path(tiny_model, kernel):
    model, sdpa = _models(tiny_model)
    _, padded = _batches()
    with torch.no_grad():
        assert torch.equal(model(**padded).logits, sdpa(**padded).logits)
    prompt = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])  # left-padded, as the task evaluation generates
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kwargs), sdpa.generate(prompt, **kwargs))
    assert kernel[1] == []


def test_available_only_on_a_bf16_card_with_a_usable_signature():
    assert not varlen.available("cpu", torch.bfloat16)
    assert not varlen.available("cuda", torch.float16)
    assert varlen.usable_signature(frozenset(inspect.signature(_torch_2_11_signature).parameters))
    assert not varlen.usable_signature(frozenset({"query", "is_causal", "return_aux"}))  # torch 2.10
    assert not varlen.usable_signature(None)
    assert varlen.usable_signature(varlen.kernel_parameters())  # this torch (2.13)


def test_the_gpu_checks_kernel_switch_reaches_a_built_peft_model(tiny_model, kernel):
    """bench-padding switches one built model between the kernels (padding._set_kernel): transformers reads the
    implementation at every forward, through PEFT's wrapper too."""
    from gpu_check import padding
    from gpu_check.common import worker_recipe
    from launcher.worker.loading import add_lora

    _, sdpa = _models(tiny_model)
    model = add_lora(sdpa, worker_recipe(tiny_model))
    free, _ = _batches()
    with torch.no_grad():
        model(**free, use_cache=False)
        assert kernel[1] == []
        padding._set_kernel(model, VARLEN)
        model(**free, use_cache=False)
        assert len(kernel[1]) == model.config.num_hidden_layers
        padding._set_kernel(model, "sdpa")
        model(**free, use_cache=False)
    assert len(kernel[1]) == model.config.num_hidden_layers


def test_trls_trainer_hands_the_boundaries_down_to_the_kernel(tiny_model, kernel, tmp_path):
    """One step of TRL's SFTTrainer with the worker's padding-free collator (trainer_config.padding_free_collator):
    compute_loss passes the collator's cu_seq_lens through the Trainer to every layer's kernel call."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from launcher.worker.trainer_config import padding_free_collator

    model, _ = _models(tiny_model)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    recipe = type("R", (), {"padding_free": True, "packing": False})()
    args = SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        logging_strategy="no",
        save_strategy="no",
        dataset_text_field="text",
    )
    data = Dataset.from_list([{"text": " ".join(["word"] * n)} for n in (5, 9, 3, 7)])
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        data_collator=padding_free_collator(recipe, tokenizer),
    )
    trainer.train()
    calls = kernel[1]
    assert len(calls) >= model.config.num_hidden_layers and len(calls[0]["cu"]) == 5  # 4 examples, their bounds
