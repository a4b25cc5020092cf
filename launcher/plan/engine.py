"""Which engine on how many processes runs a job on one box, each choice with its reason.

The rules are the reference article's (docs/sizing.md, "Engine rules"): Unsloth on one card where it fits; more
cards (DDP) when one card would take longer than a working day (WORKDAY_HOURS); FSDP or DeepSpeed ZeRO-3 when no
card holds the job, with QLoRA's 4-bit shards offloaded to CPU RAM when even the shards do not fit.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace

from launcher.plan import sizing
from launcher.plan.figures import _fmt_hours
from launcher.plan.hardware import Hardware
from launcher.plan.job import Job, _steps_and_tokens
from launcher.plan.sizing import Workload


# The article: "more cards when a run on one card would take longer than a working day".
WORKDAY_HOURS = 8.0
# A CPU run longer than this is refused: CPU training is for tiny models and tests.
CPU_MAX_HOURS = 24.0
SHARDING_ENGINES = ("fsdp", "deepspeed")


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
    reasons = [f"CPU run: this box has no GPU ({hw.cpu_count} cores, {hw.ram_gb:.3g} GB RAM); "
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
    reasons = [f"CPU run: this box has no GPU ({hw.cpu_count} cores, {hw.ram_gb:.3g} GB RAM); "
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
               "--unsloth builds it here), then run ftrun from that environment; ftrun's Docker image has it as a second "
               "environment (docker run --entrypoint ftrun-unsloth ...)")
UNSLOTH_MISSING = ("engine: unsloth needs Unsloth, which is not installed in this environment. " + UNSLOTH_FIX +
                   "; or set engine: trl")


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
        engine_reason = {"unsloth": "engine unsloth: LoRA/QLoRA on one card with Unsloth (fastest, least memory)"
                                    + ("" if hw.is_this_machine else "; in ftrun's Docker image it runs in the "
                                       "ftrun-unsloth environment: docker run --entrypoint ftrun-unsloth ..."),
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
    need_ram = est_all.load_ram_gb / sizing.USABLE_RAM_FRACTION
    rent_note = None
    if est_all.load_ram_gb > ram_usable and not hw.is_this_machine:
        # A box not rented yet: its RAM is the catalog's assumption (about twice its GPU memory), not a reading.
        # The plan names the RAM the job needs instead of refusing on that assumption; on the box itself the
        # launch plans again with the RAM it reads (cgroup limit included) and refuses there if it falls short.
        rent_note = (f"host RAM: loading needs {est_all.load_ram_gb:.0f} GB ({sizing.USABLE_RAM_FRACTION:.0%} of a "
                     f"box with {need_ram:.0f} GB); rent {hw.count} x {hw.gpu.name} with at least {need_ram:.0f} GB of "
                     f"RAM (this plan assumed {hw.ram_gb:.0f} GB for it)")
    elif est_all.load_ram_gb > ram_usable:
        need = need_ram
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
    if rent_note:
        reasons.append(rent_note)
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
