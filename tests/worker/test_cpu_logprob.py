"""launcher/worker/cpu_logprob.py: TRL's fused LM head on the CPU gives the model's own loss and gradients, and TRL's
own per-token metrics, with the real trl 1.16 head (add_fused_lm_head) on a real PEFT LoRA model."""

from __future__ import annotations

import pytest
import torch

from launcher.plan import loss_head
from launcher.worker import cpu_logprob, fused_head

VOCAB = 3000


def _model(lora: bool = True):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    if lora:
        model = get_peft_model(
            model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
        )
    return model


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 40), generator=g)
    labels = ids.clone()
    labels[0, :7] = -100  # a prompt that is not trained
    labels[1, 30:] = -100
    return ids, labels


def _loss_and_grads(model, fused: bool):
    model.zero_grad()
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels, fused_lm_head=True) if fused else model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out, grads


@pytest.fixture
def trl_kernel(monkeypatch):
    """TRL's module as shipped, restored after the test (install() replaces its kernel reference)."""
    from trl.trainer import utils

    monkeypatch.setattr(utils, "_ChunkedLogProbFunction", utils._ChunkedLogProbFunction)
    return utils


@pytest.mark.parametrize("chunk_elements", [loss_head.CPU_LOSS_CHUNK_ELEMENTS, 16 * VOCAB])
def test_loss_and_gradients_equal_the_models_own(trl_kernel, monkeypatch, chunk_elements):
    from trl.trainer.utils import add_fused_lm_head

    monkeypatch.setattr(loss_head, "CPU_LOSS_CHUNK_ELEMENTS", chunk_elements)  # 16 tokens a chunk: 5 chunks of 80
    model = _model()
    plain, plain_grads = _loss_and_grads(model, fused=False)
    add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))  # as SFTTrainer does
    theirs, trl_grads = _loss_and_grads(model, fused=True)
    assert fused_head.install()
    assert isinstance(trl_kernel._ChunkedLogProbFunction, fused_head._Dispatch)
    ours, our_grads = _loss_and_grads(model, fused=True)

    assert ours.loss.item() == pytest.approx(plain.loss.item(), rel=1e-5)
    for name, g in plain_grads.items():
        torch.testing.assert_close(our_grads[name], g, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(our_grads[name], trl_grads[name], rtol=1e-4, atol=1e-6)
    # TRL's metrics (entropy, token accuracy) are still computed, equal to its own kernel's
    torch.testing.assert_close(ours.entropy, theirs.entropy, rtol=1e-4, atol=1e-5)
    assert torch.equal(ours.is_top1, theirs.is_top1)
    assert torch.equal(ours.label_mask, theirs.label_mask)


def test_a_trainable_head_goes_to_trls_kernel(trl_kernel, monkeypatch):
    from trl.trainer.utils import add_fused_lm_head

    model = _model(lora=False)  # full fine-tuning: the head learns, its gradient needs TRL's backward
    plain, plain_grads = _loss_and_grads(model, fused=False)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    fused_head.install()
    calls = []
    monkeypatch.setattr(cpu_logprob, "function", lambda: calls.append(1))
    ours, grads = _loss_and_grads(model, fused=True)
    assert not calls
    assert ours.loss.item() == pytest.approx(plain.loss.item(), rel=1e-5)
    torch.testing.assert_close(grads["lm_head.weight"], plain_grads["lm_head.weight"], rtol=1e-4, atol=1e-6)


def test_installed_once(trl_kernel):
    before = trl_kernel._ChunkedLogProbFunction
    assert fused_head.install() and fused_head.install()  # twice: wrapped once
    assert trl_kernel._ChunkedLogProbFunction.trl_function is before
