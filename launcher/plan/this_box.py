"""What this machine has: its GPUs read from NVML (else, where an NVIDIA driver is loaded, from torch.cuda in a child
process), as CUDA_VISIBLE_DEVICES and MIG show them to a CUDA process, its driver, and the box `ftrun plan` sizes for
(--gpus, this machine, the recipe's box:). The cards, the catalog and a `--gpus` spec are launcher/plan/hardware.py's.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from launcher.errors import HardwareError, UsageError
from launcher.plan import links
from launcher.plan.hardware import Gpu, Hardware, USER_CATALOG_ENV, _ram_gb, cpu_cores, from_spec, lookup
from launcher.plan.sizing_constants import GB


# Files the NVIDIA kernel driver creates: the torch fallback runs only where one exists (a CPU box never imports torch).
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
    """Every device CUDA could enumerate, in NVML order, the driver version, and notes; a GPU in MIG mode contributes
    its instances instead (CUDA runs only on those). Raises pynvml.NVMLError without a driver. nvidia-ml-py 13
    pynvml.py: nvmlDeviceGetMigMode -> [current, pending], nvmlDeviceGetMigDeviceHandleByIndex (NOT_FOUND: empty slot).
    """
    pynvml.nvmlInit()
    notes: list[str] = []

    def ask(call: Any, *args: Any, default: Any = None) -> Any:
        try:  # NOT_SUPPORTED (a card without MIG or NVLink), NOT_FOUND (an empty MIG slot), ...
            return call(*args)
        except pynvml.NVMLError:
            return default

    try:
        raw = ask(pynvml.nvmlSystemGetDriverVersion)
        driver = (_text(raw).strip() or None) if raw is not None else _driver_version_from_os()
        devices: list[_Device] = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = _text(pynvml.nvmlDeviceGetName(handle))
            uuid = _text(ask(pynvml.nvmlDeviceGetUUID, handle, default=""))
            cc = ask(lambda: tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle)))
            if ask(pynvml.nvmlDeviceGetMigMode, handle, default=[None])[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
                memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
                devices.append(_Device(uuid, name, memory, cc, nvlink=_has_active_nvlink(pynvml, handle)))
                continue
            instances = []
            for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                mig = ask(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot)
                if mig is None:
                    continue
                ids = ask(
                    lambda: (
                        int(pynvml.nvmlDeviceGetGpuInstanceId(mig)),
                        int(pynvml.nvmlDeviceGetComputeInstanceId(mig)),
                    )
                )
                mig_uuid, mig_name = (
                    _text(ask(pynvml.nvmlDeviceGetUUID, mig, default="")),
                    _text(pynvml.nvmlDeviceGetName(mig)),
                )
                memory = int(pynvml.nvmlDeviceGetMemoryInfo(mig).total)
                instances.append(
                    _Device(mig_uuid, mig_name, memory, cc, parent_name=name, parent_uuid=uuid, mig_ids=ids)
                )
            if not instances:
                notes.append(
                    f"GPU {i} ({name}) has MIG enabled but no MIG instance: CUDA cannot use it "
                    "(create one with nvidia-smi mig, or disable MIG)"
                )
            devices += instances
        return devices, driver, notes
    finally:
        pynvml.nvmlShutdown()


def _has_active_nvlink(pynvml: Any, handle: Any) -> bool:
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                return True
        except pynvml.NVMLError:  # consumer cards and unused link slots: no NVLink there
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
        found = [
            d
            for d in devices
            if d.is_mig
            and (d.parent_uuid or "").lower() == legacy.group(1)
            and d.mig_ids == (int(legacy.group(2)), int(legacy.group(3)))
        ]
    else:
        # CUDA accepts a unique prefix of a UUID; a MIG-enabled card named by its GPU UUID stands for its instances.
        found = [d for d in devices if d.uuid and d.uuid.lower().startswith(low)]
        if not found and low.startswith("gpu-"):
            found = [d for d in devices if d.is_mig and (d.parent_uuid or "").lower().startswith(low)][:1]
    return found[0] if len(found) == 1 else None


def _cuda_view(devices: list[_Device], visible: str | None) -> tuple[list[_Device], list[str]]:
    """What a CUDA process here enumerates: CUDA_VISIBLE_DEVICES applied, and one MIG instance at most."""
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
                    notes.append(
                        f"CUDA_VISIBLE_DEVICES entry '{entry}' names no device on this box: CUDA ignores it "
                        "and every entry after it"
                    )
                break
            if device not in chosen:
                chosen.append(device)
    migs = [d for d in chosen if d.is_mig]
    if len(migs) > 1:
        # MIG user guide, "CUDA Device Enumeration": a process enumerates a single MIG instance however many are
        # visible (pytorch/pytorch#130181), so torchrun's ranks cannot each take one: the job plans for the first.
        notes.append(
            f"{len(migs)} MIG instances are visible, but a CUDA process can use only one: planning for "
            f"{migs[0].uuid or migs[0].name}; run one job per MIG instance, each with its own "
            "CUDA_VISIBLE_DEVICES=MIG-<uuid>"
        )
        chosen = [d for d in chosen if not d.is_mig or d is migs[0]]
    return chosen, notes


def _mig_profile(name: str) -> tuple[str | None, int | None]:
    """'NVIDIA A100-SXM4-80GB MIG 3g.40gb' -> ('3g.40gb', 3)."""
    m = re.search(r"(?:\d+c\.)?(\d+)g\.\d+gb", name.lower())
    return (m.group(0), int(m.group(1))) if m else (None, None)


def _gpu(
    name: str, memory_bytes: int, cc: tuple[int, int] | None, notes: list[str], parent_name: str | None = None
) -> Gpu:
    """A detected device as sizing sees it, priced and rated from the catalog."""
    if parent_name is None and " MIG " in f" {name} ":
        # torch names a MIG instance after its card: "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
        parent_name = name.split(" MIG ")[0]
    entry = lookup(parent_name or name)
    memory = round(memory_bytes / GB, 2)
    if parent_name is None:
        if entry is None:
            notes.append(
                f"GPU '{name}' is not in the catalog: no price or TFLOP/s known, time is estimated "
                f"from its memory class; add it to {USER_CATALOG_ENV}"
            )
        return replace(entry.gpu(), memory_gb=memory, compute_capability=cc) if entry else Gpu(name, memory, cc)
    profile, slices = _mig_profile(name)
    card = entry.name if entry else parent_name
    tflops = entry.tflops_bf16 * slices / MIG_COMPUTE_SLICES if entry and slices else None
    notes.append(
        f"{card} is split by MIG: planning for one MIG instance ({profile or 'profile unknown'}, {memory:.1f} GB"
        + (f", {slices} of {MIG_COMPUTE_SLICES} compute slices" if tflops else ", its compute share unknown")
        + "), not the whole card; a MIG instance's price depends on the provider: set price_per_hour_eur"
    )
    return Gpu(
        f"{card} MIG {profile}" if profile else f"{card} MIG", memory, cc, round(tflops, 1) if tflops else None, None
    )


def _driver_version_from_os() -> str | None:
    for path in DRIVER_VERSION_FILES:
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        # "550.54.14", or "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 ..."
        m = re.search(r"\b(\d{3,}\.\d+(?:\.\d+)?)\b", text)
        if m:
            return m.group(1)
    return None


# Runs in a child process: ftrun's own holds no CUDA context, and it sees what the worker will (CUDA_VISIBLE_DEVICES)
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
        done = subprocess.run(
            [sys.executable, "-c", _TORCH_PROBE], capture_output=True, text=True, timeout=TORCH_PROBE_TIMEOUT_S
        )
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

    if not any(Path(p).exists() for p in NVIDIA_DRIVER_FILES):
        return _cpu_only(
            cpu, ram, f"{why}, and no NVIDIA driver is loaded on this box: CPU only; plan for a GPU box with --gpus"
        )
    if importlib.util.find_spec("torch") is None:
        return _cpu_only(
            cpu, ram, f"{why}, and torch is not installed to ask instead: CPU only; install ftrun[gpu] (nvidia-ml-py)"
        )
    try:
        found = _torch_devices()
    except HardwareError as exc:
        return _cpu_only(cpu, ram, f"{why}, and {exc.args[0] if exc.args else exc}: CPU only")
    if not found:
        return _cpu_only(
            cpu,
            ram,
            f"{why}, and torch.cuda sees no device (CUDA_VISIBLE_DEVICES, or a driver that does not "
            "match torch's CUDA): CPU only",
        )
    notes: list[str] = []
    gpus = tuple(_gpu(d["name"], int(d["total_memory"]), (int(d["major"]), int(d["minor"])), notes) for d in found)
    # torch does not tell NVLink from PCIe; the catalog knows how a card's multi-GPU boxes are built.
    entry = lookup(gpus[0].name) if len(gpus) > 1 else None
    interconnect = links.NONE if len(gpus) == 1 else entry.interconnect if entry else links.PCIE
    notes.insert(
        0,
        f"{why}: GPUs read through torch.cuda instead (name, memory, compute capability); the "
        f"interconnect is not visible that way and is taken as {interconnect} "
        f"({'from the catalog' if entry else 'assumed'}); "
        "install ftrun[gpu] (nvidia-ml-py) for NVML's view",
    )
    return Hardware(gpus, interconnect, cpu, ram, "detected", tuple(notes), _driver_version_from_os())


def _cpu_only(cpu: int, ram: float, note: str) -> Hardware:
    return Hardware((), links.NONE, cpu, ram, "detected", (note,))


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
        return _cpu_only(cpu, ram, "CUDA_VISIBLE_DEVICES hides all GPUs: CPU only")
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
            raise UsageError(
                f"the recipe's box: {box!r} is not a box ftrun knows ({exc.message})", fix=exc.fix
            ) from None
        return (
            replace(named, source=f"recipe box: {box}"),
            f"the recipe's box: {box} (this machine has no GPU; --gpus plans for another box)",
        )
    return here, "this machine (no GPU detected, and the recipe names no box:; --gpus plans for a GPU box)"
