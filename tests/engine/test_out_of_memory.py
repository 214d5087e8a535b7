"""A failed allocation is told apart from other failures, on every device's error type."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatrain.engine.runtime import is_out_of_memory, record_failure
from megatrain.failures import Activity


def test_allocation_failures_of_every_device_are_out_of_memory() -> None:
    try:
        torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: the CPU allocator refuses at once
    except RuntimeError as exc:
        cpu_error: BaseException = exc
    assert is_out_of_memory(cpu_error)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of memory"))  # only the allocators' error types


def test_the_failure_record_is_what_the_worker_reads(tmp_path: Path) -> None:
    from megatrain.failures import pick, read_records

    assert pick(read_records(tmp_path)) is None
    record_failure(tmp_path, 3, RuntimeError("boom"), Activity("training", 4))
    assert pick(read_records(tmp_path))["kind"] == "infrastructure"
    oom = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
    record_failure(tmp_path, 1, oom, Activity("training", 5))
    picked = pick(read_records(tmp_path))
    assert (picked["kind"], picked["rank"], picked["step"]) == ("out_of_memory", 1, 5)
    assert picked["message"] == "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"
    assert json.loads((tmp_path / "failure.rank1.json").read_text())["exception"] == "RuntimeError"
