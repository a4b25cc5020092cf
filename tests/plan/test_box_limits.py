"""The container's limits (cgroup v1 and v2): the RAM and cores the plan sizes with, the OOM kills the supervisor
reads, and /dev/shm for NCCL. Fake cgroup trees for the layouts people's boxes have; the real kernel where this
machine lets a test make a cgroup of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.errors import HardwareError
from launcher.plan import cgroup, hardware
from launcher.plan import this_box

REPO = Path(__file__).resolve().parents[2]
GiB = 2**30


def _tree(root: Path, mountinfo: list[str], own: list[str], files: dict[str, str]) -> Path:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/mountinfo").write_text("\n".join(mountinfo) + "\n")
    (root / "proc/self/cgroup").write_text("\n".join(own) + "\n")
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def v2_docker(tmp_path: Path, memory_max: str = "17179869184", cpu_max: str = "400000 100000") -> Path:
    """Docker on cgroup v2 with a cgroup namespace: the container's cgroup is the mount's root."""
    return _tree(
        tmp_path,
        ["35 30 0:29 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"],
        ["0::/"],
        {
            "sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids",
            "sys/fs/cgroup/memory.max": memory_max,
            "sys/fs/cgroup/cpu.max": cpu_max,
            "sys/fs/cgroup/memory.current": str(5 * GiB),
            "sys/fs/cgroup/memory.events": "low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 0\n",
        },
    )


def v1_nested(tmp_path: Path) -> Path:
    """cgroup v1 without a namespace: the process sits in /docker/abc, its parent /docker has the smaller limit."""
    return _tree(
        tmp_path,
        [
            "40 30 0:35 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory",
            "41 30 0:36 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct",
        ],
        ["12:memory:/docker/abc", "4:cpu,cpuacct:/docker/abc", "0::/"],
        {
            "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712",
            "sys/fs/cgroup/memory/docker/memory.limit_in_bytes": str(8 * GiB),
            "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": str(32 * GiB),
            "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes": str(GiB),
            "sys/fs/cgroup/memory/docker/abc/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n",
            "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "250000",
            "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
        },
    )


def test_cgroup_v2_container_limits(tmp_path):
    root = v2_docker(tmp_path)
    assert cgroup.memory_limit_bytes(root) == 16 * GiB
    assert cgroup.cpu_limit(root) == 4
    assert cgroup.oom_kills(root) == 2
    assert cgroup.memory_headroom_bytes(root) == 11 * GiB


def test_cgroup_v2_without_limits(tmp_path):
    root = v2_docker(tmp_path, memory_max="max", cpu_max="max 100000")
    assert cgroup.memory_limit_bytes(root) is None and cgroup.cpu_limit(root) is None
    assert cgroup.memory_headroom_bytes(root) is None


def test_cgroup_v1_takes_the_smallest_limit_up_the_hierarchy(tmp_path):
    root = v1_nested(tmp_path)
    assert cgroup.memory_limit_bytes(root) == 8 * GiB  # the parent's, not the process's own 32 GB
    assert cgroup.cpu_limit(root) == 3  # 2.5 cores of quota: 3 threads' worth, rounded up
    assert cgroup.oom_kills(root) == 3
    assert cgroup.memory_headroom_bytes(root) == 7 * GiB


def test_no_cgroup_files_mean_no_limit(tmp_path):
    root = _tree(tmp_path, [], [], {})
    assert cgroup.memory_limit_bytes(root) is None and cgroup.cpu_limit(root) is None
    assert cgroup.oom_kills(root) is None


def test_the_plan_sizes_ram_and_cores_by_the_container(monkeypatch):
    """detect(): the host's 64 cores and its RAM, capped by the cgroup, each with a note saying so."""
    monkeypatch.setattr(cgroup, "memory_limit_bytes", lambda root=None: 8 * GiB)
    monkeypatch.setattr(cgroup, "cpu_limit", lambda root=None: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU probe: the box's CPU side is what is tested
    hw = this_box.detect()
    assert hw.ram_gb == 8 and hw.cpu_count == 1
    assert any("container memory limit 8.0 GB" in n for n in hw.notes)
    assert any("container CPU quota 1 cores" in n for n in hw.notes)


def test_the_box_quantization_takes_the_cores_the_plan_counts(tmp_path, monkeypatch):
    """A 4-core quota on a 64-core host: the one quantization per box runs on the 4 cores the plan counts
    (hardware.cpu_cores), not on the 64 the affinity shows."""
    import torch
    import transformers

    from launcher.worker import loading

    quota, unlimited = (
        v2_docker(tmp_path / "quota", cpu_max="400000 100000"),
        v2_docker(tmp_path / "none", cpu_max="max 100000"),
    )
    read = cgroup.cpu_limit
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr(cgroup, "cpu_limit", lambda root=None: read(unlimited))
    assert hardware.cpu_cores() == 64
    monkeypatch.setattr(cgroup, "cpu_limit", lambda root=None: read(quota))
    assert hardware.cpu_cores() == 4

    loading_threads = []

    class Quantized:
        def save_pretrained(self, path):
            Path(path).mkdir(parents=True)
            (Path(path) / "model.safetensors").write_bytes(b"")

    def from_pretrained(model, **kwargs):  # stands in for bitsandbytes' load: the threads it runs on are tested
        loading_threads.append(torch.get_num_threads())
        return Quantized()

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    before = torch.get_num_threads()
    loading._quantize_into(tmp_path / ".quantized", "m", {}, {"model": "m"})
    assert loading_threads == [4] and torch.get_num_threads() == before
    assert (tmp_path / ".quantized" / loading.QUANTIZED_MANIFEST).is_file()


def test_threads_per_process_share_the_cores():
    assert hardware.threads_per_process(16, 2) == 8
    assert hardware.threads_per_process(2, 8) == 1
    assert hardware.threads_per_process(7, 1) == 7


# --- /dev/shm (issue 21 item 4) --------------------------------------------------------------------------------

DDP2 = {"device": "cuda", "engine": "ddp", "num_processes": 2}


def test_a_small_dev_shm_refuses_a_multi_process_gpu_run(monkeypatch):
    from launcher.run import prepare

    monkeypatch.setattr(hardware, "shared_memory_bytes", lambda path=hardware.SHM_PATH: 64 * 2**20)
    with pytest.raises(HardwareError) as err:
        prepare._check_shared_memory(DDP2)
    assert "/dev/shm holds only 64 MB" in err.value.message and "--ipc=host" in err.value.fix
    prepare._check_shared_memory({**DDP2, "engine": "trl", "num_processes": 1})  # one process: no NCCL peers
    prepare._check_shared_memory({**DDP2, "device": "cpu"})  # gloo on a CPU box: no NCCL
    monkeypatch.setattr(hardware, "shared_memory_bytes", lambda path=hardware.SHM_PATH: 16 * GiB)
    prepare._check_shared_memory(DDP2)


def test_a_replan_onto_several_processes_checks_dev_shm_before_it_launches(tmp_path, monkeypatch):
    """One card of two runs out of memory in the smoke test; the re-plan shards the job over both (fsdp x 2). On a
    box whose /dev/shm is Docker's 64 MB that job is refused with the first launch's message before it starts."""
    from helpers import ARTICLE_DATA, article_recipe
    from launcher.errors import SmokeOOM
    from launcher.run import prepare, smoke, smoke_replan
    from launcher.store.rundir import RunDir
    from launcher.store.state import read_state

    monkeypatch.setattr(prepare, "hardware_for", lambda gpus=None: hardware.from_spec("2xH100"))
    monkeypatch.setattr(hardware, "shared_memory_bytes", lambda path=hardware.SHM_PATH: 64 * 2**20)
    recipe = article_recipe(tmp_path, method="lora", micro_batch_size=1, gradient_accumulation_steps=8)
    # a job planned on one card (a run resumed on this box): the first launch has nothing to refuse
    one = {**prepare.make_plan(recipe, ARTICLE_DATA).to_dict(), "engine": "trl", "num_processes": 1}
    prepare._check_shared_memory(one)
    launched = []

    def out_of_memory(run, recipe, plan_dict, *rest):
        launched.append((plan_dict["engine"], plan_dict["num_processes"]))
        raise SmokeOOM("CUDA out of memory", peak_memory_gb=79.5)

    monkeypatch.setattr(smoke, "run_smoke", out_of_memory)
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    with pytest.raises(HardwareError) as err:
        smoke_replan._smoke(run, recipe, one, [], [], ARTICLE_DATA)
    assert launched == [("trl", 1)], launched  # the sharded job never started
    with pytest.raises(HardwareError) as direct:
        prepare._check_shared_memory({**one, "engine": "fsdp", "num_processes": 2})
    assert (err.value.message, err.value.fix) == (direct.value.message, direct.value.fix)
    assert "/dev/shm holds only 64 MB" in err.value.message and "2 processes of engine fsdp" in err.value.message
    state = read_state(run)
    assert state["state"] == "failed-smoke" and state["reason"] == err.value.message


def test_dev_shm_is_read_from_the_box():
    size = hardware.shared_memory_bytes()
    assert size is None or size > 0
    assert hardware.shared_memory_bytes("/no/such/dir") is None


# --- the real kernel ------------------------------------------------------------------------------------------


def _own_memory_cgroup() -> Path | None:
    """A directory this test may create a memory cgroup under (root, a writable v1 or v2 hierarchy); else None."""
    found = cgroup._hierarchy(Path("/"), "memory")
    if found is None or not os.access(found[1][0], os.W_OK):
        return None
    return found[1][0]


_PROBE = """
import json, os, subprocess, sys
from pathlib import Path
cg = Path(sys.argv[1])
(cg / "cgroup.procs").write_text(str(os.getpid()))
from launcher.plan import cgroup, hardware
from launcher.run.attempt import _host_oom
before = cgroup.oom_kills()
hog = subprocess.run([sys.executable, "-c", "b = bytearray(1536 * 2**20)"])
print(json.dumps({"limit": cgroup.memory_limit_bytes(), "ram_gb": hardware._ram_gb(), "before": before,
                  "rc": hog.returncode, "host_oom": _host_oom(before)}))
"""


def test_a_real_oom_kill_is_counted_and_classified(tmp_path):
    """A child of a cgroup limited to 512 MB allocates 1.5 GB: the kernel kills it, cgroup.oom_kills() counts it
    and the supervisor's classification says host memory, with the limit."""
    parent = _own_memory_cgroup()
    if parent is None:
        pytest.skip("no writable memory cgroup on this machine (not root, or no memory controller)")
    cg = parent / f"ftrun-test-{os.getpid()}"
    try:
        cg.mkdir()
        limit_file = cg / (
            "memory.max"
            if (parent / "memory.max").exists() or (cg / "memory.max").exists()
            else "memory.limit_in_bytes"
        )
        limit_file.write_text(str(512 * 2**20))
        (cg / "memory.swap.max").exists() and (cg / "memory.swap.max").write_text("0")
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here: {exc}")
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, str(cg)], capture_output=True, text=True, cwd=REPO, timeout=120
        )
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        cg.rmdir()
    assert out["limit"] == 512 * 2**20 and out["ram_gb"] == 0.5
    assert out["rc"] == -9
    assert out["host_oom"] == {"oom_kills": 1, "limit_gb": 0.5}
