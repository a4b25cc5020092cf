"""Model loading in the worker: this rank's device, the compute and weights dtypes, the quantization config and the
attention kernel, then the model with LoRA. The worker, the FSDP exercise and the GPU check all call it, so what the
GPU check proves is what the worker does; engine contexts (DeepSpeed's partitioned loading) and Unsloth's loader are
passed in: this module imports no backend.

Versions relied on: torch 2.13, transformers 5.24, peft 0.21, bitsandbytes 0.50, accelerate 1.15. transformers'
`from_pretrained(device_map=None)` with a bitsandbytes config places the model on `torch.cuda.current_device()`
(`transformers/quantizers/quantizer_bnb_4bit.py`, update_device_map), device 0 until `torch.cuda.set_device`: so
the device is set from LOCAL_RANK before any load.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from launcher.engine_kinds import SHARDING as SHARDING_ENGINES
from launcher.methods import METHODS, is_adapter, is_quantized

# SHARDING_ENGINES shard or partition the weights themselves: they load without a device map (transformers
# refuses a device_map under ZeRO-3's partitioned loading; FSDP places the shards on each rank's device).


def local_rank() -> int:
    """This process's index on its box: torchrun and accelerate launch set LOCAL_RANK (0 for one process)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def compute_dtype(capability: Optional[tuple[int, int]]):
    """bf16 on compute capability 8.0+ (A100, L4/L40S, RTX 30/40/50, H100, ...), fp16 on 7.x (T4, V100) and
    below, fp32 on the CPU (capability None).

    Not torch.cuda.is_bf16_supported(): it counts emulation (`torch/cuda/__init__.py`), which makes a T4 or V100
    train bf16 at a fraction of its fp16 tensor-core speed. fp16 trains with the Trainer's loss scaling (fp16=True).
    """
    import torch

    from launcher.plan.throughput import training_precision  # the plan's rule: the plan and the worker cannot disagree

    if capability is None:
        return torch.float32
    return torch.bfloat16 if training_precision("cuda", tuple(capability)) == "bf16" else torch.float16


def select_device() -> tuple[str, Any]:
    """('cuda', dtype) on this rank's own GPU, made the current device, or ('cpu', fp32): detected, never configured.

    Called once at worker start, before the model, a process group or a memory cap touch CUDA: without
    set_device every rank would allocate on GPU 0 (and NCCL would bind every rank to it). It also sets the SDPA
    backends (apply_sdpa_backends) before the first attention call, on every path that loads a model.
    """
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
    table = METHODS[method]
    if (not table.adapter and not table.eight_bit_optimizer) or (table.eight_bit_optimizer and dtype == torch.float16):
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
    """The attn_implementation to pass (launcher/plan/attention.py implementation, the plan's own rule), or None for
    transformers' default, SDPA. torch's varlen kernel (attention.VARLEN) is registered with transformers here, in
    the process that loads the model (launcher/worker/varlen.py register)."""
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
    """What runs attention in this process, for worker.json and the log: the implementation the model was loaded
    with (or, before the load, will be: the same rule), the kernel of padded, padding-free and decode batches,
    torch's release, and a line saying it. Unsloth's loader brings its own attention."""
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
    """Leave on exactly the SDPA backends launcher/plan/attention.py names (cuDNN's off by default) and return what
    torch then reports. The flags are process-wide and read at every dispatch (torch/backends/cuda/__init__.py
    enable_cudnn_sdp and its siblings; sdp_utils.cpp check_runtime_disabled_*); a CPU has no cuDNN backend, and its
    own SDPA reads the flash and math flags, so the same call is right there."""
    import torch

    from launcher.plan import attention

    backends, _ = attention.sdpa_backends()
    for name, flag in attention.SDPA_BACKENDS.items():
        getattr(torch.backends.cuda, f"enable_{flag}")(name in backends)
    return sdpa_state()


def sdpa_state() -> dict[str, Any]:
    """Each SDPA backend on or off as torch reports it now, and where the choice came from (worker.json's and
    task_eval.json's sdpa_backends)."""
    import torch

    from launcher.plan import attention

    state: dict[str, Any] = {
        name: bool(getattr(torch.backends.cuda, f"{flag}_enabled")()) for name, flag in attention.SDPA_BACKENDS.items()
    }
    state["source"] = attention.sdpa_backends()[1]
    return state


def quantization_config(method: str, dtype):
    """QLoRA's 4-bit NF4 config; quant storage in the compute dtype so FSDP can shard the 4-bit weights
    (accelerate excludes non-floating Params4bit from sharding: fsdp2_prepare_model)."""
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
    """QLoRA under FSDP loads on the CPU: {"device_map": {"": "cpu"}}, else {}. Both loads of that path use it:
    the one that quantizes (once per box, `quantized_once_per_box`) and every rank's load of the result.

    Why the CPU (transformers 5.24, accelerate 1.15, bitsandbytes 0.50, torch 2.13):
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
    """
    if is_quantized(method) and engine == "fsdp":
        return {"device_map": {"": "cpu"}}
    return {}


QUANTIZED_DIR = ".quantized"  # <run_dir>/.quantized/: box-local, never synced (store/sync copies checkpoints,
QUANTIZED_MANIFEST = "ftrun_quantized.json"  # metadata and final/ only); written last: without it, no copy


def local_world_size() -> int:
    """Processes on this box: torchrun (and accelerate launch, which runs it) set LOCAL_WORLD_SIZE."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def quantized_once_per_box(recipe, kwargs: dict[str, Any], run_dir) -> Optional[Path]:
    """The folder of the 4-bit model, quantized once for this box, that every FSDP rank loads; None where the
    ranks load the recipe's model themselves (one process on the box, or no run directory to write into).

    Why not each rank quantizing its own copy (the path before: N x the 4-bit model in the box's RAM, 2 x 36.8 GB
    for Llama-3.1-70B on 2 cards) or accelerate's rank-0 broadcast (skipped for Params4bit, fsdp_qlora_kwargs):
    - the first rank of the box to take the lock (`_box_lock`) quantizes on the CPU with all of the box's cores
      (the others wait idle) and writes the quantized model with save_pretrained: bitsandbytes'
      Linear4bit._save_to_state_dict stores the packed weight (in the quant storage dtype) and its quant state
      (QuantState.as_dict(packed=True)), and config.json carries the quantization config. A folder whose manifest
      matches (`_quantized_identity`) is reused: a restart or resume does not quantize again;
    - every rank then loads that folder: transformers loads a pre-quantized checkpoint with
      Bnb4bitDeserialize (integrations/bitsandbytes.py), which calls Params4bit.from_prequantized
      (bitsandbytes nn/modules.py): torch.Tensor._make_subclass(cls, data.to(device)) on the tensor read from
      the memory-mapped safetensors file, no copy on the CPU. The packed weights stay pages of the file, which
      the ranks of the box share in the page cache (measured against the path before: tests/worker/
      test_fsdp_qlora.py, test_the_box_holds_one_4bit_copy_while_loading_not_one_per_rank); what a
      rank makes its own is its shard (fully_shard copies its chunk: _fsdp_param.py, _init_sharded_param,
      new_zeros + copy_) or, on a GPU, the units moved to the card.
    """
    if local_world_size() < 2:
        return None
    run_dir = run_dir if run_dir is not None else getattr(recipe, "output_dir", None)
    if run_dir is None:
        if local_rank() == 0:
            print(
                "[ftrun worker] QLoRA + FSDP without a run directory: each rank quantizes the model on its own "
                "CPU (one 4-bit copy per rank in RAM)",
                flush=True,
            )
        return None
    folder = Path(run_dir) / QUANTIZED_DIR
    identity = _quantized_identity(recipe.model, kwargs)
    with _box_lock(Path(run_dir) / (QUANTIZED_DIR + ".lock")):
        if _manifest(folder) == identity:
            if local_rank() == 0:
                print(f"[ftrun worker] 4-bit model: reusing {folder} (quantized for this run before)", flush=True)
        else:
            _quantize_into(folder, recipe.model, kwargs, identity)
    return folder


def _quantized_identity(model: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """What the quantized folder was made from: the source's files (size, mtime), the quantization, the dtype and
    the library versions. The same on every rank."""
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


class _box_lock:
    """An exclusive fcntl lock on a file of the run directory: the ranks of this box take turns; the kernel
    releases it when its holder dies, so a crashed quantization never blocks a restart."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        import fcntl

        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        return False


def _quantize_into(folder: Path, model: str, kwargs: dict[str, Any], identity: dict[str, Any]) -> None:
    """Load and quantize `model` on the CPU with every core of the box, save it into `folder` (written aside and
    renamed, the manifest last), and give its memory back before this rank loads the folder like the others."""
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
    # the box's cores as the plan counts them (the affinity, capped by a cgroup CPU quota, launcher/plan/cgroup.py
    # cpu_limit: threads beyond it add no speed, the kernel throttles the cgroup once a period's quota is spent),
    # the count the plan's quantizing time assumes
    cores = cpu_cores()
    started = time.monotonic()
    # torchrun sets OMP_NUM_THREADS=1 per rank; the others wait on the lock, so this rank takes the box's cores.
    # fork_rng: the quantizing rank must draw the same LoRA initialisation afterwards as the ranks that did not
    # load twice (fully_shard takes each rank's chunk of its own tensors: different draws would mix two models).
    with torch.random.fork_rng(devices=[]):
        torch.set_num_threads(cores)
        try:
            quantized = AutoModelForCausalLM.from_pretrained(model, **kwargs)
            # save_pretrained writes on global rank 0 only once a process group exists (transformers 5.24
            # distributed/mixin.py, should_save_on_this_rank); the copy belongs to the box, the lock holder writes it
            quantized.should_save_on_this_rank = lambda is_main_process: True
            quantized.save_pretrained(str(tmp))
        finally:
            torch.set_num_threads(threads)
    del quantized
    gc.collect()
    _release_free_memory()
    seconds = round(time.monotonic() - started, 1)
    (tmp / QUANTIZED_MANIFEST).write_text(json.dumps({"identity": identity, "seconds": seconds}, indent=2))
    os.replace(tmp, folder)
    print(
        f"[ftrun worker] 4-bit model: quantized once for this box on {cores} CPU cores in {seconds:.0f} s into "
        f"{folder}; every rank maps it",
        flush=True,
    )


def _release_free_memory() -> None:
    """glibc keeps freed heap memory for reuse; give it back, so the box is not charged for a copy that is gone."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to ask
        pass


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
    """Whether the model has a vision tower (config.json vision_config): it trains with its processor, loaded as
    image-text-to-text (launcher/data/image_stats.py vision_config, the plan's reading of the same file)."""
    from launcher.data.image_stats import vision_config

    return vision_config(model) is not None


def model_class(model: str):
    """The transformers class that loads the model: image-text-to-text for a vision-language model (transformers
    5.24 maps qwen2_5_vl to Qwen2_5_VLForConditionalGeneration, which holds the vision tower), else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if reads_images(model) else AutoModelForCausalLM


def _worker_line(line: str) -> None:
    print(f"[ftrun worker] {line}", flush=True)


def load_tokenizer(recipe, say=None):
    """The model's tokenizer, or a vision-language model's processor (its tokenizer inside, as .tokenizer; how it
    was built said through `say`, by default the worker's line on rank 0)."""
    from transformers import AutoTokenizer

    if reads_images(recipe.model):
        from launcher.worker.processor import load_processor

        # every rank builds its own processor (its collator renders its own batches); rank 0 says the fallback
        processor = load_processor(recipe.model, say=say or (lambda line: is_main_process() and _worker_line(line)))
        if processor.tokenizer.pad_token is None:
            processor.tokenizer.pad_token = processor.tokenizer.eos_token
        return processor
    tokenizer = AutoTokenizer.from_pretrained(recipe.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# A vision-language model's language model and vision tower, by their module paths in transformers 5.24's Qwen2-VL
# family (Qwen2_5_VLForConditionalGeneration: model.language_model.layers.N.self_attn.q_proj; the tower model.visual,
# its blocks' attention `qkv` and `proj`); PEFT matches a string target_modules as a full regular expression (peft
# tuners_utils.py check_target_module_exists).
LANGUAGE_MODEL = "language_model"
VISION_TOWER = "visual"


def lora_targets(model, recipe):
    """The recipe's lora.target_modules for a text model; for a vision-language model a regular expression over
    module names: those layers in the language model only (what vLLM serves as LoRA), unless lora.vision_tower asks
    for the tower's blocks too (launcher/plan/vision.py says what each means for serving)."""
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
    """LoRA on the base model, 16-bit or 4-bit alike.

    Not PEFT's prepare_model_for_kbit_training for QLoRA: it casts every parameter that is not 4-bit to fp32
    (peft/utils/other.py: embeddings, lm_head, norms), and bitsandbytes' Linear4bit returns its input's dtype,
    so the residual stream and every checkpointed layer input became fp32 too: for Qwen3-8B about 2.3 GB more
    weights and twice the saved activations the plan counts in bf16 (docs/sizing.md, "QLoRA without the upcast").
    What the cast was for is already there: the RMSNorms compute in fp32 inside their forward
    (transformers 5.24 modeling_qwen3.py/modeling_llama.py: hidden_states.to(torch.float32); Gemma's
    x.float()), the loss in fp32 (TRL's fused head accumulates in fp32; the model's ForCausalLMLoss upcasts
    the logits). PEFT freezes the base (only the adapters train), and TRL 1.16's SFTTrainer does not call it
    either (it enables input gradients for a PEFT model under checkpointing, sft_trainer.py). Checkpointing
    itself is the trainer's (SFTConfig activation_checkpointing; under FSDP the accelerate config's alone,
    engines/fsdp.py trainer_fields), as for LoRA.
    """
    from peft import LoraConfig, PeftModel, get_peft_model

    if recipe.gradient_checkpointing:
        model.enable_input_require_grads()  # checkpointed LoRA needs grads flowing into the frozen embeddings
    if getattr(recipe, "init_from", None):  # a recipe-like namespace (the GPU check's) may not name it
        from launcher.recipe import parent_adapter

        # the earlier run's adapter, trained further (its own r, alpha and modules: adapter_config.json); a DPO
        # reference is then that adapter's frozen copy, which trl 1.16's DPOTrainer makes itself for a PeftModel
        # passed without a peft_config (dpo_trainer.py: add_adapter("ref", ...) and a copy of the weights)
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
    """The base model by method (4-bit for qlora, 16-bit for lora, fp32 master weights for full on trl/ddp), then LoRA.

    `context`: a context manager the engine wraps the load in (DeepSpeed ZeRO-3 partitions while loading).
    `run_dir`: where QLoRA + FSDP keeps the box's one quantized copy (default: the recipe's output_dir).
    """
    import contextlib

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
        print("[ftrun worker] " + describe_model(model), flush=True)
        if reads_images(recipe.model) and is_adapter(recipe.method):
            tower = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and f".{VISION_TOWER}." in n)
            print(f"[ftrun worker] LoRA: {tower:,} trainable parameters in the vision tower", flush=True)
        if device == "cuda":  # the kernel that runs, said once
            print(f"[ftrun worker] {attention_facts(device, dtype, model)['line']}", flush=True)
    return model, tokenizer


def describe_model(model) -> str:
    """What was actually built: parameter counts, where and how the base weights are stored (says 4-bit only if it
    is)."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    adapter = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    kinds: dict[str, int] = {}
    for module in model.modules():
        name = type(module).__name__
        if name in ("Linear4bit", "Linear8bitLt", "Linear"):
            kinds[name] = kinds.get(name, 0) + 1
    layers = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    devices = sorted({str(p.device) for p in model.parameters()})
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
    # the base model's count is the one the plan and the built model state; an adapter's parameters come on top
    split = f" ({total - adapter:,} of the base model and {adapter:,} of the LoRA adapter)" if adapter else ""
    return (
        f"model: {total:,} parameters{split}, {trainable:,} trainable; linear layers: {layers}; "
        f"on {', '.join(devices)} in {', '.join(dtypes)}"
    )
