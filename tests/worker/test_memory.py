"""The worker's memory (launcher/worker/memory.py): out-of-memory classification, peak measurement per rank and over
ranks, the --memory-limit cap on each rank's own device.

CUDA-only choices are tested with torch.cuda's queries replaced (this box has no GPU); the maximum over ranks
runs for real in two gloo processes; the classification uses real exception objects of the classes torch raises,
with the texts torch, NCCL and the CPU allocator produce (launcher/worker/memory.py's docstring says where each is
from).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from launcher.worker import memory
from launcher.plan.sizing_constants import GB

NCCL_HEAD = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled cuda error "
    "(run with NCCL_DEBUG=INFO for details), NCCL version 2.26.2\n"
)


def _accelerator_error(text: str, code: int) -> BaseException:
    # as torch/csrc/Exceptions.cpp's _new_accelerator_error_object builds it from c10::AcceleratorError
    exc = torch.AcceleratorError(text)
    exc.error_code = code
    return exc


OUT_OF_MEMORY = {
    "caching allocator": torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 23.55 GiB of which "
        "1.02 GiB is free. Including non-PyTorch memory, this process has 22.52 GiB memory in use."
    ),
    "CUDA runtime call": _accelerator_error(
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call, "
        "so the stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n",
        2,
    ),
    "cuBLAS handle": RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    "NCCL device buffer": dist.DistBackendError(
        NCCL_HEAD + "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n"
        "Failed to CUDA calloc async 4 bytes"
    ),
    "NCCL cuda failure": dist.DistBackendError(
        NCCL_HEAD + "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 2 'out of memory'"
    ),
    "NCCL host buffer": dist.DistBackendError(
        NCCL_HEAD.replace("unhandled cuda error", "unhandled system error") + "ncclSystemError: System call (e.g. "
        "socket, malloc) or external library call failed or device error. \nLast error:\nFailed to malloc 8388608 bytes"
    ),
    "Triton kernel": RuntimeError("Triton Error [CUDA]: out of memory"),
    "CPU allocator": RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 1073741824 bytes. Error code 12 (Cannot allocate memory)"
    ),
    "Python": MemoryError(),
}

NOT_OUT_OF_MEMORY = {
    "illegal access": _accelerator_error("CUDA error: an illegal memory access was encountered\n", 700),
    "device assert": _accelerator_error("CUDA error: device-side assert triggered\n", 710),
    "NCCL other CUDA failure": dist.DistBackendError(
        NCCL_HEAD + "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n"
        "Cuda failure 800 'operation not permitted'"
    ),
    "NCCL without a last error": dist.DistBackendError(
        NCCL_HEAD + "ncclUnhandledCudaError: Call to CUDA function failed."
    ),
    "NCCL peer gone": dist.DistBackendError(
        NCCL_HEAD + "ncclRemoteError: A call failed possibly due to a network "
        "error or a remote process exiting prematurely."
    ),
    "bitsandbytes cublasLt": RuntimeError("cublasLt ran into an error!\n\tshapeA=(4, 64), shapeB=(64, 64)"),
    "cuBLAS other status": RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx(...)`"),
    "devices": RuntimeError("Expected all tensors to be on the same device, but found at least two devices"),
    "not a RuntimeError": ValueError("the text says out of memory, but a ValueError is not an allocator's"),
}


@pytest.mark.parametrize("name", OUT_OF_MEMORY)
def test_out_of_memory_of_every_source_is_recognised(name):
    assert memory.is_out_of_memory(OUT_OF_MEMORY[name])


@pytest.mark.parametrize("name", NOT_OUT_OF_MEMORY)
def test_other_failures_are_not_out_of_memory(name):
    assert not memory.is_out_of_memory(NOT_OUT_OF_MEMORY[name])


def _raised(make):
    try:
        make()
    except BaseException as exc:  # noqa: BLE001 - the test wants the exception object as Python chains it
        return exc
    raise AssertionError("nothing raised")


def test_out_of_memory_is_found_down_the_chain_and_named_in_the_message():
    def nccl_oom():
        raise OUT_OF_MEMORY["NCCL cuda failure"]

    def wrapped():  # explicit cause, as accelerate/DeepSpeed re-raise
        try:
            nccl_oom()
        except RuntimeError as exc:
            raise RuntimeError("collective failed while preparing the model") from exc

    def during():  # implicit context: another error while handling the out-of-memory
        try:
            wrapped()
        except RuntimeError:
            raise KeyError("cleanup failed")

    for make in (wrapped, during):
        assert memory.is_out_of_memory(_raised(make))
    assert (
        memory.out_of_memory_text(_raised(wrapped))
        == "Cuda failure 2 'out of memory' [raised as: collective failed while preparing the model]"
    )
    # NCCL's first line says only "unhandled cuda error": the line that says out of memory comes first
    text = memory.out_of_memory_text(OUT_OF_MEMORY["NCCL device buffer"])
    assert text.startswith("Failed to CUDA calloc async 4 bytes [raised as: NCCL error in: ")
    assert memory.out_of_memory_text(OUT_OF_MEMORY["caching allocator"]).startswith("CUDA out of memory. Tried")
    assert memory.out_of_memory_text(MemoryError()) == "out of memory"

    def unrelated_chain():
        try:
            raise NOT_OUT_OF_MEMORY["illegal access"]
        except RuntimeError as exc:
            raise RuntimeError("step failed") from exc

    assert not memory.is_out_of_memory(_raised(unrelated_chain))
    looped = RuntimeError("a cycle")
    looped.__context__ = RuntimeError("back")
    looped.__context__.__context__ = looped
    assert not memory.is_out_of_memory(looped)


# --- CUDA queries replaced: the arithmetic and the device each call is about --------------------------


class _FakeCuda:
    """torch.cuda's memory queries, answering for one device and recording which device each call named."""

    def __init__(self, total, free, reserved, max_reserved):
        self.values = dict(total=total, free=free, reserved=reserved, max_reserved=max_reserved)
        self.devices: list[tuple[str, object]] = []

    def install(self, monkeypatch):
        v = self.values

        def record(name, result):
            def call(device=None, *args, **kwargs):
                self.devices.append((name, kwargs.get("device", device)))
                return result() if callable(result) else result

            return call

        monkeypatch.setattr(torch.cuda, "mem_get_info", record("mem_get_info", (v["free"], v["total"])))
        monkeypatch.setattr(torch.cuda, "memory_reserved", record("memory_reserved", v["reserved"]))
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", record("max_memory_reserved", v["max_reserved"]))
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", record("reset_peak_memory_stats", None))
        monkeypatch.setattr(
            torch.cuda,
            "get_device_properties",
            record("get_device_properties", type("Props", (), {"total_memory": v["total"]})),
        )
        fractions = []

        def set_fraction(fraction, device=None):
            fractions.append((fraction, device))

        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
        return fractions


def test_cuda_peak_adds_what_lives_outside_the_allocator_on_this_ranks_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    # an 80 GB card (GB = 2**30 bytes, sizing_constants.GB): 50 GB free, the allocator holds 28 GB now and held 29.5 GB
    # at its peak; the other 2 GB in use are the CUDA context and NCCL's buffers
    fake = _FakeCuda(total=80 * GB, free=50 * GB, reserved=28 * GB, max_reserved=29.5 * GB)
    fake.install(monkeypatch)
    assert memory.peak_memory_gb("cuda") == pytest.approx(31.5)
    assert {name for name, _ in fake.devices} == {"mem_get_info", "memory_reserved", "max_memory_reserved"}
    assert {device for _, device in fake.devices} == {3}  # never the default device

    # the allocator released memory between the queries (free grew): nothing outside, never negative
    _FakeCuda(total=80 * GB, free=55 * GB, reserved=28 * GB, max_reserved=29.5 * GB).install(monkeypatch)
    assert memory.peak_memory_gb("cuda") == pytest.approx(29.5)

    fake = _FakeCuda(total=80 * GB, free=50 * GB, reserved=28 * GB, max_reserved=29.5 * GB)
    fake.install(monkeypatch)
    memory.reset_peak("cuda")
    assert fake.devices == [("reset_peak_memory_stats", 3)]


def test_cuda_cap_applies_to_this_ranks_own_gpu(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "1")
    fake = _FakeCuda(total=80 * GB, free=79 * GB, reserved=0, max_reserved=0)
    fractions = fake.install(monkeypatch)
    memory.cap_memory("cuda", 20.0)
    assert fractions == [(0.25, 1)] and isinstance(fractions[0][0], float)  # torch refuses a non-float
    assert fake.devices == [("get_device_properties", 1)]
    assert "memory limited to 20 GB (GPU fraction of cuda:1)" in capsys.readouterr().out
    memory.cap_memory("cuda", 100.0)  # above the card: the whole card, not an invalid fraction
    assert fractions[-1] == (1.0, 1)


def test_oom_peak_is_unknown_when_the_device_no_longer_answers(monkeypatch, capsys):
    def broken(device=None):
        raise _accelerator_error("CUDA error: an illegal memory access was encountered\n", 700)

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    assert memory.out_of_memory_peak_gb("cuda") is None
    assert (
        "peak memory not measurable after the failure: CUDA error: an illegal memory access" in capsys.readouterr().out
    )


def test_cpu_peak_is_the_resident_peak_and_the_oom_peak_counts_from_the_cap(monkeypatch):
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB  # GB = 2**30 bytes, as memory.py counts
    assert memory.peak_memory_gb("cpu") == pytest.approx(rss, abs=0.05)
    assert memory.peak_memory_over_ranks_gb("cpu") == pytest.approx(rss, abs=0.05)  # no process group: this one
    monkeypatch.setattr(memory, "_CAPPED_BASE_RSS", [int(rss * GB) - int(0.1 * GB)])
    assert memory.out_of_memory_peak_gb("cpu") == pytest.approx(0.1, abs=0.05)


# --- the maximum over ranks, two real gloo processes ---------------------------------------------------


def _rank_peak(rank: int, world: int, init_file: str, out_dir: str, extra_mb: int) -> None:
    torch.set_num_threads(1)  # a forked child must not reuse the parent's OpenMP pool (as DataLoader workers do)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        if extra_mb:  # this rank's peak resident memory rises by about extra_mb (the pages are written)
            block = torch.ones(extra_mb * 1024 * 1024 // 4, dtype=torch.float32)
            del block
        own = memory.peak_memory_gb("cpu")
        reported = memory.peak_memory_over_ranks_gb("cpu")
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"own": own, "reported": reported}))
    finally:
        dist.destroy_process_group()


def test_peak_is_the_largest_over_ranks_with_two_gloo_processes(tmp_path):
    # forked: the ranks inherit the imported torch (a fresh interpreter would spend most of the test importing
    # it again); each still has its own process, memory and gloo connection
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_rank_peak, args=(rank, 2, str(tmp_path / "init"), str(tmp_path), 300 if rank == 1 else 0))
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r1["own"] > r0["own"] + 0.2  # rank 1 really held 300 MB more
    assert r0["reported"] == r1["reported"] == pytest.approx(max(r0["own"], r1["own"]), abs=0.01)


# --- the worker: an out-of-memory that is not torch.OutOfMemoryError takes the OOM path ------------------

# Prepended to PYTHONPATH for these runs only: once transformers.trainer is imported, the Trainer's second
# training step raises what NCCL's allocation failure raises on a GPU box (a DistBackendError, not an
# OutOfMemoryError), in every worker process or only in the rank FTRUN_TEST_OOM_RANK names.
NCCL_OOM_HOOK = """
import importlib.abc
import importlib.machinery
import os
import sys

_ONLY_RANK = os.environ.get("FTRUN_TEST_OOM_RANK")


def _patch(module):
    original = module.Trainer.training_step
    calls = []

    def training_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2 and _ONLY_RANK in (None, os.environ.get("RANK", "0")):
            import torch.distributed as dist

            raise dist.DistBackendError(%r)
        return original(self, *args, **kwargs)

    module.Trainer.training_step = training_step


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "transformers.trainer":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
""" % (NCCL_HEAD + "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 2 'out of memory'")


@pytest.mark.slow
def test_nccl_out_of_memory_stops_the_smoke_test_and_the_run_as_out_of_memory_not_as_a_crash(write_recipe, tmp_path):
    import subprocess

    from conftest import REPO

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(NCCL_OOM_HOOK)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hook), str(REPO)]), HF_HUB_OFFLINE="1")

    def ftrun(*args, **extra_env):
        return subprocess.run(
            [sys.executable, "-m", "launcher.cli", *map(str, args)],
            cwd=tmp_path,
            env={**env, **extra_env},
            capture_output=True,
            text=True,
            timeout=600,
        )

    # the smoke test: exit 78 and oom.json, so the pipeline treats it as out of memory (here with nothing to
    # adjust, it stops and lists the attempt) rather than as a worker crash
    recipe = write_recipe("smoke.yaml", output_dir=str(tmp_path / "smoke"), auto_adjust=[], max_steps=6)
    res = ftrun("smoke", recipe)
    assert res.returncode == 4, res.stdout + res.stderr
    assert "ran out of memory and nothing the recipe allows (auto_adjust: [])" in res.stderr
    oom = json.loads((tmp_path / "smoke" / "smoke" / "oom.json").read_text())
    assert oom["step"] == 2 and oom["error"].startswith("Cuda failure 2 'out of memory' [raised as: NCCL error in:")
    assert oom["peak_memory_gb"] > 0.1  # the worker's resident peak, measured after the failure

    # the full run: the supervisor reports out of memory and does not restart into the same failure
    recipe = write_recipe("run.yaml", output_dir=str(tmp_path / "run"), max_steps=6, max_restarts=2)
    res = ftrun(recipe, "--foreground", "smoke.enabled=false")
    assert res.returncode != 0, res.stdout + res.stderr
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert state["state"] == "failed" and state.get("restarts", 0) == 0, state
    assert (
        state["reason"].startswith("out of memory at step 2 (peak ")
        and "Cuda failure 2 'out of memory'" in state["reason"]
    )
    assert "recovering" not in {h.get("state") for h in state["history"]}

    # two DDP processes, rank 1 runs out: torchrun exits 1 for any failed rank; the rank's recorded exit code
    # tells the supervisor it was out of memory, not a crash to restart
    recipe = write_recipe("ddp.yaml", output_dir=str(tmp_path / "ddp"), max_steps=6, max_restarts=2)
    res = ftrun(recipe, "--foreground", "smoke.enabled=false", "engine=ddp", "num_processes=2", FTRUN_TEST_OOM_RANK="1")
    assert res.returncode != 0, res.stdout + res.stderr
    state = json.loads((tmp_path / "ddp" / "state.json").read_text())
    assert state["state"] == "failed" and state.get("restarts", 0) == 0, state
    assert state["reason"].startswith("out of memory at step 2 (peak "), state
    assert "recovering" not in {h.get("state") for h in state["history"]}


def test_a_new_attempt_does_not_inherit_the_last_attempts_exit_code(tmp_path):
    """The supervisor reads a rank's real exit code from worker.json (torchrun reports 1): before each attempt the
    previous one's is dropped, so a worker that dies before writing its own is restarted, not read as out of memory."""
    import json

    from launcher.run import worker_outcome
    from launcher.store.rundir import RunDir

    run = RunDir(tmp_path)
    run.worker.write_text(
        json.dumps({"pid": 1, "error": "out of GPU memory at step 3", "exit_code": 78, "verification": {"ok": True}})
    )
    assert worker_outcome._worker_exit_code(run) == 78
    worker_outcome._forget_worker_outcome(run)
    assert worker_outcome._worker_exit_code(run) is None
    assert json.loads(run.worker.read_text()) == {"pid": 1, "verification": {"ok": True}}
