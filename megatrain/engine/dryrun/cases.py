"""The real shapes the dryrun holds the planner to (tests/engine/test_dryrun.py and
benchmarks/dryrun_vs_planner.py).

Published model shapes at 4,096-token sequences and one sequence per micro-batch, bf16, each on a
layout its size calls for. A case runs a few micro-batches per step (enough for the pipeline's
steady state), and the planner is given the same count.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatrain.plan.layout import Layout, resolve_layout
from megatrain.spec import JobSpec, parse_spec

LLAMA3_8B = {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 8,
             "ffn_hidden_size": 14336, "vocab_size": 128256, "rope_theta": 500000.0}  # fmt: skip
LLAMA3_70B = {"num_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, "num_query_groups": 8,
              "ffn_hidden_size": 28672, "vocab_size": 128256, "rope_theta": 500000.0}  # fmt: skip
MIXTRAL_8X7B = {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 8,
                "ffn_hidden_size": 14336, "vocab_size": 32000, "rope_theta": 1e6,
                "moe": {"num_experts": 8, "router_topk": 2}}  # fmt: skip


@dataclass(frozen=True)
class Case:
    name: str
    model: dict[str, Any]
    parallelism: dict[str, Any]
    rank: int
    """The rank run: pipeline stage 0 (the most micro-batches in flight, and the embedding)."""
    microbatches: int
    """Per step and dp rank."""
    seq_length: int = 4096
    training: dict[str, Any] = dataclasses.field(default_factory=dict)
    """More of training: (method: lora, lora: {...}) for a LoRA run."""

    def spec(self) -> JobSpec:
        dp = self.parallelism.get("dp", 1)
        return parse_spec({
            "name": self.name.lower().replace(" ", "-"),
            "model": {"arch": "llama", "seq_length": self.seq_length, **self.model},
            "data": {"train": [{"dataset": "corpus"}]},
            "training": {"global_batch_size": self.microbatches * dp, "micro_batch_size": 1,
                         "precision": "bf16", "train_iters": 1, **self.training},
            "parallelism": self.parallelism,
        })  # fmt: skip

    def layout(self) -> Layout:
        return resolve_layout(self.spec())


CASES = (
    Case("Llama-3-8B", LLAMA3_8B, {"tp": 2, "dp": 1, "sequence_parallel": True}, rank=0, microbatches=1),
    Case(
        "Llama-3-70B",
        LLAMA3_70B,
        {
            "tp": 8,
            "pp": 4,
            "dp": 2,
            "virtual_stages": 2,
            "sequence_parallel": True,
            "distributed_optimizer": True,
        },
        rank=0,
        microbatches=4,
    ),
    Case("Mixtral-8x7B", MIXTRAL_8X7B, {"tp": 1, "dp": 8, "ep": 8}, rank=0, microbatches=1),
)

LORA_70B = Case(
    "Llama-3-70B LoRA",
    LLAMA3_70B,
    CASES[1].parallelism,
    rank=0,
    microbatches=4,
    training={"method": "lora", "lora": {"rank": 16, "targets": ["qkv", "proj", "fc1", "fc2"]}},
)
"""Llama-3-70B frozen, rank-16 adapters on every linear, on the 70B case's layout."""

BENCHMARK_CASES = (
    *CASES,
    # The 70B pipeline at 8 micro-batches: stage 0 holds 11 of its 16 chunks' activations at once,
    # the last stage (rank 48) 3 and the fused LM head + loss.
    dataclasses.replace(CASES[1], microbatches=8),
    dataclasses.replace(CASES[1], rank=48, microbatches=8),
    LORA_70B,
    # The layout the planner picks for it on 8 GPUs of 80 GB (benchmarks/planner.py, 8 micro-batches).
    dataclasses.replace(
        LORA_70B,
        parallelism={
            "tp": 2,
            "pp": 4,
            "dp": 1,
            "virtual_stages": 7,
            "sequence_parallel": True,
            "pipeline_layers": [3] * 15 + [2] + [3] * 3 + [2] + [3] * 3 + [2] + [3] * 3 + [2],
        },
        microbatches=8,
    ),
)
"""benchmarks/dryrun_vs_planner.py's rows: the tested cases, two more pipeline positions, and LoRA."""

__all__ = ["BENCHMARK_CASES", "CASES", "LORA_70B", "Case"]
