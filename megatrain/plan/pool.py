"""A node pool as an operator describes it: the hardware facts the planner's cost model and the
scheduler's placement read. Pure (pydantic, no torch, no database): the API stores it, the CLI reads
it from YAML (`megatrain plan SPEC --pool POOL.yaml`), the embedded default measures it.

Bandwidths are per device and one direction (what one GPU can push to a peer: NVLink inside a node,
its share of the NICs across nodes), in GB/s (1e9 bytes); latencies are one message's, in
microseconds. Peak TFLOP/s are dense (no sparsity), per device, per precision.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from megatrain.spec_base import NAME_PATTERN
from megatrain.spec_errors import SpecError, format_validation_errors

PoolPrecision = Literal["fp32", "bf16", "fp16", "fp8"]


class PoolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(..., pattern=NAME_PATTERN)
    """The pool's name, as a job spec's resources.pool gives it."""
    accelerator: str = Field("cpu", min_length=1, max_length=64)
    """cpu, or the GPU model (e.g. 'NVIDIA H100 80GB HBM3')."""
    device_memory_bytes: int = Field(..., ge=1 << 20, le=1 << 44)
    """Memory of one device (a GPU; on a CPU pool, the host memory over its slots)."""
    peak_tflops: dict[PoolPrecision, float] = Field(..., min_length=1)
    """Dense peak TFLOP/s of one device per precision (H100 SXM: bf16 989, fp8 1979, fp32 67)."""
    devices_per_node: int = Field(..., ge=1, le=1024)
    """Devices in each node: GPUs, or on a CPU pool its slots (one process each). Tensor parallelism
    stays inside a node."""
    nodes: int = Field(1, ge=1, le=100_000)
    """Nodes in the pool."""
    intra_node_bandwidth_gbps: float = Field(..., gt=0.0, le=1e5)
    """Per device, one direction, inside a node (H100 NVLink 4: ~450)."""
    intra_node_latency_us: float = Field(5.0, ge=0.0, le=1e6)
    """One message's latency inside a node."""
    inter_node_bandwidth_gbps: float = Field(..., gt=0.0, le=1e5)
    """Per device, one direction, across nodes (one 400 Gb/s NIC per GPU: ~50)."""
    inter_node_latency_us: float = Field(10.0, ge=0.0, le=1e6)
    """One message's latency across nodes."""
    storage_write_gbps: float = Field(1.0, gt=0.0, le=1e5)
    """What one node writes to the job's storage (its checkpoint shards), all its ranks together."""
    storage_read_gbps: float = Field(2.0, gt=0.0, le=1e5)
    """What one node reads from the job's storage (a checkpoint to resume from), all its ranks together."""
    startup_s: float = Field(60.0, gt=0.0, le=86_400.0)
    """An attempt's start before its first step, reading storage aside: processes, imports, process
    groups, building the model. The hang watch allows a few times this (and the reads) before it."""

    @model_validator(mode="after")
    def _peaks(self) -> PoolSpec:
        bad = [k for k, v in self.peak_tflops.items() if not 0.0 < v <= 1e6]
        if bad:
            raise ValueError(f"peak_tflops.{bad[0]} must be in (0, 1e6] TFLOP/s")
        return self

    @property
    def is_cpu(self) -> bool:
        return self.accelerator.lower() == "cpu"

    @property
    def total_devices(self) -> int:
        return self.devices_per_node * self.nodes

    def peak(self, precision: str) -> float:
        """Peak TFLOP/s for `precision`, else the next slower precision's that the operator gave
        (fp8 → bf16 → fp16 → fp32: conservative), else the only figures there are."""
        order = ["fp8", "bf16", "fp16", "fp32"]
        for p in order[order.index(precision) if precision in order else 1 :]:
            if p in self.peak_tflops:
                return self.peak_tflops[p]  # type: ignore[index]
        return next(iter(self.peak_tflops.values()))


def parse_pool(data: Any) -> PoolSpec:
    """A pool from a mapping, raising SpecError with field-named messages."""
    if not isinstance(data, dict):
        raise SpecError([{"field": "pool", "message": "a pool must be a mapping (YAML or JSON object)"}])
    try:
        return PoolSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_errors(exc, model=PoolSpec)) from None


def load_pool(path: str | Path) -> PoolSpec:
    """A pool from a YAML (or JSON) file."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise SpecError([{"field": "pool", "message": f"not valid YAML/JSON: {exc}"}]) from None
    return parse_pool(data)
