"""Tensor- and sequence-parallel collectives as autograd functions, and the parameter markers.

Activations are (B, T, C): the sequence dim is 1, the hidden/vocab dim is last. Every collective is
a torch.autograd.Function whose backward is the matching (conjugate) collective, and every one takes
the tensor-parallel group and size explicitly; with size 1 each is the identity (no group needed).

    function                     forward                       backward
    copy_to_tp                   identity                      all-reduce
    reduce_from_tp               all-reduce                    identity
    scatter_to_tp                keep my slice of the last dim  all-gather (last dim)
    gather_from_tp               all-gather (last dim)          keep my slice
    scatter_to_sequence          keep my slice of T             all-gather (T)
    gather_from_sequence         all-gather (T)                 reduce-scatter (T)
    reduce_scatter_to_sequence   reduce-scatter (T)             all-gather (T)

The sequence-parallel column linear does not use gather_from_sequence: it gathers inside its own
autograd function, so that it saves the shard and re-gathers it in backward (parallel.layers), with
the raw collectives all_gather_dim0 / reduce_scatter_dim0, which can also run asynchronously.

Parameter attributes (Megatron's): a sharded parameter has `tensor_parallel = True`,
`partition_dim` (the dim it is split along) and `partition_stride` (how many interleaved parts the
full tensor has: 2 for SwiGLU's [gate; up]). A replicated parameter whose gradient comes from a
sequence shard only (norms, RowParallel bias, positions under sequence parallelism) has
`sequence_parallel = True`; `allreduce_sequence_parallel_grads` sums those gradients over tp.
An expert-parallel parameter (parallel.expert) has `expert_parallel = True`: it holds this ep rank's
experts (dim 0 of the stacked (E, ...) weights) and is reduced over the edp group, not dp.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatrain.engine.parallel.state import Group, ParallelState

SEQUENCE_DIM = 1
HIDDEN_DIM = -1

# all_gather_into_tensor / reduce_scatter_tensor were renamed *_single in recent torch.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --------------------------------------------------------------------------------------------------
# Raw collectives (no autograd). `size` > 1 here, and so `group` is a real group.


def check_group(group: Group, size: int) -> None:
    if group is None:
        # None means WORLD to torch.distributed: never let a size>1 op silently use it.
        raise ValueError(f"a tensor-parallel collective of size {size} needs a process group, got None")


def _split(x: torch.Tensor, dim: int, group: Group, size: int) -> torch.Tensor:
    if x.shape[dim] % size:
        raise ValueError(f"dim {dim} of shape {tuple(x.shape)} is not divisible by tp={size}")
    return x.chunk(size, dim)[dist.get_rank(group)].contiguous()


def all_gather_dim0(
    x: torch.Tensor, group: Group, size: int, *, async_op: bool = False
) -> tuple[torch.Tensor, dist.Work | None]:
    """Every rank's x concatenated along dim 0, and the pending work when async_op (wait before use)."""
    x = x.contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    return out, _all_gather_single(out, x, group=group, async_op=async_op)


def reduce_scatter_dim0(
    x: torch.Tensor, group: Group, size: int, *, async_op: bool = False
) -> tuple[torch.Tensor, dist.Work | None]:
    """This rank's 1/size slice along dim 0 of x summed over ranks, and the pending work when async_op."""
    if x.shape[0] % size:
        raise ValueError(f"dim 0 of shape {tuple(x.shape)} is not divisible by tp={size}")
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    return out, _reduce_scatter_single(out, x, group=group, async_op=async_op)


def _all_gather(x: torch.Tensor, dim: int, group: Group, size: int) -> torch.Tensor:
    # The collective concatenates along dim 0; move `dim` there and back (a copy for dim != 0:
    # Megatron keeps activations (T, B, C) to avoid it, our models are batch-first).
    out, _ = all_gather_dim0(x.movedim(dim, 0), group, size)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group, size: int) -> torch.Tensor:
    if x.shape[dim] % size:
        raise ValueError(f"dim {dim} of shape {tuple(x.shape)} is not divisible by tp={size}")
    out, _ = reduce_scatter_dim0(x.movedim(dim, 0), group, size)
    return out.movedim(0, dim).contiguous()


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    # A copy: the input may be saved for another op's backward, and all_reduce works in place.
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


# --------------------------------------------------------------------------------------------------
# Autograd functions.


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, size: int) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_reduce(grad, ctx.group), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, size: int) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _split(x, HIDDEN_DIM, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, HIDDEN_DIM, ctx.group, ctx.size), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _all_gather(x, HIDDEN_DIM, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _split(grad, HIDDEN_DIM, ctx.group, ctx.size), None, None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _split(x, SEQUENCE_DIM, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, SEQUENCE_DIM, ctx.group, ctx.size), None, None


class _GatherFromSequence(torch.autograd.Function):
    """Forward all-gather; backward reduce-scatter, because what follows (a column-parallel matmul)
    leaves each rank a partial gradient for the whole sequence."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _all_gather(x, SEQUENCE_DIM, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, SEQUENCE_DIM, ctx.group, ctx.size), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _reduce_scatter(x, SEQUENCE_DIM, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, SEQUENCE_DIM, ctx.group, ctx.size), None, None


def _apply(fn: type[torch.autograd.Function], x: torch.Tensor, group: Group, size: int) -> torch.Tensor:
    if size == 1:
        return x
    check_group(group, size)
    return fn.apply(x, group, size)


def copy_to_tp(x: torch.Tensor, group: Group, size: int) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce the gradient backward."""
    return _apply(_CopyToTP, x, group, size)


def reduce_from_tp(x: torch.Tensor, group: Group, size: int) -> torch.Tensor:
    """Leave a tensor-parallel region: all-reduce partial sums forward, identity backward."""
    return _apply(_ReduceFromTP, x, group, size)


def scatter_to_tp(x: torch.Tensor, group: Group, size: int) -> torch.Tensor:
    """Keep this rank's slice of the last dim; backward all-gathers it."""
    return _apply(_ScatterToTP, x, group, size)


def gather_from_tp(x: torch.Tensor, group: Group, size: int) -> torch.Tensor:
    """All-gather the last dim; backward keeps this rank's slice."""
    return _apply(_GatherFromTP, x, group, size)


def scatter_to_sequence(x: torch.Tensor, group: Group, size: int) -> torch.Tensor:
    """(B, T, C) -> (B, T/tp, C), this rank's sequence slice; backward all-gathers along T."""
    return _apply(_ScatterToSequence, x, group, size)


def gather_from_sequence(x: torch.Tensor, group: Group, size: int) -> torch.Tensor:
    """(B, T/tp, C) -> (B, T, C) all-gathered; backward reduce-scatters along T."""
    return _apply(_GatherFromSequence, x, group, size)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Group, size: int) -> torch.Tensor:
    """(B, T, C) partial sums -> (B, T/tp, C) summed slice; backward all-gathers along T."""
    return _apply(_ReduceScatterToSequence, x, group, size)


# --------------------------------------------------------------------------------------------------
# Sharding full tensors (the canonical single-device layout) and gathering them back.


def shard_tensor(full: torch.Tensor, dim: int, rank: int, size: int, stride: int = 1) -> torch.Tensor:
    """Rank `rank`'s shard of `full` along `dim`.

    With stride s the full tensor is s concatenated parts (SwiGLU fc1: [gate; up], s=2); the shard is
    the concatenation of the rank's slice of each part, so the local layout is again [gate_r; up_r].
    """
    if full.shape[dim] % (size * stride):
        raise ValueError(f"dim {dim} of {tuple(full.shape)} is not divisible by tp×stride={size}×{stride}")
    chunks = full.chunk(size * stride, dim)
    return torch.cat(chunks[rank::size], dim).contiguous()


def unshard_tensor(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of shard_tensor: the full tensor from every rank's shard, in rank order."""
    parts = [shard.chunk(stride, dim) for shard in shards]
    return torch.cat([parts[r][s] for s in range(stride) for r in range(len(shards))], dim)


def gather_shards(shard: torch.Tensor, dim: int, stride: int, group: Group, size: int) -> torch.Tensor:
    """All-gather a parameter shard from every tp rank and reassemble the full tensor (no autograd)."""
    if size == 1:
        return shard
    check_group(group, size)
    out, _ = all_gather_dim0(shard, group, size)  # concatenated along dim 0
    return unshard_tensor(list(out.chunk(size, 0)), dim, stride)


def mark_tensor_parallel(param: nn.Parameter, dim: int, stride: int = 1) -> None:
    param.tensor_parallel = True  # type: ignore[attr-defined]
    param.partition_dim = dim  # type: ignore[attr-defined]
    param.partition_stride = stride  # type: ignore[attr-defined]


def mark_sequence_parallel(param: nn.Parameter) -> None:
    param.sequence_parallel = True  # type: ignore[attr-defined]


def mark_expert_parallel(param: nn.Parameter) -> None:
    param.expert_parallel = True  # type: ignore[attr-defined]


def is_expert_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "expert_parallel", False))


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_parallel", False))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, state: ParallelState) -> bool:
    """True for a shard, or for a replicated param on tp rank 0: count each element once (grad norms)."""
    return is_tensor_parallel(param) or state.tp_rank == 0


# --------------------------------------------------------------------------------------------------
# Gradient reduction for sequence-parallel replicated parameters.


def sequence_parallel_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]


@torch.no_grad()
def allreduce_sequence_parallel_grads(model: nn.Module, state: ParallelState) -> None:
    """Sum over tp the gradients of replicated parameters that only saw a sequence shard.

    Uses `.main_grad` where a parameter has one (the fp32 accumulation buffer of mixed precision),
    else `.grad`. Call after backward (and after the data-parallel gradient sync); one all-reduce per
    dtype over a flattened buffer.
    """
    if state.tp_size == 1:
        return
    check_group(state.tp_group, state.tp_size)
    grads: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in sequence_parallel_params(model):
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad
        if g is not None:
            grads.setdefault(g.dtype, []).append(g)
    for bucket in grads.values():
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=state.tp_group)
        for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            g.copy_(reduced)
