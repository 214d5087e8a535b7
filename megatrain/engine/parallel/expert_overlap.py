"""Expert parallelism with the all-to-alls hidden behind the experts' compute
(`parallelism.moe_overlap_chunks`, Megatron's --overlap-moe-expert-parallel-comm on one micro-batch).

    overlap_experts(model, chunks=2)   # after parallelize_experts; a no-op at ep=1 or chunks=1

An MoE layer's N routed tokens are cut into K contiguous chunks after the router (which still sees
all of them, so its aux loss is unchanged). Each chunk is permuted, exchanged, run through this
rank's experts and sent back on its own, and the exchanges are asynchronous, so while chunk c's
experts compute, chunk c+1's dispatch and chunk c-1's combine are on the wire:

    forward    dispatch 0..K-1 posted | wait 0, experts 0, post combine 0 | wait 1, experts 1, ...
    backward   combine-grads 0..K-1 posted | wait 0, experts' backward 0, post dispatch-grad 0 | ...

Only the first chunk's dispatch and the last one's combine (each 1/K of the exchange) stay exposed
when the experts take longer than the wire. One autograd node (_Pipelined) owns the chunk loop
in both directions, since autograd alone would order the chunks' nodes by creation, not to
overlap: forward runs each chunk's experts under enable_grad on detached rows and keeps that small
graph; backward runs it per chunk with torch.autograd.grad and hands the expert weights the summed
gradient. `pipelined` takes what runs where a chunk arrives as a function (Exchange.compute), so
the two-hop dispatch (expert_dedup) pipelines its inter-node hop the same way, its node hop and
the experts being that function.

Inside a recomputed layer (non-reentrant checkpoint) the first forward keeps no small graphs: its
experts run without grad and it saves only the rows each chunk received, which the checkpoint
drops like any saved activation. When backward needs them the checkpoint reruns the layer; that
rerun (inside the backward pass) builds the small graphs, shielded from the checkpoint's hooks, and
leaves them on the dispatcher for the backward of its node. So a recomputed MoE layer holds its
input only, as a plain one does, and its experts run forward twice, not three times.

The result equals AllToAllDispatcher's to rounding: the same rows meet the same experts; only the
order of a weight gradient's sum over rows changes (chunk by chunk).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatrain.engine.models.moe import PermuteDispatcher, moe_layers
from megatrain.engine.parallel import lanes
from megatrain.engine.parallel.expert import AllToAllDispatcher, _all_gather_single, _chunk_order
from megatrain.engine.parallel.mappings import check_group
from megatrain.engine.parallel.state import Group

Compute = Callable[[int, list[torch.Tensor]], torch.Tensor]
"""What runs where a chunk's rows arrive: (chunk index, its received tensors) -> rows to send back,
as many as the first tensor's (for the pairs dispatch this rank's experts; for the two-hop one the
node hop, the experts and the weighted sums)."""


@dataclass
class Exchange:
    """One MoE layer's pipelined exchange over `group`: each chunk's (input_splits, output_splits)
    (rows this rank sends to each rank, rows it receives from each), what runs on a chunk's rows
    where they arrive, and the dispatcher's list in which a checkpoint's rerun leaves its small
    graphs for the backward of the node it reruns."""

    group: Group
    splits: list[tuple[list[int], list[int]]]
    compute: Compute
    stash: list[list[tuple[list[torch.Tensor], torch.Tensor]]]
    orders: list[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None
    """Per chunk, a row order applied to what arrives (and to its gradient) outside the small graph,
    and its inverse to what goes back: the pairs dispatch's (source, expert) -> expert-major. Outside
    the graph, the received rows are the tensors the experts save, not one more copy."""

    def arrive(self, c: int, x: torch.Tensor) -> torch.Tensor:
        return x if self.orders is None else _reorder(x, self.orders[c][0])

    def leave(self, c: int, x: torch.Tensor) -> torch.Tensor:
        return x if self.orders is None else _reorder(x, self.orders[c][1])


def _post(x: torch.Tensor, group: Group, output_splits: list[int], input_splits: list[int]) -> tuple:
    """Start an all-to-all of x's rows; returns (x, output buffer, work): x must live until waited."""
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x, output_splits, input_splits, group=group, async_op=True)
    return x, out, work


def _take(posted: tuple) -> torch.Tensor:
    _, out, work = posted
    lanes.wait(work)
    return out


def _reorder(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return x if index is None else x.index_select(0, index)


def _in_checkpoint() -> bool:
    """Whether saved tensors go through default hooks (a checkpointed region's, or another's)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _release(y: torch.Tensor) -> None:
    """Let a small graph's output, or an input leaf that no op saved, go while the graph waits for
    backward, which needs y's grad_fn (or the leaf's place in the graph), not its values (an op
    that saved its own output keeps its own reference): as Megatron's deallocate_output_tensor.
    Kept, the chunks' outputs and received rows were a fifth more than the pairs dispatch keeps."""
    if y._base is None:  # (a view's storage is its base's)
        y.data = torch.empty((0,), dtype=y.dtype, device=y.device)


def _grad(y: torch.Tensor, inputs: list[torch.Tensor], dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """torch.autograd.grad(y, inputs, dy, allow_unused=True) for a released y, whose shape no
    longer matches dy's (autograd checks dy against y's grad_fn, which still has the shape)."""
    engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
    return engine.run_backward((y,), (dy,), False, False, tuple(inputs), True, False)


def _leaves(rows: list[torch.Tensor], needs: tuple[bool, ...]) -> list[torch.Tensor]:
    """A chunk's received rows as the small graph's inputs: those whose gradient goes back, leaves."""
    return [r.detach().requires_grad_(True) if n else r for r, n in zip(rows, needs, strict=True)]


class _Pipelined(torch.autograd.Function):
    """(K chunks of m row tensors, *params) -> K tensors of rows back at their source ranks; see the
    module docstring for the schedule and for recompute. A chunk's m tensors (the rows, and for the
    two-hop dispatch their probabilities and expert mask) travel with the same splits."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, ex: Exchange, m: int, n: int, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        needs = ctx.needs_input_grad[3:]
        track = any(needs)
        # A checkpoint's first forward keeps nothing but the received rows; its rerun inside
        # backward (or a plain forward) keeps each chunk's small graph.
        recomputed = track and _in_checkpoint()
        keep = track and (not recomputed or _in_backward())
        ctx.ex, ctx.m, ctx.needs, ctx.params = ex, m, needs[:n], tensors[n:]
        dispatched = [_post(t, ex.group, *reversed(ex.splits[i // m])) for i, t in enumerate(tensors[:n])]
        combined, received, graphs = [], [], []
        saved: set[int] = set()  # storages the small graphs saved

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.add(t.untyped_storage().data_ptr())
            return t

        # Own hooks: the experts' own graph keeps its tensors even inside a recomputed layer.
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for c, (in_s, out_s) in enumerate(ex.splits):
                rows = [ex.arrive(c, _take(posted)) for posted in dispatched[c * m : (c + 1) * m]]
                received += rows
                if keep:
                    inputs = _leaves(rows, needs[c * m : (c + 1) * m])
                    with torch.enable_grad():
                        y = ex.compute(c, inputs)
                    graphs.append((inputs, y))
                else:
                    with torch.no_grad():
                        y = ex.compute(c, rows)
                combined.append(_post(ex.leave(c, y.detach()), ex.group, in_s, out_s))
        if recomputed:
            ctx.save_for_backward(*received)  # dropped by the checkpoint, rerun for backward
            if keep:
                ex.stash.append(graphs)
            ctx.graphs = None
        else:
            ctx.graphs = graphs
        out = tuple(_take(posted) for posted in combined)
        for inputs, y in graphs:
            _release(y)  # (once its combine is done with it)
            if not recomputed:  # (a rerun's rows are the saved ones its node checks)
                for x in inputs:
                    if x.requires_grad and x.untyped_storage().data_ptr() not in saved:
                        _release(x)  # a leaf no op saved: only its place in the graph counts
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ex, m, params = ctx.ex, ctx.m, ctx.params
        graphs = ctx.graphs if ctx.graphs is not None else _rerun_graphs(ctx)
        wanted = [p for p in params if p.requires_grad]
        returned = [
            _post(g.contiguous(), ex.group, *reversed(sp)) for g, sp in zip(grads, ex.splits, strict=True)
        ]
        param_grads: list[torch.Tensor | None] = [None] * len(wanted)
        sent: list[tuple | None] = []
        for c, (posted, (in_s, out_s)) in enumerate(zip(returned, ex.splits, strict=True)):
            dy = ex.arrive(c, _take(posted))
            needs = ctx.needs[c * m : (c + 1) * m]
            inputs, y = graphs[c] if graphs is not None else _rerun_chunk(ctx, c)
            leaves = [t for t, need in zip(inputs, needs, strict=True) if need]
            got = _grad(y, [*leaves, *wanted], dy)
            for j, g in enumerate(got[len(leaves) :]):
                if g is not None:
                    param_grads[j] = g if param_grads[j] is None else param_grads[j] + g
            dx = iter(got[: len(leaves)])
            for t, need in zip(inputs, needs, strict=True):
                g = next(dx) if need else None
                if g is None and need:
                    g = torch.zeros_like(t)
                sent.append(None if g is None else _post(ex.leave(c, g), ex.group, in_s, out_s))
        ctx.graphs = None
        by_param = dict(zip(map(id, wanted), param_grads, strict=True))
        return (
            None, None, None,
            *(None if posted is None else _take(posted) for posted in sent),
            *(by_param.get(id(p)) for p in params),
        )  # fmt: skip


def _rerun_graphs(ctx: Any) -> list[tuple[list[torch.Tensor], torch.Tensor]] | None:
    """The small graphs the checkpoint's rerun of this layer left on the dispatcher, when they are
    this node's (the rows it saved are theirs); None: run each chunk again in backward."""
    received = ctx.saved_tensors  # (reruns the checkpointed layer if nothing has yet)
    stash = ctx.ex.stash
    graphs = stash.pop() if stash else None
    stash.clear()
    if graphs is None or len(graphs) * ctx.m != len(received):
        return None
    mine = [t.data_ptr() for inputs, _ in graphs for t in inputs]
    if mine != [r.data_ptr() for r in received]:
        return None
    return graphs


def _rerun_chunk(ctx: Any, c: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    m = ctx.m
    inputs = _leaves(list(ctx.saved_tensors[c * m : (c + 1) * m]), ctx.needs[c * m : (c + 1) * m])
    with torch.enable_grad():
        return inputs, ctx.ex.compute(c, inputs)


def pipelined(
    ex: Exchange, chunks: list[list[torch.Tensor]], params: list[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """Each chunk's tensors (rows, then any that travel with them) sent by ex.splits, ex.compute run
    on them where they arrive, its output sent back: one tensor of rows per chunk, at its source.
    Differentiable in the chunks' float tensors and in `params` (what compute uses)."""
    m = len(chunks[0])
    flat = [t for chunk in chunks for t in chunk]
    return _Pipelined.apply(ex, m, len(flat), *flat, *params)


class OverlappedDispatcher(AllToAllDispatcher):
    """AllToAllDispatcher whose `run` pipelines `chunks` token chunks through the exchange and the
    experts (the module docstring); dispatch/combine on their own stay the unchunked ones."""

    def __init__(self, num_experts: int, group: Group, size: int, rank: int, chunks: int):
        super().__init__(num_experts, group, size, rank)
        if chunks < 1:
            raise ValueError(f"moe_overlap_chunks={chunks} must be at least 1")
        self.chunks = chunks
        self.recomputed: list[list[tuple[list[torch.Tensor], torch.Tensor]]] = []
        """Small graphs a checkpoint's rerun of this layer built, for its node's backward to take."""

    def run(
        self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, experts: nn.Module
    ) -> torch.Tensor:
        n = x.shape[0]
        k = min(self.chunks, n)
        if self.size == 1 or k <= 1:
            return super().run(x, probs, routing_map, experts)
        check_group(self.group, self.size)
        bounds = [n * i // k for i in range(k + 1)]
        local = [PermuteDispatcher() for _ in range(k)]
        permuted = []
        for i, d in enumerate(local):
            s = slice(bounds[i], bounds[i + 1])
            permuted.append([d.dispatch(x[s], probs[s], routing_map[s])[0]])  # (M_i, C) expert-major
        counts = torch.stack([routing_map[bounds[i] : bounds[i + 1]].sum(0) for i in range(k)])  # (K, E)
        gathered = counts.new_empty(self.size * counts.numel())
        _all_gather_single(gathered, counts.reshape(-1), group=self.group)
        table = gathered.view(self.size, k, self.size, self.local_experts).cpu()
        splits, regroup = self._chunks(table, x.device)

        def compute(c: int, rows: list[torch.Tensor]) -> torch.Tensor:
            return experts(rows[0], regroup[c][2])  # rows expert-major (Exchange.orders)

        ex = Exchange(self.group, splits, compute, self.recomputed, [r[:2] for r in regroup])
        backs = pipelined(ex, permuted, list(experts.parameters()))
        self._splits, self._order = None, None
        return torch.cat([d.combine(b) for d, b in zip(local, backs, strict=True)])

    def _chunks(self, table: torch.Tensor, device: torch.device) -> tuple[list, list]:
        """table[source, chunk, destination rank, local expert]: rows of each chunk's exchange ->
        each chunk's (input_splits, output_splits) and (order, inverse, rows per local expert): the
        received (source, expert) rows' reorder expert-major and back (None with one local expert)."""
        splits, regroup = [], []
        self.rows_sent = self.rows_received = 0
        for i in range(table.shape[1]):
            t = table[:, i]  # (P, P, L)
            input_splits = t[self.rank].sum(1).tolist()
            received = t[:, self.rank]  # (P, L)
            output_splits = received.sum(1).tolist()
            self.rows_sent += sum(input_splits) - input_splits[self.rank]
            self.rows_received += sum(output_splits) - output_splits[self.rank]
            order = inverse = None
            if self.local_experts > 1:
                order = _chunk_order(received).to(device)
                inverse = torch.empty_like(order)
                inverse[order] = torch.arange(order.numel(), device=device)
            per_expert = received.sum(0).tolist() if self.local_experts > 1 else [sum(output_splits)]
            splits.append((input_splits, output_splits))
            regroup.append((order, inverse, per_expert))
        return splits, regroup


def overlap_experts(model: nn.Module, chunks: int) -> int:
    """Swap every all-to-all dispatcher in `model` for an OverlappedDispatcher of `chunks` chunks;
    returns how many were swapped (0 at ep=1, where there is nothing to hide, or chunks=1)."""
    if chunks == 1:
        return 0
    count = 0
    for layer in moe_layers(model):
        d = layer.dispatcher
        if type(d) is AllToAllDispatcher and d.size > 1:
            layer.dispatcher = OverlappedDispatcher(d.num_experts, d.group, d.size, d.rank, chunks)
            count += 1
    return count
