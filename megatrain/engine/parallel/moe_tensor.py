"""Tensor (+ sequence) parallelism for an MoE layer (megatrain.engine.models.moe.MoELayer), in place.

Every tp rank holds its slice of every expert, as the dense MLP is split: experts.fc1_weight
(E, W, C) along dim 1 ([gate; up] rows with stride 2 under SwiGLU, like a column-parallel fc1),
experts.fc2_weight (E, C, F) along dim 2 (row-parallel fc2). The router is replicated and every rank
routes the same tokens, so each computes its F-slice of every routed expert and the partial outputs
are summed when the routed part is left:

    no sequence parallelism:  enter = copy_to_tp (backward all-reduce), leave = reduce_from_tp
    sequence parallelism:     enter = gather_from_sequence (all-gather T; backward reduce-scatter),
                              leave = reduce_scatter_to_sequence, as fc1/fc2 gather and reduce-scatter

Inside the region everything downstream of the summed output gets partial gradients, the router's
included (d probs = dy·y_partial), so the router weight's gradient is summed over tp like a norm's
(marked sequence_parallel: allreduce_sequence_parallel_grads). Two replicated terms enter those sums
once per rank and are therefore taken 1/tp each: the aux losses' injected gradient
(router.aux_grad_fraction) and fc2's bias (experts.fc2_bias_fraction, its gradient summed over tp).
The shared expert is a dense MLP, split as one (ColumnParallel fc1, RowParallel fc2, with their own
collectives on the residual stream's shard).
"""

from __future__ import annotations

import functools

from torch import nn

from megatrain.engine.models.moe import MoELayer
from megatrain.engine.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatrain.engine.parallel.mappings import (
    copy_to_tp,
    gather_from_sequence,
    mark_sequence_parallel,
    mark_tensor_parallel,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    shard_tensor,
)
from megatrain.engine.parallel.state import ParallelState
from megatrain.plan.layout import LayoutError, model_problems


def parallelize_moe_layer(layer: MoELayer, state: ParallelState, swiglu: bool) -> None:
    """Shard `layer` (built in full, identically on every tp rank) over tp, in place."""
    tp, rank = state.tp_size, state.tp_rank
    if tp == 1:
        return
    experts, shared = layer.experts, layer.shared_expert
    # The layout's own rules (megatrain.plan.layout), on this layer's widths.
    problems = model_problems(
        state.layout,
        moe_ffn_hidden_size=experts.fc2_weight.shape[2],
        shared_expert_ffn_hidden_size=shared.fc2.in_features if shared is not None else None,
        model="model.",
        par="parallelism.",
    )
    if problems:
        raise LayoutError("; ".join(p["message"] for p in problems))
    stride = 2 if swiglu else 1
    _shard(experts, "fc1_weight", 1, stride, rank, tp)
    if experts.fc1_bias is not None:
        _shard(experts, "fc1_bias", 1, stride, rank, tp)
    _shard(experts, "fc2_weight", 2, 1, rank, tp)
    if experts.fc2_bias is not None:
        experts.fc2_bias_fraction = 1.0 / tp
        mark_sequence_parallel(experts.fc2_bias)
    router = layer.router
    router.aux_grad_fraction = 1.0 / tp
    mark_sequence_parallel(router.gate.weight)
    group = state.tp_group
    if state.sequence_parallel:
        layer.enter = functools.partial(gather_from_sequence, group=group, size=tp)
        layer.leave = functools.partial(reduce_scatter_to_sequence, group=group, size=tp)
    else:
        layer.enter = functools.partial(copy_to_tp, group=group, size=tp)
        layer.leave = functools.partial(reduce_from_tp, group=group, size=tp)
    if shared is not None:
        shared.fc1 = ColumnParallelLinear.from_linear(shared.fc1, state, stride=stride)
        shared.fc2 = RowParallelLinear.from_linear(shared.fc2, state)


def _shard(module: nn.Module, name: str, dim: int, stride: int, rank: int, tp: int) -> None:
    full = getattr(module, name)
    param = nn.Parameter(shard_tensor(full.detach(), dim, rank, tp, stride), requires_grad=full.requires_grad)
    mark_tensor_parallel(param, dim, stride)
    setattr(module, name, param)
