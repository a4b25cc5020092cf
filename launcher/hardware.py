"""What the box has (GPUs, interconnect, CPU, RAM), read from NVML and the OS, or described by a `--gpus` spec."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import HardwareError, UsageError

CATALOG_FILE = Path(__file__).with_name("gpus.yaml")
USER_CATALOG_ENV = "FTRUN_GPUS"
USER_CATALOG_DEFAULT = Path("~/.config/ftrun/gpus.yaml")


@dataclass(frozen=True)
class Gpu:
    name: str  # catalog name when known (H100-80GB), else the NVML name
    memory_gb: float  # total, decimal GB (1e9 bytes), as sizing counts
    compute_capability: tuple[int, int] | None = None
    tflops_bf16: float | None = None  # dense bf16; None for a card the catalog does not know
    price_per_hour_eur: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "memory_gb": self.memory_gb,
            "compute_capability": list(self.compute_capability) if self.compute_capability else None,
            "tflops_bf16": self.tflops_bf16,
            "price_per_hour_eur": self.price_per_hour_eur,
        }


@dataclass(frozen=True)
class Hardware:
    gpus: tuple[Gpu, ...]
    interconnect: str  # "nvlink" | "pcie" | "none"
    cpu_count: int
    ram_gb: float  # total, decimal GB
    source: str  # "detected" | "--gpus SPEC"
    notes: tuple[str, ...] = field(default=())  # announced fallbacks (e.g. NVML missing)

    @property
    def count(self) -> int:
        return len(self.gpus)

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
            return f"CPU only ({self.cpu_count} cores, {self.ram_gb:.0f} GB RAM)"
        g = self.gpu
        link = f", {'NVLink' if self.interconnect == 'nvlink' else 'PCIe'}" if self.count > 1 else ""
        return f"{self.count} x {g.name} ({g.memory_gb:.0f} GB each{link})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpus": [g.to_dict() for g in self.gpus],
            "count": self.count,
            "interconnect": self.interconnect,
            "cpu_count": self.cpu_count,
            "ram_gb": round(self.ram_gb, 1),
            "source": self.source,
            "notes": list(self.notes),
        }


# ---------------------------------------------------------------------------------------------
# Catalog

@dataclass(frozen=True)
class CatalogGpu:
    name: str
    memory_gb: float
    tflops_bf16: float
    interconnect: str
    price_per_hour_eur: float
    compute_capability: tuple[int, int] | None
    nvml_names: tuple[str, ...]

    def gpu(self) -> Gpu:
        return Gpu(self.name, self.memory_gb, self.compute_capability, self.tflops_bf16, self.price_per_hour_eur)


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
                interconnect=str(v.get("interconnect", "pcie")),
                price_per_hour_eur=float(v["price_per_hour_eur"]),
                compute_capability=tuple(cc) if cc else None,
                nvml_names=tuple(v.get("nvml_names", [])),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise HardwareError(f"GPU catalog {source}: entry {name} is incomplete ({exc})",
                                fix="each entry needs memory_gb, tflops_bf16, price_per_hour_eur.") from None
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


def lookup(name: str) -> CatalogGpu | None:
    """A catalog entry by its name, loosely spelled ('h100', 'H100-80GB', 'rtx 4090'), or by NVML name."""
    cat = catalog()
    want = _norm(name)
    for entry in cat.values():
        if _norm(entry.name) == want:
            return entry
    for entry in cat.values():  # NVML names: 'NVIDIA H100 80GB HBM3' -> H100-80GB
        if any(_norm(n) in want for n in entry.nvml_names):
            return entry
    prefix = [e for e in cat.values() if _norm(e.name).startswith(want)]
    if prefix and want:
        # 'A100' -> the largest A100: users who write the bare name mean the common rental card.
        return max(prefix, key=lambda e: e.memory_gb)
    return None


# ---------------------------------------------------------------------------------------------
# --gpus SPEC

_SPEC = re.compile(r"^\s*(?:(\d+)\s*[x×*]\s*)?([A-Za-z0-9][A-Za-z0-9 _.\-]*?)\s*$")


def from_spec(spec: str) -> Hardware:
    """`4xH100-80GB`, `RTX4090`, `2xA100-80GB`, `cpu` -> a Hardware for a box not rented yet."""
    text = spec.strip()
    if text.lower() in ("cpu", "none", "0"):
        return Hardware((), "none", os.cpu_count() or 1, _ram_gb(), f"--gpus {spec}")
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
    interconnect = "none" if count == 1 else entry.interconnect
    # A planned box has the CPU and RAM typical for its cards; rental boxes give ~8 cores and ~2x VRAM in RAM per card.
    return Hardware(gpus, interconnect, cpu_count=8 * count, ram_gb=max(32.0, 2 * entry.memory_gb * count),
                    source=f"--gpus {spec}")


def catalog_box(name: str, count: int) -> Hardware:
    entry = catalog()[name]
    return Hardware(tuple(entry.gpu() for _ in range(count)), "none" if count == 1 else entry.interconnect,
                    cpu_count=8 * count, ram_gb=max(32.0, 2 * entry.memory_gb * count),
                    source=f"catalog {count}x{name}")


# ---------------------------------------------------------------------------------------------
# Detection

def _ram_gb() -> float:
    try:
        import psutil
    except ImportError:  # psutil is a dependency; without it, read the POSIX counters
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return pages / 1e9
    return psutil.virtual_memory().total / 1e9


def _nvml_gpus(pynvml: Any) -> tuple[tuple[Gpu, ...], str, list[str]]:
    """GPUs and interconnect from NVML; raises pynvml.NVMLError when there is no driver."""
    pynvml.nvmlInit()
    notes: list[str] = []
    try:
        gpus = []
        nvlink = False
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total / 1e9
            try:
                cc = tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle))
            except pynvml.NVMLError:
                cc = None
            entry = lookup(name)
            if entry is None:
                notes.append(f"GPU '{name}' is not in the catalog: no price or TFLOP/s known, time is estimated "
                             f"from its memory class; add it to {USER_CATALOG_ENV}")
            gpus.append(Gpu(
                name=entry.name if entry else name,
                memory_gb=round(memory, 2),
                compute_capability=cc,
                tflops_bf16=entry.tflops_bf16 if entry else None,
                price_per_hour_eur=entry.price_per_hour_eur if entry else None,
            ))
            nvlink = nvlink or _has_active_nvlink(pynvml, handle)
        interconnect = "none" if len(gpus) <= 1 else ("nvlink" if nvlink else "pcie")
        return tuple(gpus), interconnect, notes
    finally:
        pynvml.nvmlShutdown()


def _has_active_nvlink(pynvml: Any, handle: Any) -> bool:
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                return True
        except pynvml.NVMLError:
            # Consumer cards and unused link slots answer NOT_SUPPORTED / INVALID_ARGUMENT: no NVLink there.
            continue
    return False


def detect() -> Hardware:
    """This box: GPUs via NVML (never torch), CPU and RAM via the OS. No GPU or no driver -> a CPU-only Hardware."""
    cpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ram = _ram_gb()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return Hardware((), "none", cpu, ram, "detected", ("CUDA_VISIBLE_DEVICES hides all GPUs: CPU only",))
    try:
        import pynvml  # nvidia-ml-py; imported here so `import launcher.hardware` stays light
    except ImportError:
        return Hardware((), "none", cpu, ram, "detected",
                        ("nvidia-ml-py is not installed, so no GPU could be detected: CPU only; "
                         "install ftrun[gpu] on a GPU box, or plan for one with --gpus",))
    try:
        gpus, interconnect, notes = _nvml_gpus(pynvml)
    except pynvml.NVMLError as exc:  # no driver / no device: the box is CPU-only, and we say why
        return Hardware((), "none", cpu, ram, "detected", (f"no NVIDIA driver answered ({exc}): CPU only",))
    if visible:
        # NVML ignores CUDA_VISIBLE_DEVICES; honour it so the plan matches what the worker will see.
        keep = [int(x) for x in visible.split(",") if x.strip().isdigit() and int(x) < len(gpus)]
        if keep:
            gpus = tuple(gpus[i] for i in keep)
            interconnect = "none" if len(gpus) == 1 else interconnect
    return Hardware(gpus, interconnect if gpus else "none", cpu, ram, "detected", tuple(notes))


def main() -> None:  # pragma: no cover - `python -m launcher.hardware` prints what the box has
    hw = detect()
    print(hw.describe())
    for note in hw.notes:
        print("note:", note, file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    main()
