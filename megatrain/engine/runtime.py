"""This process's place in a run: torchrun's environment, the process group, the device, threads and
the precision the hardware really runs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatrain.failures import OUT_OF_MEMORY, Activity, describe, write_record
from megatrain.settings import get_settings


@dataclass(frozen=True)
class Dist:
    """This process's place in the job; `group` is None for a single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    group: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> str:
        return f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu"


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def native_bf16(device: str) -> bool:
    """Whether `device` runs bf16 in hardware (not emulated)."""
    if device.startswith("cuda"):
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    return cpu_has_native_bf16()


def effective_precision(precision: str, device: str) -> str:
    """The precision a run uses: auto resolved (bf16 where `device` runs it natively, else fp32),
    and bf16/fp16 asked for on a CPU that only emulates them run in fp32. fp8 is bf16 with float8
    GEMMs: on a CPU it follows bf16's rule (and its GEMMs are emulated: the tests' path); on a GPU
    without float8 GEMMs (compute capability < 8.9) it runs bf16.

    Emulated bf16 measured ~25× slower than fp32 on this project's 2-core AVX2 machine, so there
    such jobs run in fp32 unless MEGATRAIN_CPU_LOW_PRECISION=1 asks for the real thing.
    """
    if precision == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    if precision == "fp8" and device.startswith("cuda"):
        # Emulated float8 GEMMs on an older GPU would be slower than bf16, for bf16's accuracy or worse.
        return "fp8" if torch.cuda.get_device_capability(device) >= (8, 9) else "bf16"
    if precision == "fp32" or device.startswith("cuda"):
        return precision
    if cpu_has_native_bf16() or get_settings().cpu_low_precision:
        return precision
    return "fp32"


def _set_threads(local_world_size: int) -> None:
    """Share this machine's cores among the local ranks instead of each grabbing them all."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // local_world_size))


def flight_recorder_env(out_dir: Path) -> dict[str, str]:
    """NCCL's flight recorder (read when the process group is made): a ring of each rank's last
    collectives, dumped to out_dir/nccl_trace.rank{R} when a collective times out, so a hang names
    the collective and the ranks that never joined it."""
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(out_dir / "nccl_trace.rank"),
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(out_dir / "nccl_trace.rank"),  # its older name
    }


def init_distributed(out_dir: Path | None = None, timeout_s: float | None = None) -> Dist:
    """Join torchrun's process group (nccl on CUDA, gloo on CPU), or a single process's Dist. A
    collective waits at most `timeout_s` (settings.collective_timeout_s); on CUDA the flight recorder
    dumps into `out_dir` when one times out (an operator's own TORCH_* settings win)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if not torch.cuda.is_available():
        _set_threads(local_world)
    if world_size <= 1:
        return Dist()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = timedelta(seconds=timeout_s or get_settings().collective_timeout_s)
    if torch.cuda.is_available():
        for key, value in flight_recorder_env(out_dir or Path.cwd()).items():
            os.environ.setdefault(key, value)
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return Dist(
        rank=dist.get_rank(),
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world,
        group=dist.group.WORLD,
    )


# Phrases of an allocation failure: the CPU allocator's c10 error ("DefaultCPUAllocator: can't
# allocate memory", "not enough memory") is a plain RuntimeError, as is an NCCL/cuBLAS "out of memory".
_OOM_PHRASES = ("can't allocate memory", "not enough memory", "out of memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is a failed allocation (CUDA's OutOfMemoryError, the CPU allocator's error,
    Python's MemoryError): the same attempt would fail again, so it must not be retried."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(p in str(exc) for p in _OOM_PHRASES)


def record_failure(out: Path, rank: int, exc: BaseException, activity: Activity) -> dict[str, Any]:
    """Write OUT/failure.rank{R}.json for `exc` (what failed, where, user or infrastructure error;
    a failed allocation is out_of_memory) and return the record."""
    record = describe(exc, rank, activity, OUT_OF_MEMORY if is_out_of_memory(exc) else None)
    write_record(out, record)
    return record
