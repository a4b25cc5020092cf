"""(Recipe, Hardware, DataStats) -> Plan: engine, processes, memory, tokens, time, cost, each with its reason; refuses with advice."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field, replace
from typing import Any

from launcher.deliver import llamacpp
from launcher.plan import sizing
from launcher.errors import MissingSoftware, PlanError
from launcher.plan.hardware import Hardware, catalog, catalog_box
from launcher.plan.models import Architecture, load_architecture
from launcher.recipe import TOKENS_MEANING
from launcher.plan.sizing import Workload

# The one memory unit of every figure the plan shows, said once (JSON "units", the text's last line).
UNIT = "GB = 2**30 bytes (GiB), as nvidia-smi and card names count: an RTX 4090 is 24 GB, an H100 80 GB"

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
    price_per_hour_eur: float | None  # the whole box; None when no price is known
    total_steps: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    checkpoint_every_steps: int
    reasons: list[str]
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    measured: dict[str, Any] = field(default_factory=dict)
    hardware: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    offload_params: bool = False  # FSDP keeps the parameter shards in CPU RAM (engines/fsdp.py: fsdp_offload_params)
    refusal: dict[str, Any] = field(default_factory=dict)  # when fits is False: message, why, missing, options
    cheapest_rental: dict[str, Any] | None = None  # the catalog box that runs the job for the least money

    def to_dict(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "units": UNIT,
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
            "refusal": dict(self.refusal) if self.refusal else None,
            "cheapest_rental": dict(self.cheapest_rental) if self.cheapest_rental else None,
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


def _job(recipe: Any, arch: Architecture, data_stats: Any, tokens: float | None,
         tokens_from: str = "--tokens") -> tuple[Job, list[str]]:
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
        source = tokens_from if tokens else "unknown"
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
    missing: str = ""  # a package this machine lacks (never "does not fit": the fix is an install)


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
        return Choice(False, engine, "cpu", n, None, capacity, reasons, missing="deepspeed",
                      refusal="engine: deepspeed needs DeepSpeed, which is not installed here: pip install "
                              "'ftrun[deepspeed]' (DS_BUILD_OPS=0 on a box without CUDA)")
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
        return Choice(False, "unsloth", "cpu", 1, None, capacity, reasons, missing="unsloth",
                      refusal=UNSLOTH_MISSING + " (Unsloth needs an NVIDIA GPU for real runs; on a CPU it is allowed "
                      "only where it is installed, to test the engine)")
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
UNSLOTH_FIX = ("Unsloth pins transformers<=5.17, trl<=1.15 and datasets<5.0, so it lives in its own virtual environment: "
               "python3 -m venv .venv-unsloth && .venv-unsloth/bin/pip install 'ftrun[train,unsloth]' (scripts/test.sh "
               "--unsloth builds it here), then run ftrun from that environment; ftrun's Docker image (docker/) has it")
UNSLOTH_MISSING = ("engine: unsloth needs Unsloth, which is not installed in this environment. " + UNSLOTH_FIX +
                   "; or set engine: trl")
# What a box named for planning (--gpus, the recipe's box:) runs: ftrun's Docker image, docker/requirements.txt.
IMAGE_SOFTWARE = "ftrun's Docker image (docker/requirements.txt: Unsloth, DeepSpeed, bitsandbytes, llama.cpp)"
# Minutes a rented box needs before the download: start, image pull or pip install (the article: 5-10 min for
# install and model download together).
SETUP_MINUTES = 5.0


def choose(job: Job, hw: Hardware, forced: str = "auto", unsloth_ok: bool = False,
           workday_hours: float = WORKDAY_HOURS, processes: int | None = None, nnodes: int = 1,
           in_hand: bool = True) -> Choice:
    """The engine and card count for this box. `in_hand`: the box is the one being planned, billed whole, so
    its cards are used (DDP) whenever that is faster than one card; otherwise (choosing a box to rent) the
    article's rules: one card if it fits, DDP when one card takes longer than a working day. Sharding when
    no card holds the job; otherwise refuse. `processes` (recipe num_processes) is honoured or refused."""
    if hw.is_cpu_only and forced == "unsloth":
        return _choose_cpu_unsloth(job, hw, unsloth_ok, processes)
    if hw.is_cpu_only:
        return _choose_cpu(job, hw, forced, processes, nnodes)
    if processes is not None:
        return _choose_gpu_count(job, hw, forced, unsloth_ok, workday_hours, processes, in_hand)
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
        return Choice(False, "unsloth", "cuda", 1, None, cap, [], missing="unsloth", refusal=UNSLOTH_MISSING +
                      " (Unsloth also needs a GPU of compute capability 7.0 or newer)")
    if forced in ("ddp", *SHARDING_ENGINES) and n * nnodes < 2:
        what = "DDP copies the model to every card to train on more data at once"
        if forced in SHARDING_ENGINES:
            what = f"{forced} shards the model over several cards"
        two = sizing.memory(job.arch, job.workload(forced, 2, "cuda"))
        bigger = (f", or plan for a box of two with --gpus 2x{g.name} ({two.peak_gb:.1f} GB per card)"
                  if _fits(two, cap) else "")
        return Choice(False, forced, "cuda", 1, None, cap, [], refusal=f"engine: {forced} needs 2 or more GPUs and "
                      f"this box has one ({what}); use engine: auto or trl{bigger}")

    single_engine = "trl"
    if forced in ("unsloth", "trl"):
        single_engine = forced
    elif forced == "auto" and lora and unsloth_ok and cc_ok:
        single_engine = "unsloth"

    one = sizing.memory(job.arch, job.workload(single_engine, 1, "cuda"))
    fits_one = _fits(one, cap)
    if forced == "auto" and lora and not unsloth_ok:
        reasons.append("Unsloth not installed on this machine: TRL on one GPU (Unsloth would need less memory and run "
                       "~1.4x faster; " + UNSLOTH_FIX + ")")

    if fits_one and forced in ("auto", "unsloth", "trl", "ddp"):
        w1 = job.workload(single_engine, 1, "cuda")
        tps1, hrs1 = _hours(job, w1, hw, 1)
        spare = cap - one.per_gpu_gb
        fit_reason = f"fits one card: needs {one.per_gpu_gb:.1f} GB of {cap:.1f} GB ({spare:.1f} GB spare)"
        long_day = hrs1 is not None and hrs1 > workday_hours
        want_ddp = forced == "ddp" or (forced == "auto" and n > 1 and (in_hand or long_day))
        if want_ddp and n > 1:
            wd = job.workload("ddp", n, "cuda")
            est = sizing.memory(job.arch, wd)
            tps, hrs = _hours(job, wd, hw, n)
            faster = tps > tps1
            if _fits(est, cap) and (faster or forced == "ddp"):
                speed = sizing.scaling(n, hw.interconnect)
                if forced == "ddp":
                    why = "forced by the recipe"
                elif in_hand:
                    why = (f"the box is billed whole, so its {n} cards cost no more per hour than one: "
                           f"{_fmt_hours(hrs) if hrs is not None else 'time unknown'} instead of "
                           f"{_fmt_hours(hrs1) if hrs1 is not None else 'time unknown'} on one card with {n - 1} idle "
                           f"({single_engine}), so less time and less money")
                else:
                    why = f"one card would take {_fmt_hours(hrs1)}, longer than a working day ({workday_hours:g} h)"
                link = ("NVLink" if hw.interconnect == "nvlink" else
                        "PCIe: cards talk over PCIe, which scales worse than NVLink")
                reasons += [fit_reason, f"engine ddp over {n} GPUs: {why}; ~{speed:.1f}x one card ({link})",
                            f"DDP keeps a full copy per card: {est.per_gpu_gb:.1f} GB per card"]
                return Choice(True, "ddp", "cuda", n, est, cap, reasons, tps, hrs)
            if not _fits(est, cap):
                reasons.append(f"DDP would need {est.per_gpu_gb:.1f} GB per card (gradient buckets): staying on one card")
            else:
                reasons.append(f"DDP over {n} cards ({tps:,.0f} tokens/s) would be slower than {single_engine} on one "
                               f"card ({tps1:,.0f} tokens/s): staying on one card")
            if forced == "ddp":
                return Choice(False, "ddp", "cuda", n, est, cap, reasons, refusal=f"engine: ddp needs "
                              f"{est.per_gpu_gb:.1f} GB per card, the cards have {cap:.1f} GB")
        engine_reason = {"unsloth": "engine unsloth: LoRA/QLoRA on one card with Unsloth (fastest, least memory)",
                         "trl": "engine trl on one GPU"}[single_engine]
        if forced in ("unsloth", "trl"):
            engine_reason += " (forced by the recipe)"
        reasons += [fit_reason, engine_reason]
        if n > 1 and not in_hand:
            reasons.append(f"the box has {n} cards; {n - 1} stay idle because one card finishes within a working day "
                           f"({_fmt_hours(hrs1) if hrs1 else 'time unknown'}); a 1-card box costs 1/{n} per hour, "
                           "or force engine: ddp")
        elif n > 1:
            reasons.append(f"the box has {n} cards; {n - 1} stay idle (billed all the same): rent a 1-card box "
                           f"for this job instead, it costs 1/{n} per hour")
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
                      processes: int, in_hand: bool = True) -> Choice:
    """The engine choice on `processes` of the box's cards; refused when the rules need another count."""
    if processes > hw.count:
        return Choice(False, forced, "cuda", processes, None, hw.gpu.memory_gb, [],
                      refusal=f"num_processes={processes} needs {processes} GPUs, this box has {hw.count}")
    used = replace(hw, gpus=hw.gpus[:processes])
    c = choose(job, used, forced, unsloth_ok, workday_hours, in_hand=in_hand)
    if c.fits and c.processes != processes and forced == "auto" and processes > 1:
        c = choose(job, used, "ddp", unsloth_ok, workday_hours, in_hand=in_hand)  # a count > 1 asks for several
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
                       workday_hours=workday_hours, in_hand=False)
            if not c.fits:
                continue
            # A box whose extra cards stay idle is never a sensible alternative.
            if count > 1 and c.processes == 1:
                continue
            price = entry.price_per_hour_eur * count if entry.price_per_hour_eur is not None else None
            rows.append({
                "gpus": f"{count}x{name}",
                "engine": c.engine,
                "per_gpu_gb": round(c.estimate.peak_gb, 1),
                "card_gb": round(entry.memory_gb, 1),
                "tokens_per_second": round(c.tokens_per_second),
                "hours": round(c.hours, 2) if c.hours is not None else None,
                "cost_eur": round(c.hours * price, 2) if c.hours is not None and price is not None else None,
                "price_per_hour_eur": round(price, 2) if price is not None else None,
            })
    return rows


def _by_cost(r: dict[str, Any]) -> tuple[float, float]:
    """Cheapest first (by the run's cost, else by the hour); boxes without a known price last."""
    money = r["cost_eur"] if r["cost_eur"] is not None else r["price_per_hour_eur"]
    return (money if money is not None else math.inf, r["hours"] if r["hours"] is not None else math.inf)


def _pick_alternatives(rows: list[dict[str, Any]], limit: int = 6) -> list[dict[str, Any]]:
    """Boxes that hold the job (rows only holds those): the cheapest, and the two fastest."""
    if not rows:
        return []
    by_cost = sorted(rows, key=_by_cost)
    by_time = sorted(rows, key=lambda r: (r["hours"] if r["hours"] is not None else math.inf, _by_cost(r)))
    picked: list[dict[str, Any]] = []
    for r in by_cost[: limit - 2] + (by_time[:2] if rows[0]["hours"] is not None else by_cost[limit - 2: limit]):
        if r not in picked:
            picked.append(r)
    return sorted(picked, key=_by_cost)[:limit]


def cheapest_rental(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The catalog box with a known price that runs the job for the least money (by the hour without a token count)."""
    priced = [r for r in rows if r["price_per_hour_eur"] is not None]
    return min(priced, key=_by_cost) if priced else None


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
              workday_hours: float = WORKDAY_HOURS, arch: Architecture | None = None, nnodes: int = 1,
              price: float | None = None, box_reason: str | None = None, allow_network: bool = True,
              tokens_from: str = "--tokens") -> Plan:
    """Size the recipe's job for this box. When nothing fits: PlanError (concrete options in .fix, the whole
    no-fit plan in .plan); when it needs software this machine lacks: MissingSoftware (the install in .fix)."""
    plan = plan_for(recipe, hardware, data_stats, tokens, unsloth_available, smoke, workday_hours, arch, nnodes,
                    price, box_reason, allow_network, tokens_from)
    if not plan.fits:
        missing = plan.refusal.get("missing")
        err_type = MissingSoftware if missing else PlanError
        err = err_type(plan.refusal["message"], fix="\n  - " + "\n  - ".join(plan.refusal["options"]))
        err.plan = plan
        raise err
    return plan


def _software(hardware: Hardware, unsloth_available: bool | None) -> tuple[bool, str]:
    """Whether Unsloth can be used, and the plan's line about the software it assumes."""
    if unsloth_available is not None:
        return unsloth_available, f"software: Unsloth {'available' if unsloth_available else 'not available'} (given)"
    if not hardware.is_cpu_only and not hardware.is_this_machine:
        return True, (f"software: planned with {IMAGE_SOFTWARE}, what a rented box runs; not this machine's "
                      "installation")
    here = _unsloth_installed()
    return here, ("software: as installed on this machine (Unsloth " + ("installed" if here else "not installed")
                  + ")")


def _price(recipe: Any, hardware: Hardware, price: float | None) -> tuple[float | None, str]:
    if price is not None:
        return price, "--price"
    if recipe.price_per_hour_eur is not None:
        return recipe.price_per_hour_eur, "recipe price_per_hour_eur"
    if hardware.is_cpu_only:
        return 0.0, "a CPU box, no GPU price"
    if hardware.price_per_hour_eur is not None:
        return hardware.price_per_hour_eur, f"catalog: {hardware.count} x {hardware.gpu.name}"
    return None, "unknown"


def _download(recipe: Any, arch: Architecture, engine: str, allow_network: bool) -> tuple[Any, list[str]]:
    """What the run downloads, and the plan's lines about it (which 4-bit repository, and why)."""
    from launcher.plan.models import download_size, prequantized_repo

    repo = prequantized_repo(recipe.model, recipe.method)
    lines = []
    if repo and engine == "unsloth":
        got = download_size(recipe.model, arch, repo, allow_network)
        lines.append(f"weights: the pre-quantized 4-bit repository {repo} instead of {recipe.model} (same model, "
                     "NF4 already: about a quarter of the download, no quantization at load)")
        return got, lines
    got = download_size(recipe.model, arch, None, allow_network)
    if repo:
        lines.append(f"weights: {recipe.model} in 16-bit, quantized to 4 bits while loading ({engine} loads the "
                     f"recipe's model); the pre-quantized {repo} is about a quarter of the download: "
                     f"model={repo} to use it")
    return got, lines


def plan_for(recipe: Any, hardware: Hardware, data_stats: Any = None, tokens: float | None = None,
             unsloth_available: bool | None = None, smoke: dict[str, Any] | None = None,
             workday_hours: float = WORKDAY_HOURS, arch: Architecture | None = None, nnodes: int = 1,
             price: float | None = None, box_reason: str | None = None, allow_network: bool = True,
             tokens_from: str = "--tokens") -> Plan:
    """The plan, fitting or not (Plan.fits False: the memory needed, the reasons, the options in .refusal)."""
    arch = arch or load_architecture(recipe.model)
    unsloth_ok, software = _software(hardware, unsloth_available)
    job, notes = _job(recipe, arch, data_stats, tokens, tokens_from)
    notes += llamacpp.plan_check(recipe, this_box=hardware.source == "detected")  # each requested output can be made
    forced = recipe.engine
    wanted = None if recipe.num_processes == "auto" else int(recipe.num_processes)
    choice = choose(job, hardware, forced, unsloth_ok, workday_hours, processes=wanted, nnodes=nnodes)
    if not choice.fits and not choice.missing and not unsloth_ok and forced == "auto" and hardware.gpus \
            and hardware.is_this_machine:
        # On the box in hand, a job that only Unsloth's lower memory fits is missing software, not too big:
        # the fix is the install, never a bigger box
        with_unsloth = choose(job, hardware, forced, True, workday_hours, processes=wanted, nnodes=nnodes)
        if with_unsloth.fits and with_unsloth.engine == "unsloth":
            need = with_unsloth.estimate.per_gpu_gb if with_unsloth.estimate else None
            choice = replace(choice, missing="unsloth", refusal=(
                "it fits this box only with Unsloth" + (f" ({need:.1f} GB of {with_unsloth.capacity_gb:.1f} GB per "
                                                       "card)" if need else "") + ", and Unsloth is not installed "
                "in this environment. " + UNSLOTH_FIX))
    if choice.fits and choice.engine == "deepspeed" and hardware.is_this_machine and not _deepspeed_installed():
        choice = replace(choice, fits=False, missing="deepspeed", refusal="engine: deepspeed needs DeepSpeed, which "
                         "is not installed in this environment: pip install 'ftrun[deepspeed]' (ftrun's Docker image "
                         "has it)")
    rows = _box_rows(job, forced if forced in ("auto", *SHARDING_ENGINES) else "auto", True, workday_hours)
    alternatives = _pick_alternatives(rows)
    g = hardware.gpu
    box = [f"box: {box_reason}"] if box_reason else []
    head = [f"model {arch.name}: {_fmt_tokens(arch.params)} params ({arch.source})"] + box + [software]

    est = choice.estimate
    if not choice.fits and est is None and choice.device == "cuda" and choice.engine in ("trl", "unsloth", "ddp",
                                                                                          *SHARDING_ENGINES):
        # a forced engine refused before sizing (unsloth for a full fine-tune, ddp on one card, more processes
        # than cards): the JSON still says what the job needs, as the engine asked for would run it
        est = sizing.memory(job.arch, job.workload(choice.engine, max(1, choice.processes), "cuda"))
    if not choice.fits:
        options = ([] if choice.missing else _refusal_options(job, hardware, forced, unsloth_ok, workday_hours, rows))
        if choice.missing:
            options = [f"install {choice.missing} on this machine (the fix is above), or plan for a rented box with "
                       f"--gpus, which assumes {IMAGE_SOFTWARE}"]
            if choice.missing == "unsloth" and forced == "auto":  # or change the recipe so that TRL fits here
                options += _fixes_here(job, hardware, forced, unsloth_ok, workday_hours)
        message = (_missing_message(job, choice) if choice.missing else _refusal_message(job, hardware, choice))
        return Plan(
            fits=False, engine=choice.engine, device=choice.device, num_processes=choice.processes,
            gpus=_gpus_dict(hardware, choice), model=_model_dict(arch, est), method=job.method,
            memory=_memory_dict(est, choice, {}) if est else {"capacity_gb": round(choice.capacity_gb, 1)},
            tokens={"training_tokens": job.training_tokens, "source": job.tokens_source, "seq_len": job.seq_len},
            estimate={"hours": choice.hours, "cost_eur": None}, price_per_hour_eur=None, total_steps=0,
            micro_batch_size=job.micro_batch, gradient_accumulation_steps=job.accumulation, checkpoint_every_steps=0,
            reasons=head + choice.reasons, alternatives=alternatives, hardware=hardware.to_dict(),
            notes=notes + list(hardware.notes), offload_params=choice.offload_params,
            refusal={"message": message, "why": choice.refusal, "missing": choice.missing or None, "options": options},
            cheapest_rental=cheapest_rental(rows))

    steps, training = _steps_and_tokens(job, choice.processes)
    tps = choice.tokens_per_second
    reasons = head + choice.reasons
    download, download_lines = _download(recipe, arch, choice.engine, allow_network and choice.device == "cuda")
    reasons += download_lines
    measured: dict[str, Any] = {}
    if smoke:
        applied = _apply_smoke(smoke, choice)
        measured = applied["measured"]
        notes += applied["notes"]
        tps = measured.get("tokens_per_second", tps)
    if training is None:
        hrs = None
        reasons.append("time and cost unknown: " + _no_tokens_hint(recipe))
    else:
        hrs = sizing.hours(training, tps) + choice.load_hours  # loading that the smoke test does not measure
    box_price, price_src = _price(recipe, hardware, price)
    if box_price is None:
        notes.append(f"no price known for {hardware.gpu.name}: cost not shown; give the box's price with "
                     "--price EUR/h (or price_per_hour_eur in the recipe)")
    cost = hrs * box_price if hrs is not None and box_price is not None else None
    kind = "measured by the smoke test" if "tokens_per_second" in measured else "estimated"
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
        money = (f"cost at {box_price:.2f} EUR/h ({price_src}) = {cost:.2f} EUR" if cost is not None
                 else "cost unknown (no price: --price EUR/h)")
        reasons.append(f"time: {training / 1e6:.2f}M training tokens / {tps:,.0f} tokens/s ({kind}) = "
                       f"{_fmt_hours(hrs)}; {money}")
    setup_hours = None
    if choice.device == "cuda":
        setup_hours = SETUP_MINUTES / 60 + download.seconds() / 3600
    step_seconds = (job.micro_batch * job.accumulation * choice.processes * job.mean_tokens) / tps if tps else 0
    every = max(1, round(recipe.checkpoint_every_minutes * 60 / step_seconds)) if step_seconds else 1
    if steps:
        every = min(every, steps)
    total_hours = hrs + setup_hours if hrs is not None and setup_hours is not None else hrs
    rental = cheapest_rental(rows)

    return Plan(
        fits=True,
        engine=choice.engine,
        device=choice.device,
        num_processes=choice.processes,
        gpus=_gpus_dict(hardware, choice),
        model=_model_dict(arch, est),
        method=job.method,
        memory=_memory_dict(est, choice, measured),
        tokens={"training_tokens": int(training) if training is not None else None,
                "meaning": TOKENS_MEANING,
                "tokens_per_second": round(tps, 1),
                "estimated_tokens_per_second": round(choice.tokens_per_second, 1),
                "seq_len": job.seq_len, "mean_tokens": round(job.mean_tokens, 1),
                "source": job.tokens_source, "precision": precision,
                "tokens_per_second_source": "measured" if "tokens_per_second" in measured else "estimated"},
        estimate={"hours": round(hrs, 3) if hrs is not None else None,
                  "cost_eur": round(cost, 2) if cost is not None else None,
                  "setup_hours": round(setup_hours, 3) if setup_hours is not None else None,
                  "setup": ({"minutes": SETUP_MINUTES, "what": "box start and image pull or pip install"}
                            if setup_hours is not None else None),
                  "download": download.to_dict() if choice.device == "cuda" else None,
                  "total_hours": round(total_hours, 3) if total_hours is not None else None,
                  "total_cost_eur": (round(total_hours * box_price, 2)
                                     if total_hours is not None and box_price is not None else None)},
        price_per_hour_eur=round(box_price, 2) if box_price is not None else None,
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
        cheapest_rental=rental,
    )


def _no_tokens_hint(recipe: Any) -> str:
    return (f"the data file {recipe.data} is not on this machine and no token count was given: add `tokens: 15M` to "
            f"the recipe or pass --tokens 15M ({TOKENS_MEANING})")


def _gpus_dict(hardware: Hardware, choice: Choice) -> dict[str, Any]:
    g = hardware.gpu
    return {"name": g.name if g else "cpu", "count": choice.processes if g else 0,
            "memory_gb": round(g.memory_gb, 1) if g else round(hardware.ram_gb, 1),
            "box_count": hardware.count, "interconnect": hardware.interconnect, "source": hardware.source}


def _model_dict(arch: Architecture, est: Any) -> dict[str, Any]:
    return {"name": arch.name, "params": arch.params, "trainable_params": est.trainable_params if est else None,
            "source": arch.source, "layers": arch.layers, "hidden": arch.hidden, "vocab": arch.vocab}


def _memory_dict(est: Any, choice: Choice, measured: dict[str, Any]) -> dict[str, Any]:
    return {
        "unit": UNIT,
        "per_gpu_gb": round(measured.get("peak_memory_gb", est.per_gpu_gb), 1),
        "estimated_per_gpu_gb": round(est.per_gpu_gb, 1),
        "peak_gb": round(est.peak_gb, 1),
        "total_gb": round(est.total_gb, 1),
        "capacity_gb": round(choice.capacity_gb, 1),
        "usable_gb": round(choice.capacity_gb * (sizing.USABLE_FRACTION if choice.device == "cuda"
                                                 else sizing.USABLE_RAM_FRACTION), 1),
        "breakdown_gb": {k: round(v, 2) for k, v in est.breakdown_gb.items()},
        "explanations": dict(est.explanations),
        "offloaded_ram_gb": round(est.offloaded_ram_gb, 1),
        "offloaded_params_gb": round(est.offloaded_params_gb, 1),
        "load_peak_gb": round(est.load_peak_gb, 1),
        "load_ram_gb": round(est.load_ram_gb, 1),
        "load_explanation": est.load_explanation,
        "source": "measured" if "peak_memory_gb" in measured else "estimated",
    }


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


def _missing_message(job: Job, c: Choice) -> str:
    return f"{job.method} of {job.arch.name} needs software this machine lacks: {c.refusal}"


def _refusal_options(job: Job, hw: Hardware, forced: str, unsloth_ok: bool, workday_hours: float,
                     rows: list[dict[str, Any]]) -> list[str]:
    """What to do instead, each checked: a box that holds the job (from rows, which hold only such boxes),
    and recipe changes that make it fit this box."""
    options = []
    if rows:
        best = min(rows, key=_by_cost)
        money = (f"{_fmt_hours(best['hours'])}, {best['cost_eur']:.2f} EUR" if best["cost_eur"] is not None
                 else f"{best['price_per_hour_eur']:.2f} EUR/h" if best["price_per_hour_eur"] is not None
                 else "price unknown")
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
    return options


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
    box_count = gpus.get("box_count", p.num_processes)
    card = f"{gpus['name']} ({gpus['memory_gb']:.0f} GB{' each' if box_count > 1 else ''})"
    if p.device != "cuda":
        where = f"CPU ({gpus['memory_gb']:.0f} GB RAM)"
    elif p.num_processes == box_count:
        where = f"{box_count} x {card}"
    else:
        where = f"{p.num_processes} of the box's {box_count} x {card}"
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
    price = f"{p.price_per_hour_eur:.2f} EUR/h" if p.price_per_hour_eur is not None else "no price known: --price EUR/h"
    cost = f"{e['cost_eur']:.2f} EUR at {price}" if e["cost_eur"] is not None else f"unknown ({price})"
    lines.append(f"Time:   {_fmt_hours(e['hours'])} training; cost {cost}")
    if e.get("setup_hours") is not None:
        d = e["download"]
        fetch = ("download: none, " + d["source"] if d["cached"] else
                 f"download {d['gb']} GB of {d['repo']} at {d['bandwidth_mb_s']:g} MB/s: "
                 f"{_fmt_hours(d['seconds'] / 3600)}; size: {d['source']}")
        total_cost = f", {e['total_cost_eur']:.2f} EUR" if e.get("total_cost_eur") is not None else ""
        lines.append(f"Setup:  {_fmt_hours(e['setup_hours'])} ({e['setup']['minutes']:g} min {e['setup']['what']}; "
                     f"{fetch})")
        if e.get("total_hours") is not None:
            lines.append(f"Total:  {_fmt_hours(e['total_hours'])}{total_cost} on this box")
    lines.append(f"Steps:  {p.total_steps:,} optimizer steps (micro-batch {p.micro_batch_size} x accumulation "
                 f"{p.gradient_accumulation_steps} x {p.num_processes} process{'es' if p.num_processes > 1 else ''}); "
                 f"checkpoint every {p.checkpoint_every_steps} steps")
    r = p.cheapest_rental
    if r is not None and p.device == "cuda":
        money = (f"{_fmt_hours(r['hours'])}, {r['cost_eur']:.2f} EUR" if r["cost_eur"] is not None
                 else f"{r['price_per_hour_eur']:.2f} EUR/h")
        here = (f"{_fmt_hours(e['hours'])}, {e['cost_eur']:.2f} EUR" if e["cost_eur"] is not None
                else _fmt_hours(e["hours"]))
        lines.append(f"Rent:   this box as planned {here}; the cheapest box to rent instead is {r['gpus']} "
                     f"({r['engine']}, {money}, training only)")
    if p.alternatives:
        lines.append("")
        lines.append("Other boxes that hold the job (estimated; with ftrun's Docker image):")
        lines.append(f"  {'gpus':<16} {'engine':<9} {'GB/card':>8} {'tokens/s':>9} {'time':>14} {'cost EUR':>9}")
        for a in p.alternatives:
            cost_a = f"{a['cost_eur']:.2f}" if a["cost_eur"] is not None else "-"
            lines.append(f"  {a['gpus']:<16} {a['engine']:<9} {a['per_gpu_gb']:>8} {a['tokens_per_second']:>9,} "
                         f"{_fmt_hours(a['hours']):>14} {cost_a:>9}")
    lines.append("")
    for n in p.notes:
        lines.append(f"note: {n}")
    lines.append(f"note: {UNIT}; tokens are {TOKENS_MEANING}")
    return "\n".join(lines)
