"""The training engines as a table: one row an engine (trl, unsloth, ddp, fsdp, deepspeed), with how it starts its
processes, the config file it writes into the run directory, and what it does with the weights and checkpoints.
A root leaf: the recipe, the plan's choice and the launch (launcher/worker/engines/) ask it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class EngineKind:
    name: str
    launcher: str  # "python": one process; "torchrun" or "accelerate": one process per GPU (gloo ones on a CPU)
    config_file: Optional[str]  # written into the run directory from the plan (data, not code), or None
    shards: bool  # shards or partitions the weights itself: loads without a device map, no fp32 master copy
    per_rank_checkpoints: bool  # its checkpoints hold state split per process: resumed only on the same count
    cpu_processes: bool  # runs several gloo processes on a CPU (FSDP through accelerate does not shard there)
    multi_node: bool  # trains over several boxes (--nnodes), each a complete set of processes
    what: str  # for the recipe's help

    @property
    def multi_process(self) -> bool:
        return self.launcher != "python"


ENGINES: dict[str, EngineKind] = {
    e.name: e
    for e in (
        EngineKind(
            "unsloth",
            "python",
            None,
            shards=False,
            per_rank_checkpoints=False,
            cpu_processes=False,
            multi_node=False,
            what="Unsloth's kernels, one GPU",
        ),
        EngineKind(
            "trl",
            "python",
            None,
            shards=False,
            per_rank_checkpoints=False,
            cpu_processes=False,
            multi_node=False,
            what="TRL, one process",
        ),
        EngineKind(
            "ddp",
            "torchrun",
            None,
            shards=False,
            per_rank_checkpoints=False,
            cpu_processes=True,
            multi_node=True,
            what="a whole copy per GPU",
        ),
        # accelerate launch reads the FSDP plugin settings from its config file (launcher/worker/engines/fsdp.py)
        EngineKind(
            "fsdp",
            "accelerate",
            "accelerate_fsdp.yaml",
            shards=True,
            per_rank_checkpoints=False,
            cpu_processes=False,
            multi_node=False,
            what="FSDP2 shards over the GPUs",
        ),
        # the Trainer drives DeepSpeed from the JSON config (SFTConfig.deepspeed); torchrun only starts the processes
        EngineKind(
            "deepspeed",
            "torchrun",
            "deepspeed.json",
            shards=True,
            per_rank_checkpoints=True,
            cpu_processes=True,
            multi_node=True,
            what="ZeRO-3, with CPU offload",
        ),
    )
}
AUTO = "auto"  # the recipe's default: the plan chooses


def names(where) -> tuple[str, ...]:
    return tuple(name for name, e in ENGINES.items() if where(e))


SINGLE_PROCESS = names(lambda e: not e.multi_process)
MULTI_PROCESS = names(lambda e: e.multi_process)
SHARDING = names(lambda e: e.shards)
PER_RANK_CHECKPOINTS = names(lambda e: e.per_rank_checkpoints)
CPU_MULTI_PROCESS = names(lambda e: e.cpu_processes)
MULTI_NODE = names(lambda e: e.multi_node)
