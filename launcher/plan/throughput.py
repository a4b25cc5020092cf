"""Training speed and its price: FLOPs per token, tokens/s for a box (one card's rate at the method's MFU, data
parallel's speed-up, sharding and offload transfers), the task evaluation's generation speed, hours and cost (no
torch, no I/O). Memory is launcher/plan/sizing.py's; docs/sizing.md, "Time and cost", derives every constant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from launcher.methods import METHODS, is_adapter, is_quantized
from launcher.plan import links
from launcher.plan.sizing import MemoryEstimate, Workload, memory, offloaded_activation_bytes
from launcher.plan.sizing_constants import ADAPTER_BYTES, EAGER_OP_SECONDS, GB, GRADIENT_CHURN_BYTES

if TYPE_CHECKING:  # for the annotations only
    from launcher.plan.models import Architecture as Arch

# Model FLOPs utilisation per GPU (dense bf16 peak), calibrated on one H200 (docs/sizing.md, "Time and cost").
MFU = {name: m.mfu for name, m in METHODS.items()}  # launcher/methods.py
# Unsloth's kernels: LLaMA-Factory measured 1.6x over HF for 4-bit LoRA, the article's RTX 4090 row ~1.4x: the lower.
UNSLOTH_SPEEDUP = 1.4
# QLoRA + FSDP gathers 4-bit shards and dequantises them: the article's "bei maessigem Tempo".
QLORA_SHARDED_EFFICIENCY = 0.7
# CPU: fp32 FLOP/s per core and a fixed cost per micro-batch, calibrated on the tiny demo model (docs/sizing.md)
CPU_FLOPS_PER_CORE = 5e9
CPU_SECONDS_PER_MICRO_BATCH = 0.8
# GPU: kernel launches, optimizer step and Python per micro-batch; matters only for small models.
GPU_SECONDS_PER_MICRO_BATCH = 0.01
# A card the catalog does not know: assume this dense bf16 TFLOP/s per GB of memory (an A100-class ratio).
UNKNOWN_GPU_TFLOPS = 150.0
# PCIe 3.0/4.0/5.0 x16 per direction, GB/s (8/16/32 GT/s x 16 lanes x 128b/130b), for compute capability 7/8/9+
PCIE_GB_S = {3: 15.75, 4: 31.5, 5: 63.0}
# FSDP's offload moves each unit's shard to the card in forward and again in backward (reshard_after_forward).
OFFLOAD_PASSES = 2
# NF4 quantizing per CPU core (bitsandbytes 0.50 backends/default/ops.py quantize_4bit; docs/sizing.md, "Loading")
CPU_NF4_PARAMS_PER_CORE_S = 5e6


def pcie_gb_s(compute_capability: tuple[int, int] | None) -> float:
    """One card's host-link bandwidth per direction (PCIE_GB_S); PCIe 4.0 for a card of unknown generation."""
    if compute_capability is None:
        return PCIE_GB_S[4]
    major = tuple(compute_capability)[0]
    return PCIE_GB_S[3 if major < 8 else 4 if major < 9 else 5]


# DeepSpeed ZeRO-3 optimizer offload, bytes per trainable parameter over one card's host link (stage3.py): each
# micro-batch the 16-bit gradient partition down and back (partition_grads, 2 + 2), at the boundary the fp32 gradient
# down (_offload_grad_partition_at_boundary), after the step the master into the 16-bit partition
# (_reassign_or_swap_out_partitioned_parameters, fp32 side; none under offload_param).
DS_OFFLOAD_MICRO_BATCH_BYTES = 4
DS_OFFLOAD_STEP_BYTES = 4
DS_OFFLOAD_PARAMS_BACK_BYTES = 4
# DeepSpeedCPUAdam (csrc/adam), bound by memory bandwidth, per core of the box (docs/sizing.md, "CPU offload")
CPU_ADAM_PARAMS_PER_CORE_S = 2e8


def deepspeed_offload_seconds(
    arch: Arch, est: MemoryEstimate, w: Workload, link_gb_s: float, cpu_count: int
) -> tuple[float, float]:
    """DeepSpeed CPU offload per micro-batch for one card: (host-link transfer s, CPU optimizer step s), the per-step
    parts spread over the accumulation. The card waits for both (the CPU step runs between backward and forward)."""
    if not (w.engine == "deepspeed" and w.offload_optimizer and w.sharded) or w.device == "cpu":
        return 0.0, 0.0
    n, t, acc = w.num_gpus, est.trainable_params, max(1, w.accumulation)
    per_micro = DS_OFFLOAD_MICRO_BATCH_BYTES * t / n
    if w.offload_params:  # each unit's 16-bit partition goes up before its all-gather, in forward and in backward
        per_micro += OFFLOAD_PASSES * arch.params * 2 / n
    per_step = (DS_OFFLOAD_STEP_BYTES + (0 if w.offload_params else DS_OFFLOAD_PARAMS_BACK_BYTES)) * t / n
    transfer = (per_micro + per_step / acc) / (link_gb_s * 1e9)  # links are rated in 1e9 bytes/s
    step = t / (CPU_ADAM_PARAMS_PER_CORE_S * max(1, cpu_count)) / acc
    return transfer, step


def offload_seconds_per_micro_batch(est: MemoryEstimate, w: Workload, link_gb_s: float) -> float:
    """Seconds one card spends moving offloaded shards over its host link per micro-batch: its shard of the
    parameters up in every forward and backward, the trainable parameters' gradient shard down once (FSDP)."""
    if not (w.offload_params and w.sharded) or w.device == "cpu" or w.engine != "fsdp":
        return 0.0
    n = w.num_gpus
    params_gb = est.offloaded_params_gb / n - _resident_states_gb(est, w)  # this card's shard of the weights
    grads_gb = est.trainable_params * 4 / n / GB
    return (OFFLOAD_PASSES * params_gb + grads_gb) * GB / (link_gb_s * 1e9)  # links are rated in 1e9 bytes/s


def activation_offload_seconds(arch: Arch, w: Workload, link_gb_s: float) -> float:
    """Seconds per micro-batch TRL's activation offloading adds: down in the forward, back in the backward
    (trl/models/activation_offloading.py). trl overlaps them with compute; the plan counts them whole."""
    if not w.offload_activations or w.device == "cpu" or not w.gradient_checkpointing:
        return 0.0
    return 2 * offloaded_activation_bytes(arch, w.tokens_per_micro_batch) / (link_gb_s * 1e9)


def _resident_states_gb(est: MemoryEstimate, w: Workload) -> float:
    """Offloaded GB per card that never cross the link: optimizer states and gradient buffers."""
    n = w.num_gpus
    t = est.trainable_params
    if is_adapter(w.method):
        return t * (ADAPTER_BYTES - 4) / n / GB  # of the 16 B per adapter parameter, only the fp32 weight moves up
    table = METHODS[w.method]
    return t * (table.gradient_bytes + table.optimizer_bytes + GRADIENT_CHURN_BYTES) / n / GB


def load_seconds(arch: Arch, w: Workload, cpu_count: int) -> float:
    """Time to load QLoRA under FSDP: one process quantizes the whole model on the CPU with all the box's cores
    (launcher/worker/loading.py, quantized_once_per_box), once per run: a restart maps the saved copy."""
    if not is_quantized(w.method) or w.engine != "fsdp" or not w.sharded or w.device == "cpu":
        return 0.0
    return arch.linear_params / (CPU_NF4_PARAMS_PER_CORE_S * max(1, cpu_count))


# bf16 tensor cores start at compute capability 8.0; below it fp16 with loss scaling (gpus.yaml: the fp16 rate)
BF16_MIN_COMPUTE_CAPABILITY = (8, 0)


def training_precision(device: str, compute_capability: tuple[int, int] | list[int] | None) -> str:
    """The 16-bit format a run trains in: "bf16", "fp16" (with loss scaling) or "fp32" on a CPU; an unknown compute
    capability counts as bf16-capable."""
    if device == "cpu":
        return "fp32"
    if compute_capability is not None and tuple(compute_capability) < BF16_MIN_COMPUTE_CAPABILITY:
        return "fp16"
    return "bf16"


def flops_per_token(
    arch: Arch,
    method: str,
    seq_len: int,
    gradient_checkpointing: bool,
    reference_forward: bool = False,
    dense_row: int = 0,
    kl_forward: bool = False,
) -> float:
    """Training FLOPs per token (docs/sizing.md, "Time and cost"): forward 2 x matmul params + causal attention;
    backward 2x forward for full, 1x for LoRA; recomputation and DPO's reference pass add a forward each, KTO's KL
    sequence one (two with a reference). `dense_row`: the tokens of a padding-free row under a dense mask (0: none),
    whose attention SDPA computes whole."""
    matmul = arch.active_params - arch.embedding_params + (arch.embedding_params if arch.tied_embeddings else 0)
    if dense_row:
        attention = 4 * arch.layers * arch.q_dim * dense_row  # QK^T and AV over the whole row
    else:
        attention = 2 * arch.layers * arch.q_dim * seq_len  # QK^T and AV, 2 FLOPs per MAC, causal halves the context
    forward = 2 * matmul + attention
    backward = forward if is_adapter(method) else 2 * forward
    kl = forward * (1 + reference_forward) if kl_forward else 0
    return forward + backward + (forward if gradient_checkpointing else 0) + (forward if reference_forward else 0) + kl


def dense_row(w: Workload, seq: int) -> int:
    """The tokens of the row a dense mask spans, for examples of `seq` tokens on average (0: no dense mask)."""
    return w.micro_batch * w.sequences * seq if w.dense_mask else 0


def tokens_per_second(
    arch: Arch,
    w: Workload,
    tflops_bf16: float | None,
    interconnect: str = links.NONE,
    cpu_count: int = 1,
    mean_seq_len: int | None = None,
    compute_capability: tuple[int, int] | None = None,
) -> float:
    """Training tokens per second for the whole box (parameter offload adds its host-link transfers to each
    micro-batch, not overlapped with compute: docs/sizing.md, "Parameter offload")."""
    seq = mean_seq_len or w.seq_len
    # DPO's reference: a forward of every token, each step or once before training (the same count in one epoch)
    ref, dense = bool(w.reference), dense_row(w, seq)
    flops = flops_per_token(arch, w.method, seq, w.gradient_checkpointing, ref, dense, w.kl_forward)
    tokens = w.micro_batch * w.sequences * seq
    if w.device == "cpu":
        seconds = tokens * flops / (cpu_count * CPU_FLOPS_PER_CORE) + CPU_SECONDS_PER_MICRO_BATCH
        return tokens / seconds
    peak = (tflops_bf16 or UNKNOWN_GPU_TFLOPS) * 1e12
    rate = peak * MFU[w.method] * (UNSLOTH_SPEEDUP if w.engine == "unsloth" else 1.0)
    link = pcie_gb_s(compute_capability)
    transfer = 0.0
    if w.offload_params and w.sharded and w.engine == "fsdp":
        transfer = offload_seconds_per_micro_batch(memory(arch, w), w, link)
    elif w.offload_optimizer and w.sharded and w.engine == "deepspeed":
        transfer = sum(deepspeed_offload_seconds(arch, memory(arch, w), w, link, cpu_count))
    transfer += activation_offload_seconds(arch, w, link)
    one = tokens / (tokens * flops / rate + GPU_SECONDS_PER_MICRO_BATCH + transfer)
    if w.num_gpus <= 1:
        return one
    speed = one * links.scaling(w.num_gpus, interconnect)
    if w.sharded:
        speed *= links.sharding_efficiency(interconnect)
        if is_quantized(w.method):
            speed *= QLORA_SHARDED_EFFICIENCY
    return speed


# --- generation: the task evaluation's answers (launcher/worker/task_eval.py), GRPO's sampling (plan/sampling.py) ----
# Prompts answered per generate call: a CPU gains little past a few (and pads more), a GPU fills up with more.
GENERATION_BATCH = {"cpu": 8, "cuda": 32}
# The share of the datasheet bandwidth a decode step reaches: not measured yet (docs/BENCHMARKS.md section 7)
GENERATION_EFFICIENCY = 0.5
# Kernels of one eager decode step, counted in transformers 5.24 (modeling_qwen3.py, modeling_llama.py,
# integrations/sdpa_attention.py, generation/utils.py _sample) and peft 0.21 (tuners/lora/layer.py Linear.forward) for
# bf16 weights, SDPA and a padding mask; what each counts and the profiler's check: docs/sizing.md, "Sampling".
DECODE_KERNELS_PER_NORM = 8
DECODE_KERNELS_PER_ATTENTION = 22  # and the residuals
DECODE_KERNELS_PER_MLP = 5
DECODE_KERNELS_PER_LORA_MODULE = 6  # one unmerged module
DECODE_KERNELS_PER_EXPERT = 9  # per expert a step routes tokens to
DECODE_KERNELS_PER_ROUTER = 5
DECODE_KERNELS_PER_STEP = 40  # outside the layers


def decode_kernels(arch: Arch, lora_modules: int = 0, batch: int = 1) -> int:
    """Kernels one eager decode step launches: per layer its norms, attention, MLP (MoE: the experts the batch hits),
    `lora_modules` adapted linears (0: merged or none), plus the step's own."""
    norms = arch.norms_per_layer + (2 if arch.qk_norm else 0)
    layer = norms * DECODE_KERNELS_PER_NORM + DECODE_KERNELS_PER_ATTENTION
    layer += lora_modules * DECODE_KERNELS_PER_LORA_MODULE
    if arch.experts > 1:
        layer += (
            DECODE_KERNELS_PER_ROUTER + min(arch.experts, batch * arch.experts_per_token) * DECODE_KERNELS_PER_EXPERT
        )
    else:
        layer += DECODE_KERNELS_PER_MLP
    return arch.layers * layer + DECODE_KERNELS_PER_STEP


def decode_step_seconds(
    arch: Arch,
    bandwidth_gb_s: float,
    tflops_bf16: float | None,
    batch: int,
    context: int = 0,
    lora_modules: int = 0,
    launches: bool = True,
) -> tuple[float, str]:
    """Seconds of one batched decode step on one card and what bounds it ("launch", "memory" or "compute"): the
    slowest of the launches, the 16-bit weights and KV cache at `context` tokens read once, and 2 x active parameters
    per prompt (docs/sizing.md, "Sampling"). `launches` False: CUDA graphs (vLLM), no launch floor."""
    kv = batch * context * arch.layers * 2 * arch.kv_dim * 2
    read = (arch.params * 2 + kv) / (bandwidth_gb_s * 1e9 * GENERATION_EFFICIENCY)
    compute = batch * 2 * arch.active_params / ((tflops_bf16 or UNKNOWN_GPU_TFLOPS) * 1e12 * GENERATION_EFFICIENCY)
    launch = decode_kernels(arch, lora_modules, batch) * EAGER_OP_SECONDS if launches else 0.0
    return max((launch, "launch"), (read, "memory"), (compute, "compute"))


def generation_tokens_per_second(
    arch: Arch, bandwidth_gb_s: float | None, tflops_bf16: float | None, batch: int = GENERATION_BATCH["cuda"]
) -> float | None:
    """New tokens/s of batched greedy generation on one card (a merged model, the cache left out: short answers);
    None without the card's bandwidth."""
    if not bandwidth_gb_s:
        return None
    return batch / decode_step_seconds(arch, bandwidth_gb_s, tflops_bf16, batch)[0]


def hours(training_tokens: float, tokens_per_sec: float) -> float:
    return training_tokens / tokens_per_sec / 3600


def cost_eur(hours_: float, price_per_hour: float) -> float:
    return hours_ * price_per_hour
