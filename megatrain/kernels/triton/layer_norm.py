"""LayerNorm in Triton: one program per row forward (saving mean and 1/std); backward with
per-program partial weight and bias gradients reduced after (Liger-Kernel's approach), against
megatrain.kernels.layer_norm's twins.

Launch: grid (rows,) forward and (programs,) backward (one per SM on CUDA), BLOCK = next power of
two of hidden, num_warps from block_and_warps (4 to 32). Computes in fp32; returns x's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from megatrain.kernels.layer_norm import layer_norm as layer_norm_torch
from megatrain.kernels.triton._launch import block_and_warps, reduction_programs, runs_here


@triton.jit
def _layer_norm_forward_kernel(
    y_ptr, x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, n_cols, eps, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    centred = tl.where(mask, x - mean, 0.0)  # padding lanes would add mean² to the variance
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
    y = centred * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_backward_kernel(
    dx_ptr,
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dw_ptr,
    db_ptr,
    n_rows,
    n_cols,
    rows_per_program,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * rows_per_program
    end = tl.minimum(start + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)  # this program's shares of the weight and bias grads
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(start, end):
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = tl.where(mask, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
        g = dy * w
        # d/dx of xhat·w: rstd · (g - mean(g) - xhat · mean(g · xhat))
        mean_g = tl.sum(g, axis=0) / n_cols
        mean_gx = tl.sum(g * xhat, axis=0) / n_cols
        dx = (g - mean_g - xhat * mean_gx) * rstd
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    tl.store(dw_ptr + pid * n_cols + cols, dw, mask=mask)
    tl.store(db_ptr + pid * n_cols + cols, db, mask=mask)


def layer_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd) for x (rows, h) contiguous: y in x's dtype, mean and rstd (rows,) fp32."""
    rows, h = x.shape
    y = torch.empty_like(x)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    block, warps = block_and_warps(h)
    if rows:
        _layer_norm_forward_kernel[(rows,)](
            y, x, weight, weight if bias is None else bias, mean, rstd, h, eps,
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=warps,
        )  # fmt: skip
    return y, mean, rstd


def layer_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight fp32, dbias fp32) for dy and x (rows, h) contiguous."""
    rows, h = x.shape
    dx = torch.empty_like(x)
    programs = reduction_programs(rows, x.device)
    partial_w = torch.empty(programs, h, dtype=torch.float32, device=x.device)
    partial_b = torch.empty_like(partial_w)
    block, warps = block_and_warps(h)
    if rows:
        per_program = triton.cdiv(rows, programs)
        _layer_norm_backward_kernel[(programs,)](
            dx, dy, x, weight, mean, rstd, partial_w, partial_b, rows, h, per_program,
            BLOCK=block, num_warps=warps,
        )  # fmt: skip
    return dx, partial_w.sum(dim=0), partial_b.sum(dim=0)


class _TritonLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        b = bias.contiguous() if bias is not None else None
        y, mean, rstd = layer_norm_forward(rows, weight.contiguous(), b, eps)
        ctx.save_for_backward(rows, weight, mean, rstd)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.view(x.shape)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, dy: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = layer_norm_backward(dy.reshape(x.shape).contiguous(), x, weight.contiguous(), mean, rstd)
        grad_weight = dw.to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = db.to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        return dx.view(dy.shape), grad_weight, grad_bias, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) · weight + bias in Triton (the "torch" twin where Triton cannot run)."""
    if not runs_here(x, weight):
        return layer_norm_torch(x, weight, bias, eps)
    return _TritonLayerNorm.apply(x, weight, bias, eps)
