"""Which engine on how many processes runs a job on one box, each choice with its reason: the reference article's
rules (docs/sizing.md, "Engine rules")."""

from __future__ import annotations

from dataclasses import replace

from launcher.methods import METHODS, OBJECTIVES, is_adapter, is_quantized
from launcher.plan import engine_software, links, sizing, sizing_constants
from launcher.plan import throughput
from launcher.plan.choice import (
    CPU_ADAM_NOTE,
    OFFLOAD_FORCED,
    SHARDING_ENGINES,
    WORKDAY_HOURS,
    Choice,
    _fits,
    _hours,
    _tps,
    offload_words,
)
from launcher.plan.cpu_engine import _choose_cpu, _choose_cpu_unsloth
from launcher.plan.engine_software import UNSLOTH_FIX, UNSLOTH_MISSING, UNSLOTH_NOT_FOR
from launcher.plan.figures import _fmt_hours
from launcher.plan.hardware import Hardware
from launcher.plan.job import Job


# bitsandbytes' 8-bit AdamW has no DTensor support (illegal memory accesses reported under FSDP2)
FULL_8BIT_FSDP = (
    "method full-8bit cannot run on FSDP: its 8-bit AdamW (bitsandbytes) has no support for the "
    "DTensor parameters FSDP2 shards into (illegal memory access reported under FSDP2)"
)


# engine auto keeps TRL for a vision-language model: no GPU has run Unsloth's vision path in ftrun's checks yet, so it
# is the recipe's choice, sized with TRL's terms (Job.workload)
UNSLOTH_VISION_OPT_IN = (
    "TRL on one GPU: Unsloth's vision path (engine: unsloth) has not been run on a GPU by ftrun's checks yet, so "
    "engine auto keeps TRL's SFTTrainer with the processor for a vision-language model"
)
UNSLOTH_VISION_SIZED = (
    "Unsloth's vision path (FastVisionModel, UnslothVisionDataCollator): memory and time are estimated from TRL's "
    "terms, as for engine trl (Unsloth's savings on a vision-language model are not measured by ftrun yet); its "
    "collator leaves the image tokens out of the loss, with the padding"
)


def _idle(cards: int) -> str:
    return "1 GPU stays idle" if cards == 1 else f"{cards} GPUs stay idle"


def _held(offload_opt: bool, offload: bool) -> str:
    if offload_opt:
        return f" with {offload_words(offload_opt, offload)}"
    return " with parameter offload to CPU RAM" if offload else ""


def choose(
    job: Job,
    hw: Hardware,
    forced: str = "auto",
    unsloth_ok: bool = False,
    workday_hours: float = WORKDAY_HOURS,
    processes: int | None = None,
    nnodes: int = 1,
    in_hand: bool = True,
    offload: str = "auto",
) -> Choice:
    """`in_hand`: the box being planned, billed whole, so its cards are used whenever faster; `processes` (recipe
    num_processes) is honoured or refused; `offload`: auto, none, or OFFLOAD_FORCED's."""
    vision = bool(getattr(job.arch, "vision_tower", ""))
    if hw.is_cpu_only and forced == "unsloth":
        return _choose_cpu_unsloth(job, hw, unsloth_ok, processes)
    if hw.is_cpu_only:
        return _choose_cpu(job, hw, forced, processes, nnodes, offload)
    if processes is not None:
        return _choose_gpu_count(job, hw, forced, unsloth_ok, workday_hours, processes, in_hand, offload)
    g = hw.gpu
    cap = g.memory_gb
    n = hw.count
    lora = is_adapter(job.method)
    cc_ok = g.compute_capability is None or g.compute_capability >= (7, 0)
    reasons: list[str] = []

    if forced == "unsloth" and not OBJECTIVES[job.objective].unsloth:
        why = UNSLOTH_NOT_FOR.format(job.objective) + "; use engine: auto or trl"
        return Choice(False, "unsloth", "cuda", 1, None, cap, [], refusal=why)
    if forced == "unsloth" and not lora:
        why = f"engine: unsloth trains LoRA/QLoRA only; method is {job.method}"
        return Choice(False, "unsloth", "cuda", 1, None, cap, [], refusal=why)
    if forced == "unsloth" and not unsloth_ok:
        why = UNSLOTH_MISSING + " (Unsloth also needs a GPU of compute capability 7.0 or newer)"
        return Choice(False, "unsloth", "cuda", 1, None, cap, [], missing="unsloth", refusal=why)
    if forced in ("ddp", *SHARDING_ENGINES) and n * nnodes < 2:
        what = "DDP copies the model to every card to train on more data at once"
        if forced in SHARDING_ENGINES:
            what = f"{forced} shards the model over several cards"
        two = sizing.memory(job.arch, job.workload(forced, 2, "cuda"))
        bigger = (
            f", or plan for a box of two with --gpus 2x{g.name} ({two.peak_gb:.1f} GB per card)"
            if _fits(two, cap)
            else ""
        )
        why = f"engine: {forced} needs 2 or more GPUs and this box has one ({what}); use engine: auto or trl{bigger}"
        return Choice(False, forced, "cuda", 1, None, cap, [], refusal=why)
    force_offload = offload in OFFLOAD_FORCED
    if force_offload and (forced not in ("auto", "deepspeed") or n * nnodes < 2):
        why = (
            f"offload: {offload} is DeepSpeed ZeRO-3's CPU offload: it needs engine: deepspeed (or "
            f"auto) and 2 or more GPUs; this box has {n}, the engine is {forced}. Set offload: auto "
            "to let the plan add it only when nothing else fits"
        )
        return Choice(False, forced if forced != "auto" else "deepspeed", "cuda", n, None, cap, [], refusal=why)

    single_engine = "trl"
    if forced in ("unsloth", "trl"):
        single_engine = forced
    elif forced == "auto" and lora and unsloth_ok and cc_ok and vision and OBJECTIVES[job.objective].unsloth:
        reasons.append(UNSLOTH_VISION_OPT_IN)
    elif forced == "auto" and lora and unsloth_ok and cc_ok and OBJECTIVES[job.objective].unsloth:
        single_engine = "unsloth"
    elif forced == "auto" and lora and unsloth_ok and cc_ok:
        reasons.append(UNSLOTH_NOT_FOR.format(job.objective) + ": TRL on one GPU")

    one = sizing.memory(job.arch, job.workload(single_engine, 1, "cuda"))
    fits_one = _fits(one, cap)
    if forced == "auto" and lora and not unsloth_ok and OBJECTIVES[job.objective].unsloth and not vision:
        reasons.append(
            "Unsloth not installed on this machine: TRL on one GPU (Unsloth would need less memory and run "
            "~1.4x faster; " + UNSLOTH_FIX + ")"
        )

    if fits_one and forced in ("auto", "unsloth", "trl", "ddp") and not force_offload:
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
                speed = links.scaling(n, hw.interconnect)
                if forced == "ddp":
                    why = "forced by the recipe"
                elif in_hand:
                    why = (
                        f"the box is billed whole, so its {n} cards cost no more per hour than one: "
                        f"{_fmt_hours(hrs) if hrs is not None else 'time unknown'} instead of "
                        f"{_fmt_hours(hrs1) if hrs1 is not None else 'time unknown'} on one card with {n - 1} idle "
                        f"({single_engine}), so less time and less money"
                    )
                else:
                    why = f"one card would take {_fmt_hours(hrs1)}, longer than a working day ({workday_hours:g} h)"
                link = (
                    links.title(hw.interconnect)
                    if hw.interconnect == links.NVLINK
                    else f"{links.title(links.PCIE)}: cards talk over it, which scales worse than NVLink"
                )
                reasons += [
                    fit_reason,
                    f"engine ddp over {n} GPUs: {why}; ~{speed:.1f}x one card ({link})",
                    f"DDP keeps a full copy per card: {est.per_gpu_gb:.1f} GB per card",
                ]
                return Choice(True, "ddp", "cuda", n, est, cap, reasons, tps, hrs)
            if not _fits(est, cap):
                reasons.append(
                    f"DDP would need {est.per_gpu_gb:.1f} GB per card (gradient buckets): staying on one card"
                )
            else:
                reasons.append(
                    f"DDP over {n} cards ({tps:,.0f} tokens/s) would be slower than {single_engine} on one "
                    f"card ({tps1:,.0f} tokens/s): staying on one card"
                )
            if forced == "ddp":
                why = f"engine: ddp needs {est.per_gpu_gb:.1f} GB per card, the cards have {cap:.1f} GB"
                return Choice(False, "ddp", "cuda", n, est, cap, reasons, refusal=why)
        engine_reason = {
            "unsloth": "engine unsloth: LoRA/QLoRA on one card with Unsloth"
            + ("; " + UNSLOTH_VISION_SIZED if vision else " (fastest, least memory)")
            + (
                ""
                if hw.is_this_machine
                else "; in ftrun's Docker image it runs in the "
                "ftrun-unsloth environment: docker run --entrypoint ftrun-unsloth ..."
            ),
            "trl": "engine trl on one GPU",
        }[single_engine]
        if forced in ("unsloth", "trl"):
            engine_reason += " (forced by the recipe)"
        reasons += [fit_reason, engine_reason]
        if n > 1 and not in_hand:
            reasons.append(
                f"the box has {n} cards; {_idle(n - 1)} because one card finishes within a working day "
                f"({_fmt_hours(hrs1) if hrs1 else 'time unknown'}); a 1-card box costs 1/{n} per hour, "
                "or force engine: ddp"
            )
        elif n > 1:
            reasons.append(
                f"the box has {n} cards; {_idle(n - 1)} (billed all the same): rent a 1-card box "
                f"for this job instead, it costs 1/{n} per hour"
            )
        return Choice(True, single_engine, "cuda", 1, one, cap, reasons, tps1, hrs1)

    offloadable = job.gradient_checkpointing and not job.offload_activations and not force_offload
    trl_alone = single_engine == "trl" and forced in ("auto", "trl") and (n == 1 or forced == "trl")
    if not fits_one and trl_alone and offloadable:
        # TRL's activation offloading: saved layer inputs in pinned RAM (throughput.activation_offload_seconds)
        w_off = job.workload("trl", 1, "cuda", offload_activations=True)
        off = sizing.memory(job.arch, w_off)
        ram_ok = (
            off.offloaded_ram_gb + sizing_constants.CPU_RUNTIME_GB <= hw.ram_gb * sizing_constants.USABLE_RAM_FRACTION
        )
        if _fits(off, cap) and ram_ok:
            tps_off, hrs_off = _hours(job, w_off, hw, 1)
            tps_plain = _tps(job, job.workload("trl", 1, "cuda"), hw)
            reasons += [
                f"one card would need {one.peak_gb:.1f} GB of {cap:.1f} GB; with TRL's activation offloading "
                f"the {job.arch.layers} saved layer inputs ({off.offloaded_ram_gb:.1f} GB) wait in CPU RAM: "
                f"{off.per_gpu_gb:.1f} GB on the card",
                f"engine trl on one GPU with activation offloading: the host link moves "
                f"{2 * off.offloaded_ram_gb / max(1, job.micro_batch):.2f} GB per sequence, "
                f"~{tps_off / tps_plain:.0%} of the speed without it"
                + (" (forced by the recipe)" if forced == "trl" else ""),
            ]
            return Choice(True, "trl", "cuda", 1, off, cap, reasons, tps_off, hrs_off, offload_activations=True)

    if forced in ("unsloth", "trl", "ddp"):
        why = (
            f"engine: {forced} keeps the whole job on each card: needs {one.per_gpu_gb:.1f} GB, "
            f"the card has {cap:.1f} GB"
        )
        return Choice(False, forced, "cuda", n if forced == "ddp" else 1, one, cap, reasons, refusal=why)

    # no single card holds it: shard; full-8bit with DeepSpeed, whose ZeRO-3 hands its 8-bit AdamW plain tensors
    to_deepspeed = forced == "auto" and (METHODS[job.method].eight_bit_optimizer or force_offload)
    shard_engine = "deepspeed" if forced == "deepspeed" or to_deepspeed else "fsdp"
    if n < 2:
        why = (
            f"needs {one.per_gpu_gb:.1f} GB on one card, the card has {cap:.1f} GB "
            f"({sizing_constants.USABLE_FRACTION:.0%} usable), and the box has no second card to shard over"
        )
        return Choice(False, single_engine, "cuda", 1, one, cap, reasons, refusal=why)
    if METHODS[job.method].eight_bit_optimizer and shard_engine == "fsdp":
        return Choice(False, "fsdp", "cuda", n, None, cap, reasons, refusal=FULL_8BIT_FSDP)

    def sized(k: int, params: bool, optimizer: bool) -> sizing.MemoryEstimate:
        return sizing.memory(job.arch, job.workload(shard_engine, k, "cuda", params, optimizer))

    def fewest(params: bool, optimizer: bool = False):
        for k in range(2, n + 1):
            if _fits(sized(k, params, optimizer), cap):
                return k
        return None

    setting = offload  # the recipe's offload:, before `offload` names the choice (parameters in CPU RAM)
    offload_opt, offload = OFFLOAD_FORCED.get(setting, (False, False))
    est_plain = sized(n, False, False)  # the layout without offload: what the reasons compare with
    minimum = fewest(offload, offload_opt)
    est_all = sized(n, offload, offload_opt)
    if minimum is None and is_quantized(job.method) and shard_engine == "fsdp" and setting != "none":
        # The published 70B-on-2x24 GB QLoRA runs: FSDP with the 4-bit shards offloaded to CPU RAM.
        minimum = fewest(True)
        if minimum is not None:
            offload, est_all = True, sized(n, True, False)
    ds_tried = minimum is None and not is_adapter(job.method) and setting == "auto" and forced in ("auto", "deepspeed")
    if ds_tried:
        # as 70B full fine-tuning usually runs: ZeRO-3 with the optimizer (then the parameters) in CPU RAM
        shard_engine = "deepspeed"
        for params in (False, True):
            offload, offload_opt, est_all = params, True, sized(n, params, True)
            minimum = fewest(params, True)
            if minimum is not None:
                break

    def refused(why: str) -> Choice:
        return Choice(
            False,
            shard_engine,
            "cuda",
            n,
            est_all,
            cap,
            reasons,
            offload_params=offload,
            offload_optimizer=offload_opt,
            refusal=why,
        )

    if minimum is None:
        # one layout's figures, the last one tried: its whole job ("in all") and its share per card
        ds = f" with DeepSpeed ZeRO-3 and {offload_words(True, offload)}"
        held = ds if ds_tried else _held(offload_opt, offload)
        why = (
            f"needs {est_all.total_gb:.0f} GB in all; sharded over all {n} cards{held} it still "
            f"needs {est_all.peak_gb:.1f} GB per card"
            + (f" ({est_all.load_explanation})" if est_all.load_peak_gb > est_all.per_gpu_gb else "")
            + f", the cards have {cap:.1f} GB"
        )
        return refused(why)
    ram_usable = hw.ram_gb * sizing_constants.USABLE_RAM_FRACTION
    need_ram = est_all.host_ram_gb / sizing_constants.USABLE_RAM_FRACTION
    ram_why = est_all.ram_explanation
    rent_note = None
    if est_all.host_ram_gb > ram_usable and not hw.is_this_machine:
        # a box not rented yet: its RAM is the catalog's assumption, so the plan names what the job needs
        what = "training with CPU offload" if est_all.train_ram_gb > est_all.load_ram_gb else "loading"
        rent_note = (
            f"host RAM: {what} needs {est_all.host_ram_gb:.0f} GB ({sizing_constants.USABLE_RAM_FRACTION:.0%} of a "
            f"box with {need_ram:.0f} GB); rent {hw.count} x {hw.gpu.name} with at least {need_ram:.0f} GB of "
            f"RAM (this plan assumed {hw.ram_gb:.0f} GB for it)"
        )
    elif est_all.host_ram_gb > ram_usable:
        phase = "training" if est_all.train_ram_gb > est_all.load_ram_gb else "loading"
        return refused(
            f"the cards hold it{_held(offload_opt, offload)} ({est_all.peak_gb:.1f} GB per card), but {phase} does "
            f"not fit the box's RAM: {ram_why}; this box has {hw.ram_gb:.0f} GB "
            f"({sizing_constants.USABLE_RAM_FRACTION:.0%} usable). A box with {need_ram:.0f} GB of RAM or more "
            f"holds it (`ftrun plan` on that box reads its RAM)"
        )
    wn = job.workload(shard_engine, n, "cuda", offload, offload_opt)
    tps, hrs = _hours(job, wn, hw, n)
    link = (
        links.title(hw.interconnect)
        if hw.interconnect == links.NVLINK
        else f"{links.title(links.PCIE)} (sharding exchanges every layer: expect it slower)"
    )
    label = "FSDP" if shard_engine == "fsdp" else "DeepSpeed ZeRO-3"
    if to_deepspeed and METHODS[job.method].eight_bit_optimizer:
        reasons.append(f"DeepSpeed ZeRO-3, not FSDP: {FULL_8BIT_FSDP}")
    if offload_opt:
        reasons.append(
            f"engine deepspeed with {offload_words(True, offload)}: "
            + (
                f"forced by the recipe (offload: {setting})"
                if force_offload
                else f"nothing else fits: sharded over all {n} cards without offload each card needs "
                f"{est_plain.peak_gb:.1f} GB of {cap:.1f} GB"
                + (f", with the optimizer offloaded {sized(n, False, True).peak_gb:.1f} GB" if offload else "")
            )
            + f"; {minimum} x {cap:.0f} GB {link} is the fewest that fits with it"
        )
    else:
        reasons.append(
            f"engine {shard_engine}: needs {one.total_gb:.0f} GB, largest card {cap:.0f} GB; "
            f"{minimum} x {cap:.0f} GB {link} is the fewest that fits"
        )
    reasons.append(
        f"{label} over all {n} cards of this box (billed whole; more shards run faster and leave more room): "
        f"{est_all.per_gpu_gb:.1f} GB per card, {cap - est_all.per_gpu_gb:.1f} GB spare"
        + (" (forced by the recipe)" if forced in SHARDING_ENGINES else "")
    )
    if is_quantized(job.method):
        reasons.append(
            "QLoRA + FSDP: 4-bit shards are gathered and dequantised per layer, so it runs at a moderate pace"
        )
    gb_s = throughput.pcie_gb_s(hw.gpu.compute_capability)
    if offload_opt:
        move, step = throughput.deepspeed_offload_seconds(job.arch, est_all, wn, gb_s, hw.cpu_count)
        reasons.append(
            f"CPU offload: {est_all.offload_explanation}. The optimizer is DeepSpeedCPUAdam, fp32 AdamW, whatever the "
            "recipe's optimizer"
            + (
                ": method full-8bit's 8-bit AdamW is not used (DeepSpeed replaces the client "
                "optimizer under offload), so the run trains as method full does, with 16 B/param of "
                "states in RAM instead of 2 on the cards"
                if METHODS[job.method].eight_bit_optimizer
                else ""
            )
            + f". Each micro-batch's gradients cross PCIe ({gb_s:g} GB/s per card) and every optimizer step moves the "
            f"fp32 gradients down"
            + (" and the updated parameters up" if not offload else "")
            + (", the 16-bit parameters go up before every gather" if offload else "")
            + f" and runs Adam on {hw.cpu_count} CPU cores: +{move:.2f} s transfer and +{step:.2f} s CPU step per "
            f"micro-batch (accumulation {job.accumulation}; {tps:,.0f} tokens/s against "
            f"{_tps(job, job.workload(shard_engine, n, 'cuda'), hw):,.0f} if it fitted without offload); "
            f"{CPU_ADAM_NOTE}"
        )
    elif offload:
        move = throughput.offload_seconds_per_micro_batch(est_all, wn, gb_s)
        reasons.append(
            f"parameter offload (fsdp_offload_params): without it each card needs "
            f"{est_plain.peak_gb:.1f} GB; the shards "
            f"({est_all.offloaded_params_gb:.1f} GB) live in CPU RAM and cross PCIe ({gb_s:g} GB/s per card) "
            f"in every forward and backward: +{move:.1f} s per micro-batch"
        )
    load_h = throughput.load_seconds(job.arch, wn, hw.cpu_count) / 3600
    if est_all.load_explanation:
        reasons.append(
            "loading: "
            + est_all.load_explanation
            + (
                f"; quantizing on {hw.cpu_count} CPU cores takes about {_fmt_hours(load_h)} (in the time)"
                if load_h
                else ""
            )
        )
    if rent_note:
        reasons.append(rent_note)
    return Choice(
        True,
        shard_engine,
        "cuda",
        n,
        est_all,
        cap,
        reasons,
        tps,
        hrs,
        min_gpus=minimum,
        offload_params=offload,
        offload_optimizer=offload_opt,
        load_hours=load_h,
    )


def _choose_gpu_count(
    job: Job,
    hw: Hardware,
    forced: str,
    unsloth_ok: bool,
    workday_hours: float,
    processes: int,
    in_hand: bool = True,
    offload: str = "auto",
) -> Choice:
    """The engine choice on `processes` of the box's cards; refused when the rules need another count."""
    if processes > hw.count:
        why = f"num_processes={processes} needs {processes} GPUs, this box has {hw.count}"
        return Choice(False, forced, "cuda", processes, None, hw.gpu.memory_gb, [], refusal=why)
    used = replace(hw, gpus=hw.gpus[:processes])
    c = choose(job, used, forced, unsloth_ok, workday_hours, in_hand=in_hand, offload=offload)
    if c.fits and c.processes != processes and forced == "auto" and processes > 1:
        c = choose(job, used, "ddp", unsloth_ok, workday_hours, in_hand=in_hand)  # a count > 1 asks for several
    if c.fits and c.processes != processes:
        why = f"num_processes={processes}: engine {c.engine} runs {c.processes} process(es) here"
        return Choice(False, c.engine, "cuda", processes, c.estimate, c.capacity_gb, c.reasons, refusal=why)
    if c.fits:
        idle = hw.count - processes
        c.reasons.append(
            f"num_processes={processes} from the recipe"
            + (f"; {idle} of the box's {hw.count} cards {'stays' if idle == 1 else 'stay'} idle" if idle else "")
        )
    return c


def choose_with_software(
    job: Job,
    hw: Hardware,
    forced: str,
    unsloth_ok: bool,
    workday_hours: float,
    *,
    processes: int | None,
    nnodes: int,
    offload: str,
) -> Choice:
    """`choose`, then what the box in hand lacks: Unsloth (if only it fits) or DeepSpeed, as missing software."""
    choice = choose(job, hw, forced, unsloth_ok, workday_hours, processes=processes, nnodes=nnodes, offload=offload)
    if not (choice.fits or choice.missing or unsloth_ok) and forced == "auto" and hw.gpus and hw.is_this_machine:
        with_unsloth = choose(job, hw, forced, True, workday_hours, processes=processes, nnodes=nnodes, offload=offload)
        if with_unsloth.fits and with_unsloth.engine == "unsloth":
            need = with_unsloth.estimate.per_gpu_gb if with_unsloth.estimate else None
            choice = replace(
                choice,
                missing="unsloth",
                refusal=(
                    "it fits this box only with Unsloth"
                    + (f" ({need:.1f} GB of {with_unsloth.capacity_gb:.1f} GB per card)" if need else "")
                    + ", and Unsloth is not installed "
                    "in this environment. " + UNSLOTH_FIX
                ),
            )
    planned_deepspeed = choice.fits and choice.engine == "deepspeed" and hw.is_this_machine
    if planned_deepspeed and not engine_software._deepspeed_installed():
        choice = replace(
            choice,
            fits=False,
            missing="deepspeed",
            refusal="engine: deepspeed needs DeepSpeed, which "
            "is not installed in this environment: pip install 'ftrun[deepspeed]' (ftrun's Docker image "
            "has it)",
        )
    return choice
