"""The planner estimates in the precision a pool's devices will run: auto is bf16 on a GPU pool (or
an unknown one) and fp32 on a CPU pool; an explicit precision is estimated as asked."""

from __future__ import annotations

import pytest

from megatrain.plan.layout import resolve_layout
from megatrain.plan.memory import from_spec, planned_precision
from megatrain.spec import parse_spec


def test_planned_precision() -> None:
    assert planned_precision("auto", "cpu") == "fp32"
    assert planned_precision("auto", "NVIDIA H100 80GB HBM3") == "bf16"
    assert planned_precision("auto", None) == "bf16"
    assert planned_precision("bf16", "cpu") == "bf16"
    assert planned_precision("fp16", "NVIDIA A100") == "fp16"
    assert planned_precision("fp8", "NVIDIA H100 80GB HBM3") == "fp8"
    with pytest.raises(ValueError, match="must be auto, fp32, bf16, fp16 or fp8"):
        planned_precision("fp4", "cpu")


def test_auto_spec_is_estimated_for_the_pool() -> None:
    spec = parse_spec({"name": "p", "data": {"train": [{"path": "file:///d/c.jsonl"}]}})
    assert spec.training.precision == "auto"
    layout = resolve_layout(spec)
    on_cpu = from_spec(spec, layout, accelerator="cpu")
    on_gpu = from_spec(spec, layout, accelerator="NVIDIA H100 80GB HBM3")
    # fp32 keeps 4-byte weights (main weights alias them); bf16 2-byte weights + fp32 main weights.
    assert on_cpu.params_bytes == 4 * on_cpu.num_params
    assert on_gpu.params_bytes == 2 * on_gpu.num_params
    assert on_cpu.optimizer_bytes == 8 * on_cpu.num_params
    assert on_gpu.optimizer_bytes == 12 * on_gpu.num_params
    explicit = parse_spec({"name": "p", "data": {"train": [{"path": "file:///d/c.jsonl"}]},
                           "training": {"precision": "bf16"}})  # fmt: skip
    assert from_spec(explicit, layout, accelerator="cpu").params_bytes == on_gpu.params_bytes
