"""How `parallelism: auto` runs an MoE candidate's all-to-alls: the exchange as it is or pipelined
behind the experts in MOE_OVERLAP_CHUNKS token chunks, by the pairs dispatch or, where the ep group
spans nodes, in two hops; and, where the layout rules allow it, with two micro-batches in flight
(parallelism.moe_overlap_microbatches: 1F1B's steady pairs side by side, each one's exchanges behind
the other's compute). The lanes hold one micro-batch more, so the search scores that variant as a
candidate of its own, judged for memory on its own."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

from megatrain.plan.cost import StepTime, predict_step
from megatrain.plan.links import ep_ranks_per_node
from megatrain.plan.result import Choice
from megatrain.plan.schedule_rules import lane_problems

MOE_OVERLAP_CHUNKS = (2, 4)
"""Chunks an MoE layer's all-to-alls may be pipelined in under `parallelism: auto` (beyond 4 the
exchanges are wire-bound where they matter: tests/plan/test_moe_overlap.py)."""


def exchange_options(search: Any, c: Choice) -> list[tuple[Choice, StepTime]]:
    """(choice, predicted step) for `c` with its fastest exchange, and with its fastest exchange in
    lanes where lane_problems allows them."""
    out = [fastest_exchange(search, c)]
    spec = search.spec
    lay = c.layout
    if search.model.moe is not None and not lane_problems(
        spec.model, lay, spec.training.global_batch_size, c.micro_batch_size
    ):
        out.append(fastest_exchange(search, replace(c, moe_overlap_microbatches=True)))
    return out


def fastest_exchange(search: Any, c: Choice) -> tuple[Choice, StepTime]:
    """`c` with the fastest way to run its MoE all-to-alls (at ep > 1), lanes as `c` has them. The
    memory estimate is the same for every chunking and dispatch, as what each keeps for backward is
    (tests/engine/parallel/test_expert_parallel.py)."""
    best = (c, predict_step(search.model, c.layout, search.settings(c), search.pool))
    lay = c.layout
    if lay.ep == 1 or search.model.moe is None:
        return best
    spans_nodes = ep_ranks_per_node(lay.tp, lay.cp, lay.ep, search.pool.devices_per_node) < lay.ep
    dispatches = ("pairs", "nodes") if spans_nodes else ("pairs",)
    for how, k in itertools.product(dispatches, (1, *MOE_OVERLAP_CHUNKS)):
        if (k, how) == (c.moe_overlap_chunks, c.moe_dispatch):
            continue
        option = replace(c, moe_overlap_chunks=k, moe_dispatch=how)
        t = predict_step(search.model, lay, search.settings(option), search.pool)
        if t.step_time_s < best[1].step_time_s:
            best = (option, t)
    return best
