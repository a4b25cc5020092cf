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

# Model FLOPs utilisation per GPU (dense bf16 peak), calibrated on one H200's measured Qwen3-8B steps
# (docs/sizing.md, "Time and cost"); QLoRA dequantises every weight on every forward and recompute.
MFU = {name: m.mfu for name, m in METHODS.items()}  # launcher/methods.py
# Unsloth's kernels: LLaMA-Factory measured 1.6x tokens/s over HF for 4-bit LoRA; the article's
# RTX 4090 row implies ~1.4x. We use the lower.
UNSLOTH_SPEEDUP = 1.4
# QLoRA + FSDP gathers 4-bit shards and dequantises them: the article's "bei maessigem Tempo".
QLORA_SHARDED_EFFICIENCY = 0.7
# CPU: effective fp32 FLOP/s per core for small matmuls, and a fixed cost per micro-batch (Python,
# optimizer, data collation) that dominates for tiny models. Both replaced by the smoke test's measurement.
# Calibrated on the tiny demo model on 2 cores (measured ~600 tokens/s by the smoke test).
CPU_FLOPS_PER_CORE = 5e9
CPU_SECONDS_PER_MICRO_BATCH = 0.8
# GPU: kernel launches, optimizer step and Python per micro-batch; matters only for small models.
GPU_SECONDS_PER_MICRO_BATCH = 0.01
# A card the catalog does not know: assume this dense bf16 TFLOP/s per GB of memory (an A100-class ratio).
UNKNOWN_GPU_TFLOPS = 150.0
# Host link of a card, by compute capability: PCIe 3.0 x16 for Volta/Turing (7.x), 4.0 for Ampere/Ada (8.x),
# 5.0 for Hopper, Blackwell and RTX 50 (9.0+; SXM boards reach the host over PCIe 5.0 too). Per direction, GB/s:
# the specification's 8/16/32 GT/s per lane x 16 lanes x 128b/130b encoding. A board that gives each card
# only x8 halves it; the smoke test measures the real rate.
PCIE_GB_S = {3: 15.75, 4: 31.5, 5: 63.0}
# FSDP's offload moves each unit's shard to the card before its all-gather, in forward and again in backward
# (reshard_after_forward: the recomputation under checkpointing reuses the backward's gather).
OFFLOAD_PASSES = 2
# Loading QLoRA on the CPU: bitsandbytes 0.50 quantizes NF4 on the CPU with its pure-torch fallback
# (backends/default/ops.py, quantize_4bit; the CPU backend has no native 4-bit quantizer). Measured ~5-6M
# parameters/s per process on a 2-core VM (1-2 threads; docs/sizing.md, "Loading"), counted per core: the one
# process that quantizes for the box runs with all of its cores (launcher/worker/loading.py, _quantize_into).
CPU_NF4_PARAMS_PER_CORE_S = 5e6


def pcie_gb_s(compute_capability: tuple[int, int] | None) -> float:
    """One card's host-link bandwidth per direction (PCIE_GB_S); PCIe 4.0 for a card of unknown generation."""
    if compute_capability is None:
        return PCIE_GB_S[4]
    major = tuple(compute_capability)[0]
    return PCIE_GB_S[3 if major < 8 else 4 if major < 9 else 5]


# DeepSpeed ZeRO-3 optimizer offload, bytes per trainable parameter crossing one card's host link (its partition):
# every micro-batch, the reduce-scattered 16-bit gradient partition is copied into the pinned CPU buffer and, to add
# the next micro-batch on the card, back (stage3.py partition_grads: 2 B down, 2 B up); at the accumulation boundary
# the fp32 gradient goes down for the CPU step (_offload_grad_partition_at_boundary: 4 B); after the step the fp32
# master partition is copied into the card's 16-bit partition (_reassign_or_swap_out_partitioned_parameters:
# counted at 4 B, the fp32 side; none under offload_param, whose partitions stay in RAM).
DS_OFFLOAD_MICRO_BATCH_BYTES = 4
DS_OFFLOAD_STEP_BYTES = 4
DS_OFFLOAD_PARAMS_BACK_BYTES = 4
# DeepSpeedCPUAdam (csrc/adam: AVX2/AVX-512, OpenMP over the rank's threads) is bound by memory bandwidth: per
# parameter it reads the fp32 master, gradient, m and v and writes master, m and v (28 B). Measured 0.68G params/s on
# one core of the 2-core development VM (a 20M-parameter step; docs/sizing.md, "CPU offload"); a
# server's cores share its memory channels (~5 GB/s per core on a loaded 2-socket box), so the plan counts 0.2G
# params/s per core of the box, every core busy (each rank runs with cores / ranks threads: launch_env).
CPU_ADAM_PARAMS_PER_CORE_S = 2e8


def deepspeed_offload_seconds(
    arch: Arch, est: MemoryEstimate, w: Workload, link_gb_s: float, cpu_count: int
) -> tuple[float, float]:
    """DeepSpeed CPU offload per micro-batch for one card: (host-link transfer s, CPU optimizer step s); the step's
    own transfer and the CPU step are paid once per optimizer step, so they are spread over the accumulation. The
    card waits for both: ZeRO-3 runs the CPU step between backward and the next forward."""
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
    """Seconds per micro-batch TRL's activation offloading adds: the offloaded activations go down to pinned RAM in
    the forward and come back in the backward (trl/models/activation_offloading.py, OffloadActivations). trl overlaps
    the copies with compute on a second stream; the plan counts them whole, as for parameter offload."""
    if not w.offload_activations or w.device == "cpu" or not w.gradient_checkpointing:
        return 0.0
    return 2 * offloaded_activation_bytes(arch, w.tokens_per_micro_batch) / (link_gb_s * 1e9)


def _resident_states_gb(est: MemoryEstimate, w: Workload) -> float:
    """Offloaded bytes per card that never cross the link: optimizer states and gradient buffers (the step runs on
    the CPU)."""
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


# bf16 tensor cores start with compute capability 8.0 (Ampere). Below it (T4 7.5, V100 7.0) bf16 is only
# emulated, slower than fp16, so the worker trains in fp16 with loss scaling, and the catalog's throughput
# figure for those cards is their fp16 tensor rate (gpus.yaml).
BF16_MIN_COMPUTE_CAPABILITY = (8, 0)


def training_precision(device: str, compute_capability: tuple[int, int] | list[int] | None) -> str:
    """The 16-bit format a run trains in: "bf16", "fp16" (with loss scaling) or "fp32" on a CPU.

    An unknown compute capability counts as bf16-capable: every card ftrun plans for by name is
    Ampere or newer unless the catalog says otherwise."""
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
    """Training FLOPs per token: forward 2 x matmul params + causal attention; backward 2x forward for full
    (input and weight gradients), 1x for LoRA (input gradients only); recomputation adds one forward, and so does
    DPO's reference pass (the same tokens through the frozen reference, without gradients).

    `dense_row`: the tokens of a padding-free row whose attention carries a dense mask (0: none). SDPA's
    memory-efficient kernel then computes every query against every key of the row, masked or not (no causal
    skipping, no example boundaries): 4 x q_dim x row per token and layer instead of 2 x q_dim x seq_len.

    KTO's KL sequence (as long as an example on average: the same answers, rotated) adds a forward through the
    policy, and one through the reference where it has one."""
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
    """The tokens of the padding-free row a dense mask spans, for examples of `seq` tokens on average (0: no dense
    mask)."""
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
    flops = flops_per_token(
        arch,
        w.method,
        seq,
        w.gradient_checkpointing,
        reference_forward=bool(w.reference),
        dense_row=dense_row(w, seq),
        kl_forward=w.kl_forward,
    )
    if w.device == "cpu":
        tokens = w.micro_batch * w.sequences * seq
        seconds = tokens * flops / (cpu_count * CPU_FLOPS_PER_CORE) + CPU_SECONDS_PER_MICRO_BATCH
        return tokens / seconds
    peak = (tflops_bf16 or UNKNOWN_GPU_TFLOPS) * 1e12
    rate = peak * MFU[w.method] * (UNSLOTH_SPEEDUP if w.engine == "unsloth" else 1.0)
    tokens = w.micro_batch * w.sequences * seq
    transfer = 0.0
    if w.offload_params and w.sharded and w.engine == "fsdp":
        transfer = offload_seconds_per_micro_batch(memory(arch, w), w, pcie_gb_s(compute_capability))
    elif w.offload_optimizer and w.sharded and w.engine == "deepspeed":
        transfer = sum(deepspeed_offload_seconds(arch, memory(arch, w), w, pcie_gb_s(compute_capability), cpu_count))
    transfer += activation_offload_seconds(arch, w, pcie_gb_s(compute_capability))
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
# A greedy decode step reads every weight once: it takes at least the model's 16-bit bytes (and the KV cache's) over
# the card's memory bandwidth, and a batch of prompts shares the step. The bandwidth-bound kernels reach about half of
# the datasheet figure at these sizes: an assumption no GPU has measured yet (docs/BENCHMARKS.md section 7).
GENERATION_EFFICIENCY = 0.5
# transformers' generate runs the model eagerly: every operation is a kernel launched from Python, one after the
# other, and below ~30B parameters a decode step takes longer to launch than the card takes to run it. Kernels of one
# decode step, counted in the pinned sources for bf16 weights, SDPA and a padding mask (transformers 5.24
# models/qwen3/modeling_qwen3.py, models/llama/modeling_llama.py, integrations/sdpa_attention.py, cache_utils.py
# DynamicLayer.update), and checked with torch.profiler on the tiny Qwen3 in bf16 (docs/sizing.md "Sampling": 56 a
# layer on the CPU, where SDPA takes the grouped K/V itself and the output needs no copy; 6 per LoRA module; 35 a step
# outside the layers, before the sampling):
# - an RMSNorm: to(fp32), pow, mean, add eps, rsqrt, mul, to(bf16), mul by the weight;
DECODE_KERNELS_PER_NORM = 8
# - attention and the residuals: q, k, v and o, RoPE on q and k (mul, neg, cat, mul, add each), the cache's two cats,
#   K/V repeated for the mask (two copies), SDPA and the output's transpose, the two residual adds;
DECODE_KERNELS_PER_ATTENTION = 22
# - the MLP: gate, up and down, SiLU and the gate's mul;
DECODE_KERNELS_PER_MLP = 5
# - one unmerged LoRA module (peft 0.21 tuners/lora/layer.py Linear.forward): the input cast to the adapter's fp32,
#   A, B, the scaling, the add, the cast back (lora.dropout > 0 adds one more, left out: its default is 0);
DECODE_KERNELS_PER_LORA_MODULE = 6
# - one MoE expert a step routes tokens to (a mask, an index, the gate, up and down linears, SiLU, mul, the weighted
#   index_add), and the router's linear, softmax, top-k and normalisation once per layer;
DECODE_KERNELS_PER_EXPERT = 9
DECODE_KERNELS_PER_ROUTER = 5
# - once per step: the embedding, the rotary table, the 4-D mask from the 2-D one, the final norm, the LM head on the
#   last position, the sampling (temperature, softmax, multinomial), the finished-sequence bookkeeping and the cats of
#   the ids and the mask (transformers 5.24 generation/utils.py _sample).
DECODE_KERNELS_PER_STEP = 40


def decode_kernels(arch: Arch, lora_modules: int = 0, batch: int = 1) -> int:
    """Kernels one eager decode step launches (the DECODE_KERNELS_* counts): per layer its norms, its attention and
    MLP, its LoRA modules, its experts hit (MoE: at most every expert, at least the batch's picks), plus the step's
    own. `lora_modules`: the adapted linears per layer (0: merged or none)."""
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
    """One batched decode step on one card and what bounds it: ("launch", "memory" or "compute"). The slowest of
    the launches (decode_kernels x sizing_constants.EAGER_OP_SECONDS), the memory roofline (the 16-bit weights and
    the batch's KV cache at `context` tokens read once, at GENERATION_EFFICIENCY of the bandwidth) and the compute
    (2 x active parameters per prompt). `launches` False: an engine that replays CUDA graphs (vLLM), no launch
    floor."""
    kv = batch * context * arch.layers * 2 * arch.kv_dim * 2
    read = (arch.params * 2 + kv) / (bandwidth_gb_s * 1e9 * GENERATION_EFFICIENCY)
    compute = batch * 2 * arch.active_params / ((tflops_bf16 or UNKNOWN_GPU_TFLOPS) * 1e12 * GENERATION_EFFICIENCY)
    launch = decode_kernels(arch, lora_modules, batch) * EAGER_OP_SECONDS if launches else 0.0
    return max((launch, "launch"), (read, "memory"), (compute, "compute"))


def generation_tokens_per_second(
    arch: Arch, bandwidth_gb_s: float | None, tflops_bf16: float | None, batch: int = GENERATION_BATCH["cuda"]
) -> float | None:
    """New tokens per second of batched greedy generation on one card (decode_step_seconds, a merged model, the
    cache left out: the answers are short). None without the card's bandwidth (a card the catalog lacks, MIG)."""
    if not bandwidth_gb_s:
        return None
    return batch / decode_step_seconds(arch, bandwidth_gb_s, tflops_bf16, batch)[0]


def hours(training_tokens: float, tokens_per_sec: float) -> float:
    return training_tokens / tokens_per_sec / 3600


def cost_eur(hours_: float, price_per_hour: float) -> float:
    return hours_ * price_per_hour
