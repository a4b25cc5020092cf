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
    # torchrun starts exactly n processes (accelerate's `--cpu --num_processes n` silently starts
    # one); each worker checks WORLD_SIZE and the process group against the plan.
    nodes = (plan or {}).get("nodes")
    if nodes and int(nodes.get("nnodes", 1)) > 1:
        # Several boxes: static rendezvous at node 0's address; every node runs the same command
        # with its own --node-rank.
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
    """The worker's argv for this plan: an argument list, never a shell string built from recipe values.

    Writes the engine's config file (DeepSpeed JSON, accelerate FSDP YAML) into the run directory
    first, generated from the plan, so the command and its files always agree.
    """
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


# torch's caching-allocator settings, by every name torch reads them from. torch 2.13 reads the first of
# PYTORCH_CUDA_ALLOC_CONF, PYTORCH_HIP_ALLOC_CONF, PYTORCH_ALLOC_CONF that is set (c10/cuda/CUDAAllocatorConfig.h
# CUDAAllocatorConfig::instance, the strings in libc10.so); torch 2.9-2.11 read PYTORCH_ALLOC_CONF first and the CUDA
# name as its deprecated alias (c10/core/AllocatorConfig.cpp AcceleratorAllocatorConfig::instance,
# C10_ALLOCATOR_CONFIG_PARSE_ENV). Both read PYTORCH_ALLOC_CONF, and with any of the three set its value is the user's.
ALLOCATOR_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
# Segments that grow in place (cuMemMap) instead of a new cudaMalloc per size: a micro-batch of a new length reuses
# the address range the last one freed, so variable-length steps do not strand cached blocks (the H200's padding step
# reserved 29.9 GB where 23.3 were sized: docs/sizing.md, "Padding-free micro-batches"), which is what torch's own
# out-of-memory message recommends.
EXPANDABLE_SEGMENTS = "expandable_segments:True"
# A CPU worker's OpenMP threads sleep while they wait for work rather than spin (libgomp's OMP_WAIT_POLICY, which
# torch's CPU build reads). Spinning, torch's threads on a box whose cores other processes also use wait on a thread
# the kernel descheduled: the tiny model's 16 answers of 16 tokens (transformers' generate) took 1.2-4.8 s with 2
# threads at a load of 6 on 2 cores, 0.22-0.38 s passive and 0.16-0.30 s on one thread (2026-12-06). The smoke test
# then priced the demo's GRPO step at 0.13-4.5 s where its full runs took 0.37-1.1 s (scripts/grpo_eta.py): forecasts
# of -87% and +407%; passive, -51% to +16% at loads of 8-13.
# Numerics do not change (the tests have run passive since docs/BENCHMARKS.md, "OpenMP threads spun").
CPU_WAIT_ENV, CPU_WAIT_POLICY = "OMP_WAIT_POLICY", "PASSIVE"


def launch_env(plan: dict[str, Any], grace_seconds: float | None = None, vllm: bool = False) -> dict[str, str]:
    """Environment for the launched worker(s): CPU threads split between processes; a single-process engine
    shown only its own card; NCCL's P2P and InfiniBand off on RTX 40-series cards with an old driver; torch's
    allocator with expandable segments on a GPU. A variable the user set is kept. `vllm`: the run generates with
    vLLM, whose sleep mode's memory pool refuses expandable segments (vllm/device_allocator/cumem.py CuMemAllocator
    asserts it; pytorch issue 147851): left to vLLM."""
    n = int(plan.get("num_processes", 1))
    env: dict[str, str] = {}
    if plan.get("device") == "cuda" and not vllm and not any(v in os.environ for v in ALLOCATOR_ENV):
        env["PYTORCH_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
    if plan.get("device") == "cpu" and CPU_WAIT_ENV not in os.environ:
        env[CPU_WAIT_ENV] = CPU_WAIT_POLICY
    if n > 1 and "OMP_NUM_THREADS" not in os.environ:
        # The box's cores shared out between its processes, on CPU and on GPU boxes alike. torchrun and
        # accelerate launch set OMP_NUM_THREADS=1 for 2+ processes when it is unset (torch 2.13
        # torch/distributed/run.py config_from_args: "Setting OMP_NUM_THREADS environment variable for each process
        # to be 1 in default"; accelerate 1.15 commands/launch.py _validate_launch_command takes
        # num_cpu_threads_per_process from OMP_NUM_THREADS, default 1 off CPU, and utils/launch.py
        # prepare_multi_gpu_env exports it as OMP_NUM_THREADS to every rank), which leaves QLoRA+FSDP's CPU quantization
        # of a 70B model on one thread per rank, about
        # cores/n times slower than the plan (throughput.load_seconds counts threads_per_process x n). Unset, every
        # process would use every core on a CPU box: oversubscribed, about 10x slower.
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
            # accelerate 1.15 state.py PartialState.__init__ raises NotImplementedError in the worker
            # itself (transformers training_args.py _setup_devices builds one under torchrun too) unless
            # both variables exist; only `accelerate launch` sets them (commands/launch.py
            # multi_gpu_launcher). Its test counts every card nvidia-smi lists, not the visible ones, so
            # one process on one card of a 2-card box is stopped as well: set them for every CUDA engine
            # (only NCCL acts on them, so a single process loses nothing).
            for var in ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE"):
                if var not in os.environ:
                    env[var] = "1"
    if grace_seconds is not None and plan.get("engine") in MULTI_PROCESS:
        # The launcher's own wait between forwarding a SIGTERM and SIGKILLing the ranks, default 30 s: a
        # checkpoint taking longer was cut off although grace_seconds allowed more. torch 2.12 and 2.13
        # (2.13.0 is the image's and the tests'; docker/requirements*.txt) read it: torch/distributed/
        # launcher/api.py LaunchConfig.__post_init__ takes TORCH_ELASTIC_SHUTDOWN_TIMEOUT when torchrun's
        # --shutdown-timeout (run.py, new in 2.12) is not given, and SimpleElasticAgent.run passes it to
        # PContext.close. torch 2.11 has neither: no variable, no option (torchrun exits 2 on
        # "unrecognized arguments: --shutdown-timeout"), a fixed 30 s (elastic/agent/server/
        # local_elastic_agent.py:416 `self._pcontext.close(death_sig)`, multiprocessing/api.py:1007
        # SubprocessContext._close `timeout: int = 30`); there only the supervisor's SIGTERM straight to
        # the ranks keeps grace_seconds. Hence the variable, never the option. accelerate launch (fsdp)
        # builds the same LaunchConfig (commands/launch.py multi_gpu_launcher -> torch.distributed.run.run).
        # A margin above grace_seconds: the supervisor's own deadline is the one that binds.
        env[LAUNCHER_SHUTDOWN_TIMEOUT_ENV] = str(math.ceil(grace_seconds) + LAUNCHER_SHUTDOWN_MARGIN_S)
    return env


def planned_device(visible: str | None) -> str | None:
    """CUDA_VISIBLE_DEVICES for a one-process engine (trl, unsloth): the card it was planned on, alone; None where
    the process already sees one card (or none).

    Why: with one process and several visible cards transformers sets n_gpu to torch.cuda.device_count()
    (transformers 5.24 training_args.py _setup_devices, the DistributedType.NO branch), multiplies the batch by
    it (train_batch_size) and wraps every model that is not 4/8-bit in nn.DataParallel (trainer.py _wrap_model):
    an n x global batch with fewer steps than planned, a wrong learning-rate schedule, ETA and cost, peak memory
    read on cuda:0 only. The plan sizes one card, the first that CUDA enumerates (launcher/plan/hardware.py
    detect, in CUDA_VISIBLE_DEVICES' order when it is set); the worker checks `n_gpu == 1` (engines/ddp.py
    single_checks). The entry is kept as the user wrote it (an index or a GPU-/MIG- UUID), so it names the same
    card under the same CUDA_DEVICE_ORDER."""
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
        # Every LoRA/full parameter takes part in each forward: the unused-parameter search the Trainer turns on by
        # default costs an extra graph traversal per step. Not so for a vision tower that trains: a micro-batch
        # without images never calls it, and DDP waits for its gradients' all-reduce on the other ranks forever
        # (2 gloo processes hung at step 0 on data mixing text-only examples, 2026-12-06); trl 1.16 turns the search
        # on for a vision model left at None (dpo_trainer.py), which this field would otherwise override.
        fields: dict[str, Any] = {"ddp_find_unused_parameters": _tower_trains(run_dir)}
        if world_size(plan) > int(plan.get("num_processes", 1)):
            # Each box has its own disk: every node keeps its own checkpoints, so any node can resume.
            fields["save_on_each_node"] = True
        return fields
    if engine == "fsdp":
        # FSDP2 checkpoints activations itself (fsdp_activation_checkpointing in the accelerate
        # config); the Trainer's own checkpointing on top of it breaks the sharded backward.
        return {"activation_checkpointing": False}
    if plan.get("offload_activations") and plan.get("device") == "cuda":
        # the plan's choice where one card does not hold the job otherwise (launcher/plan/engine.py); SFTTrainer wraps
        # every forward in trl's OffloadActivations (sft_trainer.py: maybe_activation_offload_context)
        return {"activation_offloading": True}
    return {}


def _tower_trains(run_dir: Path) -> bool:
    """Whether the run's recipe trains a vision tower: a vision-language model fine-tuned whole, or with
    lora.vision_tower."""
    import yaml

    from launcher.methods import is_adapter
    from launcher.worker.loading import reads_images

    recipe = yaml.safe_load((Path(run_dir) / "recipe.yaml").read_text()) or {}
    if not reads_images(str(recipe.get("model", ""))):
        return False
    return not is_adapter(recipe.get("method", "lora")) or bool((recipe.get("lora") or {}).get("vision_tower"))


def verify(plan: dict[str, Any], trainer: Any) -> dict[str, Any]:
    """After the trainer wrapped the model, before the first step: is this the planned engine?

    Returns {"engine", "world_size", "ok", "checks": [{"check", "ok", "seen"}]}; the worker aborts
    when ok is False.
    """
    import torch.distributed as dist

    engine = plan.get("engine", "trl")
    expected = world_size(plan)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    checks = [{"check": "world size", "ok": world == expected, "seen": f"{world} process(es), plan {expected}"}]
    if world > 1:
        checks.append(group_timeout_check(trainer.args.ddp_timeout))
    if engine in ("ddp",):
        from launcher.worker.engines.ddp import checks as engine_checks
    elif engine == "deepspeed":
        from launcher.worker.engines.deepspeed import checks as engine_checks
    elif engine == "fsdp":
        from launcher.worker.engines.fsdp import checks as engine_checks
    else:
        from launcher.worker.engines.ddp import single_checks as engine_checks
    checks += engine_checks(plan, trainer)
    if engine == "unsloth":
        # A plan saying unsloth must never train with plain TRL: Unsloth imported, its patched forwards in the model.
        from launcher.worker.engines.unsloth import checks as unsloth_checks

        checks += unsloth_checks(plan, trainer)
    return {"engine": engine, "world_size": world, "ok": all(c["ok"] for c in checks), "checks": checks}


def create_process_group(plan: dict[str, Any], device: str, timeout_s: int) -> None:
    """A multi-process run's process group, made by the worker with the trainer's timeout (SFTConfig ddp_timeout,
    launcher/worker/trainer_config.py process_group_seconds) where a library would otherwise make it without:
    - ZeRO-3: DeepSpeed's init_distributed, called before the trainer by partitioned_loading (zero.Init needs the
      group), takes its default_pg_timeout, 10 minutes (deepspeed 0.19.8 constants.py, comm/comm.py), and
      accelerate keeps a group that exists (accelerate 1.15 state.py PartialState: `if not dist.is_initialized()`).
      A ZeRO-3 save longer than that (rank 0 gathers the 16-bit model while the others wait in the barrier) ended
      in NCCL's watchdog abort, whatever the plan's deadlines;
    - the CPU: transformers 5.24 TrainingArguments._setup_devices passes no timeout on its use_cpu path
      (training_args.py), so gloo's 30 minutes held.
    DDP and FSDP on a GPU keep accelerate's own group, which gets ddp_timeout (training_args.py's other branch).
    Both made here are what those libraries would make (env:// from torchrun's variables); they wrap it."""
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
    """The process group's own timeout against the trainer's ddp_timeout: whoever created the group (accelerate,
    or DeepSpeed's init_distributed under ZeRO-3, which accelerate then keeps) gave it the plan's value, so the
    watchdog's deadlines, not a library default, decide when a waiting rank gives up. Read where torch 2.13 keeps
    it (distributed_c10d.py new_group: backend_options._timeout, the backend's options for gloo and NCCL alike);
    where no backend shows it, said and not refused."""
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
    global_note = (
        (
            "; each optimizer step now takes "
            f"{new_world}/{old_world} of the examples it took before, so the run continues with another global "
            "batch (same data order, not step-for-step the same trajectory)"
        )
        if old_world != new_world
        else ""
    )
    return (
        f"{where}, resuming with {new_engine} on {new_world}: the Trainer's checkpoint (adapter or full weights, "
        f"optimizer.pt, scheduler) holds the whole state, so it loads on any count{global_note}"
    ), False


def worker_file(run_dir: Path, mode: str) -> Path:
    return run_dir / "worker.json" if mode == "full" else run_dir / "smoke" / "worker.json"


def failed_verification(worker_json: Path) -> str | None:
    """The error of a worker that refused to train with another engine than planned, else None.

    torchrun reports any failed worker as exit code 1, so the reason is read from worker.json.
    """
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


# Run by `python -S -c` between the supervisor's fork and the worker: ask for the signal, check the parent is still the
# one that started it (a parent that died before prctl sends nothing), then exec the worker, which keeps the pid and
# the death signal (prctl(2): PR_SET_PDEATHSIG survives execve).
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
    """`cmd`, started so that it gets `sig` when the process that starts it dies (Linux; elsewhere `cmd` itself).

    Why not Popen's preexec_fn=die_with_parent: it runs Python in the forked child of a process with threads (the
    supervisor's copier, its stderr reader), and Python's docs warn that the child can deadlock before exec. It did:
    a supervisor's child hung in a futex, never exec'd, and the run stayed 'running' with no worker (the kill series
    on a busy box, 2026-12-02; ctypes.CDLL takes the dynamic loader's lock, which another thread can hold at the
    fork). The child now execs at once into this small program, which asks for the signal in a fresh process."""
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-S", "-c", _DEATH_SIGNAL_EXEC, str(int(sig)), str(os.getpid()), *cmd]


def die_with_parent(sig: "int | None" = None) -> None:
    """Linux: this process gets `sig` (SIGKILL by default) when its parent dies.

    torchrun's ranks are not in the supervisor's process group and outlive a killed launcher; an
    orphaned rank would keep training into the run directory beside the resumed run. The single-process
    worker asks for SIGTERM instead: it saves a checkpoint and exits (launcher/run/supervisor.py).
    """
    import ctypes
    import signal as _signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, int(sig or _signal.SIGKILL), 0, 0, 0)
