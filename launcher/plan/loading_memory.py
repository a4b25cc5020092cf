"""What loading a model holds before its first step: the load-time peak per card, the box's RAM while loading
(docs/sizing.md, "Loading"). `w` is a sizing.Workload and `est` a sizing.MemoryEstimate, annotated Any: sizing.py
imports this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from launcher.methods import METHODS, is_quantized
from launcher.plan import vision
from launcher.plan.sizing_constants import CPU_RUNTIME_GB, CUDA_CONTEXT_GB, GB, NF4_BYTES, USABLE_RAM_FRACTION

if TYPE_CHECKING:  # for the annotations only: at run time this module imports nothing else
    from launcher.plan.models import Architecture as Arch

# Bytes per parameter the CPU quantizer holds besides the 4-bit result (docs/sizing.md, "4-bit weights (QLoRA)")
QUANTIZE_TEMPORARY_BYTES = 20


def _sixteen_bit_adapter(method: str) -> bool:
    """Adapters on a 16-bit base: each process upcasts its own LoRA weights to fp32 while it loads."""
    return METHODS[method].adapter and not METHODS[method].quantized


def nf4_model_bytes(arch: Arch) -> float:
    """The whole model as QLoRA holds it: linear weights in NF4 (a vision tower's too: vision.quantized_params),
    embeddings, head and norms in 16 bits."""
    four_bit = arch.linear_params + vision.quantized_params(arch)
    return four_bit * NF4_BYTES + (arch.params - four_bit) * 2


def layer_unit_bytes(arch: Arch, w: Any) -> float:
    """One decoder layer as FSDP gathers it (4-bit weights for QLoRA, 16-bit otherwise)."""
    per_layer = (arch.params - arch.embedding_params * (1 if arch.tied_embeddings else 2)) / arch.layers
    return per_layer * (NF4_BYTES if is_quantized(w.method) else (4 if w.device == "cpu" else 2))


def embedding_unit_bytes(arch: Arch, w: Any) -> float:
    """The embedding (or the untied lm_head), always 16-bit on a GPU: accelerate shards it as a unit of its own."""
    return arch.embedding_params * (4 if w.device == "cpu" else 2)


def _loading(arch: Arch, w: Any, est: Any, static_sharded_gb: float, layer_b: float, embed_b: float) -> None:
    """The load-time peak per card and the box's CPU RAM while loading, for the paths where loading, not the
    training step, decides (docs/sizing.md, "Loading"). Other paths load below their training peak."""
    n = w.num_gpus if w.sharded else 1
    if n < 2 or w.device == "cpu":
        return
    if not is_quantized(w.method):
        _loading_16bit(arch, w, est, n)
        return
    model_gb = nf4_model_bytes(arch) / GB
    lora_gb = est.trainable_params * 4 / GB  # fp32 LoRA weights, added before the engine shards
    if w.engine == "fsdp":
        # launcher/worker/loading.py quantized_once_per_box: one process quantizes and saves, every process maps the
        # file (Params4bit.from_prequantized: one shared copy in the page cache) and holds its fp32 LoRA; fully_shard
        # keeps each unit's shard (in pinned RAM under offload). docs/sizing.md, "4-bit weights (QLoRA)".
        resident = 0.0 if w.offload_params else static_sharded_gb - _optimizer_free(est, n)
        est.load_peak_gb = CUDA_CONTEXT_GB + resident + max(layer_b, embed_b) / GB
        temp_gb = quantize_temporary_bytes(arch) / GB
        quantizing = model_gb + temp_gb + n * CPU_RUNTIME_GB
        offloaded = est.offloaded_params_gb  # with parameter offload: shards, gradients, optimizer states (pinned)
        sharding = n * (lora_gb + CPU_RUNTIME_GB) + offloaded
        est.load_ram_gb = max(quantizing, sharding)
        est.load_explanation = (
            f"one process quantizes the model once for the box on its CPU ({model_gb:.1f} GB in 4-bit + "
            f"{temp_gb:.1f} GB of temporaries for its largest weight) and saves it into the run directory "
            f"(.quantized/, {model_gb:.1f} GB of disk, reused on restart) while "
            + ("the other waits" if n == 2 else f"the other {n - 1} wait")
            + f"; then each of "
            f"the {n} processes maps that file (one copy in the page cache, shared) and holds its fp32 LoRA "
            f"({lora_gb:.1f} GB) + {CPU_RUNTIME_GB:.0f} GB of runtime"
            + (
                f", and the box the offloaded shards, gradients and optimizer states in pinned RAM ({offloaded:.1f} GB)"
                if offloaded
                else ""
            )
            + f": {est.load_ram_gb:.0f} GB of RAM at the peak ("
            + ("quantizing" if quantizing >= sharding else "sharding")
            + "; "
            f"a box with {est.load_ram_gb / USABLE_RAM_FRACTION:.0f} GB or more holds it); each card holds "
            + ("" if w.offload_params else "its shards and ")
            + f"one unit whole while sharding ({max(layer_b, embed_b) / GB:.1f} GB): {est.load_peak_gb:.1f} GB"
        )
    elif w.engine == "deepspeed":
        # no zero.Init for 4-bit models: bitsandbytes puts all of it on each card (quantizer_bnb_4bit.update_device_map)
        est.load_peak_gb = CUDA_CONTEXT_GB + model_gb + lora_gb
        est.load_explanation = (
            f"DeepSpeed + QLoRA loads the whole 4-bit model onto every card before ZeRO-3 "
            f"partitions it: {est.load_peak_gb:.1f} GB per card"
        )


def quantize_temporary_bytes(arch: Arch) -> float:
    """What quantizing the largest linear weight allocates besides its result (bitsandbytes 0.50 backends/default/ops.py
    quantize_4bit), one weight at a time (transformers core_model_loading.py, has_on_the_fly_quantization)."""
    largest = max(arch.hidden * arch.intermediate, arch.hidden * arch.q_dim)
    return largest * QUANTIZE_TEMPORARY_BYTES


def fused_expert_params(arch: Arch) -> int:
    """MoE expert weights transformers 5 fuses while loading (conversion_mapping): new memory in each process."""
    return 3 * arch.hidden * arch.intermediate * arch.experts * arch.layers if arch.experts > 1 else 0


def _loading_16bit(arch: Arch, w: Any, est: Any, n: int) -> None:
    """The box's RAM while FSDP or DeepSpeed load 16-bit weights (LoRA, full): what each process holds privately, the
    weights themselves being one shared copy of the mapped files in the page cache (docs/sizing.md, "16-bit weights").
    FSDP: every rank upcasts its trainable parameters to fp32 on its CPU (accelerate 1.15 utils/fsdp_utils.py
    fsdp2_prepare_model, "Upcast to fp32 master weights"), and MoE experts fuse while loading. DeepSpeed ZeRO-3:
    zero.Init partitions each weight (engines/deepspeed.py partitioned_loading), rank 0 alone reads the checkpoint.
    """
    lora_gb = est.trainable_params * 4 / GB if _sixteen_bit_adapter(w.method) else 0.0
    fused_gb = fused_expert_params(arch) * 2 / GB
    model_gb = arch.params * 2 / GB
    if w.engine == "fsdp":
        if _sixteen_bit_adapter(w.method):
            own = lora_gb + fused_gb
            what = f"its fp32 LoRA weights ({lora_gb:.1f} GB)" + (
                f" and the MoE experts fused while loading ({fused_gb:.1f} GB)" if fused_gb else ""
            )
        else:
            own = est.trainable_params * 4 / GB
            what = (
                f"the whole model upcast to fp32 ({own:.0f} GB: accelerate upcasts the trainable weights to "
                f"fp32 master weights on the CPU before it shards them)"
            )
        est.load_ram_gb = n * (own + CPU_RUNTIME_GB)
        est.load_explanation = (
            f"each of the {n} processes loads the whole model onto its CPU before FSDP shards it (the "
            f"{model_gb:.0f} GB of 16-bit weights stay in the page cache, shared) and holds {what} + "
            f"{CPU_RUNTIME_GB:.0f} GB of runtime: {est.load_ram_gb:.0f} GB of RAM"
            + (
                "; engine: deepspeed loads partitioned (zero.Init) and holds no such copies"
                if not _sixteen_bit_adapter(w.method)
                else ""
            )
        )
    elif w.engine == "deepspeed":
        est.load_ram_gb = n * (lora_gb + CPU_RUNTIME_GB) + fused_gb
        est.load_explanation = (
            f"ZeRO-3 creates each weight partitioned on the cards (zero.Init) and rank 0 alone reads the "
            f"checkpoint (the {model_gb:.0f} GB of 16-bit weights in the page cache)"
            + (f", fusing the MoE experts ({fused_gb:.1f} GB)" if fused_gb else "")
            + f": {est.load_ram_gb:.0f} GB of RAM for the {n} processes"
        )


def _optimizer_free(est: Any, n: int) -> float:
    """Optimizer states and gradients do not exist yet while the model is being sharded."""
    b = est.breakdown_gb
    return (
        b.get("adapters", 0.0) * 12 / 16
        + b.get("gradients", 0.0)
        + b.get("optimizer", 0.0)
        + b.get("gradient churn", 0.0)
    )
