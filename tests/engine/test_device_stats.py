"""Device utilization and memory in the metrics row: the CPU twin measured, the NVML one faked."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megatrain.engine.device_stats import CpuMonitor, NvmlMonitor, device_monitor, nvml_device_ref
from megatrain.engine.train import run
from megatrain.spec import parse_spec

from .helpers import read_jsonl, tiny_spec


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_cpu_monitor_measures_this_process() -> None:
    monitor = CpuMonitor(cores=1)
    _spin(0.3)
    busy = monitor.sample()
    time.sleep(0.3)
    idle = monitor.sample()
    # One spinning thread over one core is ~100 (less when the machine is shared, never 0); the
    # process's other threads can push the raw figure past 100, which reads as the core fully busy.
    assert 0 < busy["cpu_util"] <= 100
    assert idle["cpu_util"] < busy["cpu_util"]  # a sleeping process uses (almost) no CPU time
    assert 0 < busy["device_memory_used_bytes"] < busy["device_memory_total_bytes"]
    assert device_monitor("cpu").cores == torch.get_num_threads()  # type: ignore[attr-defined]


def test_cpu_utilization_is_over_the_rank_s_cores() -> None:
    one, two = CpuMonitor(cores=1), CpuMonitor(cores=2)
    _spin(0.2)
    a, b = one.sample()["cpu_util"], two.sample()["cpu_util"]
    assert b == pytest.approx(a / 2, rel=0.2)  # the same CPU time over twice the cores


def test_nvml_ref_honours_cuda_visible_devices() -> None:
    assert nvml_device_ref(1, None) == 1
    assert nvml_device_ref(1, "") == 1
    assert nvml_device_ref(1, "3,5") == 5
    assert nvml_device_ref(0, "GPU-8f6a,GPU-11c2") == "GPU-8f6a"
    assert nvml_device_ref(0, "MIG-4c1e") == "MIG-4c1e"
    with pytest.raises(ValueError, match="not among"):
        nvml_device_ref(2, "3,5")


class FakeNvml:
    """The pynvml functions the monitor uses, over two GPUs at NVML indices 3 and 5."""

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        self.gpus = {
            3: {"uuid": "GPU-aaa", "name": "NVIDIA A100-SXM4-80GB", "util": 12, "used": 1 << 30},
            5: {"uuid": "GPU-bbb", "name": "NVIDIA H100 80GB HBM3", "util": 87, "used": 50 << 30},
        }
        self.failing = False

    def nvmlInit(self) -> None:  # noqa: N802 (pynvml's names)
        pass

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:  # noqa: N802
        for i, g in self.gpus.items():
            if g["uuid"] == uuid:
                return i
        raise self.NVMLError("Not Found")

    def nvmlDeviceGetName(self, h: int) -> bytes:  # noqa: N802
        return self.gpus[h]["name"].encode()  # older bindings return bytes

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:  # noqa: N802
        if self.failing:
            raise self.NVMLError("GPU is lost")
        return SimpleNamespace(gpu=self.gpus[h]["util"], memory=3)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:  # noqa: N802
        return SimpleNamespace(
            used=self.gpus[h]["used"], total=80 << 30, free=(80 << 30) - self.gpus[h]["used"]
        )


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    # Without NVML's utilization only the CUDA runtime's memory figure is left.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (30 << 30, 80 << 30))
    return fake


def test_gpu_monitor_reads_the_run_s_device(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    row = NvmlMonitor(1, "NVIDIA H100 80GB HBM3").sample()  # cuda:1 is NVML's GPU 5
    assert row == {
        "gpu_util": 87.0,
        "device_memory_used_bytes": 50 << 30,
        "device_memory_total_bytes": 80 << 30,
    }
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaa")
    assert NvmlMonitor(0, "NVIDIA A100-SXM4-80GB").sample()["gpu_util"] == 12.0
    # CUDA's own UUID of the device (bare, as torch prints it) wins over any numbering.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert NvmlMonitor(0, "NVIDIA H100 80GB HBM3", uuid="bbb").sample()["gpu_util"] == 87.0


def test_device_monitor_picks_the_gpu_twin_by_cuda_s_uuid(
    nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid="bbb"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H100 80GB HBM3")
    monitor = device_monitor("cuda:1")
    assert isinstance(monitor, NvmlMonitor) and monitor.index == 1
    assert monitor.sample()["gpu_util"] == 87.0


def test_gpu_monitor_without_a_trustworthy_nvml_reports_memory_only(
    nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    memory_only = {"device_memory_used_bytes": 50 << 30, "device_memory_total_bytes": 80 << 30}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    # CUDA's numbering disagrees with NVML's (fastest-first order on mixed GPUs): not another GPU's figures.
    assert NvmlMonitor(0, "NVIDIA H100 80GB HBM3").sample() == memory_only
    monitor = NvmlMonitor(1, "NVIDIA H100 80GB HBM3")
    assert "gpu_util" in monitor.sample()
    nvml.failing = True  # NVML errors mid-run (or never supports it, on MIG): memory only from then on
    assert monitor.sample() == memory_only
    nvml.failing = False
    assert monitor.sample() == memory_only
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed
    assert NvmlMonitor(1, "NVIDIA H100 80GB HBM3").sample() == memory_only


def test_a_cpu_run_reports_utilization_and_memory(tmp_path: Path, corpus: Path) -> None:
    run(parse_spec(tiny_spec(corpus, train_iters=3)), tmp_path / "out")
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 3
    for r in rows:
        assert 0 < r["cpu_util"] <= 100
        assert 0 < r["device_memory_used_bytes"] < r["device_memory_total_bytes"]
        assert "gpu_util" not in r
