"""An MoE combine: routed rows summed back into their tokens, each weighted by its routing
probability, as an autograd Function that saves only the rows, the probabilities and the index;
and its reference twin (the composite it replaces).

    out[t] = Σ_{i: index[i] = t} y[i] · w[i]      (y (M, C), w (M,) or None, index (M,) -> (n, C))

The sum runs in fp32 and is cast back to y's dtype (a token's k terms add in fp32, as Megatron's
unpermute does with probabilities). The composite (`y.float() * w` then `index_add_`) saves two fp32
copies of the rows for backward: the cast, which the product keeps for w's gradient, and the
weighted product, which index_add_ keeps for its source's shape. Here backward gathers the
gradient rows (fp32, transient) and needs y only for w's gradient: per routed row act·C bytes
saved instead of act·C + 8·C (a bf16 layer: 2C instead of 10C). Without w it saves the index
only (the two-hop dispatch's per-node and per-token sums).
"""

from __future__ import annotations

from typing import Any

import torch


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, y: torch.Tensor, weights: torch.Tensor | None, index: torch.Tensor, n: int
    ) -> torch.Tensor:
        rows = y.float() if weights is None else y.float() * weights.unsqueeze(-1)
        out = rows.new_zeros(n, y.shape[-1]).index_add_(0, index, rows)
        if weights is not None and ctx.needs_input_grad[1]:
            ctx.save_for_backward(index, weights, y)
        else:
            ctx.save_for_backward(index, weights)
        ctx.dtype = y.dtype
        return out.to(y.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        index, weights, *y = ctx.saved_tensors
        g = grad.float().index_select(0, index)  # (M, C): each row's token's gradient
        dw = (g * y[0]).sum(-1).to(weights.dtype) if y else None  # (fp32 product, no cast copy of y)
        dy = g if weights is None else g.mul_(weights.unsqueeze(-1).float())
        return (dy.to(ctx.dtype) if ctx.needs_input_grad[0] else None), dw, None, None


def moe_combine(y: torch.Tensor, weights: torch.Tensor | None, index: torch.Tensor, n: int) -> torch.Tensor:
    """Rows y (M, C) summed into n tokens by index (M,), each weighted by weights (M,) when given."""
    return _Combine.apply(y, weights, index, n)


def moe_combine_reference(
    y: torch.Tensor, weights: torch.Tensor | None, index: torch.Tensor, n: int
) -> torch.Tensor:
    rows = y.float() if weights is None else y.float() * weights.unsqueeze(-1)
    return rows.new_zeros(n, y.shape[-1]).index_add_(0, index, rows).to(y.dtype)
