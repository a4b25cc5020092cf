"""Which engine on how many processes runs a job on a box without a GPU, each choice with its reason."""

from __future__ import annotations

from launcher.engine_kinds import CPU_MULTI_PROCESS
from launcher.methods import METHODS, OBJECTIVES, is_adapter
from launcher.plan import engine_software, sizing, sizing_constants
from launcher.plan.choice import CPU_ADAM_NOTE, OFFLOAD_FORCED, Choice, _hours, offload_words
from launcher.plan.engine_software import UNSLOTH_MISSING, UNSLOTH_NOT_FOR
from launcher.plan.figures import _fmt_hours
from launcher.plan.hardware import Hardware
from launcher.plan.job import Job


# Unsloth 2026.10.9's CPU backend (unsloth/_cpu_init.py): FastVisionModel raises NotImplementedError
UNSLOTH_VISION_CPU = (
    "engine: unsloth with a vision-language model needs a GPU: Unsloth's CPU backend has no vision path "
    '(FastVisionModel: "vision / audio models are not supported on the CPU backend yet"); use engine: auto or trl '
    "on this box"
)
CPU_MAX_HOURS = 24.0  # a CPU run longer than this is refused: CPU training is for tiny models and tests


def _cpu_box(hw: Hardware) -> list[str]:
    return [
        f"CPU run: this box has no GPU ({hw.cpu_count} cores, {hw.ram_gb:.3g} GB RAM); "
        "only sensible for tiny models and tests"
    ]


def _choose_cpu(
    job: Job, hw: Hardware, forced: str, processes: int | None = None, nnodes: int = 1, offload: str = "auto"
) -> Choice:
    capacity, reasons = hw.ram_gb, _cpu_box(hw)
    if offload in OFFLOAD_FORCED and forced != "deepspeed":
        why = (
            f"offload: {offload} is DeepSpeed ZeRO-3's CPU offload; on a CPU box it runs only with "
            "engine: deepspeed (2 or more gloo processes)"
        )
        return Choice(False, forced, "cpu", processes or 1, None, capacity, reasons, refusal=why)
    if forced in ("unsloth", "fsdp"):
        why = {
            "unsloth": "Unsloth needs an NVIDIA GPU",
            # accelerate/the Trainer turn an FSDP2 config into plain DDP on a CPU: a silent fallback, refused
            "fsdp": "FSDP through accelerate/the Trainer does not shard on CPU (it silently becomes DDP); "
            "use engine: ddp or deepspeed for several CPU processes",
        }[forced]
        return Choice(
            False, forced, "cpu", 1, None, capacity, reasons, refusal=f"engine: {forced} is impossible here: {why}"
        )
    if forced == "trl" and processes is not None and processes > 1:
        why = f"engine: trl is one process, num_processes is {processes}; use engine: ddp"
        return Choice(False, forced, "cpu", processes, None, capacity, reasons, refusal=why)
    if forced in CPU_MULTI_PROCESS or (forced == "auto" and processes is not None and processes > 1):
        return _choose_cpu_multi(job, hw, "ddp" if forced == "auto" else forced, processes, reasons, nnodes, offload)
    w = job.workload("trl", 1, "cpu")
    est = sizing.memory(job.arch, w)
    tps, hrs = _hours(job, w, hw, 1)
    reasons.append("engine trl, one process on the CPU" + (" (forced by the recipe)" if forced == "trl" else ""))
    if METHODS[job.method].bitsandbytes:
        reasons.append(
            f"{job.method} relies on bitsandbytes, whose CPU support is limited: the smoke test will tell; "
            "method lora (or full) is the safe choice on CPU"
        )
    if est.per_gpu_gb > capacity * sizing_constants.USABLE_RAM_FRACTION:
        why = (
            f"needs {est.per_gpu_gb:.1f} GB of RAM, this box has {capacity:.0f} GB "
            f"({sizing_constants.USABLE_RAM_FRACTION:.0%} usable)"
        )
        return Choice(False, "trl", "cpu", 1, est, capacity, reasons, tps, hrs, refusal=why)
    if hrs is not None and hrs > CPU_MAX_HOURS:
        why = (
            f"fits in RAM but would take about {_fmt_hours(hrs)} on {hw.cpu_count} CPU cores "
            f"(more than {CPU_MAX_HOURS:.0f} h)"
        )
        return Choice(False, "trl", "cpu", 1, est, capacity, reasons, tps, hrs, refusal=why)
    reasons.append(f"memory: needs {est.per_gpu_gb:.1f} GB of {capacity:.0f} GB RAM")
    return Choice(True, "trl", "cpu", 1, est, capacity, reasons, tps, hrs)


def _choose_cpu_multi(
    job: Job,
    hw: Hardware,
    engine: str,
    processes: int | None,
    reasons: list[str],
    nnodes: int = 1,
    offload: str = "auto",
) -> Choice:
    """Several gloo processes on one CPU box (DDP or DeepSpeed ZeRO-3): for tests and the trajectory checks."""
    capacity = hw.ram_gb
    n = processes if processes is not None else 2
    if n * nnodes < 2:  # one process per node is fine when there are several nodes
        why = f"engine: {engine} with num_processes=1 is single-process training; use engine: trl"
        return Choice(False, engine, "cpu", n, None, capacity, reasons, refusal=why)
    if n > hw.cpu_count:
        why = f"{n} gloo processes need at least {n} CPU cores, this box has {hw.cpu_count}"
        return Choice(False, engine, "cpu", n, None, capacity, reasons, refusal=why)
    if engine == "deepspeed" and not engine_software._deepspeed_installed():
        why = (
            "engine: deepspeed needs DeepSpeed, which is not installed here: pip install "
            "'ftrun[deepspeed]' (DS_BUILD_OPS=0 on a box without CUDA)"
        )
        return Choice(False, engine, "cpu", n, None, capacity, reasons, missing="deepspeed", refusal=why)
    w = job.workload("trl", 1, "cpu")
    est = sizing.memory(job.arch, w)
    # The processes share the box's cores, so the box's throughput is about one process's.
    tps, hrs = _hours(job, w, hw, n)
    src = "num_processes from the recipe" if processes is not None else "2 by default on CPU"
    what = (
        "each holds a full copy and trains on its own micro-batches; gradients are averaged over gloo"
        if engine == "ddp"
        else "ZeRO-3 partitions parameters, gradients and optimizer states; about 4x slower per step than DDP here"
    )
    reasons.append(f"engine {engine}, {n} gloo processes on the CPU ({src}): {what}")
    opt_off, param_off = OFFLOAD_FORCED.get(offload, (False, False))
    if opt_off:
        reasons.append(
            f"{offload_words(opt_off, param_off)} forced by the recipe: on a CPU box the states stay in "
            "the same RAM, so memory and time are as without it; the optimizer is DeepSpeedCPUAdam (fp32 "
            f"AdamW) whatever the method; {CPU_ADAM_NOTE}"
        )
    total = est.per_gpu_gb * n
    if total > capacity * sizing_constants.USABLE_RAM_FRACTION:
        why = f"{n} processes need {total:.1f} GB of RAM, this box has {capacity:.0f} GB"
        return Choice(False, engine, "cpu", n, est, capacity, reasons, tps, hrs, refusal=why)
    reasons.append(f"memory: {n} x {est.per_gpu_gb:.1f} GB of {capacity:.0f} GB RAM")
    return Choice(
        True, engine, "cpu", n, est, capacity, reasons, tps, hrs, offload_params=param_off, offload_optimizer=opt_off
    )


def _choose_cpu_unsloth(job: Job, hw: Hardware, unsloth_ok: bool, processes: int | None) -> Choice:
    """engine: unsloth forced on a CPU box: allowed only where Unsloth imports (its CPU path, for the test tier)."""
    capacity, reasons = hw.ram_gb, _cpu_box(hw)
    if not is_adapter(job.method):
        why = f"engine: unsloth trains LoRA/QLoRA only; method is {job.method}"
        return Choice(False, "unsloth", "cpu", 1, None, capacity, reasons, refusal=why)
    if not OBJECTIVES[job.objective].unsloth:
        why = UNSLOTH_NOT_FOR.format(job.objective) + "; use engine: auto or trl"
        return Choice(False, "unsloth", "cpu", 1, None, capacity, reasons, refusal=why)
    if job.arch.vision_tower:
        return Choice(False, "unsloth", "cpu", 1, None, capacity, reasons, refusal=UNSLOTH_VISION_CPU)
    if not unsloth_ok:
        why = (
            UNSLOTH_MISSING + " (Unsloth needs an NVIDIA GPU for real runs; on a CPU it is allowed "
            "only where it is installed, to test the engine)"
        )
        return Choice(False, "unsloth", "cpu", 1, None, capacity, reasons, missing="unsloth", refusal=why)
    if processes is not None and processes > 1:
        why = f"engine: unsloth is one process, num_processes is {processes}; use engine: ddp"
        return Choice(False, "unsloth", "cpu", processes, None, capacity, reasons, refusal=why)
    # Unsloth's fused kernels are GPU kernels; on a CPU it runs its plain PyTorch path: sized as trl.
    w = job.workload("trl", 1, "cpu")
    est = sizing.memory(job.arch, w)
    tps, hrs = _hours(job, w, hw, 1)
    reasons.append(
        "engine unsloth (forced by the recipe) on the CPU: Unsloth's CPU path (\"no GPU found, training "
        'on CPU"), for testing the engine; its speed and memory gains need an NVIDIA GPU, so time and '
        "memory are estimated as for trl"
    )
    if est.per_gpu_gb > capacity * sizing_constants.USABLE_RAM_FRACTION:
        why = f"needs {est.per_gpu_gb:.1f} GB of RAM, this box has {capacity:.0f} GB"
        return Choice(False, "unsloth", "cpu", 1, est, capacity, reasons, tps, hrs, refusal=why)
    reasons.append(f"memory: needs {est.per_gpu_gb:.1f} GB of {capacity:.0f} GB RAM")
    return Choice(True, "unsloth", "cpu", 1, est, capacity, reasons, tps, hrs)
