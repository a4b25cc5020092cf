"""--gpus specs, the GPU catalog, and detection on a box without NVIDIA driver."""

from __future__ import annotations

import sys
import types

import pytest

from launcher import hardware
from launcher.errors import UsageError
from launcher.hardware import detect, from_spec


@pytest.mark.parametrize("spec,name,count,interconnect", [
    ("4xH100-80GB", "H100-80GB", 4, "nvlink"),
    ("RTX4090", "RTX4090", 1, "none"),
    ("2xA100-80GB", "A100-80GB", 2, "nvlink"),
    ("2 x rtx4090", "RTX4090", 2, "pcie"),
    ("8xB200", "B200", 8, "nvlink"),
    ("h100", "H100-80GB", 1, "none"),
    ("A100", "A100-80GB", 1, "none"),  # the bare name means the common rental card
])
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
    f.write_text("gpus:\n  H100-80GB:\n    memory_gb: 85.52\n    tflops_bf16: 989\n    price_per_hour_eur: 2.0\n")
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


def test_detect_without_driver_is_cpu_only(monkeypatch):
    """A fake pynvml whose init fails like on a box without NVIDIA driver: CPU-only, said so."""
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


def test_detect_reads_nvml(monkeypatch):
    fake = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    fake.NVMLError = NVMLError
    fake.NVML_FEATURE_ENABLED = 1
    fake.NVML_NVLINK_MAX_LINKS = 2
    fake.nvmlInit = lambda: None
    fake.nvmlShutdown = lambda: None
    fake.nvmlDeviceGetCount = lambda: 2
    fake.nvmlDeviceGetHandleByIndex = lambda i: i
    fake.nvmlDeviceGetName = lambda h: "NVIDIA H100 80GB HBM3"
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=81559 * 2**20)
    fake.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    fake.nvmlDeviceGetNvLinkState = lambda h, link: 1
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    hw = detect()
    assert hw.count == 2 and hw.interconnect == "nvlink"
    assert hw.gpu.name == "H100-80GB" and hw.gpu.memory_gb == pytest.approx(85.52, abs=0.01)
    assert hw.gpu.compute_capability == (9, 0) and hw.price_per_hour_eur == pytest.approx(7.8)


def test_cuda_visible_devices_empty_means_cpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert detect().is_cpu_only


def test_this_box_is_detected():
    hw = detect()
    assert hw.source == "detected" and hw.cpu_count >= 1 and hw.ram_gb > 0
    assert hw.is_cpu_only == (hw.count == 0)
