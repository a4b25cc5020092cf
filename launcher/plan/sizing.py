"""Pure sizing arithmetic: the memory per device a workload needs, term by term, each term explained (no torch, no I/O).
Loading is launcher/plan/loading_memory.py's, the constants sizing_constants.py's, speed and cost throughput.py's;
docs/sizing.md derives every constant and compares the totals with published measurements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from launcher.engine_kinds import SHARDING
from launcher.methods import METHODS, is_adapter, is_quantized
from launcher.plan import vision
from launcher.plan.loading_memory import _loading, embedding_unit_bytes, layer_unit_bytes
from launcher.plan.loss_head import (
    FUSED_TOKEN_TILE,
    FUSED_VOCAB_TILE,
    LOGIT_BYTES_HF,
    LOGIT_BYTES_HF_CPU,
    cpu_loss_chunk_tokens,
    fused_head_bytes,
)
from launcher.plan.sizing_constants import (
    ADAPTER_BYTES,
    CPU_RUNTIME_GB,
    CUDA_CONTEXT_GB,
    FRAGMENTATION,
    GB,
    GRADIENT_CHURN_BYTES,
    LAYER_BACKWARD_FACTOR,
    LOGIT_BYTES_UNSLOTH,
    NCCL_GB,
    NF4_BYTES,
    UNSLOTH_LAYER_FACTOR,
)

if TYPE_CHECKING:  # for the annotations only: at run time this module imports nothing else
    from launcher.plan.models import Architecture as Arch


# How a workload computes the LM head's loss (launcher/plan/loss_head.py has what each holds):
LOSS_FUSED, LOSS_MATERIALIZED, LOSS_UNSLOTH = "fused LM head", "materialized logits", "Unsloth fused cross-entropy"


# DPO's reference (trl 1.16 dpo_trainer.py compute_ref_log_probs): what it costs, whether each step runs it
REFERENCES = {
    "adapter off": (
        "the base model with the LoRA adapter switched off (PEFT's disable_adapter): the same weights, no second model",
        True,
    ),
    "parent copy": (
        "the parent adapter's frozen copy (trl adds it as a second adapter, 'ref'; init_from): the same "
        "base weights, the adapter's parameters twice",
        True,
    ),
    "frozen copy": (
        "a frozen copy of the model (no gradient, no optimizer state; trl prepares it like the policy)",
        True,
    ),
    "precomputed": (
        "precomputed once over the data before training (one forward per example, 2 floats kept per "
        "pair): no reference model in memory while training",
        False,
    ),
}


@dataclass(frozen=True)
class Workload:
    """What decides memory and speed, independent of where the numbers came from."""

    method: str  # qlora | lora | full | full-8bit
    seq_len: int  # tokens per sequence in the largest micro-batch
    micro_batch: int
    gradient_checkpointing: bool = True
    lora_r: int = 16
    lora_targets: Any = "all-linear"
    engine: str = "trl"  # unsloth | trl | ddp | fsdp | deepspeed
    num_gpus: int = 1
    device: str = "cuda"  # cuda | cpu
    # FSDP parameter offload: the shards of weights, gradients and optimizer states live in CPU RAM
    offload_params: bool = False
    # DeepSpeed ZeRO-3 optimizer offload: fp32 master, gradients and Adam states in pinned RAM, the step on the CPU
    # (with offload_params, the 16-bit partitions too). docs/sizing.md, "CPU offload".
    offload_optimizer: bool = False
    # micro-batches per optimizer step: the offload's per-step transfer and CPU step spread over them
    accumulation: int = 1
    # "": ftrun's engine's loss (Unsloth's for unsloth, else TRL's fused LM head); LOSS_MATERIALIZED: whole logits
    loss: str = ""
    # TRL's activation_offloading: the saved layer inputs to pinned RAM (trl/models/activation_offloading.py)
    offload_activations: bool = False
    # preference objectives: rows of the micro-batch per example (DPO, ORPO: 2), and REFERENCES' key ("": none)
    sequences: int = 1
    reference: str = ""
    # GRPO: answers this process samples at once (TRL's generation batch per device), each at most seq_len tokens
    generation_batch: int = 0
    # SDPA's dense L x L mask over the one padding-free row (launcher/plan/attention.py dense_mask)
    dense_mask: bool = False
    # KTO: each example's KL sequence runs forward without a gradient (launcher/methods.py Objective.kl_forward)
    kl_forward: bool = False
    # a vision-language model: LoRA on the tower too, and the patches it runs on in the largest micro-batch
    lora_vision: bool = False
    vision_patches: int = 0

    @property
    def loss_kind(self) -> str:
        if self.loss:
            return self.loss
        return LOSS_UNSLOTH if self.engine == "unsloth" else LOSS_FUSED

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch * self.sequences

    @property
    def sharded(self) -> bool:
        return self.engine in SHARDING and self.num_gpus > 1


@dataclass
class MemoryEstimate:
    breakdown_gb: dict[str, float]  # per device
    explanations: dict[str, str]
    per_gpu_gb: float
    total_gb: float  # the whole job on one imaginary device: what the article's memory table gives
    trainable_params: int
    offloaded_ram_gb: float = 0.0  # Unsloth parks checkpointed activations in CPU RAM
    # Loading (docs/sizing.md, "Loading"): the largest transient per card and the box's RAM then (0: below the
    # training peak), and the parameter shards FSDP's offload keeps in RAM while training.
    load_peak_gb: float = 0.0
    load_ram_gb: float = 0.0
    load_explanation: str = ""
    offloaded_params_gb: float = 0.0
    # DeepSpeed CPU offload: the box's RAM while training (the offloaded states + every process's runtime), and why
    train_ram_gb: float = 0.0
    offload_explanation: str = ""

    @property
    def host_ram_gb(self) -> float:
        """What the box's RAM must hold at its peak: while loading, or while training with CPU offload."""
        return max(self.load_ram_gb, self.train_ram_gb)

    @property
    def ram_explanation(self) -> str:
        return self.offload_explanation if self.train_ram_gb > self.load_ram_gb else self.load_explanation

    @property
    def peak_gb(self) -> float:
        """What a card must hold: the training step's peak or the load's, whichever is larger."""
        return max(self.per_gpu_gb, self.load_peak_gb)


def _adamw_full(method: str) -> bool:
    """Every weight trained with a 32-bit AdamW (an fp32 master copy where the weights are 16-bit)."""
    return not METHODS[method].adapter and not METHODS[method].eight_bit_optimizer


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def trainable_params(arch: Arch, w: Workload) -> int:
    if is_adapter(w.method):
        tower = vision.lora_params(arch, w.lora_r, w.lora_targets) if w.lora_vision else 0
        return arch.lora_params(w.lora_r, w.lora_targets) + tower
    return arch.params


def layer_activation_bytes_per_token(arch: Arch, fp32: bool = False, lora_targets: Any = None) -> float:
    """Bytes one decoder layer saves for backward, per token (flash / SDPA: no s^2 term; a dense mask is
    dense_mask_bytes). Full fine-tuning: every linear's input, q, k, v, the norms' inputs and outputs, the MLP's
    intermediates, two fp32 copies of each RMSNorm's input. LoRA on a GPU (lora_targets given): only the targeted
    linears save their input (a 16-bit copy each), plus attention's, the gated MLP's and one fp32 copy per norm.
    Checked with autograd's saved-tensor hooks: tests/plan/test_sizing_activations.py.
    """
    h, i = arch.hidden, arch.intermediate
    if lora_targets is not None and not fp32:
        shapes = arch.linear_shapes()
        inputs = sum(shapes[m][0] for m in arch.resolve_targets(lora_targets))
        return arch.norms_per_layer * 4 * h + 2 * (2 * arch.q_dim + 2 * arch.kv_dim) + 2 * 3 * i + 2 * inputs
    elems = 4 * h + 2 * arch.q_dim + 2 * arch.kv_dim + 4 * i
    norm_fp32 = arch.norms_per_layer * 2 * 4 * h
    return elems * (4 if fp32 else 2) + (0 if fp32 else norm_fp32)


# SDPA's additive mask saved for backward (aten convert_boolean_attn_mask): bf16 attn_bias on a GPU, fp32 on the CPU
# (torch 2.13 _scaled_dot_product_flash_attention_for_cpu); by each layer, or the recomputed one.
MASK_BIAS_BYTES = {"cuda": 2, "cpu": 4}


def dense_mask_bytes(arch: Arch, w: Workload) -> float:
    """Bytes the dense mask of a padding-free row holds at the step's peak: transformers' boolean (1, 1, L, L) mask
    (masking_utils.py sdpa_mask, alive all step) and each kept layer's additive bias; 0 without a dense mask."""
    if not w.dense_mask:
        return 0.0
    row = w.tokens_per_micro_batch
    kept = 1 if w.gradient_checkpointing else arch.layers
    return row**2 * (1 + MASK_BIAS_BYTES["cpu" if w.device == "cpu" else "cuda"] * kept)


def memory(arch: Arch, w: Workload) -> MemoryEstimate:
    """Peak memory per device for one training step, as a breakdown whose terms are explained."""
    cpu = w.device == "cpu"
    n = w.num_gpus if w.sharded else 1
    t = w.tokens_per_micro_batch
    P = arch.params
    unsloth = w.engine == "unsloth"
    b16 = 4 if cpu else 2  # the CPU worker trains in fp32: no bf16 matmul speed-up to be had there
    terms: dict[str, float] = {}
    why: dict[str, str] = {}
    shard = f" / {n} GPUs (sharded)" if n > 1 else ""
    # Full fine-tuning in the Trainer's own loop keeps fp32 weights under autocast (launcher/worker/loading.py
    # weights_dtype): weight 4 + gradient 4 + AdamW 8 B/param. FSDP and DeepSpeed keep bf16 + an fp32 master.
    fp32_master = not cpu and _adamw_full(w.method) and w.engine not in SHARDING

    if is_quantized(w.method):
        # the decoder's linear weights and a vision tower's (transformers' 4-bit loading quantizes both: vision.py)
        four_bit = arch.linear_params + vision.quantized_params(arch)
        other = P - four_bit  # embeddings, lm_head, norms stay 16-bit
        terms["weights"] = (four_bit * NF4_BYTES + other * b16) / n / GB
        with_tower = " (the vision tower's included)" if arch.vision_linears else ""
        why["weights"] = (
            f"{_count(four_bit)} linear weights{with_tower} in NF4 ({NF4_BYTES:.3f} B/param with quantization "
            f"constants) + {_count(other)} embedding/head/norm params in {'fp32' if cpu else 'bf16'}{shard}"
        )
    elif fp32_master:
        terms["weights"] = P * 4 / GB
        why["weights"] = f"{_count(P)} params x 4 B (fp32 master weights, trained under bf16 autocast)"
    else:
        terms["weights"] = P * b16 / n / GB
        why["weights"] = f"{_count(P)} params x {b16} B ({'fp32' if cpu else 'bf16'}){shard}"

    T = trainable_params(arch, w)
    if is_adapter(w.method):
        terms["adapters"] = T * ADAPTER_BYTES / n / GB
        why["adapters"] = (
            f"LoRA r={w.lora_r}: {_count(T)} trainable params x {ADAPTER_BYTES} B "
            f"(fp32 weight, gradient, AdamW m and v){shard}"
        )
    else:
        table = METHODS[w.method]
        grad_b = 4 if cpu or fp32_master else table.gradient_bytes
        # fp32 weights (CPU, or fp32 master weights on a GPU): no separate master copy
        opt_b = 8 if (cpu and not table.eight_bit_optimizer) or fp32_master else table.optimizer_bytes
        # DeepSpeed's ZeRO optimizer keeps fp32 master partitions whatever the client optimizer: 4 B/param more.
        ds_master = not cpu and table.eight_bit_optimizer and w.engine == "deepspeed"
        opt_b += 4 if ds_master else 0
        terms["gradients"] = P * grad_b / n / GB
        why["gradients"] = f"one gradient per weight, {grad_b} B each{shard}"
        terms["optimizer"] = P * opt_b / n / GB
        why["optimizer"] = (
            "fp32 master partitions (DeepSpeed) 4 B + 8-bit AdamW m and v 2 B"
            if ds_master
            else "8-bit AdamW: m and v at 1 B each"
            if table.eight_bit_optimizer
            else ("AdamW m and v in fp32" if cpu or fp32_master else "fp32 master weights 4 B + AdamW m and v 8 B")
        ) + shard
        if not cpu:
            terms["gradient churn"] = P * GRADIENT_CHURN_BYTES / n / GB
            why["gradient churn"] = (
                "gradients are freed and re-allocated every step between activations; the "
                "allocator keeps ~half their size reserved but unusable (1 B/param)"
            )

    lora = is_adapter(w.method) and not unsloth
    layer = layer_activation_bytes_per_token(arch, fp32=cpu, lora_targets=w.lora_targets if lora else None)
    offload = live = 0.0
    factor = UNSLOTH_LAYER_FACTOR if unsloth else 1.0
    if w.gradient_checkpointing:
        checkpoints = arch.layers * t * arch.hidden * b16
        live = LAYER_BACKWARD_FACTOR * factor * layer * t
        offloaded_by = (
            "Unsloth" if unsloth else "TRL's activation offloading" if w.offload_activations and not cpu else ""
        )
        if offloaded_by:
            offload = (checkpoints if unsloth else offloaded_activation_bytes(arch, t)) / GB
            checkpoints = 0.0
        terms["activations"] = (checkpoints + live) / GB
        why["activations"] = (
            f"gradient checkpointing: "
            f"{f'layer inputs offloaded to CPU RAM by {offloaded_by}, ' if offloaded_by else ''}"
            f"{'' if offloaded_by else f'{arch.layers} saved layer inputs + '}"
            f"one layer recomputed ({layer / 1e3:.0f} KB/token) for {t:,} tokens per micro-batch"
        )
    else:
        terms["activations"] = (arch.layers * layer * factor * t) / GB
        why["activations"] = (
            f"no gradient checkpointing: all {arch.layers} layers keep their activations "
            f"({layer / 1e3:.0f} KB/token/layer) for {t:,} tokens per micro-batch"
        )
    # counted in bf16; the CPU worker trains in fp32 (b16 = 4): twice the bytes
    tower = (b16 / 2) * vision.activation_bytes(
        arch, w.vision_patches, w.gradient_checkpointing, trains=not is_adapter(w.method) or w.lora_vision
    )
    if tower:
        terms["activations"] += tower / GB
        why["activations"] += (
            f"; the vision tower over {w.vision_patches:,} patches: "
            + ("each block's input kept, one block recomputed" if w.gradient_checkpointing else "every block's tensors")
            + " and the merger's"
            + f" ({tower / GB:.2f} GB)"
        )
    if cpu:
        # The CPU attention path (math SDPA) materialises the score matrix: heads x s^2 fp32, twice for backward.
        kept = 1 if w.gradient_checkpointing else arch.layers
        terms["activations"] += 2 * w.micro_batch * w.sequences * arch.heads * w.seq_len**2 * 4 * kept / GB
    if w.dense_mask:
        terms["attention mask"] = dense_mask_bytes(arch, w) / GB
        kept = 1 if w.gradient_checkpointing else arch.layers
        why["attention mask"] = (
            f"SDPA's dense mask over the padding-free row of {t:,} tokens (no variable-length kernel here): "
            f"{t:,}^2 x 1 B boolean + {t:,}^2 x {MASK_BIAS_BYTES['cpu' if cpu else 'cuda']} B additive mask saved "
            f"for the backward by {kept} layer{'s' if kept > 1 else ''}"
        )
    if w.sequences > 1:
        why["activations"] += (
            f" ({w.micro_batch} pairs x {w.sequences} sequences: each prompt with its chosen and "
            f"its rejected answer, padded to the longest, {w.seq_len:,} tokens)"
        )
    if w.kl_forward:
        # trl 1.16 kto_trainer.py _compute_kl_logps: under no_grad, one layer at a time, below the recomputed layer
        why["activations"] += (
            "; each example's KL sequence (its prompt with another example's answer, KTO's KL estimate) runs "
            "forward without a gradient: no activations kept, inside the backward's peak"
        )
    if w.reference:
        what, per_step = REFERENCES[w.reference]
        copy = w.reference == "frozen copy"
        # the copy in the policy's dtype (trl 1.16: dtype=self.model.dtype), sharded like it; the parent adapter's
        # copy: its fp32 parameters once more; the others add no weights
        copy_b = 4 if fp32_master else b16
        extra = P * copy_b / n if copy else (T * 4 / n if w.reference == "parent copy" else 0.0)
        terms["reference model"] = extra / GB
        why["reference model"] = f"the reference: {what}" + (
            f", {_count(P)} params x {copy_b} B{shard}" if copy else ""
        )
        if per_step:
            # its forward runs under no_grad: one layer at a time, below the backward's recomputed layer
            why["reference model"] += (
                "; its forward each step keeps no activations (no gradient), one layer at a "
                "time: inside the backward's peak"
            )

    loss = w.loss_kind
    if loss == LOSS_FUSED:
        head = fused_head_bytes(arch, w)
        # With gradient checkpointing the head's backward ends (its buffers freed) before the last layer is recomputed:
        # the card holds the larger of the two, so only the head's excess over the recomputed layer counts here.
        excess = max(0.0, head - live) if w.gradient_checkpointing else head
        terms["logits and loss"] = excess / GB
        if cpu and is_adapter(w.method):
            at_once = f"{cpu_loss_chunk_tokens(arch.vocab, t):,} tokens x {arch.vocab:,} vocabulary entries"
        else:
            at_once = f"{min(t, FUSED_TOKEN_TILE):,} tokens x {min(arch.vocab, FUSED_VOCAB_TILE):,} vocabulary entries"
        why["logits and loss"] = (
            f"TRL's fused LM head: the logits never exist whole, {at_once} at a time; {head / GB:.2f} GB at its peak"
            + (
                f", before any layer is recomputed: {excess / GB:.2f} GB beyond the recomputed layer"
                if w.gradient_checkpointing
                else ""
            )
        )
    else:
        logit_b = LOGIT_BYTES_UNSLOTH if unsloth else (LOGIT_BYTES_HF_CPU if cpu else LOGIT_BYTES_HF)
        terms["logits and loss"] = t * arch.vocab * logit_b / GB
        why["logits and loss"] = f"{t:,} tokens x {arch.vocab:,} vocabulary x {logit_b} B " + (
            "(chunked fused cross-entropy, gradient in place)"
            if unsloth
            else "(logits, fp32 copy for the loss, its gradient)"
        )

    if n > 1:
        # Units: a decoder layer (4-bit for QLoRA) or the embedding / lm_head (16-bit); the one computed and the one
        # prefetched are whole on every card.
        per_layer = (P - arch.embedding_params * (1 if arch.tied_embeddings else 2)) / arch.layers
        layer_b = NF4_BYTES if is_quantized(w.method) else b16
        layer_unit = per_layer * layer_b
        embed_unit = arch.embedding_params * b16
        gathered = max(2 * layer_unit, layer_unit + embed_unit)
        if not is_adapter(w.method):
            gathered += max(per_layer, arch.embedding_params) * b16  # its full gradient before reduce-scatter
        terms["gathered shards"] = gathered / GB
        why["gathered shards"] = (
            f"FSDP/ZeRO-3 holds the unit being computed whole (a layer: {per_layer / 1e6:.0f}M "
            f"params, or the embedding: {arch.embedding_params / 1e6:.0f}M) plus the prefetched next one"
            + (", and a unit's full gradient before reduce-scatter" if not is_adapter(w.method) else "")
        )

    if is_quantized(w.method) and not cpu:
        # bitsandbytes 0.50 backends/cuda/ops.py gemm_4bit: _dequant_linear_fallback dequantizes the whole weight to
        # 16 bits for F.linear (forward and backward): the largest weight, one at a time.
        largest = max(a * b for a, b in arch.linear_shapes().values())
        terms["dequantized weight"] = largest * 2 / GB
        why["dequantized weight"] = (
            f"the largest 4-bit weight ({_count(largest)} params) dequantized to 16 bits for "
            "its matmul, one weight at a time"
        )
    dynamic = terms["activations"] + terms["logits and loss"] + terms.get("attention mask", 0.0)
    if w.generation_batch:
        kv, why_kv = generation_bytes(arch, w, b16)
        # trl 1.16 grpo_trainer.py _prepare_inputs: generation's cache is freed before the micro-batches start
        terms["generation"] = max(0.0, kv - dynamic * GB) / GB
        why["generation"] = why_kv + (
            f"; it is freed before the step's activations and logits ({dynamic:.2f} GB) exist, so only the excess "
            "counts"
        )
    if cpu:
        terms["runtime"] = CPU_RUNTIME_GB
        why["runtime"] = "Python, torch and tokenizer in the worker process"
    else:
        runtime = CUDA_CONTEXT_GB + FRAGMENTATION * dynamic
        parts = [f"CUDA context {CUDA_CONTEXT_GB} GB", f"allocator slack {FRAGMENTATION:.0%} of activations and logits"]
        if w.num_gpus > 1:
            runtime += NCCL_GB
            parts.append(f"NCCL buffers {NCCL_GB} GB")
            if w.engine == "ddp":
                grad_bytes = T * (4 if fp32_master else METHODS[w.method].gradient_bytes)
                runtime += grad_bytes / GB
                parts.append(
                    f"DDP gradient buckets {grad_bytes / GB:.1f} GB (a second copy of the trainable gradients)"
                )
        terms["runtime"] = runtime
        why["runtime"] = ", ".join(parts)

    per_gpu = sum(terms.values())
    # The article's table counts the job, not the card: unsharded static memory + one device's dynamic memory.
    static_sharded = sum(v for k, v in terms.items() if k in STATIC_TERMS)
    total = static_sharded * n + (per_gpu - static_sharded) - terms.get("gathered shards", 0.0)
    offloaded = 0.0
    ds_offload = w.engine == "deepspeed" and w.offload_optimizer and n > 1 and not cpu
    if ds_offload:
        per_gpu, total, offloaded = _deepspeed_offload(arch, w, terms, why, n, T)
    elif w.offload_params and n > 1 and not cpu:
        # FSDP2's CPUOffloadPolicy keeps every shard in pinned RAM and runs the optimizer step there
        for k in [k for k in STATIC_TERMS if k in terms]:
            offloaded += terms.pop(k) * n
            why.pop(k, None)
        per_gpu = sum(terms.values())
    est = MemoryEstimate(terms, why, per_gpu, total, T, offload, offloaded_params_gb=offloaded)
    _loading(arch, w, est, static_sharded, layer_unit_bytes(arch, w), embedding_unit_bytes(arch, w))
    if ds_offload:
        est.train_ram_gb = offloaded + n * CPU_RUNTIME_GB
        est.offload_explanation = (
            f"DeepSpeed CPU offload keeps {_count(T)} fp32 master weights, fp32 gradients, Adam m and v and a 16-bit "
            f"gradient accumulation buffer in pinned RAM ({DS_OFFLOAD_HOST_BYTES} B/param"
            + (f", and the {_count(P)} 16-bit parameter partitions, 2 B/param" if w.offload_params else "")
            + f": {offloaded:.0f} GB) + {CPU_RUNTIME_GB:.0f} GB of runtime per process: {est.train_ram_gb:.0f} GB of "
            "RAM while training"
        )
    return est


def generation_bytes(arch: Arch, w: Workload, b16: int) -> tuple[float, str]:
    """GRPO's sampling: the generation batch's KV cache at its longest (DynamicCache, the weights' dtype) and the last
    position's fp32 logits."""
    cache = w.generation_batch * w.seq_len * arch.layers * 2 * arch.kv_dim * b16
    logits = w.generation_batch * arch.vocab * 4 * 2
    return cache + logits, (
        f"sampling {w.generation_batch} answers at once: their KV cache, {w.generation_batch} x {w.seq_len:,} tokens "
        f"(prompt and answer) x {arch.layers} layers x 2 x {arch.kv_dim} x {b16} B = {cache / GB:.2f} GB, and each "
        "step's last logits"
    )


# DeepSpeed ZeRO-3 optimizer offload, bytes per trainable parameter in the box's RAM (stage3.py): fp32 master 4
# (_create_fp32_partitions), fp32 gradient buffer 4 (initialize_optimizer_states), Adam m, v 8 (DeepSpeedCPUAdam),
# 16-bit gradients 2 (_setup_for_real_optimizer); offload_param: 2 (_create_param_groups_fp16_flat_cpu_memory).
DS_OFFLOAD_HOST_BYTES = 18


def _deepspeed_offload(
    arch: Arch, w: Workload, terms: dict[str, float], why: dict[str, str], n: int, T: int
) -> tuple[float, float, float]:
    """Move what DeepSpeed's CPU offload keeps in RAM off the card's terms (gradients, optimizer states, churn; the
    weights under offload_param). The client optimizer is not used: transformers hands DeepSpeed a DummyOptim
    (integrations/deepspeed.py deepspeed_optim_sched), DeepSpeed builds DeepSpeedCPUAdam (engine.py). Returns GB: per
    card, the job's in all (cards + RAM), and the box's RAM for the offloaded states."""
    for k in ("gradients", "optimizer", "gradient churn"):
        terms.pop(k, None)
        why.pop(k, None)
    host = T * DS_OFFLOAD_HOST_BYTES / GB
    if "adapters" in terms:  # LoRA: the fp32 adapter weights stay on the card, their states go to RAM
        terms["adapters"] = T * 4 / n / GB
        why["adapters"] = f"LoRA r={w.lora_r}: {_count(T)} fp32 adapter weights / {n} GPUs (states offloaded)"
    if w.offload_params:
        host += terms.pop("weights") * n
        why.pop("weights", None)
    static = sum(v for k, v in terms.items() if k in STATIC_TERMS)
    per_gpu = sum(terms.values())
    total = static * n + (per_gpu - static) - terms.get("gathered shards", 0.0) + host
    return per_gpu, total, host


# Terms that stay resident between steps (sharded under FSDP/ZeRO-3, offloadable to CPU RAM by FSDP).
STATIC_TERMS = ("weights", "adapters", "gradients", "optimizer", "gradient churn")


def offloaded_activation_bytes(arch: Arch, tokens: int) -> float:
    """Bytes TRL's activation offloading moves to pinned RAM per micro-batch under gradient checkpointing: each layer's
    16-bit input and the final RMSNorm's fp32 input, once (trl/models/activation_offloading.py pack_tensor dedups by
    storage). Checked against a real step: tests/worker/test_fused_head.py."""
    return arch.layers * tokens * arch.hidden * 2 + tokens * arch.hidden * 4
