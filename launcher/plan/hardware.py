"""A box as the plan sees it (GPUs, interconnect, CPU, RAM), a `--gpus` spec or a catalog entry made into one, and the
box's CPU cores and RAM as the OS and its cgroup give them; what this machine's GPUs are is launcher/plan/this_box.py's.
Owns the GPU catalog, launcher/plan/gpus.yaml: adding a card is an entry in that file; everything that names, sizes or
prices a card reads it through `catalog()` (tests/test_tables.py).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from launcher.errors import HardwareError, UsageError
from launcher.plan import cgroup, links
from launcher.plan.sizing_constants import GB

CATALOG_FILE = Path(__file__).with_name("gpus.yaml")
USER_CATALOG_ENV = "FTRUN_GPUS"
USER_CATALOG_DEFAULT = Path("~/.config/ftrun/gpus.yaml")


@dataclass(frozen=True)
class Gpu:
    name: str  # catalog name when known (H100-80GB), else the NVML name
    memory_gb: float  # total as CUDA sees it, in GB = 2**30 bytes (sizing_constants.GB): 24.0 for an RTX 4090
    compute_capability: tuple[int, int] | None = None
    tflops_bf16: float | None = None  # dense bf16; None for a card the catalog does not know
    price_per_hour_eur: float | None = None
    memory_bandwidth_gb_s: float | None = None  # decimal GB/s (catalog); None where the catalog does not say

    def to_dict(self) -> dict[str, Any]:
        cc = self.compute_capability
        return {**asdict(self), "compute_capability": list(cc) if cc else None}


@dataclass(frozen=True)
class Hardware:
    gpus: tuple[Gpu, ...]
    interconnect: str  # a launcher/plan/links.py LINKS name
    cpu_count: int
    ram_gb: float  # total, GB = 2**30 bytes
    source: str  # "detected" | "--gpus SPEC" | "recipe box: SPEC" | "catalog ..."
    notes: tuple[str, ...] = field(default=())  # announced fallbacks (e.g. NVML missing)
    driver_version: str | None = None  # NVIDIA driver ("550.54.14"); None when planned from a spec or unreadable

    @property
    def count(self) -> int:
        return len(self.gpus)

    @property
    def is_this_machine(self) -> bool:
        """Detected here (its installed software counts), not a box named for planning (docker/'s image)."""
        return self.source == "detected"

    @property
    def is_cpu_only(self) -> bool:
        return not self.gpus

    @property
    def gpu(self) -> Gpu | None:
        """The card (boxes are homogeneous in practice; with mixed cards, the smallest decides)."""
        return min(self.gpus, key=lambda g: g.memory_gb) if self.gpus else None

    @property
    def price_per_hour_eur(self) -> float | None:
        if not self.gpus:
            return 0.0
        prices = [g.price_per_hour_eur for g in self.gpus]
        return None if any(p is None for p in prices) else round(sum(prices), 2)

    def describe(self) -> str:
        if self.is_cpu_only:
            return f"CPU only ({self.cpu_count} cores, {self.ram_gb:.3g} GB RAM)"
        g = self.gpu
        link = f", {links.title(self.interconnect)}" if self.count > 1 else ""
        return f"{self.count} x {g.name} ({g.memory_gb:.0f} GB{' each' if self.count > 1 else ''}{link})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpus": [g.to_dict() for g in self.gpus],
            "count": self.count,
            "interconnect": self.interconnect,
            "cpu_count": self.cpu_count,
            "ram_gb": round(self.ram_gb, 1),
            "source": self.source,
            "notes": list(self.notes),
            "driver_version": self.driver_version,
        }


@dataclass(frozen=True)
class CatalogGpu:
    name: str
    memory_gb: float
    tflops_bf16: float
    interconnect: str
    price_per_hour_eur: float | None  # None: no known price (the plan asks for --price)
    compute_capability: tuple[int, int] | None
    nvml_names: tuple[str, ...]
    memory_bandwidth_gb_s: float | None = None

    def gpu(self) -> Gpu:
        bandwidth = self.memory_bandwidth_gb_s
        return Gpu(
            self.name, self.memory_gb, self.compute_capability, self.tflops_bf16, self.price_per_hour_eur, bandwidth
        )


def _parse_catalog(raw: Any, source: str) -> dict[str, CatalogGpu]:
    if not isinstance(raw, dict) or not isinstance(raw.get("gpus"), dict):
        raise HardwareError(
            f"GPU catalog {source} must have a top-level `gpus:` mapping", fix=f"copy the shape of {CATALOG_FILE}."
        )
    out = {}
    for name, v in raw["gpus"].items():
        try:
            cc = v.get("compute_capability")
            optional = {
                k: None if v.get(k) is None else float(v[k]) for k in ("price_per_hour_eur", "memory_bandwidth_gb_s")
            }
            out[str(name)] = CatalogGpu(
                name=str(name),
                memory_gb=float(v["memory_gb"]),
                tflops_bf16=float(v["tflops_bf16"]),
                interconnect=str(v.get("interconnect", links.PCIE)),
                compute_capability=tuple(cc) if cc else None,
                nvml_names=tuple(v.get("nvml_names", [])),
                **optional,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise HardwareError(
                f"GPU catalog {source}: entry {name} is incomplete ({exc})",
                fix="each entry needs memory_gb and tflops_bf16 (price_per_hour_eur may be null).",
            ) from None
        if out[str(name)].interconnect not in links.LINKS:
            raise HardwareError(
                f"GPU catalog {source}: entry {name} has interconnect "
                f"{out[str(name)].interconnect!r}, which the plan does not know",
                fix=f"write one of: {', '.join(links.LINKS)}.",
            )
    return out


@functools.cache
def catalog() -> dict[str, CatalogGpu]:
    """The built-in catalog, updated entry by entry from the user's YAML (FTRUN_GPUS or ~/.config/ftrun/gpus.yaml)."""
    merged = _parse_catalog(yaml.safe_load(CATALOG_FILE.read_text()), str(CATALOG_FILE))
    user = Path(os.environ.get(USER_CATALOG_ENV) or USER_CATALOG_DEFAULT).expanduser()
    if user.is_file():
        merged.update(_parse_catalog(yaml.safe_load(user.read_text()), str(user)))
    return merged


reset_catalog_cache = catalog.cache_clear


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _words(name: str) -> str:
    """'NVIDIA A100-SXM4-80GB' -> ' nvidia a100 sxm4 80gb ' (whole words, for matching names word by word)."""
    return " " + " ".join(re.findall(r"[a-z0-9]+", name.lower())) + " "


def lookup(name: str) -> CatalogGpu | None:
    """A catalog entry by its name, loosely spelled ('h100', 'rtx 4090'), or by NVML name: of the catalog's names that
    occur in it as whole words, the longest ('NVIDIA L40S' is L40S, not L4)."""
    cat = catalog()
    want = _norm(name)
    if not want:
        return None
    for entry in cat.values():
        if _norm(entry.name) == want:
            return entry
    words = _words(name)
    matches = [(len(_norm(n)), entry) for entry in cat.values() for n in entry.nvml_names if _words(n) in words]
    if matches:
        return max(matches, key=lambda m: m[0])[1]
    prefix = [e for e in cat.values() if _norm(e.name).startswith(want)]
    if prefix:
        # 'H100' -> H100-80GB: the largest of the entries that differ only by a memory size (not H100-NVL or -PCIe)
        sized = [e for e in prefix if re.fullmatch(r"\d+gb", _norm(e.name)[len(want) :])]
        return max(sized or prefix, key=lambda e: e.memory_gb)
    return None


_SPEC = re.compile(r"^\s*(?:(\d+)\s*[x×*]\s*)?([A-Za-z0-9][A-Za-z0-9 _.\-]*?)\s*$")


def from_spec(spec: str) -> Hardware:
    """`4xH100-80GB`, `RTX4090`, `2xA100-80GB`, `cpu` -> a Hardware for a box not rented yet."""
    text = spec.strip()
    if text.lower() in ("cpu", "none", "0"):
        return Hardware((), links.NONE, os.cpu_count() or 1, _ram_gb(), f"--gpus {spec}")
    m = _SPEC.match(text)
    entry = lookup(m.group(2)) if m else None
    count = int(m.group(1)) if m and m.group(1) else 1
    if m is None or entry is None or not 1 <= count <= 64:
        names = ", ".join(catalog())
        raise UsageError(
            f"--gpus '{spec}' is not a GPU ftrun knows" if entry is None else f"--gpus '{spec}': count must be 1-64",
            fix=f"write COUNTxNAME such as 4xH100-80GB or RTX4090; known names: {names} "
            f"(add your own in {USER_CATALOG_ENV} or ~/.config/ftrun/gpus.yaml).",
        )
    return catalog_box(entry.name, count, f"--gpus {spec}")


def catalog_box(name: str, count: int, source: str = "") -> Hardware:
    """`count` catalog cards with the CPU and RAM typical for them: rental boxes give ~8 cores and ~2x VRAM in RAM per
    card."""
    entry = catalog()[name]
    return Hardware(
        tuple(entry.gpu() for _ in range(count)),
        links.NONE if count == 1 else entry.interconnect,
        cpu_count=8 * count,
        ram_gb=max(32.0, 2 * entry.memory_gb * count),
        source=source or f"catalog {count}x{name}",
    )


def _host_ram_gb() -> float:
    try:
        import psutil
    except ImportError:  # psutil is a dependency; without it, read the POSIX counters
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GB
    return psutil.virtual_memory().total / GB


def _ram_gb(notes: list[str] | None = None) -> float:
    """The RAM this process's workers may use: the host's (psutil, /proc/meminfo), or the container's memory limit
    where that is smaller (said in `notes`)."""
    host = _host_ram_gb()
    limit = cgroup.memory_limit_bytes()
    if limit is not None and limit / GB < host:
        if notes is not None:
            notes.append(
                f"container memory limit {limit / GB:.1f} GB (cgroup) below the host's {host:.0f} GB: "
                "planning with the limit, where the kernel OOM-kills"
            )
        return limit / GB
    return host


def cpu_cores(notes: list[str] | None = None) -> int:
    """The cores this process may use: its CPU affinity, or the container's CPU quota where that is smaller (said in
    `notes`)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup.cpu_limit()
    if quota is not None and quota < cores:
        if notes is not None:
            notes.append(
                f"container CPU quota {quota} cores (cgroup) below the {cores} this process sees: planning "
                "with the quota"
            )
        return quota
    return cores


def threads_per_process(cores: int, processes: int) -> int:
    """OMP_NUM_THREADS for each of a box's worker processes, at least one: the plan's CPU-bound times use it too."""
    return max(1, cores // max(1, processes))


# NCCL's buffers in /dev/shm (Docker: 64 MB); NCCL's troubleshooting guide, "Docker": --shm-size=1g at least.
MIN_SHM_BYTES = 1 << 30
SHM_PATH = "/dev/shm"


def shared_memory_bytes(path: str = SHM_PATH) -> int | None:
    """The size of /dev/shm (a tmpfs); None where it does not exist."""
    import shutil

    try:
        return shutil.disk_usage(path).total
    except OSError:
        return None


# accelerate 1.15 utils/environment.py check_cuda_p2p_ib_support(): RTX 40-series cards need this driver for P2P/IB
P2P_IB_FIXED_DRIVER = (550, 40, 7)


def _version(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(part) for part in str(text).strip().split("."))
    except ValueError:
        return None


def nccl_p2p_ib_unsupported(gpu_names: list[str] | tuple[str, ...], driver_version: str | None) -> bool:
    """True when NCCL must be told not to use P2P and InfiniBand: an RTX 40-series card with a driver older than
    P2P_IB_FIXED_DRIVER or unreadable (these cards have no P2P to lose; a missing setting stops the run)."""
    if not any("rtx40" in _norm(name) for name in gpu_names):
        return False
    version = _version(driver_version)
    return version is None or version < P2P_IB_FIXED_DRIVER
