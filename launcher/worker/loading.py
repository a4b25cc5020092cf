"""Model loading in the worker, the FSDP exercise and the GPU check: device, dtypes, quantization, attention, LoRA.

Versions: torch 2.13, transformers 5.24, peft 0.21, bitsandbytes 0.50, accelerate 1.15. With a bitsandbytes config and
no device map transformers loads onto torch.cuda.current_device() (quantizers/quantizer_bnb_4bit.py update_device_map).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from pathlib import Path
from typing import Any, Optional

from launcher.engine_kinds import SHARDING as SHARDING_ENGINES
from launcher.methods import METHODS, is_adapter, is_quantized
from launcher.worker.process import _say

# SHARDING_ENGINES place the weights themselves: no device map (transformers refuses one under ZeRO-3's loading)


def local_rank() -> int:
    """This process's index on its box: torchrun and accelerate launch set LOCAL_RANK (0 for one process)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def compute_dtype(capability: Optional[tuple[int, int]]):
    """bf16 from compute capability 8.0, fp16 below, fp32 on the CPU; not torch.cuda.is_bf16_supported(), which
    counts emulation (torch/cuda/__init__.py)."""
    import torch

    from launcher.plan.throughput import training_precision  # the plan's rule: the plan and the worker cannot disagree

    if capability is None:
        return torch.float32
    return torch.bfloat16 if training_precision("cuda", tuple(capability)) == "bf16" else torch.float16


def select_device() -> tuple[str, Any]:
    """('cuda', dtype) on this rank's own GPU, made current before anything touches CUDA, or ('cpu', fp32)."""
    import torch

    apply_sdpa_backends()
    if not torch.cuda.is_available():
        return "cpu", torch.float32
    index = local_rank()
    count = torch.cuda.device_count()
    if index >= count:
        raise RuntimeError(
            f"LOCAL_RANK={index} but this process sees {count} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )
    torch.cuda.set_device(index)
    return "cuda", compute_dtype(torch.cuda.get_device_capability(index))


def weights_dtype(method: str, engine: str, device: str, dtype):
    """The dtype the base weights load in: fp32 for full fine-tuning on trl/ddp (AdamW updates near 1e-5 of a weight
    vanish in bf16) and for full-8bit on fp16 cards (torch/amp/grad_scaler.py: "Attempting to unscale FP16
    gradients"); FSDP2 and DeepSpeed load the compute dtype, keep fp32 masters (accelerate fsdp2_prepare_model)."""
    import torch

    if device != "cuda" or engine in SHARDING_ENGINES:
        return dtype
    table = METHODS[method]
    if (not table.adapter and not table.eight_bit_optimizer) or (table.eight_bit_optimizer and dtype == torch.float16):
        return torch.float32
    return dtype


def device_map(device: str, engine: str) -> Optional[dict[str, Any]]:
    """from_pretrained's device_map: this rank's own GPU, the CPU, or None for the sharding engines."""
    if engine in SHARDING_ENGINES:
        return None
    return {"": local_rank() if device == "cuda" else "cpu"}


def _flash_attn_2_installed() -> bool:
    # transformers' own test (utils/import_utils.py is_flash_attn_2_available: "flash-attn" 2.3.3+, with CUDA)
    from transformers.utils import is_flash_attn_2_available

    return bool(is_flash_attn_2_available())


def attention_implementation(device: str, dtype) -> Optional[str]:
    """The attn_implementation to pass (launcher/plan/attention.py's rule), or None for SDPA."""
    import torch

    from launcher.plan import attention
    from launcher.worker import varlen

    if device != "cuda":
        return None
    flash = _flash_attn_2_installed()
    chosen = attention.implementation(
        device, dtype == torch.bfloat16, flash, not flash and varlen.available(device, dtype)
    )
    if chosen == attention.VARLEN:
        varlen.register()
    return None if chosen == "sdpa" else chosen


def attention_facts(device: str, dtype, model=None, engine: str = "trl") -> dict[str, Any]:
    """What runs attention here: implementation, kernels of padded, padding-free and decode batches, a line."""
    import torch

    from launcher.plan import attention
    from launcher.worker import varlen

    if engine == "unsloth":
        line = "attention: Unsloth's own (its loader patches the model's attention)"
        return {"implementation": "unsloth", "kernels": None, "torch": torch.__version__, "why": None, "line": line}
    loaded = varlen.ran(model) if model is not None else None
    attn = loaded or attention_implementation(device, dtype) or "sdpa"
    sdpa = "SDPA (flash attention unmasked, the memory-efficient kernel with a mask)" if device == "cuda" else "SDPA"
    if attn == attention.FLASH:
        kernels = {"padded": attention.KERNEL_NAMES[attn], "padding_free": attention.KERNEL_NAMES[attn]}
    elif attn == attention.VARLEN:
        kernels = {"padded": sdpa, "padding_free": attention.KERNEL_NAMES[attn]}
    else:
        kernels = {"padded": sdpa, "padding_free": f"{sdpa} with a dense L x L mask over the row"}
    kernels["decode"] = kernels["padded"] if attn != attention.FLASH else attention.KERNEL_NAMES[attn]
    if device == "cuda" and attn == "sdpa":
        why = (
            "FlashAttention-2 needs compute capability 8.0"
            if dtype != torch.bfloat16
            else f"flash-attn 2 is not installed and torch {torch.__version__} has no usable varlen_attn "
            f"({'.'.join(map(str, attention.VARLEN_MIN_TORCH))} or newer, with flash attention built in)"
        )
    else:
        why = ""
    line = (
        f"attention: {attn}; padding-free rows on {kernels['padding_free']}, padded batches on {kernels['padded']}, "
        f"decode on {kernels['decode']}" + (f" ({why})" if why else "")
    )
    return {"implementation": attn, "kernels": kernels, "torch": torch.__version__, "why": why or None, "line": line}


def apply_sdpa_backends() -> dict[str, Any]:
    """Leave on exactly attention.py's SDPA backends: process-wide flags read at every dispatch
    (torch/backends/cuda/__init__.py enable_cudnn_sdp; sdp_utils.cpp check_runtime_disabled_*)."""
    import torch

    from launcher.plan import attention

    backends, _ = attention.sdpa_backends()
    for name, flag in attention.SDPA_BACKENDS.items():
        getattr(torch.backends.cuda, f"enable_{flag}")(name in backends)
    return sdpa_state()


def sdpa_state() -> dict[str, Any]:
    """Each SDPA backend on or off as torch reports it, and the choice's source (worker.json's sdpa_backends)."""
    import torch

    from launcher.plan import attention

    state: dict[str, Any] = {
        name: bool(getattr(torch.backends.cuda, f"{flag}_enabled")()) for name, flag in attention.SDPA_BACKENDS.items()
    }
    state["source"] = attention.sdpa_backends()[1]
    return state


def quantization_config(method: str, dtype):
    """QLoRA's NF4 config, quant storage in the compute dtype so FSDP can shard it (fsdp2_prepare_model)."""
    if not is_quantized(method):
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
    """QLoRA under FSDP loads on the CPU: {"device_map": {"": "cpu"}}, else {} (docs/engines.md, "The first GPU box",
    item 3): else bitsandbytes puts the whole 4-bit model on each GPU (quantizer_bnb_4bit.update_device_map), which
    accelerate does not avoid for 4-bit weights (fsdp2_prepare_model, "will still cause the VRAM spike"); fully_shard
    then moves one unit at a time to the GPU (torch fsdp _fsdp_init._move_states_to_device), and Linear4bit recovers
    the quant state (bitsandbytes nn/modules.py fix_4bit_weight_quant_state_from_module)."""
    if is_quantized(method) and engine == "fsdp":
        return {"device_map": {"": "cpu"}}
    return {}


QUANTIZED_DIR = ".quantized"  # <run_dir>/.quantized/: box-local, never synced (store/sync copies checkpoints,
QUANTIZED_MANIFEST = "ftrun_quantized.json"  # metadata and final/ only); written last: without it, no copy


def quantized_once_per_box(recipe, kwargs: dict[str, Any], run_dir) -> Optional[Path]:
    """The folder of the 4-bit model, quantized once for this box by the first rank to take the lock (reused where
    its manifest matches), that every FSDP rank maps (integrations/bitsandbytes.py Bnb4bitDeserialize ->
    Params4bit.from_prequantized, no copy); None where the ranks load the model themselves. docs/engines.md, "The
    first GPU box, round two", item 7."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) < 2:  # processes on this box (torchrun sets it)
        return None
    run_dir = run_dir if run_dir is not None else getattr(recipe, "output_dir", None)
    if run_dir is None:
        if local_rank() == 0:
            _say(
                "QLoRA + FSDP without a run directory: each rank quantizes the model on its own "
                "CPU (one 4-bit copy per rank in RAM)"
            )
        return None
    folder = Path(run_dir) / QUANTIZED_DIR
    identity = _quantized_identity(recipe.model, kwargs)
    with _box_lock(Path(run_dir) / (QUANTIZED_DIR + ".lock")):
        if _manifest(folder) == identity:
            if local_rank() == 0:
                _say(f"4-bit model: reusing {folder} (quantized for this run before)")
        else:
            _quantize_into(folder, recipe.model, kwargs, identity)
    return folder


def _quantized_identity(model: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """What the quantized folder was made from (source files, quantization, dtype, versions), on every rank."""
    import json

    import bitsandbytes
    import torch
    import transformers

    source = Path(model).expanduser()
    if not source.is_dir():  # a Hub name: its snapshot in the local cache (the worker downloads before it loads)
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(model, "config.json")
            source = Path(found).parent if isinstance(found, str) else source
        except ImportError:
            pass
    files = {}
    if source.is_dir():
        for f in sorted(source.iterdir()):
            if f.suffix in (".safetensors", ".json", ".bin") and f.is_file():
                st = f.stat()  # a Hub snapshot's files are links into blobs: stat follows them
                files[f.name] = [st.st_size, st.st_mtime_ns]
    quant = kwargs.get("quantization_config")
    identity = {
        "model": model,
        "resolved": str(source.resolve()) if source.is_dir() else None,
        "files": files,
        "quantization": quant.to_dict() if quant is not None else None,
        "dtype": str(kwargs.get("dtype")),
        "versions": {
            "transformers": transformers.__version__,
            "bitsandbytes": bitsandbytes.__version__,
            "torch": torch.__version__,
        },
    }
    return json.loads(json.dumps(identity, default=str))  # as the manifest reads back (lists, strings)


def _manifest(folder: Path) -> Optional[dict[str, Any]]:
    import json

    path = folder / QUANTIZED_MANIFEST
    try:
        return json.loads(path.read_text())["identity"] if path.is_file() else None
    except (ValueError, KeyError):
        return None


@contextlib.contextmanager
def _box_lock(path: Path):
    """An exclusive fcntl lock on a file of the run directory, released by the kernel when its holder dies."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _quantize_into(folder: Path, model: str, kwargs: dict[str, Any], identity: dict[str, Any]) -> None:
    """Quantize `model` on the CPU with every core into `folder` (aside, renamed, manifest last)."""
    import ctypes
    import gc
    import json
    import shutil
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from launcher.plan.hardware import cpu_cores

    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    for stale in [*folder.parent.glob(f"{folder.name}.tmp-*"), folder]:  # under the lock: nobody else writes them
        shutil.rmtree(stale, ignore_errors=True)  # a crashed attempt's, or a copy whose manifest does not match
    threads = torch.get_num_threads()
    cores = cpu_cores()  # as the plan counts them: the affinity capped by a cgroup CPU quota
    started = time.monotonic()
    # the others wait on the lock, so this rank takes the box's cores; fork_rng: the quantizing rank must draw the same
    # LoRA initialisation afterwards as the others (fully_shard takes each rank's chunk of its own tensors)
    with torch.random.fork_rng(devices=[]):
        torch.set_num_threads(cores)
        try:
            quantized = AutoModelForCausalLM.from_pretrained(model, **kwargs)
            # the lock holder writes the box's copy (transformers 5.24 distributed/mixin.py should_save_on_this_rank)
            quantized.should_save_on_this_rank = lambda is_main_process: True
            quantized.save_pretrained(str(tmp))
        finally:
            torch.set_num_threads(threads)
    del quantized
    gc.collect()
    try:  # glibc keeps freed heap memory for reuse: given back, so the box is not charged for a copy that is gone
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to ask
        pass
    seconds = round(time.monotonic() - started, 1)
    (tmp / QUANTIZED_MANIFEST).write_text(json.dumps({"identity": identity, "seconds": seconds}, indent=2))
    os.replace(tmp, folder)
    _say(
        f"4-bit model: quantized once for this box on {cores} CPU cores in {seconds:.0f} s into "
        f"{folder}; every rank maps it"
    )


def load_kwargs(recipe, device: str, dtype, engine: str) -> dict[str, Any]:
    """Every from_pretrained argument this module decides, in one dict (the GPU check reports it)."""
    kwargs: dict[str, Any] = {
        "dtype": weights_dtype(recipe.method, engine, device, dtype),
        "device_map": device_map(device, engine),
    }
    quant = quantization_config(recipe.method, dtype)
    if quant is not None:
        kwargs["quantization_config"] = quant
    attn = attention_implementation(device, dtype)
    if attn is not None:
        kwargs["attn_implementation"] = attn
    kwargs.update(fsdp_qlora_kwargs(recipe.method, engine))
    return kwargs


def reads_images(model: str) -> bool:
    """Whether the model has a vision tower (config.json vision_config, read as the plan reads it)."""
    from launcher.data.image_stats import vision_config

    return vision_config(model) is not None


def model_class(model: str):
    """AutoModelForImageTextToText for a vision-language model (it holds the vision tower), else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if reads_images(model) else AutoModelForCausalLM


def load_tokenizer(recipe, say=None):
    """The model's tokenizer, or a vision-language model's processor (how it was built said through `say`)."""
    from transformers import AutoTokenizer

    if reads_images(recipe.model):
        from launcher.worker.processor import load_processor

        # every rank builds its own processor (its collator renders its own batches); rank 0 says the fallback
        loaded = load_processor(recipe.model, say=say or (lambda line: is_main_process() and _say(line)))
        tokenizer = loaded.tokenizer
    else:
        loaded = tokenizer = AutoTokenizer.from_pretrained(recipe.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return loaded


# module paths in transformers 5.24's Qwen2-VL family (model.language_model.layers.N..., the tower model.visual); PEFT
# matches a string target_modules as a full regular expression (peft tuners_utils.py check_target_module_exists)
LANGUAGE_MODEL = "language_model"
VISION_TOWER = "visual"


def lora_targets(model, recipe):
    """lora.target_modules for a text model; for a VLM a regular expression over its modules (vision_targets)."""
    if not reads_images(recipe.model):
        return recipe.lora.target_modules
    return vision_targets(model, recipe.lora)


def vision_targets(model, lora) -> str:
    """`lora_targets` of a vision-language model, from the model's modules and the recipe's lora: section."""
    import re

    import torch

    from launcher.plan.vision import TOWER_ATTENTION

    wanted = lora.target_modules
    tower = bool(getattr(lora, "vision_tower", False))
    parts = [LANGUAGE_MODEL] + ([VISION_TOWER] if tower else [])
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or not re.search(rf"(^|\.)({'|'.join(parts)})\.", name):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if wanted == "all-linear" or leaf in wanted or (tower and leaf in TOWER_ATTENTION):
            names.append(re.escape(name))
    if not names:
        raise ValueError(f"no linear layer of the model matches lora.target_modules {wanted}")
    return "^(" + "|".join(names) + ")$"


def add_lora(model, recipe):
    """LoRA on the base model, 16-bit or 4-bit alike; not PEFT's prepare_model_for_kbit_training, whose fp32 casts
    (peft/utils/other.py) double the saved activations (docs/sizing.md, "QLoRA without the upcast"); the norms and
    the loss compute in fp32 already (transformers 5.24 modeling_llama.py)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if recipe.gradient_checkpointing:
        model.enable_input_require_grads()  # checkpointed LoRA needs grads flowing into the frozen embeddings
    if getattr(recipe, "init_from", None):  # a recipe-like namespace (the GPU check's) may not name it
        from launcher.recipe import parent_adapter

        # the earlier run's adapter, trained further; a DPO reference is its frozen copy (trl 1.16 dpo_trainer.py)
        return PeftModel.from_pretrained(model, str(parent_adapter(recipe.init_from)), is_trainable=True)
    lora = recipe.lora
    return get_peft_model(
        model,
        LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora_targets(model, recipe),
            task_type="CAUSAL_LM",
        ),
    )


def load_model_and_tokenizer(recipe, device: str, dtype, plan: Optional[dict] = None, context=None, run_dir=None):
    """The base model by method, then LoRA; `context`: the engine's (ZeRO-3); `run_dir`: QLoRA + FSDP's copy."""
    engine = (plan or {}).get("engine", "trl")
    tokenizer = load_tokenizer(recipe)
    kwargs = load_kwargs(recipe, device, dtype, engine)
    source = recipe.model
    if is_quantized(recipe.method) and engine == "fsdp":
        quantized = quantized_once_per_box(recipe, kwargs, run_dir)
        if quantized is not None:
            # its config.json carries the quantization config: passing ours again only earns a warning
            source, kwargs = str(quantized), {k: v for k, v in kwargs.items() if k != "quantization_config"}
    with context if context is not None else contextlib.nullcontext():
        model = model_class(recipe.model).from_pretrained(source, **kwargs)
    if is_adapter(recipe.method):
        model = add_lora(model, recipe)
    if is_main_process():
        _say(describe_model(model))
        if reads_images(recipe.model) and is_adapter(recipe.method):
            tower = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and f".{VISION_TOWER}." in n)
            _say(f"LoRA: {tower:,} trainable parameters in the vision tower")
        if device == "cuda":  # the kernel that runs, said once
            _say(attention_facts(device, dtype, model)["line"])
    return model, tokenizer


def describe_model(model) -> str:
    """What was built: parameter counts, and where and how the base weights are stored."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    adapter = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    kinds = Counter(type(m).__name__ for m in model.modules())
    layers = ", ".join(f"{kinds[k]} {k}" for k in sorted(kinds) if k in ("Linear4bit", "Linear8bitLt", "Linear"))
    devices = sorted({str(p.device) for p in model.parameters()})
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
    # the base model's count is the one the plan and the built model state; an adapter's parameters come on top
    split = f" ({total - adapter:,} of the base model and {adapter:,} of the LoRA adapter)" if adapter else ""
    return (
        f"model: {total:,} parameters{split}, {trainable:,} trainable; linear layers: {layers}; "
        f"on {', '.join(devices)} in {', '.join(dtypes)}"
    )
