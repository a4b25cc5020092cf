"""What the box has (GPUs, interconnect, CPU, RAM), read from NVML (else torch.cuda) and the OS, or from a `--gpus` spec.

Owns the GPU catalog: launcher/plan/gpus.yaml (memory, bf16 TFLOP/s, interconnect, price, NVML names per card),
updated entry by entry from the user's FTRUN_GPUS or ~/.config/ftrun/gpus.yaml. Adding a card to the catalog is an
entry in that file; everything that names, sizes or prices a card reads it through `catalog()` (tests/test_tables.py).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from launcher.errors import HardwareError, UsageError
from launcher.plan import cgroup, links
from launcher.plan.sizing import GB

CATALOG_FILE = Path(__file__).with_name("gpus.yaml")
USER_CATALOG_ENV = "FTRUN_GPUS"
USER_CATALOG_DEFAULT = Path("~/.config/ftrun/gpus.yaml")


@dataclass(frozen=True)
class Gpu:
    name: str  # catalog name when known (H100-80GB), else the NVML name
    memory_gb: float  # total as CUDA sees it, in GB = 2**30 bytes (sizing.GB): 24.0 for an RTX 4090
    compute_capability: tuple[int, int] | None = None
    tflops_bf16: float | None = None  # dense bf16; None for a card the catalog does not know
    price_per_hour_eur: float | None = None
    memory_bandwidth_gb_s: float | None = None  # decimal GB/s (catalog); None where the catalog does not say

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "memory_gb": self.memory_gb,
            "compute_capability": list(self.compute_capability) if self.compute_capability else None,
            "tflops_bf16": self.tflops_bf16,
            "price_per_hour_eur": self.price_per_hour_eur,
            "memory_bandwidth_gb_s": self.memory_bandwidth_gb_s,
        }


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
        if not self.gpus:
            return None
        return min(self.gpus, key=lambda g: g.memory_gb)

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


# ---------------------------------------------------------------------------------------------
# Catalog

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
        return Gpu(self.name, self.memory_gb, self.compute_capability, self.tflops_bf16, self.price_per_hour_eur,
                   self.memory_bandwidth_gb_s)


def _parse_catalog(raw: Any, source: str) -> dict[str, CatalogGpu]:
    if not isinstance(raw, dict) or not isinstance(raw.get("gpus"), dict):
        raise HardwareError(f"GPU catalog {source} must have a top-level `gpus:` mapping",
                            fix=f"copy the shape of {CATALOG_FILE}.")
    out = {}
    for name, v in raw["gpus"].items():
        try:
            cc = v.get("compute_capability")
            out[str(name)] = CatalogGpu(
                name=str(name),
                memory_gb=float(v["memory_gb"]),
                tflops_bf16=float(v["tflops_bf16"]),
                interconnect=str(v.get("interconnect", links.PCIE)),
                price_per_hour_eur=None if v.get("price_per_hour_eur") is None else float(v["price_per_hour_eur"]),
                compute_capability=tuple(cc) if cc else None,
                nvml_names=tuple(v.get("nvml_names", [])),
                memory_bandwidth_gb_s=(None if v.get("memory_bandwidth_gb_s") is None
                                       else float(v["memory_bandwidth_gb_s"])),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise HardwareError(f"GPU catalog {source}: entry {name} is incomplete ({exc})",
                                fix="each entry needs memory_gb and tflops_bf16 (price_per_hour_eur may be null).") from None
        if out[str(name)].interconnect not in links.LINKS:
            raise HardwareError(f"GPU catalog {source}: entry {name} has interconnect "
                                f"{out[str(name)].interconnect!r}, which the plan does not know",
                                fix=f"write one of: {', '.join(links.LINKS)}.")
    return out


_catalog_cache: dict[str, CatalogGpu] | None = None


def catalog() -> dict[str, CatalogGpu]:
    """The built-in catalog, updated entry by entry from the user's YAML (FTRUN_GPUS or ~/.config/ftrun/gpus.yaml)."""
    global _catalog_cache
    if _catalog_cache is None:
        merged = _parse_catalog(yaml.safe_load(CATALOG_FILE.read_text()), str(CATALOG_FILE))
        user = Path(os.environ.get(USER_CATALOG_ENV) or USER_CATALOG_DEFAULT).expanduser()
        if user.is_file():
            merged.update(_parse_catalog(yaml.safe_load(user.read_text()), str(user)))
        _catalog_cache = merged
    return _catalog_cache


def reset_catalog_cache() -> None:
    global _catalog_cache
    _catalog_cache = None


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _words(name: str) -> str:
    """'NVIDIA A100-SXM4-80GB' -> ' nvidia a100 sxm4 80gb ' (whole words, for matching names word by word)."""
    return " " + " ".join(re.findall(r"[a-z0-9]+", name.lower())) + " "


def lookup(name: str) -> CatalogGpu | None:
    """A catalog entry by its name, loosely spelled ('h100', 'H100-80GB', 'rtx 4090'), or by NVML name.

    An NVML name is matched to the most specific entry: of the catalog's names that occur in it as whole
    words, the longest ('NVIDIA L40S' is L40S, not L4; 'NVIDIA A10G' is A10G, not A10)."""
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
        # 'A100' -> A100-80GB, 'H100' -> H100-80GB: users who write the bare name mean the common rental card, the
        # largest of the entries that differ from it only by a memory size (not H100-NVL or H100-PCIe).
        sized = [e for e in prefix if re.fullmatch(r"\d+gb", _norm(e.name)[len(want):])]
        return max(sized or prefix, key=lambda e: e.memory_gb)
    return None


# ---------------------------------------------------------------------------------------------
# --gpus SPEC

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
    gpus = tuple(entry.gpu() for _ in range(count))
    interconnect = links.NONE if count == 1 else entry.interconnect
    # A planned box has the CPU and RAM typical for its cards; rental boxes give ~8 cores and ~2x VRAM in RAM per card.
    return Hardware(gpus, interconnect, cpu_count=8 * count, ram_gb=max(32.0, 2 * entry.memory_gb * count),
                    source=f"--gpus {spec}")


def for_plan(gpus: str | None, box: str | None) -> tuple[Hardware, str]:
    """The box `ftrun plan` sizes for, and why: --gpus, else a GPU detected here, else the recipe's `box:`,
    else this machine (CPU only)."""
    if gpus:
        return from_spec(gpus), f"--gpus {gpus}"
    here = detect()
    if not here.is_cpu_only:
        why = f"the GPUs of this machine (detected: {here.describe()})"
        if box:
            why += f"; the recipe's box: {box} is not used here (plan for it with --gpus {box})"
        return here, why
    if box:
        try:
            named = from_spec(box)
        except UsageError as exc:
            raise UsageError(f"the recipe's box: {box!r} is not a box ftrun knows ({exc.message})", fix=exc.fix) from None
        return (replace(named, source=f"recipe box: {box}"),
                f"the recipe's box: {box} (this machine has no GPU; --gpus plans for another box)")
    return here, "this machine (no GPU detected, and the recipe names no box:; --gpus plans for a GPU box)"


def catalog_box(name: str, count: int) -> Hardware:
    entry = catalog()[name]
    return Hardware(tuple(entry.gpu() for _ in range(count)), links.NONE if count == 1 else entry.interconnect,
                    cpu_count=8 * count, ram_gb=max(32.0, 2 * entry.memory_gb * count),
                    source=f"catalog {count}x{name}")


# ---------------------------------------------------------------------------------------------
# Detection

def _host_ram_gb() -> float:
    try:
        import psutil
    except ImportError:  # psutil is a dependency; without it, read the POSIX counters
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return pages / GB
    return psutil.virtual_memory().total / GB


def _ram_gb(notes: list[str] | None = None) -> float:
    """The RAM this process's workers may use: the host's, or the container's memory limit where that is smaller
    (psutil reads /proc/meminfo, which shows the host inside a container; the kernel OOM-kills at the cgroup's
    limit). The smaller limit is said in `notes`."""
    host = _host_ram_gb()
    limit = cgroup.memory_limit_bytes()
    if limit is not None and limit / GB < host:
        if notes is not None:
            notes.append(f"container memory limit {limit / GB:.1f} GB (cgroup) below the host's {host:.0f} GB: "
                         "planning with the limit, where the kernel OOM-kills")
        return limit / GB
    return host


def cpu_cores(notes: list[str] | None = None) -> int:
    """The cores this process may use: its CPU affinity, or the container's CPU quota where that is smaller
    (os.cpu_count() counts the host's; a quota of 4 cores on a 64-core host runs 64 threads at 1/16 speed)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup.cpu_limit()
    if quota is not None and quota < cores:
        if notes is not None:
            notes.append(f"container CPU quota {quota} cores (cgroup) below the {cores} this process sees: planning "
                         "with the quota")
        return quota
    return cores


def threads_per_process(cores: int, processes: int) -> int:
    """CPU threads for each of a box's worker processes (OMP_NUM_THREADS): the cores shared out, at least one.
    The plan's CPU-bound times (quantizing while loading) and the launch both use it, so they agree."""
    return max(1, cores // max(1, processes))


# Files the NVIDIA kernel driver creates: the torch fallback is tried only where one exists, so a
# CPU box never pays for importing torch during `ftrun plan`.
NVIDIA_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl")
# The kernel module's version is the driver version; read when NVML cannot say it.
DRIVER_VERSION_FILES = ("/sys/module/nvidia/version", "/proc/driver/nvidia/version")
# A100, H100, H200, B200: a MIG profile "3g.40gb" gets 3 of the card's 7 compute slices.
MIG_COMPUTE_SLICES = 7
TORCH_PROBE_TIMEOUT_S = 120


@dataclass(frozen=True)
class _Device:
    """One device a CUDA process can be given: a whole GPU, or one MIG instance of a GPU."""

    uuid: str  # GPU-... or MIG-...; "" when NVML does not say
    name: str  # NVML's name; a MIG instance's reads like "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    memory_bytes: int  # this device's own memory: a MIG instance's slice, never its parent's total
    compute_capability: tuple[int, int] | None
    nvlink: bool = False
    parent_name: str | None = None  # set for a MIG instance: the physical card
    parent_uuid: str | None = None
    mig_ids: tuple[int, int] | None = None  # (GPU instance, compute instance) for MIG-GPU-<uuid>/<gi>/<ci>

    @property
    def is_mig(self) -> bool:
        return self.parent_name is not None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_devices(pynvml: Any) -> tuple[list[_Device], str | None, list[str]]:
    """Every device CUDA could enumerate, in NVML order, the driver version, and notes.

    A GPU in MIG mode contributes its MIG instances instead of itself: CUDA cannot run on the parent
    of a MIG-enabled GPU, only on an instance, which has a slice of the memory. Raises
    pynvml.NVMLError when there is no driver. Function names as in nvidia-ml-py 13 (pynvml.py):
    nvmlDeviceGetMigMode -> [current, pending], nvmlDeviceGetMaxMigDeviceCount,
    nvmlDeviceGetMigDeviceHandleByIndex (NVML_ERROR_NOT_FOUND for an empty slot).
    """
    pynvml.nvmlInit()
    notes: list[str] = []
    try:
        try:
            driver = _text(pynvml.nvmlSystemGetDriverVersion()).strip() or None
        except pynvml.NVMLError:
            driver = _driver_version_from_os()
        devices: list[_Device] = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = _text(pynvml.nvmlDeviceGetName(handle))
            uuid = _nvml_uuid(pynvml, handle)
            try:
                cc = tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle))
            except pynvml.NVMLError:
                cc = None
            if not _mig_enabled(pynvml, handle):
                devices.append(_Device(uuid, name, int(pynvml.nvmlDeviceGetMemoryInfo(handle).total), cc,
                                       nvlink=_has_active_nvlink(pynvml, handle)))
                continue
            instances = []
            for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                try:
                    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                except pynvml.NVMLError:
                    continue  # an empty slot: no instance created there
                try:
                    ids = (int(pynvml.nvmlDeviceGetGpuInstanceId(mig)), int(pynvml.nvmlDeviceGetComputeInstanceId(mig)))
                except pynvml.NVMLError:
                    ids = None
                instances.append(_Device(_nvml_uuid(pynvml, mig), _text(pynvml.nvmlDeviceGetName(mig)),
                                         int(pynvml.nvmlDeviceGetMemoryInfo(mig).total), cc,
                                         parent_name=name, parent_uuid=uuid, mig_ids=ids))
            if not instances:
                notes.append(f"GPU {i} ({name}) has MIG enabled but no MIG instance: CUDA cannot use it "
                             "(create one with nvidia-smi mig, or disable MIG)")
            devices += instances
        return devices, driver, notes
    finally:
        pynvml.nvmlShutdown()


def _nvml_uuid(pynvml: Any, handle: Any) -> str:
    try:
        return _text(pynvml.nvmlDeviceGetUUID(handle))
    except pynvml.NVMLError:
        return ""


def _mig_enabled(pynvml: Any, handle: Any) -> bool:
    try:
        current = pynvml.nvmlDeviceGetMigMode(handle)[0]
    except pynvml.NVMLError:
        return False  # NOT_SUPPORTED: a card without MIG (consumer cards, V100, L40S, ...)
    return current == pynvml.NVML_DEVICE_MIG_ENABLE


def _has_active_nvlink(pynvml: Any, handle: Any) -> bool:
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                return True
        except pynvml.NVMLError:
            # Consumer cards and unused link slots answer NOT_SUPPORTED / INVALID_ARGUMENT: no NVLink there.
            continue
    return False


def _match_visible(entry: str, devices: list[_Device]) -> _Device | None:
    """The device one CUDA_VISIBLE_DEVICES entry names: an index, a (prefix of a) GPU-/MIG- UUID, or the
    older MIG-GPU-<uuid>/<gpu instance>/<compute instance> form. None when it names no single device."""
    if re.fullmatch(r"-?\d+", entry):
        # Indices count CUDA's enumeration; on the homogeneous boxes ftrun sizes it is NVML's order.
        idx = int(entry)
        return devices[idx] if 0 <= idx < len(devices) else None
    low = entry.lower()
    legacy = re.fullmatch(r"mig-(gpu-[0-9a-f-]+)/(\d+)/(\d+)", low)
    if legacy:
        found = [d for d in devices if d.is_mig and (d.parent_uuid or "").lower() == legacy.group(1)
                 and d.mig_ids == (int(legacy.group(2)), int(legacy.group(3)))]
    else:
        # CUDA accepts a unique prefix of a UUID ("GPU-8932f937"). A MIG-enabled card named by its GPU
        # UUID stands for its instances.
        found = [d for d in devices if d.uuid and d.uuid.lower().startswith(low)]
        if not found and low.startswith("gpu-"):
            found = [d for d in devices if d.is_mig and (d.parent_uuid or "").lower().startswith(low)][:1]
    return found[0] if len(found) == 1 else None


def _cuda_view(devices: list[_Device], visible: str | None) -> tuple[list[_Device], list[str]]:
    """What a CUDA process on this box enumerates: NVML lists every card, CUDA honours
    CUDA_VISIBLE_DEVICES (indices or UUIDs) and gives a process only one MIG instance."""
    notes: list[str] = []
    chosen = list(devices)
    if visible is not None:
        chosen = []
        for raw in visible.split(","):
            entry = raw.strip()
            device = _match_visible(entry, devices)
            if device is None:
                # CUDA's rule: an invalid entry hides itself and every entry after it.
                if entry != "-1":
                    notes.append(f"CUDA_VISIBLE_DEVICES entry '{entry}' names no device on this box: CUDA ignores it "
                                 "and every entry after it")
                break
            if device not in chosen:
                chosen.append(device)
    migs = [d for d in chosen if d.is_mig]
    if len(migs) > 1:
        # MIG user guide, "CUDA Device Enumeration": with CUDA 11/R450 and CUDA 12/R525 a CUDA process
        # enumerates a single MIG instance however many are visible (pytorch/pytorch#130181), so
        # torchrun's ranks cannot each take one: the job plans for the first.
        notes.append(f"{len(migs)} MIG instances are visible, but a CUDA process can use only one: planning for "
                     f"{migs[0].uuid or migs[0].name}; run one job per MIG instance, each with its own "
                     "CUDA_VISIBLE_DEVICES=MIG-<uuid>")
        chosen = [d for d in chosen if not d.is_mig or d is migs[0]]
    return chosen, notes


def _mig_profile(name: str) -> tuple[str | None, int | None]:
    """'NVIDIA A100-SXM4-80GB MIG 3g.40gb' -> ('3g.40gb', 3)."""
    m = re.search(r"(?:\d+c\.)?(\d+)g\.\d+gb", name.lower())
    return (m.group(0), int(m.group(1))) if m else (None, None)


def _gpu(name: str, memory_bytes: int, cc: tuple[int, int] | None, notes: list[str],
         parent_name: str | None = None) -> Gpu:
    """A detected device as sizing sees it, priced and rated from the catalog."""
    if parent_name is None and " MIG " in f" {name} ":
        # torch names a MIG instance after its card: "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
        parent_name = name.split(" MIG ")[0]
    entry = lookup(parent_name or name)
    memory = round(memory_bytes / GB, 2)
    if parent_name is None:
        if entry is None:
            notes.append(f"GPU '{name}' is not in the catalog: no price or TFLOP/s known, time is estimated "
                         f"from its memory class; add it to {USER_CATALOG_ENV}")
        return Gpu(entry.name if entry else name, memory, cc, entry.tflops_bf16 if entry else None,
                   entry.price_per_hour_eur if entry else None, entry.memory_bandwidth_gb_s if entry else None)
    profile, slices = _mig_profile(name)
    card = entry.name if entry else parent_name
    tflops = entry.tflops_bf16 * slices / MIG_COMPUTE_SLICES if entry and slices else None
    notes.append(f"{card} is split by MIG: planning for one MIG instance ({profile or 'profile unknown'}, "
                 f"{memory:.1f} GB"
                 + (f", {slices} of {MIG_COMPUTE_SLICES} compute slices" if tflops else ", its compute share unknown")
                 + "), not the whole card; a MIG instance's price depends on the provider: set price_per_hour_eur")
    return Gpu(f"{card} MIG {profile}" if profile else f"{card} MIG", memory, cc,
               round(tflops, 1) if tflops else None, None)


def _driver_version_from_os() -> str | None:
    for path in DRIVER_VERSION_FILES:
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        # /sys/module/nvidia/version: "550.54.14"; /proc/driver/nvidia/version: "NVRM version: NVIDIA UNIX
        # x86_64 Kernel Module  550.54.14  Thu Feb 22 ..."
        m = re.search(r"\b(\d{3,}\.\d+(?:\.\d+)?)\b", text)
        if m:
            return m.group(1)
    return None


def _nvidia_driver_present() -> bool:
    return any(Path(p).exists() for p in NVIDIA_DRIVER_FILES)


# Runs in a child process: torch initialises CUDA there, not in ftrun's own process (which stays
# light and holds no CUDA context on a card the training will need). torch sees what the worker
# will see: CUDA_VISIBLE_DEVICES and MIG are applied by CUDA itself.
_TORCH_PROBE = """
import json, torch
out = []
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"name": p.name, "total_memory": int(p.total_memory), "major": p.major, "minor": p.minor})
print(json.dumps(out))
"""


def _torch_devices() -> list[dict[str, Any]]:
    """torch.cuda's devices (name, total_memory, major, minor); HardwareError with the reason when the probe fails."""
    import json
    import subprocess

    try:
        done = subprocess.run([sys.executable, "-c", _TORCH_PROBE], capture_output=True, text=True,
                              timeout=TORCH_PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise HardwareError(f"torch.cuda did not answer within {TORCH_PROBE_TIMEOUT_S} s") from None
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise HardwareError(f"torch.cuda failed: {tail}")
    try:
        return list(json.loads(done.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        raise HardwareError(f"torch.cuda probe printed no device list: {done.stdout.strip()[-200:]!r}") from None


def _detect_with_torch(cpu: int, ram: float, why: str) -> Hardware:
    """NVML is missing or failed: ask torch.cuda, and say so."""
    import importlib.util

    if not _nvidia_driver_present():
        return Hardware((), links.NONE, cpu, ram, "detected", (f"{why}, and no NVIDIA driver is loaded on this box: "
                                                          "CPU only; plan for a GPU box with --gpus",))
    if importlib.util.find_spec("torch") is None:
        return Hardware((), links.NONE, cpu, ram, "detected", (f"{why}, and torch is not installed to ask instead: "
                                                          "CPU only; install ftrun[gpu] (nvidia-ml-py)",))
    try:
        found = _torch_devices()
    except HardwareError as exc:
        return Hardware((), links.NONE, cpu, ram, "detected", (f"{why}, and {exc.args[0] if exc.args else exc}: CPU only",))
    if not found:
        return Hardware((), links.NONE, cpu, ram, "detected",
                        (f"{why}, and torch.cuda sees no device (CUDA_VISIBLE_DEVICES, or a driver that does not "
                         "match torch's CUDA): CPU only",))
    notes: list[str] = []
    gpus = tuple(_gpu(d["name"], int(d["total_memory"]), (int(d["major"]), int(d["minor"])), notes) for d in found)
    if len(gpus) == 1:
        interconnect = links.NONE
    else:
        # torch does not tell NVLink from PCIe; the catalog knows how a card's multi-GPU boxes are built.
        entry = lookup(gpus[0].name)
        interconnect = entry.interconnect if entry else links.PCIE
    notes.insert(0, f"{why}: GPUs read through torch.cuda instead (name, memory, compute capability); the "
                    f"interconnect is not visible that way and is taken as {interconnect} "
                    f"({'from the catalog' if len(gpus) > 1 and lookup(gpus[0].name) else 'assumed'}); "
                    "install ftrun[gpu] (nvidia-ml-py) for NVML's view")
    return Hardware(gpus, interconnect, cpu, ram, "detected", tuple(notes), _driver_version_from_os())


def detect() -> Hardware:
    """This box: GPUs as a CUDA process here will see them (NVML, else torch.cuda in a child process),
    CPU and RAM via the OS, capped by the container's cgroup limits (launcher/plan/cgroup.py). No GPU or no
    driver -> a CPU-only Hardware, with the reason in notes."""
    limits: list[str] = []
    cpu = cpu_cores(limits)
    ram = _ram_gb(limits)
    hw = _detect_devices(cpu, ram)
    return replace(hw, notes=(*hw.notes, *limits)) if limits else hw


def _detect_devices(cpu: int, ram: float) -> Hardware:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return Hardware((), links.NONE, cpu, ram, "detected", ("CUDA_VISIBLE_DEVICES hides all GPUs: CPU only",))
    try:
        import pynvml  # nvidia-ml-py; imported here so `import launcher.plan.hardware` stays light
    except ImportError:
        return _detect_with_torch(cpu, ram, "nvidia-ml-py is not installed")
    try:
        devices, driver, notes = _nvml_devices(pynvml)
    except pynvml.NVMLError as exc:  # no driver, or no libnvidia-ml: torch may still see the cards
        return _detect_with_torch(cpu, ram, f"NVML did not answer ({exc})")
    chosen, view_notes = _cuda_view(devices, visible)
    notes += view_notes
    gpus = tuple(_gpu(d.name, d.memory_bytes, d.compute_capability, notes, d.parent_name) for d in chosen)
    if len(gpus) <= 1 or any(d.is_mig for d in chosen):
        interconnect = links.NONE if len(gpus) <= 1 else links.PCIE  # MIG instances have no NVLink or P2P
    else:
        interconnect = links.NVLINK if any(d.nvlink for d in chosen) else links.PCIE
    return Hardware(gpus, interconnect, cpu, ram, "detected", tuple(notes), driver)


# NCCL's shared-memory transport between the processes of one box keeps its buffers in /dev/shm; Docker gives a
# container 64 MB there unless it runs with --ipc=host or --shm-size, and NCCL then fails at the first collective
# ("unhandled system error", "Error while creating shared memory segment"). NCCL's own troubleshooting guide
# (docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting.html, "Docker") asks for --shm-size=1g at least.
# Worse on RTX 40-series boxes, where ftrun turns P2P off (nccl_p2p_ib_unsupported) and every transfer goes
# through shared memory.
MIN_SHM_BYTES = 1 << 30
SHM_PATH = "/dev/shm"


def shared_memory_bytes(path: str = SHM_PATH) -> int | None:
    """The size of /dev/shm (a tmpfs); None where it does not exist."""
    import shutil

    try:
        return shutil.disk_usage(path).total
    except OSError:
        return None


# accelerate 1.15, utils/environment.py check_cuda_p2p_ib_support(): GeForce RTX 40-series cards ("RTX 40"
# in nvidia-smi's name) on a driver older than this cannot do the P2P/IB transfers NCCL would try.
P2P_IB_FIXED_DRIVER = (550, 40, 7)


def _version(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(part) for part in str(text).strip().split("."))
    except ValueError:
        return None


def nccl_p2p_ib_unsupported(gpu_names: list[str] | tuple[str, ...], driver_version: str | None) -> bool:
    """True when NCCL must be told not to use P2P and InfiniBand: an RTX 40-series card with a driver older
    than 550.40.07 (accelerate's own test), or with a driver version nobody could read. GeForce Ada cards
    have no P2P to lose, so a wrong guess in the unknown case costs little; a missing setting stops the run."""
    if not any("rtx40" in _norm(name) for name in gpu_names):
        return False
    version = _version(driver_version)
    return version is None or version < P2P_IB_FIXED_DRIVER


def main() -> None:  # pragma: no cover - `python -m launcher.plan.hardware` prints what the box has
    hw = detect()
    print(hw.describe() + (f", driver {hw.driver_version}" if hw.driver_version else ""))
    for note in hw.notes:
        print("note:", note, file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    main()
