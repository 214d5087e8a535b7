"""GeGLU (tanh-approximated GELU gate) as an autograd Function that recomputes gelu(gate) in
backward, and its reference twin: SwiGLU's counterpart (megatrain.kernels.swiglu) on the same fused
fc1 output [gate; up]."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class _GeGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        gate, up = h.chunk(2, dim=-1)
        ctx.save_for_backward(h)  # fc1's output, kept by autograd anyway; gelu(gate) is recomputed
        return F.gelu(gate, approximate="tanh").mul_(up)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (h,) = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        grad = torch.empty_like(h)  # [d gate; d up] written in place: no cat
        d_gate, d_up = grad.chunk(2, dim=-1)
        torch.mul(F.gelu(gate, approximate="tanh"), dy, out=d_up)
        torch.ops.aten.gelu_backward.grad_input(dy * up, gate, approximate="tanh", grad_input=d_gate)
        return grad


def geglu(h: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) · up for h = [gate; up] along the last dim (fc1's fused output)."""
    return _GeGLU.apply(h)


def geglu_reference(h: torch.Tensor) -> torch.Tensor:
    """The same in plain torch ops (autograd derives the backward)."""
    gate, up = h.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
