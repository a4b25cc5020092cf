"""The launch's environment on the box (issue 21 items 1, 2, 5): a single-process engine's Trainer counts one GPU,
each rank of a multi-process launch gets its share of the cores, and two FSDP launches at once each rendezvous on
a port of their own. Real launchers (torchrun, accelerate launch), the environment `launch_env` gives the worker."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

from gpu_check.common import Context, child_env, has

_N_GPU = """
import json, torch
from transformers import TrainingArguments
args = TrainingArguments(output_dir={out!r}, per_device_train_batch_size=2, report_to=[])
print(json.dumps({{"n_gpu": args.n_gpu, "train_batch_size": args.train_batch_size,
                  "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0}}))
"""

# One os.write per line: under PYTHONUNBUFFERED=1 (set above in scripts/gpu_check.sh) print() writes its pieces one
# by one and two ranks' pieces interleave in the shared pipe (tests/worker/test_launch_env.py); a pipe write under
# PIPE_BUF bytes is never split.
_THREADS = (
    "import os, torch\nos.write(1, f\"RANK {os.environ['RANK']} {os.environ.get('OMP_NUM_THREADS')} "
    '{torch.get_num_threads()}\\n".encode())\n'
)

# Each probe that makes a process group ends through leave_rank (launcher/worker/process.py: no interpreter teardown).
_PORT = (
    "import os, torch.distributed as dist\nfrom launcher.worker.process import leave_rank\n"
    "dist.init_process_group('gloo'); dist.barrier()\n"
    "os.write(1, f\"PORT {os.environ['MASTER_PORT']}\\n\".encode())\ndist.destroy_process_group()\nleave_rank(0)\n"
)

# The worker's order (launcher/worker/train.py): its own process group where a library would make one without the
# trainer's timeout, then TrainingArguments' (accelerate's), then the check that reads the group's timeout back.
_GROUP = """
import json, sys
from transformers import TrainingArguments
from launcher.worker.engines import create_process_group, group_timeout_check
device, engine, want = sys.argv[1], sys.argv[2], int(sys.argv[3])
create_process_group({{"engine": engine, "num_processes": 2}}, device, want)
args = TrainingArguments(output_dir={out!r}, ddp_timeout=want, use_cpu=device == "cpu", report_to=[])
args.device  # accelerate's PartialState: its init_process_group, or the group that exists
print(json.dumps(group_timeout_check(want)), flush=True)
import torch.distributed as dist
from launcher.worker.process import leave_rank
dist.destroy_process_group()
leave_rank(0)
"""


def _last_json(text: str) -> dict[str, Any]:
    return json.loads(text.strip().splitlines()[-1])


def _n_gpu(ctx: Context) -> dict[str, Any]:
    """TrainingArguments in a child with the environment a trl plan launches with, and without it."""
    from launcher.worker.engines import launch_env

    plan = {"device": ctx.device, "engine": "trl", "num_processes": 1, "hardware": {"gpus": []}}
    env = launch_env(plan)
    code = _N_GPU.format(out=str(ctx.work / "n-gpu"))
    bare = child_env()
    bare.pop("CUDA_VISIBLE_DEVICES", None) if ctx.device == "cuda" else None
    seen = {}
    for name, extra in (("without", {}), ("launched", env)):
        done = subprocess.run(
            [sys.executable, "-c", code], env={**bare, **extra}, capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            return {"ok": False, "error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
        seen[name] = _last_json(done.stdout)
    want = 1 if ctx.device == "cuda" else 0
    return {
        "ok": seen["launched"]["n_gpu"] == want and seen["launched"]["train_batch_size"] == 2,
        "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        **seen,
    }


def _threads(ctx: Context) -> dict[str, Any]:
    """Two torchrun ranks launched with launch_env's environment: each one's OMP_NUM_THREADS and torch's threads."""
    from launcher.plan.hardware import cpu_cores, threads_per_process
    from launcher.worker.engines import launch_env

    probe = ctx.work / "threads_probe.py"
    probe.write_text(_THREADS)
    env = {k: v for k, v in child_env().items() if k != "OMP_NUM_THREADS"}
    env.update(launch_env({"device": ctx.device, "engine": "ddp", "num_processes": 2, "hardware": {"gpus": []}}))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(probe)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    rows = sorted(m.split()[1:] for m in re.findall(r"RANK \d+ \S+ \d+\n", done.stdout))  # whole lines
    want = str(threads_per_process(cpu_cores(), 2))
    return {
        "ok": done.returncode == 0 and rows == [["0", want, want], ["1", want, want]],
        "cores": cpu_cores(),
        "expected_threads": int(want),
        "ranks": rows,
    }


def _ports(ctx: Context) -> dict[str, Any]:
    """The generated accelerate FSDP config launched twice at the same moment: two different free ports."""
    import yaml

    from launcher.worker.engines.fsdp import accelerate_config

    cfg = ctx.work / "ports_fsdp.yaml"
    cfg.write_text(yaml.safe_dump(accelerate_config({"num_processes": 2, "device": "cpu"}, False)))
    probe = ctx.work / "ports_probe.py"
    probe.write_text(_PORT)
    env = child_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # the rendezvous is the point, not the cards
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg), str(probe)]
    jobs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for _ in range(2)
    ]
    outs = [job.communicate(timeout=180)[0] for job in jobs]
    counts = [len(re.findall(r"PORT \d+\n", out)) for out in outs]
    ports = [sorted(set(re.findall(r"PORT (\d+)\n", out))) for out in outs]  # whole lines (one os.write each)
    ok = (
        all(job.returncode == 0 for job in jobs)
        and counts == [2, 2]
        and all(len(p) == 1 for p in ports)
        and ports[0] != ports[1]
        and ["29500"] not in ports
    )
    out = {"ok": ok, "ports": ports, "exits": [job.returncode for job in jobs]}
    if not ok:
        out["tail"] = [o.strip().splitlines()[-1:] for o in outs]
    return out


def _group_timeout(ctx: Context) -> dict[str, Any]:
    """The process group's timeout as the worker makes it, read back from the group (issue 32 item 1): DDP and FSDP
    through accelerate on NCCL, ZeRO-3 through DeepSpeed's init_distributed where DeepSpeed is installed (on a GPU
    only: on the CPU DeepSpeed JIT-builds its shared-memory op first, minutes on 2 cores, and the slow tier covers
    it, tests/worker/test_engines.py). One rank (WORLD_SIZE=1): the group's options are the point, not a
    collective."""
    import socket

    seen = {}
    for engine in ["ddp"] + (["deepspeed"] if has("deepspeed") and ctx.device == "cuda" else []):
        with socket.socket() as s:  # a port of its own each: the previous store's may still be in TIME_WAIT
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        env = child_env(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port
        )
        done = subprocess.run(
            [sys.executable, "-c", _GROUP.format(out=str(ctx.work / "group")), ctx.device, engine, "1234"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        seen[engine] = (
            _last_json(done.stdout)
            if done.returncode == 0
            else {"ok": False, "seen": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
        )
    return {"ok": all(v["ok"] and "not readable" not in v["seen"] for v in seen.values()), **seen}


# On the CPU the slow tier runs these two probes themselves (tests/worker/test_launch_env.py
# test_torchrun_keeps_the_launchs_thread_count: _threads with a GPU plan's environment, and
# test_two_fsdp_launches_at_once_each_get_a_free_port: _ports); the dry run would launch the same torchrun ranks and
# accelerate jobs again (the step: 34.7 CPU s with them, 21.1 without, 2026-12-06). A GPU runs both.
IN_THE_SLOW_TIER = (
    "on the CPU the slow tier runs this probe (tests/worker/test_launch_env.py, {test}); the GPU runs it here"
)


def step_launch_env(ctx: Context) -> dict[str, Any]:
    if not has("transformers"):
        return {"ok": None, "skipped": "transformers not installed", "line": "skipped: transformers missing"}
    result: dict[str, Any] = {"n_gpu": _n_gpu(ctx)}
    ctx.progress(**result)
    if ctx.dry_run:
        why = IN_THE_SLOW_TIER.format(test="test_torchrun_keeps_the_launchs_thread_count")
        result["threads"] = {"ok": None, "skipped": why}
    else:
        result["threads"] = _threads(ctx)
    ctx.progress(**result)
    if ctx.dry_run:
        why = IN_THE_SLOW_TIER.format(test="test_two_fsdp_launches_at_once_each_get_a_free_port")
        result["ports"] = {"ok": None, "skipped": why}
    elif has("accelerate") and has("yaml"):
        result["ports"] = _ports(ctx)
    else:
        result["ports"] = {"ok": None, "skipped": "accelerate"}
    ctx.progress(**result)
    result["group_timeout"] = _group_timeout(ctx) if has("accelerate") else {"ok": None, "skipped": "accelerate"}
    oks = [part.get("ok") for part in result.values()]
    n, t, p = result["n_gpu"], result["threads"], result["ports"]
    threads = (
        f"threads per rank {[r[2] for r in t.get('ranks', [])]} of {t.get('cores')} cores"
        if "skipped" not in t
        else "threads per rank: in the slow tier"
    )
    ports = (
        f"two FSDP launches on ports {p['ports']}"
        if "ports" in p
        else "two FSDP launches: in the slow tier"
        if ctx.dry_run
        else f"two FSDP launches: skipped ({p.get('skipped')})"
    )
    line = (
        f"single process: n_gpu {n.get('launched', {}).get('n_gpu', '?')} (without the launch's "
        f"CUDA_VISIBLE_DEVICES: {n.get('without', {}).get('n_gpu', '?')}); {threads}; {ports}; process group timeout "
        f"{ {k: v['seen'] for k, v in result['group_timeout'].items() if isinstance(v, dict)} or 'skipped' }"
    )
    return {
        **result,
        "ok": all(ok is not False for ok in oks),
        "line": line,
        "omp_env": os.environ.get("OMP_NUM_THREADS"),
    }
