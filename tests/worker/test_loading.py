"""launcher/worker/loading.py: the device per rank, the dtype by compute capability, the weights' dtype per method and
engine, the attention kernel, and the real loading path on CPU (issue 12, items 2, 6, 9, 10, 13).

The choices that depend on CUDA alone are tested with torch.cuda's queries stubbed; the loading itself runs for
real on the CPU with the tiny model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from launcher.plan import attention
from launcher.worker import loading


class FakeCuda:
    """torch.cuda's queries for a box of `count` cards of one compute capability; records set_device."""

    def __init__(self, count: int, capability: tuple[int, int]):
        self.count, self.capability = count, capability
        self.current = 0
        self.set_calls: list[int] = []

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: self.capability)
        # what the old code asked: True on a T4 too (emulation counts)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
        return self

    def set_device(self, index):
        self.set_calls.append(int(index))
        self.current = int(index)


@pytest.mark.parametrize(
    "capability,expected",
    [
        ((7, 5), torch.float16),  # T4
        ((7, 0), torch.float16),  # V100
        ((8, 0), torch.bfloat16),  # A100
        ((8, 9), torch.bfloat16),  # L4 / L40S / RTX 4090
        ((9, 0), torch.bfloat16),  # H100 / H200
        ((12, 0), torch.bfloat16),  # RTX 5090 / B200-class
    ],
)
def test_dtype_follows_compute_capability_not_emulated_bf16(monkeypatch, capability, expected):
    FakeCuda(1, capability).install(monkeypatch)
    device, dtype = loading.select_device()
    assert (device, dtype) == ("cuda", expected)


def test_cpu_is_fp32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert loading.select_device() == ("cpu", torch.float32)


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_each_rank_takes_its_own_gpu_before_loading(monkeypatch, rank):
    cuda = FakeCuda(4, (9, 0)).install(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    loading.select_device()
    assert cuda.set_calls == [rank]
    # every non-sharding engine places the whole model on this rank's card, not on GPU 0
    for engine in ("trl", "ddp", "unsloth"):
        assert loading.device_map("cuda", engine) == {"": rank}
    # the sharding engines place the shards themselves; bitsandbytes then uses the current device, set above
    for engine in ("fsdp", "deepspeed"):
        assert loading.device_map("cuda", engine) is None
    assert cuda.current == rank


def test_a_rank_beyond_the_visible_gpus_is_a_clear_error(monkeypatch):
    FakeCuda(2, (9, 0)).install(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(RuntimeError, match="LOCAL_RANK=2 but this process sees 2 GPU"):
        loading.select_device()


@pytest.mark.parametrize(
    "method,engine,expected",
    [
        ("full", "trl", torch.float32),  # fp32 master weights under bf16 autocast
        ("full", "ddp", torch.float32),
        ("full", "fsdp", torch.bfloat16),  # FSDP2 upcasts trainable parameters itself (mixed precision policy)
        ("full", "deepspeed", torch.bfloat16),  # DeepSpeed's bf16 optimizer keeps fp32 master partitions
        ("full-8bit", "trl", torch.bfloat16),
        ("lora", "ddp", torch.bfloat16),
        ("qlora", "trl", torch.bfloat16),
    ],
)
def test_weights_dtype(method, engine, expected):
    assert loading.weights_dtype(method, engine, "cuda", torch.bfloat16) == expected
    assert loading.weights_dtype(method, engine, "cpu", torch.float32) == torch.float32


def test_fp16_cards_train_full_weights_in_fp32():
    # GradScaler (the Trainer's fp16=True) refuses fp16 gradients: trained weights are fp32 on a T4 / V100
    assert loading.weights_dtype("full-8bit", "trl", "cuda", torch.float16) == torch.float32
    assert loading.weights_dtype("lora", "trl", "cuda", torch.float16) == torch.float16  # frozen base stays 16-bit


def test_fp32_master_weights_keep_small_updates_that_bf16_loses():
    # why item 9 matters: an AdamW step of 1e-5 relative to the weight disappears in bf16, not in fp32
    w = torch.ones(4)
    step = torch.full((4,), 1e-5)
    assert torch.equal((w.bfloat16() + step.bfloat16()).float(), w)
    assert not torch.equal(w + step, w)


def test_flash_attention_only_where_flash_attn_2_is_installed_on_a_bf16_card(monkeypatch):
    monkeypatch.setattr(loading, "_flash_attn_2_installed", lambda: True)
    assert loading.attention_implementation("cuda", torch.bfloat16) == "flash_attention_2"
    # FlashAttention-2 needs compute capability 8.0: the fp16 cards (T4, V100) keep SDPA
    assert loading.attention_implementation("cuda", torch.float16) is None
    assert loading.attention_implementation("cuda", torch.float32) is None
    assert loading.attention_implementation("cpu", torch.float32) is None
    monkeypatch.setattr(loading, "_flash_attn_2_installed", lambda: False)
    # without flash-attn: torch's own varlen kernel where torch has flash attention built in (a CUDA build; the one
    # device query stood in for here), registered with transformers by the call
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    assert loading.attention_implementation("cuda", torch.bfloat16) is None
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    assert loading.attention_implementation("cuda", torch.bfloat16) == attention.VARLEN
    assert loading.attention_implementation("cuda", torch.float16) is None
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert attention.VARLEN in AttentionInterface._global_mapping
    assert attention.VARLEN in AttentionMaskInterface._global_mapping
    facts = loading.attention_facts("cuda", torch.bfloat16)
    assert facts["implementation"] == attention.VARLEN and "varlen_attn" in facts["kernels"]["padding_free"]
    assert facts["kernels"]["padded"].startswith("SDPA") and facts["kernels"]["decode"] == facts["kernels"]["padded"]
    assert "ftrun_varlen" in facts["line"] and facts["why"] is None
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    facts = loading.attention_facts("cuda", torch.bfloat16)
    assert facts["implementation"] == "sdpa" and "dense L x L mask" in facts["kernels"]["padding_free"]
    assert "flash-attn 2 is not installed" in facts["why"] and torch.__version__ in facts["why"]
    assert loading.attention_facts("cuda", torch.bfloat16, engine="unsloth")["implementation"] == "unsloth"


def test_flash_attn_2_test_is_transformers_own():
    # on this CPU box transformers says no (no CUDA, no flash-attn): the worker keeps SDPA
    assert loading._flash_attn_2_installed() is False


def _recipe(model, method="lora", checkpointing=True):
    lora = SimpleNamespace(r=4, alpha=8, dropout=0.0, target_modules="all-linear")
    return SimpleNamespace(model=str(model), method=method, gradient_checkpointing=checkpointing, lora=lora)


def test_real_load_on_cpu_places_and_describes(tiny_model):
    model, tokenizer = loading.load_model_and_tokenizer(_recipe(tiny_model), "cpu", torch.float32, {"engine": "trl"})
    assert {str(p.device) for p in model.parameters()} == {"cpu"}
    assert tokenizer.pad_token is not None
    text = loading.describe_model(model)
    assert "on cpu in float32" in text and "trainable" in text


def test_qlora_keeps_the_16_bit_tensors_16_bit_as_the_plan_counts_them(tiny_model):
    """Issue 32 item 2: the QLoRA load no longer runs PEFT's prepare_model_for_kbit_training, whose fp32 upcast of
    the embeddings, head and norms the plan never counted. The same loading path in bf16 on the CPU: the tensors
    that are not 4-bit stay bf16 (the plan's 2 B each: sizing.memory's "embedding/head/norm params"), the residual
    stream stays bf16, and a step's saved activations against the upcast path (PEFT's own function on the same
    4-bit model) are measured side by side. Checkpointing is the trainer's, on every engine (SFTConfig; under FSDP
    the accelerate config's), so loading turns on none. The saved activations are the decoder's (the head's and
    the loss's are fp32 either way)."""
    pytest.importorskip("bitsandbytes")
    import json

    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    from launcher.plan import models

    recipe = _recipe(tiny_model, method="qlora")
    arch = models.from_config(json.loads((tiny_model / "config.json").read_text()), "tiny", "test")
    batch = torch.randint(0, arch.vocab, (2, 32))

    def measure(model):  # a step as the trainer runs it: layers checkpointed, so each saves its input
        base = model.get_base_model()
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        other = [p for n, p in base.named_parameters() if type(p).__name__ != "Params4bit" and "lora_" not in n]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t
        ):
            out = base.model(input_ids=batch, output_hidden_states=True)  # the decoder: the layers' inputs
        out.last_hidden_state.float().sum().backward()
        return {
            "other_params": sum(p.numel() for p in other),
            "other_dtypes": {str(p.dtype) for p in other},
            "other_bytes": sum(p.numel() * p.element_size() for p in other),
            "residual": str(out.hidden_states[1].dtype),
            "saved_bytes": sum(saved),
        }

    for engine in ("trl", "fsdp", "deepspeed"):
        model, _ = loading.load_model_and_tokenizer(recipe, "cpu", torch.bfloat16, {"engine": engine})
        assert not model.get_base_model().is_gradient_checkpointing, engine
    ours = measure(model)
    assert ours["other_dtypes"] == {"torch.bfloat16"} and ours["residual"] == "torch.bfloat16", ours
    assert ours["other_params"] == arch.params - arch.linear_params  # what the plan counts at 2 B
    assert ours["other_bytes"] == 2 * ours["other_params"]

    old = AutoModelForCausalLM.from_pretrained(
        str(tiny_model), **loading.load_kwargs(recipe, "cpu", torch.bfloat16, "trl")
    )
    old = get_peft_model(
        prepare_model_for_kbit_training(old, use_gradient_checkpointing=False),
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    theirs = measure(old)
    assert theirs["other_dtypes"] == {"torch.float32"} and theirs["residual"] == "torch.float32", theirs
    assert theirs["other_bytes"] == 2 * ours["other_bytes"]  # the upcast: +2 B per 16-bit parameter
    # each checkpointed layer's input (tokens x hidden) in fp32: 2 B more per value than the plan's bf16
    assert theirs["saved_bytes"] - ours["saved_bytes"] >= arch.layers * batch.numel() * arch.hidden * 2, (ours, theirs)
    print(
        f"QLoRA bf16 tiny model: 16-bit tensors {ours['other_bytes']:,} B (upcast {theirs['other_bytes']:,}); "
        f"a step's saved activations {ours['saved_bytes']:,} B (upcast {theirs['saved_bytes']:,}, "
        f"x{theirs['saved_bytes'] / ours['saved_bytes']:.2f})"
    )
