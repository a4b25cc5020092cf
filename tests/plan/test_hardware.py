"""--gpus specs, the GPU catalog, detection: NVML (stubbed: MIG, UUID and index lists), torch fallback, no driver."""

from __future__ import annotations

import sys
import types

import pytest

from launcher.plan import hardware, this_box
from launcher.errors import UsageError
from launcher.plan.hardware import from_spec
from launcher.plan.this_box import detect


@pytest.mark.parametrize(
    "spec,name,count,interconnect",
    [
        ("4xH100-80GB", "H100-80GB", 4, "nvlink"),
        ("RTX4090", "RTX4090", 1, "none"),
        ("2xA100-80GB", "A100-80GB", 2, "nvlink"),
        ("2 x rtx4090", "RTX4090", 2, "pcie"),
        ("8xB200", "B200", 8, "nvlink"),
        ("h100", "H100-80GB", 1, "none"),
        ("A100", "A100-80GB", 1, "none"),  # the bare name means the common rental card
    ],
)
def test_spec_parsing(spec, name, count, interconnect):
    hw = from_spec(spec)
    assert hw.count == count and hw.gpu.name == name and hw.interconnect == interconnect
    assert hw.source == f"--gpus {spec}"


@pytest.mark.parametrize("spec", ["4xH1000", "GTX480", "0xH100-80GB", "x", ""])
def test_bad_spec_lists_known_names(spec):
    with pytest.raises(UsageError) as err:
        from_spec(spec)
    assert "H100-80GB" in err.value.fix and "RTX4090" in err.value.fix


@pytest.mark.parametrize("name,price", [("RTX4090", 0.58), ("L40S", 1.06), ("A100-80GB", 1.46), ("H100-80GB", 3.90)])
def test_article_prices(name, price):
    assert hardware.catalog()[name].price_per_hour_eur == price


def test_box_price_is_count_times_card():
    assert from_spec("4xH100-80GB").price_per_hour_eur == pytest.approx(15.60)


def test_catalog_has_the_issue_cards():
    for name in ("RTX4090", "RTX5090", "L40S", "A100-40GB", "A100-80GB", "H100-80GB", "H200", "B200"):
        assert name in hardware.catalog()


def test_user_catalog_overrides_price(tmp_path, monkeypatch):
    f = tmp_path / "gpus.yaml"
    f.write_text("gpus:\n  H100-80GB:\n    memory_gb: 79.65\n    tflops_bf16: 989\n    price_per_hour_eur: 2.0\n")
    monkeypatch.setenv("FTRUN_GPUS", str(f))
    hardware.reset_catalog_cache()
    try:
        assert from_spec("H100").price_per_hour_eur == 2.0
        assert "RTX4090" in hardware.catalog()  # the rest of the built-in catalog stays
    finally:
        hardware.reset_catalog_cache()


def test_nvml_names_map_to_catalog():
    assert hardware.lookup("NVIDIA H100 80GB HBM3").name == "H100-80GB"
    assert hardware.lookup("NVIDIA GeForce RTX 4090").name == "RTX4090"
    assert hardware.lookup("NVIDIA A100-SXM4-40GB").name == "A100-40GB"


def test_detect_without_driver_is_cpu_only(monkeypatch, tmp_path):
    """A fake pynvml whose init fails like on a box without NVIDIA driver: CPU-only, said so."""
    monkeypatch.setattr(this_box, "NVIDIA_DRIVER_FILES", (str(tmp_path / "none"),))
    fake = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def init():
        raise NVMLError("Driver Not Loaded")

    fake.NVMLError = NVMLError
    fake.nvmlInit = init
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    hw = detect()
    assert hw.is_cpu_only and hw.count == 0 and hw.cpu_count >= 1 and hw.ram_gb > 0
    assert any("Driver Not Loaded" in n for n in hw.notes)


MIB = 2**20


def fake_nvml(cards, driver="550.54.14"):
    """A pynvml module object answering like nvidia-ml-py 13 for `cards`: dicts with name, uuid, mib, cc,
    nvlink, and for a card in MIG mode `mig`: a list of instances (name, uuid, mib, slot, gi, ci)."""
    fake = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    fake.NVMLError = NVMLError
    fake.NVML_FEATURE_ENABLED = 1
    fake.NVML_NVLINK_MAX_LINKS = 2
    fake.NVML_DEVICE_MIG_ENABLE = 1
    fake.calls = []
    fake.nvmlInit = lambda: fake.calls.append("init")
    fake.nvmlShutdown = lambda: fake.calls.append("shutdown")
    fake.nvmlSystemGetDriverVersion = lambda: driver
    fake.nvmlDeviceGetCount = lambda: len(cards)
    fake.nvmlDeviceGetHandleByIndex = lambda i: ("gpu", i)

    def obj(h):
        card = cards[h[1]]
        if h[0] == "gpu":
            return card
        return next(m for m in card["mig"] if m["slot"] == h[2])

    fake.nvmlDeviceGetName = lambda h: obj(h)["name"].encode()  # older bindings answer bytes
    fake.nvmlDeviceGetUUID = lambda h: obj(h)["uuid"]
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=obj(h)["mib"] * MIB)

    def cc(h):
        if h[0] != "gpu":
            raise NVMLError("Not Supported")
        return cards[h[1]].get("cc", (9, 0))

    fake.nvmlDeviceGetCudaComputeCapability = cc

    def nvlink(h, link):
        if not cards[h[1]].get("nvlink"):
            raise NVMLError("Not Supported")
        return 1

    fake.nvmlDeviceGetNvLinkState = nvlink

    def mig_mode(h):
        if "mig" not in cards[h[1]]:
            raise NVMLError("Not Supported")  # what a card without MIG answers
        return [1, 1]

    fake.nvmlDeviceGetMigMode = mig_mode
    fake.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7

    def mig_handle(h, slot):
        if not any(m["slot"] == slot for m in cards[h[1]]["mig"]):
            raise NVMLError("Not Found")
        return ("mig", h[1], slot)

    fake.nvmlDeviceGetMigDeviceHandleByIndex = mig_handle
    fake.nvmlDeviceGetGpuInstanceId = lambda h: obj(h)["gi"]
    fake.nvmlDeviceGetComputeInstanceId = lambda h: obj(h)["ci"]
    return fake


H100 = "NVIDIA H100 80GB HBM3"


def h100(i, **extra):
    return {"name": H100, "uuid": f"GPU-{i}{i}{i}{i}aaaa-0000", "mib": 81559, "cc": (9, 0), "nvlink": True, **extra}


def mig(name, uuid, mib, slot, gi, ci=0):
    return {"name": f"{H100} MIG {name}", "uuid": uuid, "mib": mib, "slot": slot, "gi": gi, "ci": ci}


MIG_CARD = h100(
    0,
    mig=[
        mig("3g.40gb", "MIG-aaaa1111-3g", 40448, slot=0, gi=2),
        mig("2g.20gb", "MIG-bbbb2222-2g", 20096, slot=3, gi=5),
    ],
)


def nvml_box(monkeypatch, cards, visible=None, driver="550.54.14"):
    fake = fake_nvml(cards, driver)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    hw = detect()
    assert fake.calls == ["init", "shutdown"]
    return hw


def test_detect_reads_nvml(monkeypatch):
    hw = nvml_box(monkeypatch, [h100(0), h100(1)])
    assert hw.count == 2 and hw.interconnect == "nvlink"
    assert hw.gpu.name == "H100-80GB" and hw.gpu.memory_gb == pytest.approx(79.65, abs=0.01)
    assert hw.gpu.compute_capability == (9, 0) and hw.price_per_hour_eur == pytest.approx(7.8)
    assert hw.driver_version == "550.54.14" and hw.to_dict()["driver_version"] == "550.54.14"
    assert hw.notes == ()


def test_mig_plans_one_instance_with_its_own_memory(monkeypatch):
    """NVML lists the parent (80 GB); CUDA gets a MIG instance, and only one per process."""
    hw = nvml_box(monkeypatch, [MIG_CARD])
    assert hw.count == 1 and hw.interconnect == "none"
    g = hw.gpu
    assert g.name == "H100-80GB MIG 3g.40gb" and g.memory_gb == pytest.approx(40448 * MIB / 2**30, abs=0.01)
    assert g.tflops_bf16 == pytest.approx(989 * 3 / 7, abs=0.1) and g.compute_capability == (9, 0)
    assert g.price_per_hour_eur is None and hw.price_per_hour_eur is None
    assert any("a CUDA process can use only one" in n for n in hw.notes)
    assert any("split by MIG" in n and "3g.40gb" in n for n in hw.notes)


@pytest.mark.parametrize(
    "visible,profile,mib",
    [
        ("MIG-bbbb2222-2g", "2g.20gb", 20096),  # full MIG UUID
        ("MIG-bbbb", "2g.20gb", 20096),  # a unique prefix, as CUDA accepts
        ("MIG-GPU-0000aaaa-0000/5/0", "2g.20gb", 20096),  # the older MIG-GPU-<uuid>/<gi>/<ci> form
        ("MIG-aaaa1111-3g,MIG-bbbb2222-2g", "3g.40gb", 40448),  # two visible: the process gets the first
    ],
)
def test_mig_uuid_selects_the_instance(monkeypatch, visible, profile, mib):
    hw = nvml_box(monkeypatch, [MIG_CARD, h100(1)], visible=visible)
    assert hw.count == 1 and hw.gpu.name == f"H100-80GB MIG {profile}"
    assert hw.gpu.memory_gb == pytest.approx(mib * MIB / 2**30, abs=0.01)


def test_mig_enabled_without_instances_is_said(monkeypatch):
    hw = nvml_box(monkeypatch, [h100(0, mig=[]), h100(1)])
    assert hw.count == 1 and hw.gpu.name == "H100-80GB" and hw.gpu.memory_gb == pytest.approx(79.65, abs=0.01)
    assert any("MIG enabled but no MIG instance" in n for n in hw.notes)


@pytest.mark.parametrize(
    "visible,count,note",
    [
        ("GPU-3333aaaa-0000,GPU-1111aaaa-0000", 2, None),
        ("GPU-2222", 1, None),  # abbreviated UUID
        ("GPU-1111aaaa-0000,GPU-ffff,GPU-2222aaaa-0000", 1, "GPU-ffff"),  # CUDA stops at an entry it cannot find
        ("1,3", 2, None),
        ("0,7,1", 1, "'7'"),
        ("2,-1,3", 1, None),  # -1 ends the list, as CUDA reads it
    ],
)
def test_cuda_visible_devices_lists(monkeypatch, visible, count, note):
    hw = nvml_box(monkeypatch, [h100(i) for i in range(4)], visible=visible)
    assert hw.count == count and hw.interconnect == ("nvlink" if count > 1 else "none")
    assert any(note in n for n in hw.notes) if note else hw.notes == ()


def test_visible_index_picks_that_card(monkeypatch):
    rtx = {"name": "NVIDIA GeForce RTX 4090", "uuid": "GPU-4090", "mib": 24564, "cc": (8, 9)}
    hw = nvml_box(monkeypatch, [rtx, h100(1)], visible="1")
    assert hw.count == 1 and hw.gpu.name == "H100-80GB"
    hw = nvml_box(monkeypatch, [rtx, h100(1)], visible="GPU-4090")
    assert hw.count == 1 and hw.gpu.name == "RTX4090"


FAKE_TORCH_CUDA = """
import types
DEVICES = {devices!r}
FAIL = {fail!r}
def is_available():
    if FAIL:
        raise RuntimeError(FAIL)
    return bool(DEVICES)
def device_count():
    return len(DEVICES)
def get_device_properties(i):
    name, mib, major, minor = DEVICES[i]
    return types.SimpleNamespace(name=name, total_memory=mib * 2**20, major=major, minor=minor)
"""


@pytest.fixture
def no_nvml_box(monkeypatch, tmp_path):
    """A box with an NVIDIA driver (its version file) but no nvidia-ml-py, and a stub torch.cuda that the
    probe's child process imports instead of the real torch (PYTHONPATH)."""
    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Thu Oct 19 18:56:32 UTC 2023\n")
    monkeypatch.setattr(this_box, "NVIDIA_DRIVER_FILES", (str(version),))
    monkeypatch.setattr(this_box, "DRIVER_VERSION_FILES", (str(tmp_path / "missing"), str(version)))
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def torch_sees(devices, fail=None):
        pkg = tmp_path / "stub" / "torch"
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text("from . import cuda\n")
        (pkg / "cuda.py").write_text(FAKE_TORCH_CUDA.format(devices=devices, fail=fail))
        monkeypatch.setenv("PYTHONPATH", str(tmp_path / "stub"))

    return torch_sees


def test_without_nvml_torch_is_asked_and_that_is_said(no_nvml_box):
    no_nvml_box([("NVIDIA GeForce RTX 4090", 24564, 8, 9), ("NVIDIA GeForce RTX 4090", 24564, 8, 9)])
    hw = detect()
    assert hw.count == 2 and hw.gpu.name == "RTX4090" and hw.gpu.compute_capability == (8, 9)
    assert hw.gpu.memory_gb == pytest.approx(23.99, abs=0.01) and hw.interconnect == "pcie"
    assert hw.driver_version == "535.129.03"
    [fallback] = [n for n in hw.notes if "torch.cuda" in n]
    assert "nvidia-ml-py is not installed" in fallback and "pcie (from the catalog)" in fallback


def test_nvml_failing_falls_back_to_torch_mig_included(no_nvml_box, monkeypatch):
    fake = fake_nvml([])

    def init():
        raise fake.NVMLError("NVML Shared Library Not Found")

    fake.nvmlInit = init
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    no_nvml_box([(f"{H100} MIG 3g.40gb", 40448, 9, 0)])  # torch names a MIG instance after its card
    hw = detect()
    assert hw.count == 1 and hw.gpu.name == "H100-80GB MIG 3g.40gb" and hw.gpu.memory_gb < 45
    assert any("NVML did not answer (NVML Shared Library Not Found)" in n for n in hw.notes)


def test_torch_failing_is_cpu_only_with_the_reason(no_nvml_box):
    no_nvml_box([], fail="CUDA driver version is insufficient for CUDA runtime version")
    hw = detect()
    assert hw.is_cpu_only
    assert any("torch.cuda failed" in n and "insufficient" in n for n in hw.notes)


def test_no_driver_never_imports_torch(monkeypatch, tmp_path):
    monkeypatch.setattr(this_box, "NVIDIA_DRIVER_FILES", (str(tmp_path / "none"),))
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def must_not_run():
        raise AssertionError("torch probed on a box without NVIDIA driver")

    monkeypatch.setattr(this_box, "_torch_devices", must_not_run)
    hw = detect()
    assert hw.is_cpu_only and any("no NVIDIA driver" in n for n in hw.notes)


@pytest.mark.parametrize(
    "names,driver,off",
    [
        (["RTX4090", "RTX4090"], "535.129.03", True),  # accelerate's own test: "RTX 40" and < 550.40.07
        (["NVIDIA GeForce RTX 4080"], "550.40.06", True),
        (["RTX4090"], "550.40.07", False),
        (["RTX4090"], "560.35.03", False),
        (["RTX4090"], None, True),  # unknown driver: NCCL told to do without P2P (Ada GeForce has none)
        (["H100-80GB"], "535.129.03", False),
        (["RTX5090"], "535.129.03", False),
    ],
)
def test_nccl_p2p_ib_rule(names, driver, off):
    assert hardware.nccl_p2p_ib_unsupported(names, driver) is off


def test_cuda_visible_devices_empty_means_cpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert detect().is_cpu_only


def test_this_box_is_detected():
    hw = detect()
    assert hw.source == "detected" and hw.cpu_count >= 1 and hw.ram_gb > 0
    assert hw.is_cpu_only == (hw.count == 0)
