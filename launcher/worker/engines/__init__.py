"""One module per training engine; this file maps a plan's engine to its launch command, files and checks."""

from __future__ import annotations

import importlib
import math
import os
import sys
from pathlib import Path
from typing import Any

from launcher.engine_kinds import ENGINES, MULTI_PROCESS, PER_RANK_CHECKPOINTS, SINGLE_PROCESS
from launcher.errors import PlanError

# torchrun's (and accelerate launch's) wait for the ranks after it forwards a SIGTERM; launch_env.
LAUNCHER_SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
LAUNCHER_SHUTDOWN_MARGIN_S = 15


def _worker(run_dir: Path, mode: str) -> list[str]:
    return ["-m", "launcher.worker.train", "--run-dir", str(run_dir), "--mode", mode]


def world_size(plan: dict[str, Any]) -> int:
    return int(plan.get("num_processes", 1)) * int((plan.get("nodes") or {}).get("nnodes", 1))


def _torchrun(n: int, plan: dict[str, Any] | None = None) -> list[str]:
    # torchrun starts exactly n processes (accelerate's `--cpu --num_processes n` silently starts one)
    nodes = (plan or {}).get("nodes")
    if nodes and int(nodes.get("nnodes", 1)) > 1:  # static rendezvous at node 0's address, each its --node-rank
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={int(nodes['nnodes'])}",
            f"--node-rank={int(nodes['node_rank'])}",
            f"--master-addr={nodes['master_addr']}",
            f"--master-port={int(nodes['master_port'])}",
            f"--nproc_per_node={n}",
        ]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]


def launch_command(plan: dict[str, Any], run_dir: Path, mode: str) -> list[str]:
    """The worker's argv for this plan (never a shell string), after writing the engine's config file."""
    engine = plan.get("engine", "trl")
    n = int(plan.get("num_processes", 1))
    kind = ENGINES.get(engine)
    if kind is None:
        raise PlanError(
            f"engine '{engine}' cannot be launched by this version of ftrun",
            fix=f"set engine: auto (or {' / '.join(ENGINES)}) in the recipe.",
        )
    cfg = importlib.import_module(f"{__name__}.{engine}").write_config(plan, run_dir) if kind.config_file else None
    if kind.launcher == "python":
        return [sys.executable, *_worker(run_dir, mode)]
    if kind.launcher == "torchrun":
        return [*_torchrun(n, plan), *_worker(run_dir, mode)]
    if kind.launcher == "accelerate":
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg), *_worker(run_dir, mode)]
    raise AssertionError(f"launcher {kind.launcher!r} of engine {engine} has no command here")


# torch's caching-allocator settings, by every name torch reads them from (torch 2.13 c10/cuda/CUDAAllocatorConfig.h
# CUDAAllocatorConfig::instance; 2.9-2.11 c10/core/AllocatorConfig.cpp AcceleratorAllocatorConfig::instance): any of
# them set, the value is the user's.
ALLOCATOR_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
# variable-length steps strand no cached blocks (docs/sizing.md, "Padding-free micro-batches")
EXPANDABLE_SEGMENTS = "expandable_segments:True"
# a CPU worker's OpenMP threads sleep rather than spin while they wait (docs/BENCHMARKS.md, "OpenMP threads spun")
CPU_WAIT_ENV, CPU_WAIT_POLICY = "OMP_WAIT_POLICY", "PASSIVE"


def launch_env(plan: dict[str, Any], grace_seconds: float | None = None, vllm: bool = False) -> dict[str, str]:
    """Environment for the launched worker(s), a variable the user set kept. `vllm`: no expandable segments, which its
    sleep mode refuses (vllm/device_allocator/cumem.py CuMemAllocator)."""
    n = int(plan.get("num_processes", 1))
    env: dict[str, str] = {}
    if plan.get("device") == "cuda" and not vllm and not any(v in os.environ for v in ALLOCATOR_ENV):
        env["PYTORCH_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
    if plan.get("device") == "cpu" and CPU_WAIT_ENV not in os.environ:
        env[CPU_WAIT_ENV] = CPU_WAIT_POLICY
    if n > 1 and "OMP_NUM_THREADS" not in os.environ:
        # the box's cores shared out between its processes: torchrun and accelerate launch would set 1 (torch 2.13
        # distributed/run.py config_from_args; accelerate 1.15 commands/launch.py _validate_launch_command), which
        # leaves QLoRA+FSDP's CPU quantization on one thread per rank (docs/engines.md, "round two", item 2)
        from launcher.plan.hardware import cpu_cores, threads_per_process

        env["OMP_NUM_THREADS"] = str(threads_per_process(cpu_cores(), n))
    if plan.get("device") == "cuda" and plan.get("engine", "trl") in SINGLE_PROCESS:
        only = planned_device(os.environ.get("CUDA_VISIBLE_DEVICES"))
        if only is not None:
            env["CUDA_VISIBLE_DEVICES"] = only
    if plan.get("device") == "cuda":
        from launcher.plan.hardware import nccl_p2p_ib_unsupported

        hw = plan.get("hardware") or {}
        names = [g.get("name", "") for g in hw.get("gpus") or []] or [str((plan.get("gpus") or {}).get("name", ""))]
        if nccl_p2p_ib_unsupported(names, hw.get("driver_version")):
            # accelerate 1.15 state.py PartialState.__init__ raises NotImplementedError unless both exist (only
            # `accelerate launch` sets them, commands/launch.py multi_gpu_launcher); its test counts every card
            # nvidia-smi lists, so every CUDA engine gets them (only NCCL acts on them)
            for var in ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE"):
                if var not in os.environ:
                    env[var] = "1"
    if grace_seconds is not None and plan.get("engine") in MULTI_PROCESS:
        # the launcher's wait between forwarding a SIGTERM and SIGKILLing the ranks (default 30 s): torch 2.12+
        # distributed/launcher/api.py LaunchConfig.__post_init__ reads the variable; torch 2.11 has no variable and
        # no --shutdown-timeout option, hence the variable (docs/engines.md, "round two", item 6). accelerate launch
        # builds the same LaunchConfig. A margin above grace_seconds: the supervisor's deadline binds.
        env[LAUNCHER_SHUTDOWN_TIMEOUT_ENV] = str(math.ceil(grace_seconds) + LAUNCHER_SHUTDOWN_MARGIN_S)
    return env


def planned_device(visible: str | None) -> str | None:
    """CUDA_VISIBLE_DEVICES for a one-process engine: the planned card (the first), alone, as the user wrote it; None
    where it sees one card or none. Several would mean nn.DataParallel (transformers 5.24 training_args.py
    _setup_devices, trainer.py _wrap_model; docs/engines.md, "round two", item 1)."""
    if visible is None:
        return "0"
    entries = [e.strip() for e in visible.split(",")]
    if len(entries) <= 1 or not entries[0] or entries[0] == "-1":
        return None
    return entries[0]


def trainer_fields(plan: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Extra SFTConfig fields the engine needs inside the worker."""
    engine = plan.get("engine", "trl")
    if engine == "deepspeed":
        path = run_dir / ENGINES["deepspeed"].config_file
        if not path.is_file():
            from launcher.worker.engines.deepspeed import write_config

            write_config(plan, run_dir)
        if world_size(plan) > int(plan.get("num_processes", 1)):
            # each box keeps its own complete checkpoints (with DeepSpeed's node-local storage), as for DDP
            return {"deepspeed": str(path), "save_on_each_node": True}
        return {"deepspeed": str(path)}
    if engine == "ddp":
        # the unused-parameter search costs a graph traversal per step and every LoRA/full parameter is used, except
        # a training vision tower that a text-only micro-batch never calls (DDP then hangs; docs/engines.md, "DDP and
        # FSDP with the vision tower"); trl 1.16 turns it on for a vision model left at None (dpo_trainer.py)
        fields: dict[str, Any] = {"ddp_find_unused_parameters": _tower_trains(run_dir)}
        if world_size(plan) > int(plan.get("num_processes", 1)):
            # each box has its own disk: every node keeps its own checkpoints
            fields["save_on_each_node"] = True
        return fields
    if engine == "fsdp":
        # FSDP2 checkpoints activations itself (accelerate config); the Trainer's on top breaks the sharded backward
        return {"activation_checkpointing": False}
    if plan.get("offload_activations") and plan.get("device") == "cuda":
        # the plan's choice where one card does not hold the job otherwise (trl maybe_activation_offload_context)
        return {"activation_offloading": True}
    return {}


def _tower_trains(run_dir: Path) -> bool:
    """Whether the recipe trains a vision tower: a vision-language model fine-tuned whole, or lora.vision_tower."""
    import yaml

    from launcher.methods import is_adapter
    from launcher.worker.loading import reads_images

    recipe = yaml.safe_load((Path(run_dir) / "recipe.yaml").read_text()) or {}
    if not reads_images(str(recipe.get("model", ""))):
        return False
    return not is_adapter(recipe.get("method", "lora")) or bool((recipe.get("lora") or {}).get("vision_tower"))


def verify(plan: dict[str, Any], trainer: Any) -> dict[str, Any]:
    """Before the first step: is this the planned engine? {"engine", "world_size", "ok", "checks"}."""
    import torch.distributed as dist

    engine = plan.get("engine", "trl")
    expected = world_size(plan)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    checks = [{"check": "world size", "ok": world == expected, "seen": f"{world} process(es), plan {expected}"}]
    if world > 1:
        checks.append(group_timeout_check(trainer.args.ddp_timeout))
    several = engine in ("ddp", "deepspeed", "fsdp")  # each module's checks; one process: ddp.single_checks
    module = importlib.import_module(f"{__name__}.{engine if several else 'ddp'}")
    checks += getattr(module, "checks" if several else "single_checks")(plan, trainer)
    if engine == "unsloth":
        checks += importlib.import_module(f"{__name__}.unsloth").checks(plan, trainer)
    return {"engine": engine, "world_size": world, "ok": all(c["ok"] for c in checks), "checks": checks}


def create_process_group(plan: dict[str, Any], device: str, timeout_s: int) -> None:
    """A multi-process run's process group with the trainer's timeout where a library would make it without: ZeRO-3
    (deepspeed 0.19.8 comm/comm.py default_pg_timeout; accelerate 1.15 state.py PartialState keeps a group that
    exists) and the CPU (transformers 5.24 training_args.py _setup_devices). docs/engines.md, "round three", item 1."""
    import datetime

    import torch.distributed as dist

    if world_size(plan) <= 1 or dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    if plan.get("engine") == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl", timeout=timeout)
    elif device == "cpu":
        dist.init_process_group("gloo", timeout=timeout)


def group_timeout_check(want_s: int) -> dict[str, Any]:
    """The process group's timeout against ddp_timeout (torch 2.13 distributed_c10d.py backend_options)."""
    import torch.distributed as dist

    group = dist.distributed_c10d._get_default_group()
    for device in group._device_types:
        try:
            seen = group._get_backend(device).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):
            continue
        return {
            "check": "process group timeout",
            "ok": seen == want_s,
            "seen": f"{seen:g} s ({dist.get_backend()}), trainer ddp_timeout {want_s} s",
        }
    return {"check": "process group timeout", "ok": True, "seen": f"not readable on this backend (want {want_s} s)"}


def format_verification(v: dict[str, Any]) -> str:
    bad = [c for c in v["checks"] if not c["ok"]]
    if not bad:
        return f"engine {v['engine']} verified: " + "; ".join(f"{c['check']}: {c['seen']}" for c in v["checks"])
    return (
        f"engine {v['engine']} NOT verified: "
        + "; ".join(f"{c['check']}: {c['seen']}" for c in bad)
        + " - refusing to train with another engine than planned"
    )


def loading_context(plan: dict[str, Any], run_dir: Path | None):
    """Around from_pretrained: for ZeRO-3, partition the weights while they load (zero.Init)."""
    import contextlib

    if plan.get("engine") != "deepspeed" or run_dir is None:
        return contextlib.nullcontext()
    from launcher.worker.engines.deepspeed import partitioned_loading

    return partitioned_loading(plan, run_dir)


def resume_compatibility(manifest: dict[str, Any], plan: dict[str, Any]) -> tuple[str, bool]:
    """(message, refused) for resuming a checkpoint written by another engine or process count."""
    old_engine, old_world = manifest.get("engine", "trl"), int(manifest.get("world_size", 1))
    new_engine = plan.get("engine", "trl")
    new_world = world_size(plan)  # the manifest counts every node's processes too
    if (old_engine, old_world) == (new_engine, new_world):
        return "", False
    where = f"checkpoint step {manifest.get('step')} was written by engine {old_engine} on {old_world} process(es)"
    if old_engine in PER_RANK_CHECKPOINTS or new_engine in PER_RANK_CHECKPOINTS:
        if old_engine == new_engine:
            why = (
                f"DeepSpeed ZeRO partitions the optimizer states (and ZeRO-3 the weights) into one file per "
                f"process, and DeepSpeed does not load them on {new_world} process(es)"
            )
        else:
            why = (
                f"a {old_engine} checkpoint and a {new_engine} checkpoint hold the optimizer state in different "
                "layouts (DeepSpeed's global_step folders vs the Trainer's optimizer.pt)"
            )
        return (
            f"{where}; this plan runs {new_engine} on {new_world}: {why}. Resume with engine={old_engine} "
            f"num_processes={old_world}, or start over with --fresh (the adapter/weights of the checkpoint can be "
            "kept by hand: DeepSpeed's zero_to_fp32.py converts the weights, not the optimizer)"
        ), True
    global_note = ""
    if old_world != new_world:
        global_note = (
            f"; each optimizer step now takes {new_world}/{old_world} of the examples it took before, so the run "
            "continues with another global batch (same data order, not step-for-step the same trajectory)"
        )
    return (
        f"{where}, resuming with {new_engine} on {new_world}: the Trainer's checkpoint (adapter or full weights, "
        f"optimizer.pt, scheduler) holds the whole state, so it loads on any count{global_note}"
    ), False


def worker_file(run_dir: Path, mode: str) -> Path:
    return run_dir / "worker.json" if mode == "full" else run_dir / "smoke" / "worker.json"


def failed_verification(worker_json: Path) -> str | None:
    """The error of a worker that refused to train with another engine than planned, else None."""
    import json

    if not worker_json.is_file():
        return None
    try:
        info = json.loads(worker_json.read_text())
    except ValueError:
        return None
    v = info.get("verification")
    if v and not v.get("ok"):
        return info.get("error") or format_verification(v)
    return None


# run by `python -S -c` between the fork and the worker (prctl(2): PR_SET_PDEATHSIG survives execve)
_DEATH_SIGNAL_EXEC = """\
import ctypes, os, sys
sig, parent, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0)
if os.getppid() != parent:
    os.kill(os.getpid(), sig)
    sys.exit(128 + sig)
os.execvp(argv[0], argv)
"""


def with_death_signal(cmd: list[str], sig: int) -> list[str]:
    """`cmd`, started so that it gets `sig` when its starter dies (Linux), not by Popen's preexec_fn (docs/engines.md,
    "The worker's death signal is asked for after the exec")."""
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-S", "-c", _DEATH_SIGNAL_EXEC, str(int(sig)), str(os.getpid()), *cmd]


def die_with_parent(sig: "int | None" = None) -> None:
    """Linux: this process gets `sig` (SIGKILL by default) when its parent dies (no orphaned torchrun rank)."""
    import ctypes
    import signal as _signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    libc.prctl(1, int(sig or _signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
