"""What every engine rule weighs: the Choice it returns, whether a layout fits a card, its time, its offload words."""

from __future__ import annotations

from dataclasses import dataclass

from launcher.engine_kinds import SHARDING
from launcher.plan import sizing, sizing_constants, throughput
from launcher.plan.hardware import Hardware
from launcher.plan.job import Job, _steps_and_tokens
from launcher.plan.sizing import Workload


# The article: "more cards when a run on one card would take longer than a working day".
WORKDAY_HOURS = 8.0
SHARDING_ENGINES = SHARDING  # the engine table, launcher/engine_kinds.py


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
    offload_params: bool = False  # parameters in CPU RAM: FSDP's fsdp_offload_params, DeepSpeed's offload_param
    offload_optimizer: bool = False  # DeepSpeed ZeRO-3 offload_optimizer: states and the optimizer step on the CPU
    load_hours: float = 0.0  # loading before the first step, included in hours
    missing: str = ""  # a package this machine lacks (never "does not fit": the fix is an install)
    offload_activations: bool = False  # TRL's activation_offloading: saved layer inputs in CPU RAM


def _fits(est: sizing.MemoryEstimate, capacity: float) -> bool:
    """The card holds both the training step and the load (docs/sizing.md, "Loading")."""
    return est.peak_gb <= capacity * sizing_constants.USABLE_FRACTION


def _tps(job: Job, w: Workload, hw: Hardware) -> float:
    g = hw.gpu
    tflops, cc = (g.tflops_bf16, g.compute_capability) if g else (None, None)
    mean = int(job.mean_tokens / job.sequences)  # a pair: per sequence
    return throughput.tokens_per_second(job.arch, w, tflops, hw.interconnect, hw.cpu_count, mean, cc)


def _hours(job: Job, w: Workload, hw: Hardware, processes: int) -> tuple[float, float | None]:
    tps = _tps(job, w, hw)
    _, training = _steps_and_tokens(job, processes)
    load = throughput.load_seconds(job.arch, w, hw.cpu_count) / 3600
    return tps, (throughput.hours(training, tps) + load if training else None)


# The recipe's `offload:` values (launcher/recipe.py): auto adds DeepSpeed's CPU offload only when nothing else fits.
OFFLOAD_FORCED = {"optimizer": (True, False), "optimizer+params": (True, True)}
# DeepSpeedCPUAdam is a C++ op DeepSpeed compiles on its first use when the install did not build it (DS_BUILD_OPS=0).
CPU_ADAM_NOTE = (
    "DeepSpeed compiles its CPU Adam op (cpu_adam) with the C++ compiler on first use unless it was "
    "installed prebuilt (DS_BUILD_CPU_ADAM=1): about 4 minutes on a 2-core box, once per machine"
)


def offload_words(optimizer: bool, params: bool) -> str:
    """How the plan names DeepSpeed's CPU offload in its reasons and refusals."""
    if not optimizer:
        return "no CPU offload"
    if params:
        return "CPU offload of the optimizer and the parameters (offload_optimizer + offload_param)"
    return "CPU offload of the optimizer (offload_optimizer)"
