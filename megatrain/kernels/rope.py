"""Rotary position embedding (rotate-half layout) as an autograd Function, and its reference twin.

Two full-tensor passes forward and two backward (the op-by-op graph's slices, cat and their
zero-filled backward copies take about nine); it saves nothing but the cos/sin tables (buffers).
Computed in fp32 at least: 16-bit inputs are upcast, the result is cast back.
"""

from __future__ import annotations

from typing import Any

import torch

from megatrain.kernels._util import fp32_at_least


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[x1·c - x2·s, x2·c + x1·s] for x = [x1, x2] (halves of the last dim); c, s: (T, hd/2)."""
    out = torch.empty_like(x, dtype=torch.promote_types(x.dtype, cos.dtype))
    x1, x2 = x.chunk(2, dim=-1)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    return out


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        # A rotation's transpose is the rotation by the opposite angle.
        return _rotate(grad, cos, -sin).to(grad.dtype), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half layout (Hugging Face Llama's). x: (B, heads, T, hd);
    cos/sin: (T, hd) with equal halves, as rope_tables makes them."""
    half = x.shape[-1] // 2
    return _RoPE.apply(x, fp32_at_least(cos[..., :half]), fp32_at_least(sin[..., :half]))


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The same as Hugging Face Llama writes it: x·cos + rotate_half(x)·sin (autograd's backward)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (fp32_at_least(x) * fp32_at_least(cos) + fp32_at_least(rotated) * fp32_at_least(sin)).to(x.dtype)


def apply_rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, T, hd) and k (B, G, T, hd) rotated alike (the `apply_rope_qk` kernel: Triton
    rotates both in one launch)."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def apply_rope_qk_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference twin of apply_rope_qk."""
    return apply_rope_reference(q, cos, sin), apply_rope_reference(k, cos, sin)
