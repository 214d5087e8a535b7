"""RMSNorm in Triton: one program per row forward; backward with per-program partial weight
gradients reduced after (Liger-Kernel's approach), against megatrain.kernels.rms_norm's twins.

Launch: grid (rows,) forward and (programs,) backward (one per SM on CUDA), BLOCK = next power of
two of hidden, num_warps from block_and_warps (4 to 32). Computes in fp32; returns x's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from megatrain.kernels.rms_norm import rms_norm as rms_norm_torch
from megatrain.kernels.triton._launch import block_and_warps, reduction_programs, runs_here


@triton.jit
def _rms_norm_forward_kernel(y_ptr, x_ptr, w_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # 16-bit loads upcast explicitly; masked lanes read 0 so they add nothing to the sum.
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * n_cols + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_backward_kernel(
    dx_ptr, dy_ptr, x_ptr, w_ptr, rstd_ptr, dw_ptr, n_rows, n_cols, rows_per_program, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * rows_per_program
    end = tl.minimum(start + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)  # this program's share of the weight gradient
    for row in range(start, end):
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x * rstd
        g = dy * w
        # d/dx of x·rstd·w: rstd · (g - xhat · mean(g · xhat))
        dot = tl.sum(g * xhat, axis=0) / n_cols
        tl.store(
            dx_ptr + row * n_cols + cols, ((g - xhat * dot) * rstd).to(dx_ptr.dtype.element_ty), mask=mask
        )
        dw += dy * xhat
    tl.store(dw_ptr + pid * n_cols + cols, dw, mask=mask)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) for x (rows, h) contiguous: y in x's dtype, rstd (rows,) fp32."""
    rows, h = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    block, warps = block_and_warps(h)
    if rows:
        _rms_norm_forward_kernel[(rows,)](y, x, weight, rstd, h, eps, BLOCK=block, num_warps=warps)
    return y, rstd


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight fp32) for dy and x (rows, h) contiguous."""
    rows, h = x.shape
    dx = torch.empty_like(x)
    programs = reduction_programs(rows, x.device)
    partial = torch.empty(programs, h, dtype=torch.float32, device=x.device)
    block, warps = block_and_warps(h)
    if rows:
        per_program = triton.cdiv(rows, programs)
        _rms_norm_backward_kernel[(programs,)](
            dx, dy, x, weight, rstd, partial, rows, h, per_program, BLOCK=block, num_warps=warps
        )
    return dx, partial.sum(dim=0)


class _TritonRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y, rstd = rms_norm_forward(rows, weight.contiguous(), eps)
        ctx.save_for_backward(rows, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy.reshape(x.shape).contiguous(), x, weight.contiguous(), rstd)
        grad_weight = dw.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx.view(dy.shape), grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x², -1) + eps) · weight in Triton (the "torch" twin where Triton cannot run)."""
    if not runs_here(x, weight):
        return rms_norm_torch(x, weight, eps)
    return _TritonRMSNorm.apply(x, weight, eps)
