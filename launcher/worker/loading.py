"""Model loading in the worker: which device this rank uses, in which dtype, and how the base model is built.

One place decides, per engine and method, the device of this process (from LOCAL_RANK), the compute dtype
(from the card's compute capability), the weights' dtype, the quantization config and the attention kernel,
then loads the model and adds LoRA. The worker (`launcher/worker/train.py`), the FSDP exercise and the GPU check call
it, so what the GPU check proves is what the worker does. Engine-specific contexts (DeepSpeed's partitioned
loading) and Unsloth's own loader are chosen by the worker and passed in; this module imports no backend.

Sources relied on (installed versions: torch 2.13, transformers 5.24, peft 0.21, bitsandbytes 0.50,
accelerate 1.15):
- torch.cuda.is_bf16_supported(including_emulation=True) is True on any CUDA device whose bf16 tensors can be
  created (emulated on T4/V100, compute capability 7.x): `torch/cuda/__init__.py`. The choice below reads the
  compute capability instead: bf16 needs 8.0 (Ampere) for tensor-core speed.
- transformers' `from_pretrained(device_map=None)` with a bitsandbytes config places the model on
  `torch.cuda.current_device()` (`transformers/quantizers/quantizer_bnb_4bit.py`, update_device_map), which is
  device 0 until `torch.cuda.set_device` is called: so the device is set from LOCAL_RANK before any load.
"""

from __future__ import annotations

import os
from typing import Any, Optional

# Engines that shard or partition the weights themselves: they load without a device map (transformers
# refuses a device_map under ZeRO-3's partitioned loading; FSDP places the shards on each rank's device).
SHARDING_ENGINES = ("fsdp", "deepspeed")


def local_rank() -> int:
    """This process's index on its box: torchrun and accelerate launch set LOCAL_RANK (0 for one process)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def compute_dtype(capability: Optional[tuple[int, int]]):
    """bf16 on compute capability 8.0+ (A100, L4/L40S, RTX 30/40/50, H100, ...), fp16 on 7.x (T4, V100) and
    below, fp32 on the CPU (capability None).

    Not torch.cuda.is_bf16_supported(): it counts emulation, which makes a T4 or V100 train bf16 at a
    fraction of its fp16 tensor-core speed. fp16 trains with the Trainer's loss scaling (fp16=True).
    """
    import torch

    from launcher.plan.sizing import training_precision  # the plan's rule: the plan and the worker cannot disagree

    if capability is None:
        return torch.float32
    return torch.bfloat16 if training_precision("cuda", tuple(capability)) == "bf16" else torch.float16


def select_device() -> tuple[str, Any]:
    """('cuda', dtype) on this rank's own GPU, made the current device, or ('cpu', fp32): detected, never configured.

    Called once at worker start, before the model, a process group or a memory cap touch CUDA: without
    set_device every rank would allocate on GPU 0 (and NCCL would bind every rank to it).
    """
    import torch

    if not torch.cuda.is_available():
        return "cpu", torch.float32
    index = local_rank()
    count = torch.cuda.device_count()
    if index >= count:
        raise RuntimeError(f"LOCAL_RANK={index} but this process sees {count} GPU(s) "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    torch.cuda.set_device(index)
    return "cuda", compute_dtype(torch.cuda.get_device_capability(index))


def weights_dtype(method: str, engine: str, device: str, dtype):
    """The dtype the base weights are loaded in.

    Full fine-tuning with the Trainer's own loop (trl, ddp) keeps fp32 weights and trains under bf16/fp16
    autocast (SFTConfig bf16/fp16): AdamW updates near 1e-5 of a weight vanish when added to a bf16 weight
    (8 bits of mantissa), and training stalls quietly. Memory is what the sizer counts for full fine-tuning
    (16 bytes per parameter: fp32 weight 4, fp32 gradient 4, m and v 8). FSDP2 upcasts trainable parameters
    to fp32 itself under mixed precision (accelerate/utils/fsdp_utils.py, fsdp2_prepare_model) and DeepSpeed's
    bf16 optimizer keeps fp32 master partitions, so both load in the compute dtype. full-8bit keeps 16-bit
    weights: the 8-bit optimizer is chosen to save memory, and the sizer counts it that way, except on fp16 cards
    (compute capability below 8.0): the Trainer's fp16 loss scaling refuses to unscale fp16 gradients
    (torch/amp/grad_scaler.py, "Attempting to unscale FP16 gradients"), so trained weights are fp32 there.
    """
    import torch

    if device != "cuda" or engine in SHARDING_ENGINES:
        return dtype
    if method == "full" or (method == "full-8bit" and dtype == torch.float16):
        return torch.float32
    return dtype


def device_map(device: str, engine: str) -> Optional[dict[str, Any]]:
    """from_pretrained's device_map: this rank's own GPU, the CPU, or None for the sharding engines."""
    if engine in SHARDING_ENGINES:
        return None
    if device == "cuda":
        return {"": local_rank()}
    return {"": "cpu"}


def _flash_attn_2_installed() -> bool:
    # transformers' own test: the "flash-attn" distribution (flash-attn-4 installs the same module name) at 2.3.3 or
    # newer, with CUDA (transformers/utils/import_utils.py, is_flash_attn_2_available)
    from transformers.utils import is_flash_attn_2_available

    return bool(is_flash_attn_2_available())


def attention_implementation(device: str, dtype) -> Optional[str]:
    """flash_attention_2 where flash-attn 2 is installed on a bf16 card, else transformers' default (SDPA).

    Padding-free batches (ftrun's default) carry position_ids that mark the examples; SDPA turns them into a
    dense block-diagonal mask over the whole micro-batch, flash-attention into variable-length kernels
    without a mask. FlashAttention-2 runs on compute capability 8.0 and newer only ("FlashAttention only supports
    Ampere GPUs or newer", at the first forward; transformers checks a minimum capability for FA3/FA4 only):
    the bf16 cards by the plan's rule (compute_dtype), never the fp16 ones (T4, V100).
    """
    import torch

    if device != "cuda" or dtype != torch.bfloat16:
        return None
    return "flash_attention_2" if _flash_attn_2_installed() else None


def quantization_config(method: str, dtype):
    """QLoRA's 4-bit NF4 config; quant storage in the compute dtype so FSDP can shard the 4-bit weights
    (accelerate excludes non-floating Params4bit from sharding: fsdp2_prepare_model)."""
    if method != "qlora":
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype,
    )


def fsdp_qlora_kwargs(method: str, engine: str) -> dict[str, Any]:
    """QLoRA under FSDP loads and quantizes on this rank's CPU: {"device_map": {"": "cpu"}}, else {}.

    Why (transformers 5.24, accelerate 1.15, bitsandbytes 0.50, torch 2.13):
    - without a device map bitsandbytes puts the whole 4-bit model on the current GPU
      (quantizer_bnb_4bit.update_device_map), and each rank keeps all of it until accelerate shards it: a 70B
      model is 39.5 GB on every card, more than a 24 GB card holds;
    - accelerate's low-memory path (model to meta, rank 0's state dict broadcast) is skipped for 4-bit weights
      (utils/fsdp_utils.py, fsdp2_prepare_model: "will still cause the VRAM spike"), and transformers' FSDP-aware
      loading (is_fsdp_enabled) neither applies to quantized models nor exists before the process group does;
    - on the CPU, transformers quantizes each weight where it is loaded (integrations/bitsandbytes.py,
      Bnb4bitQuantize: Params4bit(...).to(value.device)) with bitsandbytes' CPU kernels; with the quant storage
      in the compute dtype (quantization_config) FSDP2 can shard the packed weights, and fully_shard moves one
      unit at a time to the rank's GPU (torch fsdp _fsdp_init._move_states_to_device), so a card holds its shards
      plus one unit while sharding (none with parameter offload), never the whole model;
    - bitsandbytes' Linear4bit recovers the quant state FSDP's unsharded parameter loses from the module
      (nn/modules.py, fix_4bit_weight_quant_state_from_module); accelerate's Params4bit check in prepare_model
      is not on the FSDP2 path (_prepare_fsdp2 calls fsdp2_prepare_model only).
    The cost, counted by the plan (sizing._loading, load_seconds): every rank holds the whole 4-bit model in RAM
    until it is sharded, and quantizing on the CPU is slower than on a GPU.
    """
    if method == "qlora" and engine == "fsdp":
        return {"device_map": {"": "cpu"}}
    return {}


def load_kwargs(recipe, device: str, dtype, engine: str) -> dict[str, Any]:
    """Every from_pretrained argument this module decides, in one dict (the GPU check reports it)."""
    kwargs: dict[str, Any] = {"dtype": weights_dtype(recipe.method, engine, device, dtype),
                              "device_map": device_map(device, engine)}
    quant = quantization_config(recipe.method, dtype)
    if quant is not None:
        kwargs["quantization_config"] = quant
    attn = attention_implementation(device, dtype)
    if attn is not None:
        kwargs["attn_implementation"] = attn
    kwargs.update(fsdp_qlora_kwargs(recipe.method, engine))
    return kwargs


def load_tokenizer(recipe):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(recipe.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def add_lora(model, recipe, engine: str):
    """LoRA on the base model (after kbit preparation for QLoRA)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if recipe.method == "qlora" and engine == "fsdp":
        # Not prepare_model_for_kbit_training under FSDP: it would turn on the model's own activation
        # checkpointing beside FSDP's (fsdp_activation_checkpointing in the accelerate config, engines/fsdp.py),
        # which wraps every layer twice and breaks the sharded backward; and its fp32 upcast of the embeddings,
        # head and norms (about 4 GB more for a 70B model, per rank while loading) buys nothing there, since
        # FSDP2's mixed-precision policy casts every parameter to bf16 for compute. transformers' own FSDP+QLoRA
        # example loads the 4-bit model and hands it to the trainer the same way.
        pass
    elif recipe.method == "qlora":
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=recipe.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    elif recipe.gradient_checkpointing:
        model.enable_input_require_grads()  # checkpointed LoRA needs grads flowing into the frozen embeddings
    lora = recipe.lora
    return get_peft_model(model, LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=lora.target_modules, task_type="CAUSAL_LM",
    ))


def load_model_and_tokenizer(recipe, device: str, dtype, plan: Optional[dict] = None, context=None):
    """The base model by method (4-bit for qlora, 16-bit for lora, fp32 master weights for full on trl/ddp), then LoRA.

    `context`: a context manager the engine wraps the load in (DeepSpeed ZeRO-3 partitions while loading).
    """
    import contextlib

    from transformers import AutoModelForCausalLM

    engine = (plan or {}).get("engine", "trl")
    tokenizer = load_tokenizer(recipe)
    kwargs = load_kwargs(recipe, device, dtype, engine)
    with context if context is not None else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(recipe.model, **kwargs)
    if recipe.method in ("qlora", "lora"):
        model = add_lora(model, recipe, engine)
    if is_main_process():
        print("[ftrun worker] " + describe_model(model), flush=True)
        if device == "cuda" and "attn_implementation" not in kwargs:  # the fallback is said, once
            import torch

            why = ("FlashAttention-2 needs compute capability 8.0" if dtype != torch.bfloat16
                   else "flash-attn 2 is not installed")
            print(f"[ftrun worker] attention: transformers' default (SDPA), not flash_attention_2: {why}; "
                  "padding-free batches then carry a dense mask", flush=True)
    return model, tokenizer


def describe_model(model) -> str:
    """What was actually built: parameter counts, where and how the base weights are stored (says 4-bit only if it is)."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    kinds: dict[str, int] = {}
    for module in model.modules():
        name = type(module).__name__
        if name in ("Linear4bit", "Linear8bitLt", "Linear"):
            kinds[name] = kinds.get(name, 0) + 1
    layers = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    devices = sorted({str(p.device) for p in model.parameters()})
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
    return (f"model: {total:,} parameters, {trainable:,} trainable; linear layers: {layers}; "
            f"on {', '.join(devices)} in {', '.join(dtypes)}")
