"""(Recipe, Hardware, DataStats) -> Plan: engine, processes, memory, tokens, time, cost, each with its reason; refuses with advice."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field, replace
from typing import Any

from . import sizing
from .errors import PlanError
from .hardware import Hardware, catalog, catalog_box
from .models import Architecture, load_architecture
from .sizing import Workload

# The article: "more cards when a run on one card would take longer than a working day".
WORKDAY_HOURS = 8.0
# A CPU run longer than this is refused: CPU training is for tiny models and tests.
CPU_MAX_HOURS = 24.0
# Box sizes the alternatives table and the refusal advice consider (the catalog lists 1, 2, 4, 8-card boxes).
BOX_SIZES = (1, 2, 4, 8)
# Without data statistics, an example is assumed to be this long (capped at max_length).
ASSUMED_MEAN_TOKENS = 500
SHARDING_ENGINES = ("fsdp", "deepspeed")
ENGINES = ("unsloth", "trl", "ddp", "fsdp", "deepspeed")


@dataclass
class Plan:
    fits: bool
    engine: str
    device: str  # "cuda" | "cpu"
    num_processes: int
    gpus: dict[str, Any]  # {name, count, memory_gb}
    model: dict[str, Any]
    method: str
    memory: dict[str, Any]
    tokens: dict[str, Any]
    estimate: dict[str, Any]  # {hours, cost_eur}
    price_per_hour_eur: float
    total_steps: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    checkpoint_every_steps: int
    reasons: list[str]
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    measured: dict[str, Any] = field(default_factory=dict)
    hardware: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    offload_params: bool = False  # FSDP keeps the parameter shards in CPU RAM (backends/fsdp.py: fsdp_offload_params)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "engine": self.engine,
            "device": self.device,
            "num_processes": self.num_processes,
            "gpus": dict(self.gpus),
            "model": dict(self.model),
            "method": self.method,
            "memory": dict(self.memory),
            "tokens": dict(self.tokens),
            "estimate": dict(self.estimate),
            "price_per_hour_eur": self.price_per_hour_eur,
            "total_steps": self.total_steps,
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "checkpoint_every_steps": self.checkpoint_every_steps,
            "reasons": list(self.reasons),
            "alternatives": [dict(a) for a in self.alternatives],
            "measured": dict(self.measured),
            "hardware": dict(self.hardware),
            "notes": list(self.notes),
            "offload_params": self.offload_params,
        }


# ---------------------------------------------------------------------------------------------
# Inputs: tokens and steps

@dataclass(frozen=True)
class Job:
    """The recipe's numbers that sizing needs, resolved once (with where each came from)."""

    arch: Architecture
    method: str
    seq_len: int  # longest micro-batch sequence: min(max_length, longest example) unless packing
    mean_tokens: float  # per example (or per packed sequence)
    examples: int | None
    training_tokens: float | None
    tokens_source: str
    micro_batch: int
    accumulation: int
    epochs: float
    max_steps: int | None
    gradient_checkpointing: bool
    lora_r: int
    lora_targets: Any
    packing: bool

    def workload(self, engine: str, num_gpus: int, device: str, offload: bool = False) -> Workload:
        return Workload(self.method, self.seq_len, self.micro_batch, self.gradient_checkpointing,
                        self.lora_r, self.lora_targets, engine, num_gpus, device, offload)


def _job(recipe: Any, arch: Architecture, data_stats: Any, tokens: float | None) -> tuple[Job, list[str]]:
    notes = []
    max_length = recipe.max_length
    examples = None
    if data_stats is not None:
        examples = int(data_stats.examples)
        mean = float(data_stats.mean_tokens)
        longest = min(int(data_stats.max_tokens), max_length)
        per_epoch = float(data_stats.total_tokens)
        src = "tokenizer" if getattr(data_stats, "tokens_source", "tokenizer") == "tokenizer" else "characters"
        source = f"{examples:,} examples x {mean:.0f} tokens (from the {src}" + \
                 (", about 4 characters per token: no tokenizer available)" if src == "characters" else ")")
    else:
        longest = max_length
        mean = min(ASSUMED_MEAN_TOKENS, max_length)
        per_epoch = None
        source = "--tokens" if tokens else "unknown"
    seq_len = max_length if recipe.packing else longest
    if recipe.packing:
        mean_seq = max_length  # packed sequences are full
    else:
        mean_seq = mean
    training = None
    if recipe.max_steps is not None:
        # max_steps overrides epochs (as in the HF Trainer); tokens follow from the batch shape.
        training = None  # filled in once the process count is known
        source += f"; max_steps={recipe.max_steps} decides the length"
    elif per_epoch is not None:
        training = per_epoch * recipe.epochs
        source += f" x {recipe.epochs:g} epochs"
    elif tokens:
        training = float(tokens)
    if tokens and data_stats is not None:
        notes.append("--tokens ignored: the data's own token count is used")
    if data_stats is None and tokens:
        notes.append(f"examples not known (data not read): steps assume {mean:.0f} tokens per example")
    job = Job(arch, recipe.method, seq_len, mean_seq, examples, training, source, recipe.micro_batch_size,
              recipe.gradient_accumulation_steps, recipe.epochs, recipe.max_steps, recipe.gradient_checkpointing,
              recipe.lora.r, recipe.lora.target_modules, recipe.packing)
    return job, notes


def _steps_and_tokens(job: Job, processes: int) -> tuple[int, float | None]:
    per_step_examples = job.micro_batch * job.accumulation * processes
    if job.max_steps is not None:
        steps = job.max_steps
        return steps, steps * per_step_examples * job.mean_tokens
    if job.examples is not None:
        steps = math.ceil(job.examples / per_step_examples) * job.epochs
        return max(1, math.ceil(steps)), job.training_tokens
    if job.training_tokens:
        return max(1, math.ceil(job.training_tokens / (per_step_examples * job.mean_tokens))), job.training_tokens
    return 0, None


# ---------------------------------------------------------------------------------------------
# Engine choice

@dataclass
class Choice:
    fits: bool
    engine: str
    device: str
    processes: int
    estimate: sizing.MemoryEstimate | None
    capacity_gb: float
    reasons: list[str]
    tokens_per_second: float = 0.0
    hours: float | None = None
    min_gpus: int = 1  # fewest cards that hold the job (sharding)
    refusal: str = ""  # why it does not fit, when fits is False
    offload_params: bool = False  # FSDP parameter offload to CPU RAM
    load_hours: float = 0.0  # loading before the first step, included in hours


def _unsloth_installed() -> bool:
    return importlib.util.find_spec("unsloth") is not None


def _deepspeed_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def _fits(est: sizing.MemoryEstimate, capacity: float) -> bool:
    """The card holds both the training step and the load (docs/sizing.md, "Loading")."""
    return est.peak_gb <= capacity * sizing.USABLE_FRACTION


def _tps(job: Job, w: Workload, hw: Hardware) -> float:
    g = hw.gpu
    return sizing.tokens_per_second(job.arch, w, g.tflops_bf16 if g else None, hw.interconnect, hw.cpu_count,
                                    mean_seq_len=int(job.mean_tokens),
                                    compute_capability=g.compute_capability if g else None)


def _hours(job: Job, w: Workload, hw: Hardware, processes: int) -> tuple[float, float | None]:
    tps = _tps(job, w, hw)
    _, training = _steps_and_tokens(job, processes)
    load = sizing.load_seconds(job.arch, w, hw.cpu_count) / 3600
    return tps, (sizing.hours(training, tps) + load if training else None)


# bitsandbytes' 8-bit AdamW indexes its states by the parameter's local storage and has no DTensor support; an open
# bitsandbytes issue reports illegal memory accesses with it under FSDP2, whose parameters are DTensors.
FULL_8BIT_FSDP = ("method full-8bit cannot run on FSDP: its 8-bit AdamW (bitsandbytes) has no support for the "
                  "DTensor parameters FSDP2 shards into (illegal memory access reported under FSDP2)")


def _choose_cpu(job: Job, hw: Hardware, forced: str, processes: int | None = None, nnodes: int = 1) -> Choice:
    capacity = hw.ram_gb
    reasons = [f"CPU run: this box has no GPU ({hw.cpu_count} cores, {hw.ram_gb:.0f} GB RAM); "
               "only sensible for tiny models and tests"]
    if forced in ("unsloth", "fsdp"):
        why = {"unsloth": "Unsloth needs an NVIDIA GPU",
               # STACK-FACTS: accelerate/Trainer turn an FSDP2 config into plain DDP on CPU; running
               # DDP under the FSDP name would be a silent fallback, so it is refused.
               "fsdp": "FSDP through accelerate/the Trainer does not shard on CPU (it silently becomes DDP); "
                       "use engine: ddp or deepspeed for several CPU processes"}[forced]
        return Choice(False, forced, "cpu", 1, None, capacity, reasons, refusal=f"engine: {forced} is impossible here: {why}")
    if forced == "trl" and processes is not None and processes > 1:
        return Choice(False, forced, "cpu", processes, None, capacity, reasons,
                      refusal=f"engine: trl is one process, num_processes is {processes}; use engine: ddp")
    if forced in ("ddp", "deepspeed") or (forced == "auto" and processes is not None and processes > 1):
        return _choose_cpu_multi(job, hw, "ddp" if forced == "auto" else forced, processes, reasons, nnodes)
    w = job.workload("trl", 1, "cpu")
    est = sizing.memory(job.arch, w)
    tps, hrs = _hours(job, w, hw, 1)
    reasons.append("engine trl, one process on the CPU" + (" (forced by the recipe)" if forced == "trl" else ""))
    if job.method in ("qlora", "full-8bit"):
        reasons.append(f"{job.method} relies on bitsandbytes, whose CPU support is limited: the smoke test will tell; "
                       "method lora (or full) is the safe choice on CPU")
    if est.per_gpu_gb > capacity * sizing.USABLE_RAM_FRACTION:
        return Choice(False, "trl", "cpu", 1, est, capacity, reasons, tps, hrs,
                      refusal=f"needs {est.per_gpu_gb:.1f} GB of RAM, this box has {capacity:.0f} GB "
                              f"({sizing.USABLE_RAM_FRACTION:.0%} usable)")
    if hrs is not None and hrs > CPU_MAX_HOURS:
        return Choice(False, "trl", "cpu", 1, est, capacity, reasons, tps, hrs,
                      refusal=f"fits in RAM but would take about {_fmt_hours(hrs)} on {hw.cpu_count} CPU cores "
                              f"(more than {CPU_MAX_HOURS:.0f} h)")
    reasons.append(f"memory: needs {est.per_gpu_gb:.1f} GB of {capacity:.0f} GB RAM")
    return Choice(True, "trl", "cpu", 1, est, capacity, reasons, tps, hrs)


def _choose_cpu_multi(job: Job, hw: Hardware, engine: str, processes: int | None, reasons: list[str],
                      nnodes: int = 1) -> Choice:
    """Several gloo processes on one CPU box (DDP or DeepSpeed ZeRO-3): for tests and the trajectory checks."""
    capacity = hw.ram_gb
    n = processes if processes is not None else 2
    if n * nnodes < 2:  # one process per node is fine when there are several nodes
        return Choice(False, engine, "cpu", n, None, capacity, reasons,
                      refusal=f"engine: {engine} with num_processes=1 is single-process training; use engine: trl")
    if n > hw.cpu_count:
        return Choice(False, engine, "cpu", n, None, capacity, reasons,
                      refusal=f"{n} gloo processes need at least {n} CPU cores, this box has {hw.cpu_count}")
    if engine == "deepspeed" and not _deepspeed_installed():
        return Choice(False, engine, "cpu", n, None, capacity, reasons,
                      refusal="engine: deepspeed needs DeepSpeed: pip install 'ftrun[deepspeed]' "
                              "(DS_BUILD_OPS=0 on a box without CUDA)")
    w = job.workload("trl", 1, "cpu")
    est = sizing.memory(job.arch, w)
    # The processes share the box's cores, so the box's throughput is about one process's.
    tps, hrs = _hours(job, w, hw, n)
    src = "num_processes from the recipe" if processes is not None else "2 by default on CPU"
    what = ("each holds a full copy and trains on its own micro-batches; gradients are averaged over gloo"
            if engine == "ddp" else
            "ZeRO-3 partitions parameters, gradients and optimizer states; about 4x slower per step than DDP here")
    reasons.append(f"engine {engine}, {n} gloo processes on the CPU ({src}): {what}")
    total = est.per_gpu_gb * n
    if total > capacity * sizing.USABLE_RAM_FRACTION:
        return Choice(False, engine, "cpu", n, est, capacity, reasons, tps, hrs,
                      refusal=f"{n} processes need {total:.1f} GB of RAM, this box has {capacity:.0f} GB")
    reasons.append(f"memory: {n} x {est.per_gpu_gb:.1f} GB of {capacity:.0f} GB RAM")
    return Choice(True, engine, "cpu", n, est, capacity, reasons, tps, hrs)


def _choose_cpu_unsloth(job: Job, hw: Hardware, unsloth_ok: bool, processes: int | None) -> Choice:
    """engine: unsloth forced on a CPU box: allowed only where Unsloth imports (its CPU path, for the test tier)."""
    capacity = hw.ram_gb
    reasons = [f"CPU run: this box has no GPU ({hw.cpu_count} cores, {hw.ram_gb:.0f} GB RAM); "
               "only sensible for tiny models and tests"]
    if job.method not in ("lora", "qlora"):
        return Choice(False, "unsloth", "cpu", 1, None, capacity, reasons,
                      refusal=f"engine: unsloth trains LoRA/QLoRA only; method is {job.method}")
    if not unsloth_ok:
        return Choice(False, "unsloth", "cpu", 1, None, capacity, reasons, refusal=UNSLOTH_MISSING + " (Unsloth needs "
                      "an NVIDIA GPU for real runs; on a CPU it is allowed only where it is installed, to test the engine)")
    if processes is not None and processes > 1:
        return Choice(False, "unsloth", "cpu", processes, None, capacity, reasons,
                      refusal=f"engine: unsloth is one process, num_processes is {processes}; use engine: ddp")
    # Unsloth's fused kernels are GPU kernels; on a CPU it runs its plain PyTorch path: sized as trl.
    w = job.workload("trl", 1, "cpu")
    est = sizing.memory(job.arch, w)
    tps, hrs = _hours(job, w, hw, 1)
    reasons.append("engine unsloth (forced by the recipe) on the CPU: Unsloth's CPU path (\"no GPU found, training "
                   "on CPU\"), for testing the engine; its speed and memory gains need an NVIDIA GPU, so time and "
                   "memory are estimated as for trl")
    if est.per_gpu_gb > capacity * sizing.USABLE_RAM_FRACTION:
        return Choice(False, "unsloth", "cpu", 1, est, capacity, reasons, tps, hrs,
                      refusal=f"needs {est.per_gpu_gb:.1f} GB of RAM, this box has {capacity:.0f} GB")
    reasons.append(f"memory: needs {est.per_gpu_gb:.1f} GB of {capacity:.0f} GB RAM")
    return Choice(True, "unsloth", "cpu", 1, est, capacity, reasons, tps, hrs)


# Unsloth pins older transformers/trl/datasets than ftrun's default stack: its own environment (docs/engines.md).
UNSLOTH_MISSING = ("engine: unsloth is impossible here: Unsloth is not installed in this environment. Unsloth pins "
                   "transformers<=5.17, trl<=1.15 and datasets<5.0, so it lives in its own virtual environment: "
                   "python3 -m venv .venv-unsloth && .venv-unsloth/bin/pip install 'ftrun[train,unsloth]' (scripts/test.sh "
                   "--unsloth builds it here), then run ftrun from that environment; or set engine: trl")


def choose(job: Job, hw: Hardware, forced: str = "auto", unsloth_ok: bool = False,
           workday_hours: float = WORKDAY_HOURS, processes: int | None = None, nnodes: int = 1) -> Choice:
    """The article's rules: one card if it fits; DDP when one card takes longer than a working day;
    sharding when no card holds the job; otherwise refuse. `processes` (recipe num_processes) is
    honoured or refused with the reason."""
    if hw.is_cpu_only and forced == "unsloth":
        return _choose_cpu_unsloth(job, hw, unsloth_ok, processes)
    if hw.is_cpu_only:
        return _choose_cpu(job, hw, forced, processes, nnodes)
    if processes is not None:
        return _choose_gpu_count(job, hw, forced, unsloth_ok, workday_hours, processes)
    g = hw.gpu
    cap = g.memory_gb
    n = hw.count
    lora = job.method in ("qlora", "lora")
    cc_ok = g.compute_capability is None or g.compute_capability >= (7, 0)
    reasons: list[str] = []

    # Forced engines that cannot work here are refused before anything is sized.
    if forced == "unsloth" and not lora:
        return Choice(False, "unsloth", "cuda", 1, None, cap, [], refusal="engine: unsloth trains LoRA/QLoRA only; "
                      f"method is {job.method}")
    if forced == "unsloth" and not unsloth_ok:
        return Choice(False, "unsloth", "cuda", 1, None, cap, [], refusal=UNSLOTH_MISSING + " (Unsloth also needs "
                      "a GPU of compute capability 7.0 or newer)")
    if forced in ("ddp", *SHARDING_ENGINES) and n * nnodes < 2:
        what = "DDP copies the model to every card to train on more data at once"
        if forced in SHARDING_ENGINES:
            what = f"{forced} shards the model over several cards"
        return Choice(False, forced, "cuda", 1, None, cap, [], refusal=f"engine: {forced} needs 2 or more GPUs and "
                      f"this box has one ({what}); use engine: auto or trl, or plan for a bigger box with --gpus 2x{g.name}")

    single_engine = "trl"
    if forced in ("unsloth", "trl"):
        single_engine = forced
    elif forced == "auto" and lora and unsloth_ok and cc_ok:
        single_engine = "unsloth"

    one = sizing.memory(job.arch, job.workload(single_engine, 1, "cuda"))
    fits_one = _fits(one, cap)
    if forced == "auto" and lora and not unsloth_ok:
        reasons.append("Unsloth not installed: TRL on one GPU (Unsloth would need less memory and run ~1.4x faster)")

    if fits_one and forced in ("auto", "unsloth", "trl", "ddp"):
        w1 = job.workload(single_engine, 1, "cuda")
        tps1, hrs1 = _hours(job, w1, hw, 1)
        spare = cap - one.per_gpu_gb
        fit_reason = f"fits one card: needs {one.per_gpu_gb:.1f} GB of {cap:.1f} GB ({spare:.1f} GB spare)"
        want_ddp = forced == "ddp" or (forced == "auto" and n > 1 and hrs1 is not None and hrs1 > workday_hours)
        if want_ddp and n > 1:
            wd = job.workload("ddp", n, "cuda")
            est = sizing.memory(job.arch, wd)
            if _fits(est, cap):
                tps, hrs = _hours(job, wd, hw, n)
                speed = sizing.scaling(n, hw.interconnect)
                why = ("forced by the recipe" if forced == "ddp" else
                       f"one card would take {_fmt_hours(hrs1)}, longer than a working day ({workday_hours:g} h)")
                link = ("NVLink" if hw.interconnect == "nvlink" else
                        "PCIe: cards talk over PCIe, which scales worse than NVLink")
                reasons += [fit_reason, f"engine ddp over {n} GPUs: {why}; ~{speed:.1f}x one card ({link})",
                            f"DDP keeps a full copy per card: {est.per_gpu_gb:.1f} GB per card"]
                return Choice(True, "ddp", "cuda", n, est, cap, reasons, tps, hrs)
            reasons.append(f"DDP would need {est.per_gpu_gb:.1f} GB per card (gradient buckets): staying on one card")
            if forced == "ddp":
                return Choice(False, "ddp", "cuda", n, est, cap, reasons, refusal=f"engine: ddp needs "
                              f"{est.per_gpu_gb:.1f} GB per card, the cards have {cap:.1f} GB")
        engine_reason = {"unsloth": "engine unsloth: LoRA/QLoRA on one card, Unsloth installed (fastest, least memory)",
                         "trl": "engine trl on one GPU"}[single_engine]
        if forced in ("unsloth", "trl"):
            engine_reason += " (forced by the recipe)"
        reasons += [fit_reason, engine_reason]
        if n > 1:
            reasons.append(f"the box has {n} cards; {n - 1} stay idle because one card finishes within a working day "
                           f"({_fmt_hours(hrs1) if hrs1 else 'time unknown'}); a 1-card box costs 1/{n} per hour, "
                           "or force engine: ddp")
        return Choice(True, single_engine, "cuda", 1, one, cap, reasons, tps1, hrs1)

    if forced in ("unsloth", "trl", "ddp"):
        return Choice(False, forced, "cuda", n if forced == "ddp" else 1, one, cap, reasons,
                      refusal=f"engine: {forced} keeps the whole job on each card: needs {one.per_gpu_gb:.1f} GB, "
                              f"the card has {cap:.1f} GB")

    # No single card holds it: shard.
    shard_engine = "deepspeed" if forced == "deepspeed" else "fsdp"
    if n < 2:
        return Choice(False, single_engine, "cuda", 1, one, cap, reasons,
                      refusal=f"needs {one.per_gpu_gb:.1f} GB on one card, the card has {cap:.1f} GB "
                              f"({sizing.USABLE_FRACTION:.0%} usable), and the box has no second card to shard over")
    if job.method == "full-8bit" and shard_engine == "fsdp":
        return Choice(False, "fsdp", "cuda", n, None, cap, reasons,
                      refusal=f"{FULL_8BIT_FSDP}. Set method: full (AdamW, fp32 master weights) or lora/qlora and let "
                              "the plan size it, or engine: deepspeed (ZeRO-3 hands the optimizer plain tensors; it "
                              "keeps fp32 master weights, 4 B/param more)")

    def fewest(offload: bool):
        for k in range(2, n + 1):
            if _fits(sizing.memory(job.arch, job.workload(shard_engine, k, "cuda", offload)), cap):
                return k
        return None

    offload = False
    minimum = fewest(False)
    est_all = sizing.memory(job.arch, job.workload(shard_engine, n, "cuda"))
    if minimum is None and job.method == "qlora" and shard_engine == "fsdp":
        # The published 70B-on-2x24 GB QLoRA runs: FSDP with the 4-bit shards offloaded to CPU RAM.
        minimum = fewest(True)
        if minimum is not None:
            offload, est_all = True, sizing.memory(job.arch, job.workload(shard_engine, n, "cuda", True))
    if minimum is None:
        return Choice(False, shard_engine, "cuda", n, est_all, cap, reasons,
                      refusal=f"needs {one.total_gb:.0f} GB in all; sharded over all {n} cards it still needs "
                              f"{est_all.peak_gb:.1f} GB per card"
                              + (f" ({est_all.load_explanation})" if est_all.load_peak_gb > est_all.per_gpu_gb else "")
                              + f", the cards have {cap:.1f} GB")
    ram_usable = hw.ram_gb * sizing.USABLE_RAM_FRACTION
    if est_all.load_ram_gb > ram_usable:
        need = est_all.load_ram_gb / sizing.USABLE_RAM_FRACTION
        return Choice(False, shard_engine, "cuda", n, est_all, cap, reasons, offload_params=offload,
                      refusal=f"the cards hold it{' with parameter offload to CPU RAM' if offload else ''} "
                              f"({est_all.peak_gb:.1f} GB per card), but loading does not fit the box's RAM: "
                              f"{est_all.load_explanation}; this box has {hw.ram_gb:.0f} GB "
                              f"({sizing.USABLE_RAM_FRACTION:.0%} usable). A box with {need:.0f} GB of RAM or more "
                              f"holds it (`ftrun plan` on that box reads its RAM)")
    wn = job.workload(shard_engine, n, "cuda", offload)
    tps, hrs = _hours(job, wn, hw, n)
    link = "NVLink" if hw.interconnect == "nvlink" else "PCIe (sharding exchanges every layer: expect it slower)"
    label = "FSDP" if shard_engine == "fsdp" else "DeepSpeed ZeRO-3"
    reasons.append(f"engine {shard_engine}: needs {one.total_gb:.0f} GB, largest card {cap:.0f} GB; "
                   f"{minimum} x {cap:.0f} GB {link} is the fewest that fits")
    reasons.append(f"{label} over all {n} cards of this box (billed whole; more shards run faster and leave more room): "
                   f"{est_all.per_gpu_gb:.1f} GB per card, {cap - est_all.per_gpu_gb:.1f} GB spare"
                   + (" (forced by the recipe)" if forced in SHARDING_ENGINES else ""))
    if job.method == "qlora":
        reasons.append("QLoRA + FSDP: 4-bit shards are gathered and dequantised per layer, so it runs at a moderate pace")
    if offload:
        link = sizing.pcie_gb_s(hw.gpu.compute_capability)
        move = sizing.offload_seconds_per_micro_batch(est_all, wn, link)
        reasons.append(f"parameter offload (fsdp_offload_params): without it each card needs "
                       f"{sizing.memory(job.arch, job.workload(shard_engine, n, 'cuda')).peak_gb:.1f} GB; the shards "
                       f"({est_all.offloaded_params_gb:.1f} GB) live in CPU RAM and cross PCIe ({link:g} GB/s per card) "
                       f"in every forward and backward: +{move:.1f} s per micro-batch")
    load_h = sizing.load_seconds(job.arch, wn, hw.cpu_count) / 3600
    if est_all.load_explanation:
        reasons.append("loading: " + est_all.load_explanation
                       + (f"; quantizing on {hw.cpu_count} CPU cores takes about {_fmt_hours(load_h)} (in the time)"
                          if load_h else ""))
    return Choice(True, shard_engine, "cuda", n, est_all, cap, reasons, tps, hrs, min_gpus=minimum,
                  offload_params=offload, load_hours=load_h)


def _choose_gpu_count(job: Job, hw: Hardware, forced: str, unsloth_ok: bool, workday_hours: float,
                      processes: int) -> Choice:
    """The engine choice on `processes` of the box's cards; refused when the rules need another count."""
    if processes > hw.count:
        return Choice(False, forced, "cuda", processes, None, hw.gpu.memory_gb, [],
                      refusal=f"num_processes={processes} needs {processes} GPUs, this box has {hw.count}")
    used = replace(hw, gpus=hw.gpus[:processes])
    c = choose(job, used, forced, unsloth_ok, workday_hours)
    if c.fits and c.processes != processes and forced == "auto" and processes > 1:
        c = choose(job, used, "ddp", unsloth_ok, workday_hours)  # a count > 1 asks for several processes
    if c.fits and c.processes != processes:
        return Choice(False, c.engine, "cuda", processes, c.estimate, c.capacity_gb, c.reasons,
                      refusal=f"num_processes={processes}: engine {c.engine} runs {c.processes} process(es) here")
    if c.fits:
        idle = hw.count - processes
        c.reasons.append(f"num_processes={processes} from the recipe"
                         + (f"; {idle} of the box's {hw.count} cards stay idle" if idle else ""))
    return c


# ---------------------------------------------------------------------------------------------
# Alternatives and advice

def _box_rows(job: Job, forced: str, unsloth_ok: bool, workday_hours: float) -> list[dict[str, Any]]:
    """Every catalog box (1, 2, 4, 8 cards) with whether the job fits and its time and cost."""
    rows = []
    for name, entry in catalog().items():
        for count in BOX_SIZES:
            hw = catalog_box(name, count)
            c = choose(job, hw, forced="auto" if forced == "auto" else forced, unsloth_ok=unsloth_ok,
                       workday_hours=workday_hours)
            if not c.fits:
                continue
            # A box whose extra cards stay idle is never a sensible alternative.
            if count > 1 and c.processes == 1:
                continue
            price = entry.price_per_hour_eur * count
            rows.append({
                "gpus": f"{count}x{name}",
                "engine": c.engine,
                "per_gpu_gb": round(c.estimate.per_gpu_gb, 1),
                "tokens_per_second": round(c.tokens_per_second),
                "hours": round(c.hours, 2) if c.hours is not None else None,
                "cost_eur": round(c.hours * price, 2) if c.hours is not None else None,
                "price_per_hour_eur": round(price, 2),
            })
    return rows


def _pick_alternatives(rows: list[dict[str, Any]], limit: int = 6) -> list[dict[str, Any]]:
    if not rows:
        return []
    if rows[0]["hours"] is None:  # no token count: order by price
        return sorted(rows, key=lambda r: r["price_per_hour_eur"])[:limit]
    by_cost = sorted(rows, key=lambda r: (r["cost_eur"], r["hours"]))
    by_time = sorted(rows, key=lambda r: (r["hours"], r["cost_eur"]))
    picked: list[dict[str, Any]] = []
    for r in by_cost[: limit - 2] + by_time[:2]:
        if r not in picked:
            picked.append(r)
    return sorted(picked, key=lambda r: (r["cost_eur"], r["hours"]))[:limit]


def _fixes_here(job: Job, hw: Hardware, forced: str, unsloth_ok: bool, workday_hours: float) -> list[str]:
    """Recipe changes that would make the job fit this box, each checked with the same rules."""
    tries: list[tuple[str, Job]] = []
    if job.seq_len > 256:
        for length in (job.seq_len // 2, job.seq_len // 4):
            if length >= 256:
                tries.append((f"max_length={length} (shorter sequences)", replace(job, seq_len=length)))
    if job.method == "lora":
        tries.append(("method=qlora (4-bit base model)", replace(job, method="qlora")))
    if job.method == "full":
        tries.append(("method=full-8bit (8-bit optimizer, no master copy)", replace(job, method="full-8bit")))
        tries.append(("method=qlora (train adapters on a 4-bit base instead)", replace(job, method="qlora")))
    if job.micro_batch > 1:
        acc = job.accumulation * job.micro_batch
        tries.append((f"micro_batch_size=1 gradient_accumulation_steps={acc} (same effective batch)",
                      replace(job, micro_batch=1, accumulation=acc)))
    if not job.gradient_checkpointing:
        tries.append(("gradient_checkpointing=true", replace(job, gradient_checkpointing=True)))
    out = []
    for label, variant in tries:
        c = choose(variant, hw, forced, unsloth_ok, workday_hours)
        if c.fits and c.estimate is not None:
            out.append(f"{label}: fits, {c.estimate.per_gpu_gb:.1f} GB per {'card' if c.device == 'cuda' else 'box'}")
    return out


# ---------------------------------------------------------------------------------------------
# The plan

def make_plan(recipe: Any, hardware: Hardware, data_stats: Any = None, tokens: float | None = None,
              unsloth_available: bool | None = None, smoke: dict[str, Any] | None = None,
              workday_hours: float = WORKDAY_HOURS, arch: Architecture | None = None, nnodes: int = 1) -> Plan:
    """Size the recipe's job for this box; PlanError (with concrete options in .fix) when nothing fits."""
    arch = arch or load_architecture(recipe.model)
    unsloth_ok = _unsloth_installed() if unsloth_available is None else unsloth_available
    job, notes = _job(recipe, arch, data_stats, tokens)
    forced = recipe.engine
    wanted = None if recipe.num_processes == "auto" else int(recipe.num_processes)
    choice = choose(job, hardware, forced, unsloth_ok, workday_hours, processes=wanted, nnodes=nnodes)
    rows = _box_rows(job, forced if forced in ("auto", *SHARDING_ENGINES) else "auto", unsloth_ok, workday_hours)
    alternatives = _pick_alternatives(rows)

    if not choice.fits:
        raise PlanError(_refusal_message(job, hardware, choice), fix=_refusal_fix(job, hardware, forced, unsloth_ok,
                                                                               workday_hours, rows))

    est = choice.estimate
    steps, training = _steps_and_tokens(job, choice.processes)
    tps = choice.tokens_per_second
    reasons = [f"model {arch.name}: {_fmt_tokens(arch.params)} params ({arch.source})"] + choice.reasons
    if choice.engine == "unsloth":
        from .backends.unsloth import plan_reason

        reasons += [r for r in [plan_reason(recipe.model, recipe.method)] if r]
    measured: dict[str, Any] = {}
    per_gpu = est.per_gpu_gb
    if smoke:
        applied = _apply_smoke(smoke, choice)
        measured = applied["measured"]
        notes += applied["notes"]
        tps = measured.get("tokens_per_second", tps)
        per_gpu = measured.get("peak_memory_gb", per_gpu)
    if training is None:
        hrs = None
        reasons.append("time and cost unknown: no data statistics and no --tokens")
    else:
        hrs = sizing.hours(training, tps) + choice.load_hours  # loading that the smoke test does not measure
    if hardware.is_cpu_only:
        price = recipe.price_per_hour_eur if recipe.price_per_hour_eur is not None else 0.0
        price_src = "recipe price_per_hour_eur" if recipe.price_per_hour_eur is not None else "a CPU box, no GPU price"
    elif recipe.price_per_hour_eur is not None:
        price, price_src = recipe.price_per_hour_eur, "recipe price_per_hour_eur"
    elif hardware.price_per_hour_eur is not None:
        price, price_src = hardware.price_per_hour_eur, f"catalog: {hardware.count} x {hardware.gpu.name}"
    else:
        price, price_src = 0.0, "unknown GPU: set price_per_hour_eur in the recipe"
        notes.append("GPU price unknown: cost shown as 0; set price_per_hour_eur in the recipe")
    cost = hrs * price if hrs is not None else None
    kind = "measured by the smoke test" if "tokens_per_second" in measured else "estimated"
    g = hardware.gpu
    precision = sizing.training_precision(choice.device, g.compute_capability if g else None)
    if precision == "fp16":
        cc = ".".join(map(str, g.compute_capability))
        rate = (f"speed and time count {g.tflops_bf16:g} TFLOP/s, its fp16 tensor rate (catalog)" if g.tflops_bf16
                else f"it is not in the catalog, so the estimate assumes {sizing.UNKNOWN_GPU_TFLOPS:g} TFLOP/s, more "
                     "than cards before Ampere reach; the smoke test measures it")
        reasons.append(f"precision fp16 with loss scaling: {g.name} (compute capability {cc}) has no bf16 tensor "
                       f"cores (they start at 8.0); {rate}")
        kind += ", fp16"
    if hrs is not None:
        reasons.append(f"time: {training / 1e6:.2f}M training tokens / {tps:,.0f} tokens/s ({kind}) = {_fmt_hours(hrs)}; "
                       f"cost at {price:.2f} EUR/h ({price_src}) = {cost:.2f} EUR")
    step_seconds = (job.micro_batch * job.accumulation * choice.processes * job.mean_tokens) / tps if tps else 0
    every = max(1, round(recipe.checkpoint_every_minutes * 60 / step_seconds)) if step_seconds else 1
    if steps:
        every = min(every, steps)

    return Plan(
        fits=True,
        engine=choice.engine,
        device=choice.device,
        num_processes=choice.processes,
        gpus={"name": g.name if g else "cpu", "count": choice.processes if g else 0,
              "memory_gb": round(g.memory_gb, 1) if g else round(hardware.ram_gb, 1),
              "box_count": hardware.count, "interconnect": hardware.interconnect},
        model={"name": arch.name, "params": arch.params, "trainable_params": est.trainable_params,
               "source": arch.source, "layers": arch.layers, "hidden": arch.hidden, "vocab": arch.vocab},
        method=job.method,
        memory={
            "per_gpu_gb": round(per_gpu, 1),
            "estimated_per_gpu_gb": round(est.per_gpu_gb, 1),
            "total_gb": round(est.total_gb, 1),
            "capacity_gb": round(choice.capacity_gb, 1),
            "breakdown_gb": {k: round(v, 2) for k, v in est.breakdown_gb.items()},
            "explanations": dict(est.explanations),
            "offloaded_ram_gb": round(est.offloaded_ram_gb, 1),
            "offloaded_params_gb": round(est.offloaded_params_gb, 1),
            "load_peak_gb": round(est.load_peak_gb, 1),
            "load_ram_gb": round(est.load_ram_gb, 1),
            "load_explanation": est.load_explanation,
            "source": "measured" if "peak_memory_gb" in measured else "estimated",
        },
        tokens={"training_tokens": int(training) if training is not None else None,
                "tokens_per_second": round(tps, 1),
                "estimated_tokens_per_second": round(choice.tokens_per_second, 1),
                "seq_len": job.seq_len, "mean_tokens": round(job.mean_tokens, 1),
                "source": job.tokens_source, "precision": precision,
                "tokens_per_second_source": "measured" if "tokens_per_second" in measured else "estimated"},
        estimate={"hours": round(hrs, 3) if hrs is not None else None,
                  "cost_eur": round(cost, 2) if cost is not None else None},
        price_per_hour_eur=round(price, 2),
        total_steps=steps,
        micro_batch_size=job.micro_batch,
        gradient_accumulation_steps=job.accumulation,
        checkpoint_every_steps=every,
        reasons=reasons,
        alternatives=alternatives,
        measured=measured,
        hardware=hardware.to_dict(),
        notes=notes + list(hardware.notes),
        offload_params=choice.offload_params,
    )


def _apply_smoke(smoke: dict[str, Any], choice: Choice) -> dict[str, Any]:
    measured: dict[str, Any] = {}
    notes: list[str] = []
    engine = smoke.get("engine")
    procs = smoke.get("num_processes")
    if (engine and engine != choice.engine) or (procs and int(procs) != choice.processes):
        notes.append(f"smoke test ran with engine {engine} x {procs} processes, the plan chose {choice.engine} x "
                     f"{choice.processes}: its measurements are not used")
        return {"measured": measured, "notes": notes}
    if smoke.get("tokens_per_second"):
        measured["tokens_per_second"] = float(smoke["tokens_per_second"])
    if smoke.get("peak_memory_gb"):
        measured["peak_memory_gb"] = float(smoke["peak_memory_gb"])
    if measured:
        measured["source"] = "smoke test"
    return {"measured": measured, "notes": notes}


def _refusal_message(job: Job, hw: Hardware, c: Choice) -> str:
    where = hw.describe()
    return f"{job.method} of {job.arch.name} ({_fmt_tokens(job.arch.params)} params) does not fit {where}: {c.refusal}"


def _refusal_fix(job: Job, hw: Hardware, forced: str, unsloth_ok: bool, workday_hours: float,
                 rows: list[dict[str, Any]]) -> str:
    options = []
    if rows:
        best = min(rows, key=lambda r: (r["cost_eur"] if r["cost_eur"] is not None else r["price_per_hour_eur"],
                                         r["hours"] or 0))
        money = (f"{_fmt_hours(best['hours'])}, {best['cost_eur']:.2f} EUR" if best["hours"] is not None
                 else f"{best['price_per_hour_eur']:.2f} EUR/h")
        options.append(f"rent {best['gpus']} ({best['engine']}, {best['per_gpu_gb']} GB per card, {money}); "
                       f"plan for it with --gpus {best['gpus']}")
    else:
        options.append("no box in the GPU catalog holds this job; reduce it (below) or add a bigger box to the catalog")
    if forced != "auto":
        options.append("set engine: auto to let the plan choose")
    options += _fixes_here(job, hw, forced, unsloth_ok, workday_hours)
    if len(options) == 1 + (forced != "auto"):
        options.append("no single recipe change (shorter max_length, QLoRA, 8-bit optimizer, micro_batch_size=1, "
                       "gradient checkpointing) makes it fit this box")
    return "\n  - " + "\n  - ".join(options)


# ---------------------------------------------------------------------------------------------
# Output

def _fmt_hours(h: float | None) -> str:
    if h is None:
        return "unknown"
    minutes = round(h * 60)
    if minutes < 60:
        return f"{max(minutes, 1)} min"
    if minutes < 48 * 60:
        return f"{minutes // 60} h {minutes % 60:02d} min"
    return f"{h / 24:.1f} days"


def _fmt_tokens(n: float | None) -> str:
    if n is None:
        return "unknown"
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    if n >= 1e3:
        return f"{n / 1e3:.1f}k"
    return f"{n:.0f}"


def format_plan(plan: Plan) -> str:
    """Human output: memory breakdown with each term explained, engine and reasons, tokens/time/cost, alternatives."""
    p = plan
    lines = []
    gpus = p.gpus
    where = (f"{p.num_processes} x {gpus['name']} ({gpus['memory_gb']} GB)" if p.device == "cuda"
             else f"CPU ({gpus['memory_gb']} GB RAM)")
    lines.append(f"Plan: {p.method} of {p.model['name']} on {where} -> engine {p.engine}, "
                 f"{p.num_processes} process{'es' if p.num_processes > 1 else ''}")
    lines.append("")
    mem = p.memory
    label = "per GPU" if p.device == "cuda" else "in RAM"
    src = "measured by the smoke test" if mem["source"] == "measured" else "estimated"
    lines.append(f"Memory {label}: {mem['per_gpu_gb']} GB of {mem['capacity_gb']} GB ({src}); "
                 f"whole job {mem['total_gb']} GB")
    width = max(len(k) for k in mem["breakdown_gb"])
    for k, v in mem["breakdown_gb"].items():
        lines.append(f"  {k:<{width}}  {v:8.2f} GB  {mem['explanations'].get(k, '')}")
    if mem["source"] == "measured":
        lines.append(f"  (estimate before measuring: {mem['estimated_per_gpu_gb']} GB)")
    if mem.get("offloaded_ram_gb"):
        lines.append(f"  + {mem['offloaded_ram_gb']} GB of activations offloaded to CPU RAM")
    if mem.get("offloaded_params_gb"):
        lines.append(f"  + {mem['offloaded_params_gb']} GB of parameter shards, gradients and optimizer states "
                     "offloaded to CPU RAM (FSDP parameter offload)")
    if mem.get("load_explanation"):
        lines.append(f"  loading: {mem['load_explanation']}")
    lines.append("")
    lines.append("Why:")
    for r in p.reasons:
        lines.append(f"  - {r}")
    lines.append("")
    t = p.tokens
    tps_src = t["tokens_per_second_source"]
    lines.append(f"Tokens: {_fmt_tokens(t['training_tokens'])} training tokens ({t['source']})")
    lines.append(f"Speed:  {t['tokens_per_second']:,.0f} tokens/s ({tps_src})"
                 + (f", estimate was {t['estimated_tokens_per_second']:,.0f}" if tps_src == "measured" else "")
                 + ("; trains in fp16 with loss scaling (no bf16 below compute capability 8.0)"
                    if t.get("precision") == "fp16" else ""))
    e = p.estimate
    cost = f"{e['cost_eur']:.2f} EUR at {p.price_per_hour_eur:.2f} EUR/h" if e["cost_eur"] is not None else "unknown"
    lines.append(f"Time:   {_fmt_hours(e['hours'])}; cost {cost}")
    lines.append(f"Steps:  {p.total_steps:,} optimizer steps (micro-batch {p.micro_batch_size} x accumulation "
                 f"{p.gradient_accumulation_steps} x {p.num_processes} process{'es' if p.num_processes > 1 else ''}); "
                 f"checkpoint every {p.checkpoint_every_steps} steps")
    if p.alternatives:
        lines.append("")
        lines.append("Other boxes (estimated):")
        lines.append(f"  {'gpus':<16} {'engine':<9} {'GB/card':>8} {'tokens/s':>9} {'time':>14} {'cost EUR':>9}")
        for a in p.alternatives:
            cost_a = f"{a['cost_eur']:.2f}" if a["cost_eur"] is not None else "-"
            lines.append(f"  {a['gpus']:<16} {a['engine']:<9} {a['per_gpu_gb']:>8} {a['tokens_per_second']:>9,} "
                         f"{_fmt_hours(a['hours']):>14} {cost_a:>9}")
    if p.notes:
        lines.append("")
        for n in p.notes:
            lines.append(f"note: {n}")
    return "\n".join(lines)
