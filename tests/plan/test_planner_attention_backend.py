"""The planner never proposes context parallelism that model.attention_backend (or attention dropout)
rules out: ring attention runs its own blocks, without dropout (megatrain/plan/planner.py cp_options,
megatrain/plan/layout.py context_problems)."""

from __future__ import annotations

import pytest
from plan_cases import gpu_pool, spec

from megatrain.plan.planner import plan

LONG = {"num_layers": 2, "hidden_size": 1024, "num_attention_heads": 16, "num_query_groups": 8,
        "seq_length": 16384}  # fmt: skip


def _cps(model: dict) -> tuple[set[int], dict[str, int]]:
    result = plan(spec({**LONG, **model}, global_batch_size=8), gpu_pool(), 8)
    chosen = [result.choice, *(c for c, _, _ in result.runners_up)]
    return {c.layout.cp for c in chosen}, dict(result.rejected_counts)


def test_long_sequences_consider_cp_with_sdpa() -> None:
    cps, counts = _cps({"attention_backend": "sdpa"})
    assert max(cps) > 1 and counts.get("cp_unsupported", 0) == 0


@pytest.mark.parametrize("model", [{"attention_backend": "flex"}, {"attention_dropout": 0.1}])
def test_a_backend_or_dropout_ring_attention_lacks_keeps_cp_at_one(model: dict) -> None:
    cps, counts = _cps(model)
    assert cps == {1} and counts["cp_unsupported"] >= 1
