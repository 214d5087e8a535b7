"""Gradient-accumulation fusion: weight gradients added straight into `param.main_grad`.

Megatron's `--gradient-accumulation-fusion`, on by default in DataParallel (which sets
`param.grad_accumulation_fusion`). Under DataParallel every parameter has `main_grad`, a view of the
persistent (fp32) gradient buffer. Without fusion, backward allocates a fresh `.grad`
for every weight each micro-batch (on a CPU, fresh pages: the kernel faults and zeroes each one),
fills it (the embedding's dense gradient is a zeroed (V, h) block), and DataParallel's hook then
adds it into `main_grad` and frees it: one allocation and two extra passes per weight. Here the
linear's weight-gradient GEMM accumulates in place (`main_grad.addmm_(dyᵀ, x)`), the embedding adds
its rows with `index_add_`, and the fused LM-head loss adds its chunked gradient with one scaled
pass.

The autograd contract, as in Megatron: a fused backward sets `param.grad_added_to_main_grad` and
returns a placeholder of the parameter's shape (never read: see `placeholder`), so that AccumulateGrad
and DataParallel's post-accumulate hook still run and mark the bucket ready; the hook sees the flag,
skips its own add and drops the placeholder. Every use of such a parameter must go
through these functions (the model's Linear/Embedding modules, the parallel layers and the fused
loss all do), or a real gradient would be summed with a placeholder.

Outside DataParallel (a bare model), without gradients (evaluation) or under torch.compile, the
plain F.linear / F.embedding run: fusion changes where gradients land, never their values.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F


def fusable(weight: torch.Tensor) -> bool:
    """Whether `weight`'s gradient goes straight into its main_grad (DataParallel asked for it)."""
    return getattr(weight, "grad_accumulation_fusion", False) and not torch.compiler.is_compiling()


def placeholder(weight: torch.Tensor) -> torch.Tensor:
    """What a fused backward returns for `weight`: marks the gradient as already in main_grad.

    Never read. Where main_grad has the parameter's dtype (fp32 training) it is a fresh view of
    main_grad: no allocation at all (a fresh never-touched block, freed again, would leave untouched
    pages in the heap for the next activations to fault in). Otherwise an uninitialised tensor of
    the parameter's dtype (the CUDA caching allocator hands those out for free).
    """
    weight.grad_added_to_main_grad = True  # type: ignore[attr-defined]
    main = weight.main_grad  # type: ignore[attr-defined]
    if main.dtype == weight.dtype:
        return main.view(weight.shape)
    return torch.empty_like(weight)


def add_to_main_grad(
    weight: torch.Tensor, grad: torch.Tensor, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """main_grad += grad (· scale, a 0-dim tensor: no host sync); returns the placeholder gradient."""
    main = weight.main_grad  # type: ignore[attr-defined]
    if scale is None:
        main.add_(grad)
    else:
        main.addcmul_(grad, scale.to(main.dtype))
    return placeholder(weight)


_DEFERRED: list[Callable[[], None]] | None = None
"""Where the weight-gradient GEMMs go while deferring_weight_grads is in effect. A module global,
not a ContextVar: on a GPU autograd runs backward functions in its own device threads."""


@contextlib.contextmanager
def deferring_weight_grads(into: list[Callable[[], None]]) -> Iterator[None]:
    """Within, the fused linears' weight-gradient GEMMs (main_grad += dyᵀ x) are appended to `into`
    instead of run: a backward computes only what the previous stage waits for (its input
    gradients), and a zero-bubble schedule's W pass runs `into` later, in an otherwise idle slot.
    Each closure keeps its dy and x alive until then. Parameters outside the fused linears (norms,
    biases, embeddings, float8 weights) get their gradients in the backward itself."""
    global _DEFERRED
    before, _DEFERRED = _DEFERRED, into
    try:
        yield
    finally:
        _DEFERRED = before


@torch.no_grad()
def _accumulate(main: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    if main.dtype == dy.dtype:
        main.addmm_(dy.t(), x)  # the weight-gradient GEMM accumulates in place
    else:  # 16-bit GEMM, accumulated in the fp32 buffer
        main.add_(dy.t().mm(x))


def weight_grad_into_main(main: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    """main_grad += dyᵀ x (dy (N, out), x (N, in)): now, or in the W pass (deferring_weight_grads)."""
    if _DEFERRED is not None:
        # Detached: the closure keeps the two tensors, not the forward graph they came from.
        _DEFERRED.append(functools.partial(_accumulate, main, dy.detach(), x.detach()))
    else:
        _accumulate(main, dy, x)


class _LinearWithGradAccumulation(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        # The Parameter itself, for main_grad: under activation checkpointing saved_tensors gives
        # back what the recompute saved, not necessarily this object.
        ctx.param = weight
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        weight_grad_into_main(ctx.param.main_grad, dy, x2)
        grad_bias = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, placeholder(ctx.param), grad_bias


def _linear_fp8(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The `linear_fp8` kernel for a weight that precision fp8 tagged (megatrain.kernels.fp8_linear)."""
    from megatrain import kernels

    fp8 = weight.fp8  # type: ignore[attr-defined]
    return kernels.get("linear_fp8", x.device.type, fp8.backend)(x, weight, bias, fp8.recipe)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose weight gradient accumulates into weight.main_grad when there is one; in float8
    where the weight is tagged `fp8` (precision fp8)."""
    if getattr(weight, "fp8", None) is not None:
        return _linear_fp8(x, weight, bias)
    if not (torch.is_grad_enabled() and weight.requires_grad and fusable(weight)):
        return F.linear(x, weight, bias)
    return _LinearWithGradAccumulation.apply(x, weight, bias)


class _EmbeddingWithGradAccumulation(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(tokens)
        ctx.param = weight  # for main_grad (see _LinearWithGradAccumulation)
        return F.embedding(tokens, weight)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[None, torch.Tensor]:  # type: ignore[override]
        (tokens,) = ctx.saved_tensors
        weight = ctx.param
        main = weight.main_grad
        # Only the looked-up rows: no dense zeroed (V, h) gradient.
        main.index_add_(0, tokens.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1]).to(main.dtype))
        return None, placeholder(weight)


def embedding(tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding whose weight gradient accumulates into weight.main_grad when there is one."""
    if not (torch.is_grad_enabled() and weight.requires_grad and fusable(weight)):
        return F.embedding(tokens, weight)
    return _EmbeddingWithGradAccumulation.apply(tokens, weight)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain F.linear: its gradient lands in `.grad`, which DataParallel's hook adds to main_grad
    (a weight tagged `fp8` still multiplies in float8: the precision is the run's, not the kernel's)."""
    if getattr(weight, "fp8", None) is not None:
        return _linear_fp8(x, weight, bias)
    return F.linear(x, weight, bias)


def embedding_reference(tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Plain F.embedding (a dense `.grad`, added to main_grad by DataParallel's hook)."""
    return F.embedding(tokens, weight)
