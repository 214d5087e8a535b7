"""Tensor and sequence parallelism: collectives as autograd functions, and the Megatron layers.

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

Parameter attributes (Megatron's): a sharded parameter has `tensor_parallel = True`,
`partition_dim` (the dim it is split along) and `partition_stride` (how many interleaved parts the
full tensor has: 2 for SwiGLU's [gate; up]). A replicated parameter whose gradient comes from a
sequence shard only (norms, RowParallel bias, positions under sequence parallelism) has
`sequence_parallel = True`; `allreduce_sequence_parallel_grads` sums those gradients over tp.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatrain.engine.grad_accumulation import embedding, linear
from megatrain.engine.parallel.state import Group, ParallelState

SEQUENCE_DIM = 1
HIDDEN_DIM = -1

# all_gather_into_tensor / reduce_scatter_tensor were renamed *_single in recent torch.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --------------------------------------------------------------------------------------------------
# Raw collectives (no autograd). `size` > 1 here, and so `group` is a real group.


def _check_group(group: Group, size: int) -> None:
    if group is None:
        # None means WORLD to torch.distributed: never let a size>1 op silently use it.
        raise ValueError(f"a tensor-parallel collective of size {size} needs a process group, got None")


def _split(x: torch.Tensor, dim: int, group: Group, size: int) -> torch.Tensor:
    if x.shape[dim] % size:
        raise ValueError(f"dim {dim} of shape {tuple(x.shape)} is not divisible by tp={size}")
    return x.chunk(size, dim)[dist.get_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group: Group, size: int) -> torch.Tensor:
    # The collective concatenates along dim 0; move `dim` there and back (a copy for dim != 0:
    # Megatron keeps activations (T, B, C) to avoid it, our models are batch-first).
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group, size: int) -> torch.Tensor:
    if x.shape[dim] % size:
        raise ValueError(f"dim {dim} of shape {tuple(x.shape)} is not divisible by tp={size}")
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    _reduce_scatter_single(out, x, group=group)
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
    _check_group(group, size)
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
    _check_group(group, size)
    shard = shard.contiguous()
    out = shard.new_empty((size * shard.shape[0], *shard.shape[1:]))  # concatenated along dim 0
    _all_gather_single(out, shard, group=group)
    return unshard_tensor(list(out.chunk(size, 0)), dim, stride)


def mark_tensor_parallel(param: nn.Parameter, dim: int, stride: int = 1) -> None:
    param.tensor_parallel = True  # type: ignore[attr-defined]
    param.partition_dim = dim  # type: ignore[attr-defined]
    param.partition_stride = stride  # type: ignore[attr-defined]


def mark_sequence_parallel(param: nn.Parameter) -> None:
    param.sequence_parallel = True  # type: ignore[attr-defined]


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_parallel", False))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, state: ParallelState) -> bool:
    """True for a shard, or for a replicated param on tp rank 0: count each element once (grad norms)."""
    return is_tensor_parallel(param) or state.tp_rank == 0


# --------------------------------------------------------------------------------------------------
# Layers.


class ColumnParallelLinear(nn.Module):
    """y = x Aᵀ + b with A's output rows split across tp ranks: y is the output's last-dim shard.

    Input: with sequence parallelism a sequence shard (B, T/tp, C) that is all-gathered; otherwise
    the whole (B, T, C), entered through copy_to_tp (its gradient is summed over ranks).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        state: ParallelState,
        *,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool | None = None,
        stride: int = 1,
        init: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.tp_size, self.tp_rank, self.tp_group = state.tp_size, state.tp_rank, state.tp_group
        if out_features % self.tp_size:
            raise ValueError(f"out_features={out_features} is not divisible by tp={self.tp_size}")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.sequence_parallel = state.sequence_parallel if sequence_parallel is None else sequence_parallel
        local = out_features // self.tp_size
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype))
        mark_tensor_parallel(self.weight, 0, stride)
        if bias:
            self.bias = nn.Parameter(torch.zeros(local, device=device, dtype=dtype))
            mark_tensor_parallel(self.bias, 0, stride)
        else:
            self.register_parameter("bias", None)
        if init:  # from_* copies shards instead: drawing here would shift the default RNG stream
            nn.init.normal_(self.weight, 0.0, 0.02)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        state: ParallelState,
        *,
        stride: int = 1,
        gather_output: bool = False,
        sequence_parallel: bool | None = None,
    ) -> ColumnParallelLinear:
        """This rank's shard of a full nn.Linear (stride 2 for an interleaved [gate; up])."""
        w = linear.weight
        layer = cls(
            linear.in_features,
            linear.out_features,
            state,
            bias=linear.bias is not None,
            gather_output=gather_output,
            sequence_parallel=sequence_parallel,
            stride=stride,
            init=False,
            device=w.device,
            dtype=w.dtype,
        )
        with torch.no_grad():
            layer.weight.copy_(shard_tensor(w, 0, layer.tp_rank, layer.tp_size, stride))
            if linear.bias is not None:
                layer.bias.copy_(shard_tensor(linear.bias, 0, layer.tp_rank, layer.tp_size, stride))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence(x, self.tp_group, self.tp_size)  # (B, T, C)
        else:
            x = copy_to_tp(x, self.tp_group, self.tp_size)
        y = linear(x, self.weight, self.bias)  # (B, T, out/tp)
        if self.gather_output:
            y = gather_from_tp(y, self.tp_group, self.tp_size)
        return y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}/tp{self.tp_size}, bias={self.bias is not None}, "
            f"sequence_parallel={self.sequence_parallel}, gather_output={self.gather_output}"
        )


class RowParallelLinear(nn.Module):
    """y = x Aᵀ + b with A's input columns split: x is the input's last-dim shard, partial products
    are all-reduced (or reduce-scattered along T with sequence parallelism), then the replicated
    bias is added once."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        state: ParallelState,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool | None = None,
        init: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.tp_size, self.tp_rank, self.tp_group = state.tp_size, state.tp_rank, state.tp_group
        if in_features % self.tp_size:
            raise ValueError(f"in_features={in_features} is not divisible by tp={self.tp_size}")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = state.sequence_parallel if sequence_parallel is None else sequence_parallel
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("sequence parallelism needs input_is_parallel=True")
        local = in_features // self.tp_size
        self.weight = nn.Parameter(torch.empty(out_features, local, device=device, dtype=dtype))
        mark_tensor_parallel(self.weight, 1)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
            if self.sequence_parallel:
                # Added to a sequence shard, so each rank sees part of its gradient.
                mark_sequence_parallel(self.bias)
        else:
            self.register_parameter("bias", None)
        if init:  # from_* copies shards instead: drawing here would shift the default RNG stream
            nn.init.normal_(self.weight, 0.0, 0.02)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        state: ParallelState,
        *,
        input_is_parallel: bool = True,
        sequence_parallel: bool | None = None,
    ) -> RowParallelLinear:
        """This rank's column slice of a full nn.Linear; the bias is copied whole (replicated)."""
        w = linear.weight
        layer = cls(
            linear.in_features,
            linear.out_features,
            state,
            bias=linear.bias is not None,
            input_is_parallel=input_is_parallel,
            sequence_parallel=sequence_parallel,
            init=False,
            device=w.device,
            dtype=w.dtype,
        )
        with torch.no_grad():
            layer.weight.copy_(shard_tensor(w, 1, layer.tp_rank, layer.tp_size))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp_group, self.tp_size)
        y = linear(x, self.weight)  # (B, T, out) partial sums
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.tp_group, self.tp_size)  # (B, T/tp, out)
        else:
            y = reduce_from_tp(y, self.tp_group, self.tp_size)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}/tp{self.tp_size}, out={self.out_features}, bias={self.bias is not None}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary: each rank looks up the tokens it owns, zeroes the rest and
    the ranks sum (all-reduce; reduce-scatter along T with sequence parallelism)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        state: ParallelState,
        *,
        sequence_parallel: bool | None = None,
        init: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.tp_size, self.tp_rank, self.tp_group = state.tp_size, state.tp_rank, state.tp_group
        if num_embeddings % self.tp_size:
            raise ValueError(f"num_embeddings={num_embeddings} is not divisible by tp={self.tp_size}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = state.sequence_parallel if sequence_parallel is None else sequence_parallel
        local = num_embeddings // self.tp_size
        self.vocab_start, self.vocab_end = self.tp_rank * local, (self.tp_rank + 1) * local
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, device=device, dtype=dtype))
        mark_tensor_parallel(self.weight, 0)
        if init:  # from_* copies shards instead: drawing here would shift the default RNG stream
            nn.init.normal_(self.weight, 0.0, 0.02)

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, state: ParallelState, *, sequence_parallel: bool | None = None
    ) -> VocabParallelEmbedding:
        w = embedding.weight
        layer = cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            state,
            sequence_parallel=sequence_parallel,
            init=False,
            device=w.device,
            dtype=w.dtype,
        )
        with torch.no_grad():
            layer.weight.copy_(shard_tensor(w, 0, layer.tp_rank, layer.tp_size))
        return layer

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return embedding(tokens, self.weight)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        out = embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (B, T, C)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.tp_group, self.tp_size)  # (B, T/tp, C)
        return reduce_from_tp(out, self.tp_group, self.tp_size)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}/tp{self.tp_size}, {self.embedding_dim}, rows "
            f"[{self.vocab_start}, {self.vocab_end}), sequence_parallel={self.sequence_parallel}"
        )


class SequenceParallelPositionEmbedding(nn.Module):
    """Learned positions under sequence parallelism: looks up only this rank's slice of positions,
    so (T,) positions give (T/tp, C), matching the sequence shard they are added to. The table is
    replicated and its gradient comes from the local slice: flagged sequence_parallel."""

    def __init__(self, embedding: nn.Embedding, state: ParallelState):
        super().__init__()
        self.tp_size, self.tp_rank = state.tp_size, state.tp_rank
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.weight = embedding.weight
        mark_sequence_parallel(self.weight)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        if positions.shape[0] % self.tp_size:
            raise ValueError(f"{positions.shape[0]} positions are not divisible by tp={self.tp_size}")
        local = positions.chunk(self.tp_size, 0)[self.tp_rank]
        return embedding(local, self.weight)  # (T/tp, C)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, slice {self.tp_rank}/{self.tp_size}"


# --------------------------------------------------------------------------------------------------
# Vocab-parallel cross-entropy.


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        group: Group,
        rank: int,
        ignore_index: int,
    ) -> torch.Tensor:
        # logits (N, V/tp) this rank's vocab slice, labels (N,) global ids. fp32 throughout.
        x = logits.float()
        local_v = x.shape[-1]
        start = rank * local_v
        # Subtract the global max for a stable exp (a constant per row: no gradient through it).
        row_max = x.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        x = x - row_max.unsqueeze(-1)
        outside = (labels < start) | (labels >= start + local_v)
        local_labels = (labels - start).masked_fill(outside, 0)
        target = x.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = x.exp_()  # reuse the buffer: (N, V/tp)
        # One all-reduce for both sums: the target logit (held by one rank) and Σ exp.
        sums = torch.stack([target, exp.sum(dim=-1)])
        dist.all_reduce(sums, group=group)
        target, sum_exp = sums[0], sums[1]
        valid = labels != ignore_index
        count = valid.sum()
        per_token = (sum_exp.log() - target).masked_fill(~valid, 0.0)
        loss = per_token.sum() / count  # nan when every label is ignored, like F.cross_entropy
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_labels, outside, valid, count)
        ctx.logits_dtype, ctx.consumed = logits.dtype, False
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # d loss / d logits = (softmax - onehot) / count on every valid row: local to the shard.
        if ctx.consumed:
            raise RuntimeError("vocab_parallel_cross_entropy supports one backward: it reuses its softmax")
        ctx.consumed = True
        softmax, local_labels, outside, valid, count = ctx.saved_tensors
        g = softmax  # modified in place: no second (N, V/tp) fp32 buffer, as Megatron does
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local_labels] -= (~outside).to(g.dtype)
        g.mul_((valid.to(g.dtype) * (grad / count)).unsqueeze(-1))
        return g.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, state: ParallelState, ignore_index: int = -100
) -> torch.Tensor:
    """Mean next-token cross-entropy from this rank's vocab shard of the logits, never gathering them.

    logits (B, T, V/tp) — rank r holds vocabulary ids [r·V/tp, (r+1)·V/tp); labels (B, T). Equals
    F.cross_entropy on the full logits (fp32, mean over tokens whose label is not ignore_index).
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    if state.tp_size == 1:
        return F.cross_entropy(flat_logits.float(), flat_labels, ignore_index=ignore_index)
    _check_group(state.tp_group, state.tp_size)
    return _VocabParallelCrossEntropy.apply(
        flat_logits, flat_labels, state.tp_group, state.tp_rank, ignore_index
    )


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
    _check_group(state.tp_group, state.tp_size)
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
