"""launcher/worker/loading.py: the device per rank, the dtype by compute capability, the weights' dtype per method and
engine, the attention kernel, and the real loading path on CPU (issue 12, items 2, 6, 9, 10, 13).

The choices that depend on CUDA alone are tested with torch.cuda's queries stubbed; the loading itself runs for
real on the CPU with the tiny model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

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


@pytest.mark.parametrize("capability,expected", [
    ((7, 5), torch.float16),   # T4
    ((7, 0), torch.float16),   # V100
    ((8, 0), torch.bfloat16),  # A100
    ((8, 9), torch.bfloat16),  # L4 / L40S / RTX 4090
    ((9, 0), torch.bfloat16),  # H100 / H200
    ((12, 0), torch.bfloat16),  # RTX 5090 / B200-class
])
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


@pytest.mark.parametrize("method,engine,expected", [
    ("full", "trl", torch.float32),      # fp32 master weights under bf16 autocast
    ("full", "ddp", torch.float32),
    ("full", "fsdp", torch.bfloat16),    # FSDP2 upcasts trainable parameters itself (mixed precision policy)
    ("full", "deepspeed", torch.bfloat16),  # DeepSpeed's bf16 optimizer keeps fp32 master partitions
    ("full-8bit", "trl", torch.bfloat16),
    ("lora", "ddp", torch.bfloat16),
    ("qlora", "trl", torch.bfloat16),
])
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
    assert loading.attention_implementation("cuda", torch.bfloat16) is None


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


def test_qlora_under_fsdp_checkpoints_once(tiny_model):
    """Item 10: prepare_model_for_kbit_training must not turn on the model's own checkpointing under FSDP, whose
    accelerate config checkpoints every layer itself (engines/fsdp.py); the other engines keep it."""
    pytest.importorskip("bitsandbytes")
    recipe = _recipe(tiny_model, method="qlora")
    fsdp, _ = loading.load_model_and_tokenizer(recipe, "cpu", torch.float32, {"engine": "fsdp"})
    trl, _ = loading.load_model_and_tokenizer(recipe, "cpu", torch.float32, {"engine": "trl"})
    assert not fsdp.get_base_model().is_gradient_checkpointing
    assert trl.get_base_model().is_gradient_checkpointing
    assert any(type(m).__name__ == "Linear4bit" for m in fsdp.modules())
