"""How busy the run's device is, and its memory, for the metrics row (the dashboard charts them).

One interface, two twins, chosen by `device_monitor(device)`:
  - a GPU: NVML (nvidia-ml-py) `gpu_util` (percent of the last sample period in which a kernel
    ran, as nvidia-smi shows it) and the device's memory in use / total, for the GPU the rank runs
    on (found by CUDA's UUID of it, else by CUDA_VISIBLE_DEVICES). Without NVML (not installed, no
    driver access, a MIG slice) only the memory is reported, from the CUDA runtime.
  - a CPU: `cpu_util`, this process's CPU time over the wall time since the last sample, as a
    percent of the cores the rank was given (torch's thread count, its share of the machine), and
    this process's resident memory / the memory it may use (utilization is capped at 100).
Both report `device_memory_used_bytes` and `device_memory_total_bytes`. A measurement that fails
is left out of the row, never a reason to stop training.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from megatrain.plan.memory import host_memory_bytes

log = logging.getLogger(__name__)


class DeviceMonitor(Protocol):
    def sample(self) -> dict[str, float | int]:
        """Utilization since the previous sample (or since construction) and memory now."""
        ...


def device_monitor(device: str) -> DeviceMonitor:
    """The monitor for a run's device string ("cpu", "cuda", "cuda:1")."""
    if device.startswith("cuda"):
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)  # absent on some builds
        return NvmlMonitor(index, torch.cuda.get_device_name(index), None if uuid is None else str(uuid))
    return CpuMonitor(torch.get_num_threads())


# -- CPU ---------------------------------------------------------------------------------------


def _resident_bytes() -> int:
    """This process's resident set now (/proc), else its peak (getrusage, where /proc is absent)."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss * 1024 if os.uname().sysname == "Linux" else rss)


class CpuMonitor:
    """This process's CPU utilization over `cores` cores between samples, and its memory."""

    def __init__(self, cores: int):
        self.cores = max(1, cores)
        self._total = host_memory_bytes()
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def sample(self) -> dict[str, float | int]:
        wall, cpu = time.perf_counter(), time.process_time()
        elapsed = wall - self._wall
        row: dict[str, float | int] = {
            "device_memory_used_bytes": _resident_bytes(),
            "device_memory_total_bytes": self._total,
        }
        if elapsed > 0:
            # process_time counts every thread of the process (intra-op pool, gloo, data loading), so
            # the raw figure passes 100 when helper threads run beside a busy pool; the cores given
            # to the rank are then fully busy, which is what the chart's 100% means.
            row["cpu_util"] = min(100.0, 100.0 * (cpu - self._cpu) / elapsed / self.cores)
        self._wall, self._cpu = wall, cpu
        return row


# -- GPU ---------------------------------------------------------------------------------------


def nvml_device_ref(index: int, visible: str | None) -> int | str:
    """The NVML index (int) or UUID (str) of CUDA device `index` under CUDA_VISIBLE_DEVICES."""
    if not visible:
        return index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if index >= len(entries):
        raise ValueError(f"CUDA device {index} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    entry = entries[index]
    return int(entry) if entry.isdigit() else entry  # "GPU-…" / "MIG-…" UUIDs


def _nvml_handle(nvml: Any, index: int, name: str, uuid: str | None) -> Any:
    """NVML's handle of CUDA device `index`: by its UUID where CUDA gives one, else by its position
    in CUDA_VISIBLE_DEVICES, checked by name."""
    if uuid:
        # CUDA prints the bare UUID; NVML names a whole GPU "GPU-<uuid>" and a MIG slice "MIG-<uuid>".
        for prefix in ("GPU-", "MIG-"):
            try:
                return nvml.nvmlDeviceGetHandleByUUID(prefix + uuid)
            except nvml.NVMLError:
                pass
    ref = nvml_device_ref(index, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if isinstance(ref, int):
        handle = nvml.nvmlDeviceGetHandleByIndex(ref)
    else:
        handle = nvml.nvmlDeviceGetHandleByUUID(ref)
    nvml_name = nvml.nvmlDeviceGetName(handle)
    nvml_name = nvml_name.decode() if isinstance(nvml_name, bytes) else nvml_name
    # CUDA numbers devices fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, NVML by PCI bus: on a
    # machine of mixed GPUs the two can disagree, and another GPU's figures are worse than none.
    if nvml_name != name:
        raise ValueError(f"NVML device {ref} is {nvml_name!r}, CUDA device {index} is {name!r}")
    return handle


class NvmlMonitor:
    """Utilization and memory of CUDA device `index` (this process's numbering) through NVML."""

    def __init__(self, index: int, name: str, uuid: str | None = None):
        self.index = index
        self._nvml: Any = None
        self._handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = _nvml_handle(pynvml, index, name, uuid)
            self._nvml = pynvml
        except Exception as exc:  # ImportError, NVMLError (no driver access), ValueError above
            self._handle = None
            log.warning("no GPU utilization for cuda:%d (%s); reporting memory only", index, exc)

    def sample(self) -> dict[str, float | int]:
        if self._handle is not None:
            try:
                util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
                mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
                return {
                    "gpu_util": float(util.gpu),
                    "device_memory_used_bytes": int(mem.used),
                    "device_memory_total_bytes": int(mem.total),
                }
            except self._nvml.NVMLError as exc:
                # e.g. NOT_SUPPORTED on a MIG slice: say so once, then stop asking.
                log.warning("no GPU utilization for cuda:%d from now on (%s)", self.index, exc)
                self._handle = None
        try:
            free, total = torch.cuda.mem_get_info(self.index)
        except RuntimeError:
            return {}
        return {"device_memory_used_bytes": int(total - free), "device_memory_total_bytes": int(total)}
