"""SwiGLU and GeGLU in Triton on fc1's fused output h = [gate; up] (megatrain.kernels.swiglu's
layout): forward writes act(gate)·up, backward recomputes act(gate) and writes [d gate; d up] into
one tensor. GeGLU uses tanh-approximated GELU (GPT-2's gelu_new, Gemma's gelu_pytorch_tanh).

Launch: grid (rows, cdiv(f, BLOCK)), BLOCK = next power of two of f up to 1024, num_warps 4 (an
elementwise kernel: no row reduction, so a row may span several programs). Computes in fp32;
returns h's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from megatrain.kernels.geglu import geglu as geglu_torch
from megatrain.kernels.swiglu import swiglu as swiglu_torch
from megatrain.kernels.triton._launch import runs_here

MAX_BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _activation(gate, GELU: tl.constexpr):
    """(act(gate), act'(gate)) in fp32: silu, or GELU's tanh approximation."""
    if GELU:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0  # tanh(inner)
        act = 0.5 * gate * (1.0 + t)
        slope = 0.5 * (1.0 + t) + 0.5 * gate * (1.0 - t * t) * 0.7978845608028654 * (
            1.0 + 3.0 * 0.044715 * gate * gate
        )
    else:
        s = tl.sigmoid(gate)
        act = gate * s
        slope = s * (1.0 + gate * (1.0 - s))
    return act, slope


@triton.jit
def _glu_forward_kernel(y_ptr, h_ptr, f, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < f
    gate = tl.load(h_ptr + row * 2 * f + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * 2 * f + f + cols, mask=mask, other=0.0).to(tl.float32)
    act, _ = _activation(gate, GELU)
    tl.store(y_ptr + row * f + cols, (act * up).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_backward_kernel(dh_ptr, dy_ptr, h_ptr, f, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < f
    gate = tl.load(h_ptr + row * 2 * f + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * 2 * f + f + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * f + cols, mask=mask, other=0.0).to(tl.float32)
    act, slope = _activation(gate, GELU)
    tl.store(dh_ptr + row * 2 * f + cols, (dy * up * slope).to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptr + row * 2 * f + f + cols, (dy * act).to(dh_ptr.dtype.element_ty), mask=mask)


def _grid(rows: int, f: int) -> tuple[tuple[int, int], int]:
    block = min(triton.next_power_of_2(f), MAX_BLOCK)
    return (rows, triton.cdiv(f, block)), block


def glu_forward(h: torch.Tensor, gelu: bool) -> torch.Tensor:
    """act(gate)·up (rows, f) for h (rows, 2f) contiguous."""
    rows, f = h.shape[0], h.shape[1] // 2
    y = torch.empty(rows, f, dtype=h.dtype, device=h.device)
    grid, block = _grid(rows, f)
    if rows and f:
        _glu_forward_kernel[grid](y, h, f, GELU=gelu, BLOCK=block, num_warps=NUM_WARPS)
    return y


def glu_backward(dy: torch.Tensor, h: torch.Tensor, gelu: bool) -> torch.Tensor:
    """[d gate; d up] (rows, 2f) for dy (rows, f) and h (rows, 2f) contiguous."""
    rows, f = dy.shape
    dh = torch.empty_like(h)
    grid, block = _grid(rows, f)
    if rows and f:
        _glu_backward_kernel[grid](dh, dy, h, f, GELU=gelu, BLOCK=block, num_warps=NUM_WARPS)
    return dh


class _TritonGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, gelu: bool) -> torch.Tensor:  # type: ignore[override]
        if h.shape[-1] % 2:
            raise ValueError(f"a gated activation needs [gate; up] of even width, got {h.shape[-1]}")
        rows = h.reshape(-1, h.shape[-1]).contiguous()
        ctx.save_for_backward(rows)  # fc1's output; act(gate) is recomputed in backward
        ctx.gelu = gelu
        return glu_forward(rows, gelu).view(*h.shape[:-1], h.shape[-1] // 2)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (h,) = ctx.saved_tensors
        dh = glu_backward(dy.reshape(h.shape[0], -1).contiguous(), h, ctx.gelu)
        return dh.view(*dy.shape[:-1], h.shape[-1]), None


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for h = [gate; up] in Triton (the "torch" twin where Triton cannot run)."""
    if not runs_here(h):
        return swiglu_torch(h)
    return _TritonGLU.apply(h, False)


def geglu(h: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) · up for h = [gate; up] in Triton (the "torch" twin where Triton cannot run)."""
    if not runs_here(h):
        return geglu_torch(h)
    return _TritonGLU.apply(h, True)
