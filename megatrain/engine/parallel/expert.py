"""Expert parallelism: each ep rank holds E/ep of an MoE layer's experts; tokens travel to them and
back by all-to-all over the ep group (Megatron-Core's all-to-all token dispatcher).

    model = parallelize_experts(model, state)   # after tensor parallelism, before pipeline stages

keeps this rank's experts (rows [ep_rank·E/ep, (ep_rank+1)·E/ep) of the stacked weights, sliced from
the full model every rank built from the same seed), marks them `expert_parallel` and swaps every
MoELayer's dispatcher for an AllToAllDispatcher. With N local tokens, E experts, P = ep, L = E/P:

    dispatch(x (N, C), probs (N, E), routing_map (N, E))
        permute locally, expert-major (PermuteDispatcher)        (M, C), counts (E,)
        all-gather the counts over ep                            (P, E): counts[s, e] from rank s
        all-to-all: rows for experts [jL, (j+1)L) go to rank j   (R, C), received in (source, expert)
        regroup the received rows expert-major                   (R, C), tokens_per_expert (L,)
    combine(expert_y (R, C)) reverses each step: regroup back, all-to-all back, weighted local sum.

Tensor parallelism: the ep groups are per tp coordinate (Layout.expert_group_ranks) and every tp rank
holds the same tokens here (MoELayer.enter gathers the sequence under sequence parallelism), so each
tp rank exchanges the same rows within its own ep group. Gradients: an expert's gradient sums the
losses of every rank of its ep group; DataParallel scales it by 1/(dp·cp) as any gradient and sums it
over edp (the ranks holding the same experts), which is the average over all dp×cp ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatrain.engine.models.moe import Dispatcher, PermuteDispatcher, moe_layers
from megatrain.engine.parallel import lanes
from megatrain.engine.parallel.mappings import check_group, is_expert_parallel, mark_expert_parallel
from megatrain.engine.parallel.state import Group, ParallelState
from megatrain.plan.layout import LayoutError, expert_problems

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _AllToAll(torch.autograd.Function):
    """Rows of x: the first input_splits[0] to rank 0 of `group`, the next input_splits[1] to rank 1...;
    the output holds output_splits[s] rows from each rank s in rank order. Backward: the reverse
    exchange (the splits swapped)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, group: Group, output_splits: list[int], input_splits: list[int]
    ) -> torch.Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return _exchange(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return _exchange(grad, ctx.group, ctx.input_splits, ctx.output_splits), None, None, None


def _exchange(
    x: torch.Tensor, group: Group, output_splits: list[int], input_splits: list[int]
) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    # Posted, then waited through lanes: with two micro-batches in flight the other one runs meanwhile.
    lanes.wait(dist.all_to_all_single(out, x, output_splits, input_splits, group=group, async_op=True))
    return out


def all_to_all(
    x: torch.Tensor, group: Group, size: int, output_splits: list[int], input_splits: list[int]
) -> torch.Tensor:
    """Differentiable all-to-all of x's rows (dim 0) over `group` of `size` ranks; identity at size 1."""
    if size == 1:
        return x
    check_group(group, size)
    if len(input_splits) != size or len(output_splits) != size or sum(input_splits) != x.shape[0]:
        raise ValueError(
            f"splits {input_splits} -> {output_splits} do not fit {x.shape[0]} rows over {size} ranks"
        )
    return _AllToAll.apply(x, group, output_splits, input_splits)


def _chunk_order(sizes: torch.Tensor) -> torch.Tensor:
    """Row index that reorders rows laid out in chunks (a, b) of sizes (A, B) (row-major) into (b, a)
    order: out[k] = rows[index[k]]. sizes: (A, B) int64 on CPU."""
    flat = sizes.reshape(-1)
    starts = flat.cumsum(0) - flat  # (A·B,) where chunk (a, b) begins in the input
    t_sizes = sizes.t().reshape(-1)
    t_starts = starts.view_as(sizes).t().reshape(-1)
    out_starts = t_sizes.cumsum(0) - t_sizes  # where it begins in the output
    total = int(flat.sum())
    return torch.arange(total) + torch.repeat_interleave(t_starts - out_starts, t_sizes, output_size=total)


class AllToAllDispatcher(Dispatcher):
    """PermuteDispatcher's interface over an ep group: dispatch returns the rows of this rank's L local
    experts (from every rank of the group) and their counts; combine hands each row's output back to
    the rank its token came from and sums it there, weighted by its probability."""

    def __init__(self, num_experts: int, group: Group, size: int, rank: int):
        if num_experts % size:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep={size}")
        self.num_experts, self.group, self.size, self.rank = num_experts, group, size, rank
        self.local_experts = num_experts // size
        self._local = PermuteDispatcher()
        self._splits: tuple[list[int], list[int]] | None = None
        self._order: torch.Tensor | None = None
        self.rows_sent = 0
        """Rows the last dispatch sent to other ranks (combine sends back those it received): the
        exchange's volume, for benchmarks and metrics."""
        self.rows_received = 0

    @classmethod
    def for_state(cls, num_experts: int, state: ParallelState) -> AllToAllDispatcher:
        return cls(num_experts, state.ep_group, state.ep_size, state.ep_rank)

    def dispatch(
        self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        permuted, _ = self._local.dispatch(x, probs, routing_map)  # (M, C) expert-major
        p, e, n_local = self.size, self.num_experts, self.local_experts
        if p == 1:
            self._splits, self._order = None, None
            return permuted, routing_map.sum(0).tolist()
        counts = routing_map.sum(0)  # (E,) int64 on x's device
        gathered = counts.new_empty(p * e)
        _all_gather_single(gathered, counts, group=self.group)
        # One host sync per layer: the splits must be host integers for all_to_all_single.
        table = gathered.view(p, p, n_local).cpu()  # [source, destination rank, local expert]
        input_splits = table[self.rank].sum(1).tolist()  # rows I send to each rank
        received = table[:, self.rank]  # (P, L): rows from each source for each of my experts
        output_splits = received.sum(1).tolist()
        self._splits = (output_splits, input_splits)
        self.rows_sent = sum(input_splits) - input_splits[self.rank]
        self.rows_received = sum(output_splits) - output_splits[self.rank]
        rows = all_to_all(permuted, self.group, p, output_splits, input_splits)  # (R, C) (source, expert)
        if n_local == 1:
            self._order = None
            return rows, [sum(output_splits)]
        order = _chunk_order(received)  # (source, expert) -> (expert, source)
        self._order = order.to(rows.device)
        return rows.index_select(0, self._order), received.sum(0).tolist()

    def combine(self, expert_y: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return self._local.combine(expert_y)
        if self._splits is None:
            raise RuntimeError("combine() needs a dispatch() first")
        output_splits, input_splits = self._splits
        rows = expert_y
        if self._order is not None:
            inverse = torch.empty_like(self._order)
            inverse[self._order] = torch.arange(self._order.numel(), device=self._order.device)
            rows = expert_y.index_select(0, inverse)  # back to (source, expert)
        self._splits, self._order = None, None
        back = all_to_all(rows, self.group, self.size, input_splits, output_splits)  # (M, C) expert-major
        return self._local.combine(back)  # (N, C)


@torch.no_grad()
def parallelize_experts(model: nn.Module, state: ParallelState) -> nn.Module:
    """Keep this ep rank's experts of every MoE layer in `model` (built in full, identically on every
    rank), mark them expert_parallel and swap in the all-to-all dispatcher; in place. A no-op at ep=1."""
    if state.ep_size == 1:
        return model
    for layer in moe_layers(model):
        experts = layer.experts
        total = experts.num_experts
        problems = expert_problems(state.layout, total)  # the layout's own rule (plan.layout)
        if problems:
            raise LayoutError(problems[0]["message"])
        n_local = total // state.ep_size
        lo = state.ep_rank * n_local
        for mod in experts.modules():  # the stacked weights, and their LoRA adapters if any
            for name, full in list(mod._parameters.items()):
                if full is None:
                    continue
                kept = full.detach()[lo : lo + n_local].clone()
                local = nn.Parameter(kept, requires_grad=full.requires_grad)
                local.__dict__.update(full.__dict__)  # tensor-parallel markers, if experts were sharded
                mark_expert_parallel(local)
                mod._parameters[name] = local
        layer.dispatcher = AllToAllDispatcher.for_state(total, state)
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if is_expert_parallel(p)]


def gather_experts(local: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """The full (E, ...) tensor from every ep rank's (E/ep, ...) rows (no autograd); collective over ep."""
    if state.ep_size == 1:
        return local
    check_group(state.ep_group, state.ep_size)
    local = local.contiguous()
    out = local.new_empty((local.shape[0] * state.ep_size, *local.shape[1:]))
    _all_gather_single(out, local, group=state.ep_group)
    return out


def shard_experts(full: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """This ep rank's rows of a full (E, ...) expert tensor."""
    if full.shape[0] % state.ep_size:
        raise ValueError(f"{full.shape[0]} experts are not divisible by ep={state.ep_size}")
    n_local = full.shape[0] // state.ep_size
    return full[state.ep_rank * n_local : (state.ep_rank + 1) * n_local]
