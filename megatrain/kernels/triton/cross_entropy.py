"""Cross-entropy over a chunk of logits in Triton: the inner step of the fused LM head + loss.

For each row of a (rows, V) chunk of logits (fp32, bf16 or fp16, read as they are and computed in
fp32) one program finds the log-sum-exp by an online softmax over vocabulary blocks, then writes the
logits' gradient (softmax - onehot) · w_row over the logits themselves, in their dtype (Liger-Kernel's
fused-linear-cross-entropy shape): no fp32 copy of 16-bit logits, two reads and one write of the chunk.

Three kernels: `_cross_entropy_kernel` does both passes for one rank's whole vocabulary;
`_stats_kernel` and `_grad_kernel` split them for the vocab-parallel loss, whose ranks all-reduce the
row statistics in between. Labels are local column ids, -1 where the row's label is not a column
here (another rank's shard, or an ignored token); columns from `n_cols` on are left out.

`TRITON_OPS` hands these to megatrain.kernels.linear_cross_entropy's chunk loop, whose GEMMs stay in
torch; `linear_cross_entropy` and `vocab_parallel_linear_cross_entropy` below are the registry's
"triton" backends of the two kernels.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from megatrain.kernels.linear_cross_entropy import ChunkOps, fused_linear_cross_entropy

MAX_BLOCK = 4096
"""Columns per block: a power of two, so that a row of a large vocabulary takes a few dozen blocks."""


@triton.jit
def _row_lse(x_ptr, n_cols, BLOCK: tl.constexpr):
    """(max, Σ exp(x - max)) of one row by an online softmax over blocks of BLOCK columns."""
    m = tl.full((), float("-inf"), tl.float32)
    d = tl.zeros((), tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        keep = cols < n_cols
        # other=0.0, then -inf: a 16-bit masked load with an inf fill reads NaNs in the interpreter.
        x = tl.load(x_ptr + cols, mask=keep, other=0.0).to(tl.float32)
        x = tl.where(keep, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    return m, d


@triton.jit
def _row_target(x_ptr, y):
    """The row's logit at column y, 0 when y < 0 (the label is not a column here)."""
    return tl.load(x_ptr + tl.maximum(y, 0), mask=y >= 0, other=0.0).to(tl.float32)


@triton.jit
def _row_grad(x_ptr, y, m, d, w, n_cols, BLOCK: tl.constexpr):
    """Overwrite the row with (exp(x - m) / d - onehot(y)) · w, in the logits' dtype (m the row's max
    and d its Σ exp(x - m): exp, then a division, as torch's softmax rounds)."""
    scale = w / d
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        keep = cols < n_cols
        x = tl.load(x_ptr + cols, mask=keep, other=0.0).to(tl.float32)
        g = tl.exp(x - m) * scale
        g = tl.where(cols == y, g - w, g)
        tl.store(x_ptr + cols, g.to(x_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _cross_entropy_kernel(X, stride, Y, W, LOSS, HIT, n_cols, HAS_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_ptr = X + row * stride
    y = tl.load(Y + row)
    m, d = _row_lse(x_ptr, n_cols, BLOCK)
    target = _row_target(x_ptr, y)  # read before the gradient overwrites it
    tl.store(LOSS + row, tl.log(d) + m - target)
    tl.store(HIT + row, ((target >= m) & (y >= 0)).to(tl.int8))
    if HAS_GRAD:
        _row_grad(x_ptr, y, m, d, tl.load(W + row), n_cols, BLOCK)


@triton.jit
def _stats_kernel(X, stride, Y, TOP, TOTAL, TARGET, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_ptr = X + row * stride
    m, d = _row_lse(x_ptr, n_cols, BLOCK)
    tl.store(TOP + row, m)
    tl.store(TOTAL + row, d)
    tl.store(TARGET + row, _row_target(x_ptr, tl.load(Y + row)))


@triton.jit
def _grad_kernel(X, stride, Y, TOP, TOTAL, W, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    y, m, d, w = tl.load(Y + row), tl.load(TOP + row), tl.load(TOTAL + row), tl.load(W + row)
    _row_grad(X + row * stride, y, m, d, w, n_cols, BLOCK)


def _block(n_cols: int) -> int:
    return min(MAX_BLOCK, triton.next_power_of_2(max(n_cols, 1)))


def _check(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be (rows, V) with contiguous rows, got {tuple(logits.shape)}")
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"{logits.shape[0]} rows but {labels.shape[0]} labels")


def cross_entropy_rows_(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's lse - logit[label] (fp32, (rows,)) and whether logit[label] is the row's max (bool,
    False for -1); with `weights` (rows,) the logits become their gradient (softmax - onehot) ·
    weights in place. labels: column ids, -1 for none."""
    _check(logits, labels)
    rows, n_cols = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    hit = torch.empty(rows, dtype=torch.int8, device=logits.device)
    if rows:
        w = weights if weights is not None else loss  # not read without HAS_GRAD
        _cross_entropy_kernel[(rows,)](
            logits,
            logits.stride(0),
            labels,
            w,
            loss,
            hit,
            n_cols,
            HAS_GRAD=weights is not None,
            BLOCK=_block(n_cols),
        )
    return loss, hit.bool()


def cross_entropy_stats(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's (max, Σ exp(x - max), logit[label] or 0), fp32 (rows,) each; logits unchanged."""
    _check(logits, labels)
    rows, n_cols = logits.shape
    top, total, target = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3))
    if rows:
        _stats_kernel[(rows,)](
            logits, logits.stride(0), labels, top, total, target, n_cols, BLOCK=_block(n_cols)
        )
    return top, total, target


def cross_entropy_grad_(
    logits: torch.Tensor,
    labels: torch.Tensor,
    top: torch.Tensor,
    top_all: torch.Tensor,
    total_all: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """The logits overwritten with (exp(logits - top_all) / total_all - onehot) · weights, the
    softmax over every shard given the rows' global max and Σ exp; returns them. (`top` is the
    twin's: its stats leave exp(x - top) behind, these leave the logits as they were.)"""
    _check(logits, labels)
    rows, n_cols = logits.shape
    if rows:
        _grad_kernel[(rows,)](
            logits, logits.stride(0), labels, top_all, total_all, weights, n_cols, BLOCK=_block(n_cols)
        )
    return logits


TRITON_OPS = ChunkOps(
    stats=cross_entropy_stats, grad_=cross_entropy_grad_, rows_=cross_entropy_rows_, fp32_logits=False
)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int | None = None,
    loss_mask: torch.Tensor | None = None,
    vocab_limit: int | None = None,
) -> torch.Tensor:
    """megatrain.kernels.linear_cross_entropy.linear_cross_entropy with the chunks' loss and
    gradient in Triton."""
    return fused_linear_cross_entropy(
        hidden,
        weight,
        labels,
        TRITON_OPS,
        chunk_tokens=chunk_tokens,
        loss_mask=loss_mask,
        vocab_limit=vocab_limit,
    )


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    group: dist.ProcessGroup | None,
    vocab_start: int,
    chunk_tokens: int | None = None,
    loss_mask: torch.Tensor | None = None,
    vocab_limit: int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """megatrain.kernels.vocab_parallel_linear_cross_entropy's function with the chunks' statistics
    and gradient in Triton."""
    return fused_linear_cross_entropy(
        hidden,
        weight,
        labels,
        TRITON_OPS,
        chunk_tokens=chunk_tokens,
        loss_mask=loss_mask,
        vocab_limit=vocab_limit,
        group=group,
        vocab_start=vocab_start,
        ignore_index=ignore_index,
    )
