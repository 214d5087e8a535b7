"""Rotary position embedding (rotate-half layout) in Triton: q and k rotated in one launch, one
program per (batch row, position) covering every head, against megatrain.kernels.rope's twins.

Both directions read q and k (or their gradients) where they lie, whatever their strides (the
views split_qkv makes: no .contiguous() copy), and write fresh contiguous tensors; backward is the
rotation by -θ (a rotation's transpose). rope_launch can rotate in place (out = in), but the autograd
Function does not: a gradient tensor may be shared with another branch of the graph.

Launch: grid (B·T,), a block of (next power of two of heads) × (next power of two of hd/2),
num_warps 4. Computes in fp32; returns the inputs' dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from megatrain.kernels.rope import apply_rope as apply_rope_torch
from megatrain.kernels.triton._launch import runs_here

NUM_WARPS = 4


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, b, t, sxb, sxh, sxt, sob, soh, sot, n_heads, c, s, half,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """out[b, :, t] = [x1·c - x2·s, x2·c + x1·s] over every head at one position."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < n_heads) & (dims < half)
    x = x_ptr + b * sxb + t * sxt + heads * sxh + dims
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + half, mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + b * sob + t * sot + heads * soh + dims
    tl.store(out, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + half, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, q_out_ptr, k_ptr, k_out_ptr, cos_ptr, sin_ptr,
    sqb, sqh, sqt, soqb, soqh, soqt,
    skb, skh, skt, sokb, sokh, sokt,
    scb, sct, seq_len, n_q_heads, n_k_heads, half,
    HAS_K: tl.constexpr, BACKWARD: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq_len
    t = pid % seq_len
    dims = tl.arange(0, BLOCK_D)[None, :]
    table = b * scb + t * sct + dims
    c = tl.load(cos_ptr + table, mask=dims < half, other=0.0).to(tl.float32)  # (1, BLOCK_D)
    s = tl.load(sin_ptr + table, mask=dims < half, other=0.0).to(tl.float32)
    if BACKWARD:
        s = -s  # the rotation by -θ undoes (and is the transpose of) the rotation by θ
    _rotate_heads(q_ptr, q_out_ptr, b, t, sqb, sqh, sqt, soqb, soqh, soqt, n_q_heads, c, s, half,
                  BLOCK_QH, BLOCK_D)  # fmt: skip
    if HAS_K:
        _rotate_heads(k_ptr, k_out_ptr, b, t, skb, skh, skt, sokb, sokh, sokt, n_k_heads, c, s, half,
                      BLOCK_KH, BLOCK_D)  # fmt: skip


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    if x.stride(-1) != 1:
        raise ValueError("rope needs the head dimension contiguous")
    return x.stride(0), x.stride(1), x.stride(2)


def _table_strides(cos: torch.Tensor) -> tuple[int, int]:
    """(batch, position) strides of a (T, hd) or (B, 1, T, hd) table; a shared table has batch 0."""
    if cos.dim() == 2:
        return 0, cos.stride(0)
    return (0 if cos.shape[0] == 1 else cos.stride(0)), cos.stride(2)


def rope_launch(
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor | None,
    backward: bool = False,
) -> None:
    """Rotate q (B, H, T, hd) and k (B, G, T, hd) into q_out and k_out (which may be q and k:
    each program reads a position before writing it); cos/sin (T, hd) or (B, 1, T, hd) with equal
    halves (only the first is read)."""
    batch, heads, seq, hd = q.shape
    half = hd // 2
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    k_heads = k.shape[1] if k is not None else 1
    ks = _strides(k) + _strides(k_out) if k is not None and k_out is not None else (0,) * 6
    if batch * seq == 0:
        return
    _rope_kernel[(batch * seq,)](
        q, q_out, k if k is not None else q, k_out if k_out is not None else q_out, cos, sin,
        *_strides(q), *_strides(q_out), *ks, *_table_strides(cos), seq, heads, k_heads, half,
        HAS_K=k is not None, BACKWARD=backward, BLOCK_QH=triton.next_power_of_2(heads),
        BLOCK_KH=triton.next_power_of_2(k_heads), BLOCK_D=triton.next_power_of_2(half), num_warps=NUM_WARPS,
    )  # fmt: skip


class _TritonRoPE(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if k is not None else None
        rope_launch(q, k, cos, sin, q_out, k_out)
        ctx.save_for_backward(cos, sin)
        return q_out, k_out

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, dq: torch.Tensor, dk: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, None, None]:
        cos, sin = ctx.saved_tensors
        # Into fresh tensors, not in place: autograd may hand this same gradient tensor to another
        # branch too (an add's backward passes one tensor to both inputs). dk is None only when no
        # k was given (autograd materialises an unused output's gradient as zeros).
        dq_out = torch.empty(dq.shape, dtype=dq.dtype, device=dq.device)
        dk_out = torch.empty(dk.shape, dtype=dk.dtype, device=dk.device) if dk is not None else None
        rope_launch(dq, dk, cos, sin, dq_out, dk_out, backward=True)
        return dq_out, dk_out, None, None


def apply_rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, T, hd) and k (B, G, T, hd) rotated in one launch; cos/sin (T, hd) or (B, 1, T, hd)
    (the "torch" twin where Triton cannot run)."""
    if not runs_here(q, k, cos):
        return apply_rope_torch(q, cos, sin), apply_rope_torch(k, cos, sin)
    q_out, k_out = _TritonRoPE.apply(q, k, cos, sin)
    return q_out, k_out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One tensor (B, heads, T, hd) rotated (the "torch" twin where Triton cannot run)."""
    if not runs_here(x, cos):
        return apply_rope_torch(x, cos, sin)
    out, _ = _TritonRoPE.apply(x, None, cos, sin)
    return out
