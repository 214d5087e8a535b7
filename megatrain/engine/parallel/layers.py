"""The Megatron tensor-parallel layers: column/row-parallel linears, the vocab-parallel embedding.

Activations are (B, T, C) (parallel.mappings). A ColumnParallelLinear splits its output features
over the tp ranks and a RowParallelLinear its input features, so an MLP or attention block is
column → local work → row with one all-reduce (or, with sequence parallelism, one all-gather in and
one reduce-scatter out) per direction.

Under sequence parallelism the column-parallel linear's input is a sequence shard (B, T/tp, C). Its
forward all-gathers the shard and multiplies; it saves only the shard, and backward gathers it again
for the weight gradient: the gathered (B, T, C) input would otherwise stay alive per linear until
backward, t times the shard (Megatron-Core's LinearWithGradAccumulationAndAsyncCommunication,
Korthikanti et al. 2022). Backward hides both collectives behind GEMMs: the re-gather runs while the
input gradient is computed, the input gradient's reduce-scatter while the weight gradient is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatrain import kernels
from megatrain.engine.parallel.mappings import (
    all_gather_dim0,
    check_group,
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    mark_sequence_parallel,
    mark_tensor_parallel,
    reduce_from_tp,
    reduce_scatter_dim0,
    reduce_scatter_to_sequence,
    scatter_to_tp,
    shard_tensor,
)
from megatrain.engine.parallel.state import Group, ParallelState
from megatrain.kernels.grad_accumulation import fusable, placeholder, weight_grad_into_main

# --------------------------------------------------------------------------------------------------
# The column-parallel linear under sequence parallelism.


class _SequenceParallelLinear(torch.autograd.Function):
    """y = gather_T(x) Wᵀ + b for a sequence shard x (B, T/tp, C), saving x, not the gathered input.

    The collectives concatenate along dim 0, so the gathered input is sequence-major (T, B, C). With
    one sequence per micro-batch that is also (B, T, C) and every reorder below is a view. Otherwise
    one side is copied: the output (gradient) to sequence-major when it is no wider than the input
    (qkv, fc1 at larger tp), else the input to batch-first (the LM head, whose output is V/tp wide).

    On a GPU the async collectives run on NCCL's stream beside the GEMMs on the compute stream.
    Megatron also sets CUDA_DEVICE_MAX_CONNECTIONS=1 so that the device starts the collective before
    the GEMM issued after it; without it the overlap is likely but not guaranteed (results are the same).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: Group,
        size: int,
    ) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        ctx.save_for_backward(x, weight)
        # The Parameter itself, for main_grad: under activation checkpointing saved_tensors gives
        # back what the recompute saved, not necessarily this object.
        ctx.param = weight
        ctx.fuse = weight.requires_grad and fusable(weight)
        total, _ = all_gather_dim0(x.transpose(0, 1), group, size)  # (T, B, C)
        if _sequence_major(x.shape[0], weight):
            return F.linear(total, weight, bias).transpose(0, 1).contiguous()  # (B, T, out)
        return F.linear(total.transpose(0, 1), weight, bias)  # the input copied batch-first

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight = ctx.saved_tensors
        group, size = ctx.group, ctx.size
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gathering = scattering = None
        if need_w:
            # Start re-gathering the input now: it runs while the input gradient's GEMM does.
            total, gathering = all_gather_dim0(x.transpose(0, 1), group, size, async_op=True)
        batch, seq, out = grad_out.shape
        seq_major = _sequence_major(batch, weight)
        if seq_major:
            dy = grad_out.transpose(0, 1).reshape(seq * batch, out)  # (T·B, out)
        else:
            dy = grad_out.reshape(batch * seq, out)  # (B·T, out)
        grad_x = grad_w = None
        if need_x:
            # Every token's partial input gradient, sequence-major for the reduce-scatter. A QLoRA
            # base (NF4) is dequantised for the GEMM: torchao overrides F.linear, not this mm.
            dense = weight.get_original_weight() if hasattr(weight, "get_original_weight") else weight
            grad_total = dy.mm(dense)
            if seq_major:
                grad_total = grad_total.view(seq, batch, -1)
            else:
                grad_total = grad_total.view(batch, seq, -1).transpose(0, 1)  # copied when scattered
            if gathering is not None:
                gathering.wait()  # launched first, finished first: keep the group's order
            # Sum over ranks and keep this rank's tokens, while the weight gradient is computed.
            grad_x, scattering = reduce_scatter_dim0(grad_total, group, size, async_op=True)
            del grad_total
        if need_w:
            if gathering is not None:
                gathering.wait()
            # (T·B, C) or (B·T, C): the token order of dy.
            x2 = total.view(seq * batch, -1) if seq_major else total.transpose(0, 1).reshape(batch * seq, -1)
            del total
            if ctx.fuse:
                weight_grad_into_main(ctx.param.main_grad, dy, x2)  # or in a zero-bubble W pass
                grad_w = placeholder(ctx.param)
            else:
                grad_w = dy.t().mm(x2)
        grad_b = dy.sum(0) if need_b else None
        if scattering is not None:
            scattering.wait()
            grad_x = grad_x.transpose(0, 1).contiguous()  # (B, T/tp, C)
        return grad_x, grad_w, grad_b, None, None


def _sequence_major(batch: int, weight: torch.Tensor) -> bool:
    """Whether the GEMMs run on sequence-major tokens (the output side reordered) or batch-first
    (the input side reordered): whichever copies less, and no copy at all for batch 1."""
    return batch == 1 or weight.shape[0] <= weight.shape[1]


def sequence_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group, size: int
) -> torch.Tensor:
    """all-gather along T, then linear: (B, T/tp, C) -> (B, T, out); saves only the shard for backward.

    Equals linear(gather_from_sequence(x), weight, bias), gradients included (the input's is
    reduce-scattered back to the shard); the weight gradient goes to weight.main_grad when fusable.
    """
    if size == 1:
        return kernels.get("linear", x.device.type)(x, weight, bias)
    check_group(group, size)
    if getattr(weight, "fp8", None) is not None:
        # precision fp8: the float8 GEMMs are the linear kernel's, on the gathered input (which it
        # saves: the overlapped gather above is a bf16 GEMM's).
        return kernels.get("linear", x.device.type)(gather_from_sequence(x, group, size), weight, bias)
    return _SequenceParallelLinear.apply(x, weight, bias, group, size)


# --------------------------------------------------------------------------------------------------
# Layers.


class ColumnParallelLinear(nn.Module):
    """y = x Aᵀ + b with A's output rows split across tp ranks: y is the output's last-dim shard.

    Input: with sequence parallelism a sequence shard (B, T/tp, C) that is all-gathered (and only the
    shard kept for backward: sequence_parallel_linear); otherwise
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
            # All-gathered along T; only the shard is kept for backward.
            y = sequence_parallel_linear(x, self.weight, self.bias, self.tp_group, self.tp_size)
        else:
            x = copy_to_tp(x, self.tp_group, self.tp_size)
            y = kernels.get("linear", x.device.type)(x, self.weight, self.bias)  # (B, T, out/tp)
        if (lora := self._modules.get("lora")) is not None and lora.enabled:
            # The same (copied) input as the base: one reduction of the input gradient for both;
            # under sequence parallelism the adapter gathers its rank-r product (engine.lora).
            y = y + lora(x)
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
        y = kernels.get("linear", x.device.type)(x, self.weight)  # (B, T, out) partial sums
        if (lora := self._modules.get("lora")) is not None and lora.enabled:
            y = y + lora(x)  # A is split like the weight: the adapter's partial sums join the base's
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
            return kernels.get("embedding", tokens.device.type)(tokens, self.weight)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        out = kernels.get("embedding", local.device.type)(local, self.weight).masked_fill(
            outside.unsqueeze(-1), 0.0
        )  # (B, T, C)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.tp_group, self.tp_size)  # (B, T/tp, C)
        return reduce_from_tp(out, self.tp_group, self.tp_size)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}/tp{self.tp_size}, {self.embedding_dim}, rows "
            f"[{self.vocab_start}, {self.vocab_end}), sequence_parallel={self.sequence_parallel}"
        )


class SequenceParallelPositionEmbedding(nn.Module):
    """Learned positions under sequence parallelism: looks up only this rank's slice of positions
    (along T), so (T,) positions give (T/tp, C) and (B, T) ones (B, T/tp, C), matching the sequence
    shard they are added to. The table is replicated and its gradient comes from the local slice:
    flagged sequence_parallel."""

    def __init__(self, embedding: nn.Embedding, state: ParallelState):
        super().__init__()
        self.tp_size, self.tp_rank = state.tp_size, state.tp_rank
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.weight = embedding.weight
        mark_sequence_parallel(self.weight)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions (T,) shared by the rows -> (T/tp, C); per-token positions (B, T) -> (B, T/tp, C)."""
        if positions.shape[-1] % self.tp_size:
            raise ValueError(f"{positions.shape[-1]} positions are not divisible by tp={self.tp_size}")
        local = positions.chunk(self.tp_size, -1)[self.tp_rank]
        return kernels.get("embedding", local.device.type)(local, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, slice {self.tp_rank}/{self.tp_size}"
