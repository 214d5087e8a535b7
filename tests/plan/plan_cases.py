"""Pools and specs the planner tests share."""

from __future__ import annotations

from typing import Any

from megatrain.plan.pool import PoolSpec
from megatrain.spec import JobSpec, parse_spec


def gpu_pool(nodes: int = 1, per_node: int = 8, memory_gib: float = 80.0, **kw: Any) -> PoolSpec:
    return PoolSpec(
        name="gpus",
        accelerator="NVIDIA H100 80GB HBM3",
        device_memory_bytes=int(memory_gib * (1 << 30)),
        peak_tflops={"bf16": 989.0, "fp32": 67.0},
        devices_per_node=per_node,
        nodes=nodes,
        intra_node_bandwidth_gbps=kw.pop("intra", 450.0),
        inter_node_bandwidth_gbps=kw.pop("inter", 50.0),
        **kw,
    )


def spec(model: dict[str, Any] | None = None, devices: int | None = None, **training: Any) -> JobSpec:
    raw: dict[str, Any] = {
        "name": "plan-test",
        "model": {"arch": "llama", "num_layers": 8, "hidden_size": 1024, "num_attention_heads": 16,
                  "num_query_groups": 8, "seq_length": 1024, "vocab_size": 32000, **(model or {})},
        "data": {"train": [{"dataset": "corpus"}]},
        "training": {"global_batch_size": 64, "micro_batch_size": "auto", "precision": "bf16", **training},
    }  # fmt: skip
    if devices is not None:
        raw["resources"] = {"devices": devices}
    return parse_spec(raw)


LLAMA_405B = {"num_layers": 126, "hidden_size": 16384, "num_attention_heads": 128, "num_query_groups": 8,
              "ffn_hidden_size": 53248, "seq_length": 8192, "vocab_size": 128256}  # fmt: skip
