"""The pool description the planner and the scheduler read."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatrain.plan.pool import load_pool, parse_pool
from megatrain.spec_errors import SpecError

H100 = {
    "name": "h100",
    "accelerator": "NVIDIA H100 80GB HBM3",
    "device_memory_bytes": 80 << 30,
    "peak_tflops": {"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0},
    "devices_per_node": 8,
    "nodes": 4,
    "intra_node_bandwidth_gbps": 450.0,
    "inter_node_bandwidth_gbps": 50.0,
}


def test_a_pool_reads_from_yaml_with_its_peaks(tmp_path: Path) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text("\n".join(f"{k}: {v}" for k, v in H100.items()))
    pool = load_pool(path)
    assert pool.total_devices == 32 and not pool.is_cpu
    assert (pool.peak("bf16"), pool.peak("fp8"), pool.peak("fp32")) == (989.0, 1979.0, 67.0)
    assert pool.peak("fp16") == 67.0  # not given: the next slower precision's


def test_bad_pools_name_their_fields() -> None:
    with pytest.raises(SpecError) as err:
        parse_pool(H100 | {"devices_per_node": 0, "peak_tflops": {}})
    fields = {e["field"] for e in err.value.errors}
    assert {"devices_per_node", "peak_tflops"} <= fields
    with pytest.raises(SpecError, match="peak_tflops.bf16"):
        parse_pool(H100 | {"peak_tflops": {"bf16": -1.0}})
    with pytest.raises(SpecError, match="mapping"):
        parse_pool([1])
