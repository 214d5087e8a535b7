"""LM head and cross-entropy in one pass over token chunks, never holding the full logits.

`linear_cross_entropy(hidden, weight, labels)` equals `F.cross_entropy((hidden @ weight.T).float(),
labels)` (the mean over tokens, or over the tokens a 0/1 `loss_mask` keeps) but, chunk by chunk of
tokens, computes the logits, their log-sum-exp and, when gradients are wanted, the logits' gradient
softmax - onehot in place of the logits, which it folds straight into the hidden states' and the
weight's gradients. The unfused path keeps fp32 (tokens × vocab) log-probabilities for backward and
allocates two more such tensors in it, the step's memory peak for large vocabularies; here the peak
is one (chunk × vocab) fp32 block, and the elementwise passes over the logits drop from about six
to three.

Gradients are computed in the forward pass (the loss is the graph's end, so its incoming gradient
is a scalar that backward applies by scaling). Under torch.no_grad (evaluation) only the loss is
computed.

The chunk loop (fused_linear_cross_entropy) is shared: a chunk's cross-entropy comes from ChunkOps,
the torch ops here or Triton's (megatrain.kernels.triton.cross_entropy, the CUDA backend), and with
a process group the weight is one vocab shard whose row statistics the ranks all-reduce per chunk
(megatrain.kernels.vocab_parallel_linear_cross_entropy).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatrain.kernels.grad_accumulation import add_to_main_grad, fusable
from megatrain.kernels.policy import linear_cross_entropy_chunk_rows

_EXP_RANGE = 50.0


def exp_below_max_(shifted: torch.Tensor) -> torch.Tensor:
    """exp in place of logits minus their row's max, exactly 0 where that is below -50.

    On a CPU, exp's vectorised path turns scalar (over 10x slower) for inputs whose result would be
    subnormal, and subnormal probabilities slow the gradient's GEMMs as much again; a trained head's
    logits span far more than 87 below the max. What is dropped, e^-50 ~ 2e-22 of the max at most
    per column, is below float32's resolution of the row's sum (>= 1), and what is kept stays a
    normal float through the softmax's division and a token's weight."""
    shifted.clamp_min_(-_EXP_RANGE).exp_()
    return F.threshold_(shifted, math.exp(-_EXP_RANGE), 0.0)


@dataclass(frozen=True)
class ChunkOps:
    """The cross-entropy of one chunk of logits (rows, V'), V' this rank's usable columns; labels are
    column ids, -1 where the row's label is no column here. The torch ops below, or Triton's
    (megatrain.kernels.triton.cross_entropy)."""

    stats: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """(logits, labels) -> each row's max, Σ exp(x - max) and logit[label] (0 for -1), fp32 (rows,).
    May leave the logits in a state only its own grad_ reads."""
    grad_: Callable[..., torch.Tensor]
    """(logits, labels, max, global max, global Σ exp, weights) -> the logits overwritten with
    (softmax - onehot) · weights, after stats gave `max` and the ranks agreed on the row's max and
    Σ exp(x - global max)."""
    rows_: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]
    """(logits, labels, weights) -> each row's lse - logit[label], and whether logit[label] is the
    row's max (bool, False for -1), on one rank's whole vocabulary; with weights, the logits become
    their gradient as grad_ makes it."""
    fp32_logits: bool
    """Whether 16-bit logits are cast to fp32 first (torch's ops) or read as they are (Triton's)."""


def _torch_stats(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    inside = labels >= 0
    target = logits.gather(1, labels.clamp_min(0).unsqueeze(1)).squeeze(1).masked_fill(~inside, 0.0)
    # The log-sum-exp by hand, in the logits' own storage (torch.logsumexp would allocate a second
    # (rows, V) block): the logits become exp(logits - max).
    top = logits.amax(dim=1)
    exp_below_max_(logits.sub_(top.unsqueeze(1)))
    return top, logits.sum(dim=1), target


def _torch_grad_(
    logits: torch.Tensor,
    labels: torch.Tensor,
    top: torch.Tensor,
    top_all: torch.Tensor,
    total_all: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    # exp(x - top) · exp(top - top_all) / Σ = softmax (the factor exactly 1/Σ where this shard holds
    # the row's max, and always on one rank); then minus the weight at each row's label (if here).
    logits.mul_((top - top_all).exp_().div_(total_all).mul_(weights).unsqueeze(1))
    inside = labels >= 0
    logits.scatter_add_(1, labels.clamp_min(0).unsqueeze(1), (-weights * inside).unsqueeze(1))
    return logits


def _torch_rows_(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    top, total, target = _torch_stats(logits, labels)
    if weights is not None:
        _torch_grad_(logits, labels, top, top, total, weights)
    return total.log() + top - target, (target >= top) & (labels >= 0)


TORCH_OPS = ChunkOps(stats=_torch_stats, grad_=_torch_grad_, rows_=_torch_rows_, fp32_logits=True)


@dataclass
class TokenHits:
    """What counting_token_hits() collects: the loss tokens whose label is the logits' argmax (a
    tie counts), summed over every fused cross-entropy run within it on this rank; a 0-dim fp32
    tensor on the device (no host sync), None when none ran. Every tensor-parallel rank of a
    vocab-parallel loss counts the same tokens (they agree on each row's max and target)."""

    correct: torch.Tensor | None = None
    calls: int = 0
    """How many fused cross-entropies counted (the unfused reference twins do not)."""


_HITS: ContextVar[TokenHits | None] = ContextVar("megatrain_token_hits", default=None)


@contextlib.contextmanager
def counting_token_hits() -> Iterator[TokenHits]:
    """Count the correctly predicted loss tokens of the fused cross-entropies run within (the
    training loop's token accuracy, free: the chunk loop already has each row's max and target)."""
    hits = TokenHits()
    token = _HITS.set(hits)
    try:
        yield hits
    finally:
        _HITS.reset(token)


def add_token_hits(correct: torch.Tensor) -> None:
    """Count `correct` (a 0-dim tensor) into the counting_token_hits() in effect, if any: losses
    that are not the fused kernels' (an encoder's masked-LM loss) report their accuracy too."""
    hits = _HITS.get()
    if hits is not None:
        correct = correct.float()
        hits.correct = correct if hits.correct is None else hits.correct + correct
        hits.calls += 1


def _all_reduce_stats(
    top: torch.Tensor, total: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's max, Σ exp(x - max) and target logit over the vocab shards, as Megatron's
    vocab-parallel cross-entropy agrees on them: the max first, then Σ exp and the (one owner's)
    target in one sum."""
    top_all = top.clone()
    dist.all_reduce(top_all, op=dist.ReduceOp.MAX, group=group)
    # A rank whose shard is all padding has max -inf and Σ exp 0: it adds nothing.
    scaled = torch.where(total > 0, total * (top - top_all).exp(), torch.zeros_like(total))
    sums = torch.stack([scaled, target])
    dist.all_reduce(sums, group=group)
    return top_all, sums[0], sums[1]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor,
        chunk_tokens: int | None,
        vocab_limit: int | None,
        ops: ChunkOps,
        group: dist.ProcessGroup | None,
        vocab_start: int,
    ) -> torch.Tensor:
        param = weight  # the Parameter itself: its main_grad takes the fused weight gradient
        # Rows from vocab_limit on are padding: out of the softmax, zero gradient (the Parameter is
        # still what the gradient goes to, so fusion into main_grad keeps working).
        vocab = weight.shape[0]
        if vocab_limit is not None:
            vocab = max(0, min(vocab, vocab_limit - vocab_start))
        weight = weight[:vocab]
        n = hidden.shape[0]
        want_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        rows = linear_cross_entropy_chunk_rows(n, max(vocab, 1), chunk_tokens, hidden.device.type)
        # Column ids on this shard; -1 where the label is another shard's (or padding, or ignored).
        local = labels - vocab_start
        local = local.masked_fill((local < 0) | (local >= vocab), -1)
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = grad_param = None
        if ctx.needs_input_grad[1]:
            grad_param = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            grad_param[vocab:].zero_()
            grad_weight = grad_param[:vocab]  # rows first: a contiguous view
            if vocab == 0:
                grad_param.zero_()
        # fp32: every chunk's logits land in one block (fewer fresh pages than a block per chunk);
        # 16-bit: each chunk's logits (or their fp32 cast) are their own block, freed before the next.
        hits = _HITS.get()
        correct = torch.zeros((), dtype=torch.float32, device=hidden.device)
        block = None
        if weight.dtype == torch.float32 and vocab:
            block = torch.empty(min(rows, n), vocab, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, rows):
            h = hidden[start : start + rows]
            y = local[start : start + rows]
            w = weights[start : start + rows]
            if vocab == 0:  # a shard of padding only: it joins the collectives, adds nothing
                empty = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
                top_all, total, target = _all_reduce_stats(
                    torch.full_like(empty, float("-inf")), empty, empty, group
                )
                loss_sum += ((total.log() + top_all - target) * w).sum()
                correct += ((target >= top_all) & (w > 0)).sum()
                if grad_hidden is not None:
                    grad_hidden[start : start + rows].zero_()
                continue
            if block is not None:
                logits = torch.mm(h, weight.t(), out=block[: h.shape[0]])  # (rows, V)
            else:
                logits = h @ weight.t()
                if ops.fp32_logits:
                    logits = logits.float()
            if group is None:
                row_loss, hit = ops.rows_(logits, y, w if want_grad else None)
            else:
                top, total, target = ops.stats(logits, y)
                top_all, total_all, target = _all_reduce_stats(top, total, target, group)
                row_loss, hit = total_all.log() + top_all - target, target >= top_all
                if want_grad:
                    ops.grad_(logits, y, top, top_all, total_all, w)
            loss_sum += (row_loss * w).sum()
            correct += (hit & (w > 0)).sum()
            if not want_grad:
                del logits
                continue
            g = logits.to(hidden.dtype)  # d loss / d logits, this shard's columns
            if grad_hidden is not None:  # this shard's part: the caller sums it over the shards
                torch.mm(g, weight, out=grad_hidden[start : start + rows])
            if grad_weight is not None:
                if g.dtype != torch.float32:  # 16-bit GEMM, accumulated over chunks in fp32
                    part = g.t() @ h
                    if start == 0:
                        grad_weight.copy_(part)
                    else:
                        grad_weight.add_(part)
                    del part
                elif start == 0:  # the first chunk writes: no zero-fill of the (V, h) gradient
                    torch.mm(g.t(), h, out=grad_weight)
                else:
                    grad_weight.addmm_(g.t(), h)
            del logits, g  # before the next chunk's logits: one 16-bit block alive, not two
        if hits is not None:
            hits.correct = correct if hits.correct is None else hits.correct + correct
            hits.calls += 1
        ctx.save_for_backward(grad_hidden, grad_param)
        ctx.weight_dtype = param.dtype
        # Under DataParallel the weight gradient is added straight into main_grad in backward.
        ctx.weight = param if grad_param is not None and fusable(param) else None
        return loss_sum

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_loss: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        # Scaled in place: the gradients were made for this one backward (no retain_graph reuse).
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden.mul_(grad_loss.to(grad_hidden.dtype))
        if grad_weight is not None:
            if ctx.weight is not None:
                grad_weight = add_to_main_grad(ctx.weight, grad_weight, grad_loss)
            else:
                grad_weight = grad_weight.mul_(grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def token_weights(
    labels: torch.Tensor, loss_mask: torch.Tensor | None, ignore_index: int | None = None
) -> torch.Tensor:
    """Each token's share of the mean loss, fp32 (n,): 1/n, or keep_i / Σ keep where keep is the
    loss mask (0/1) and the label not ignore_index (a tensor: no host sync; 0 when nothing is kept)."""
    if loss_mask is None and ignore_index is None:
        return torch.full(labels.shape, 1.0 / max(labels.shape[0], 1), device=labels.device)
    keep = torch.ones(labels.shape, dtype=torch.float32, device=labels.device)
    if loss_mask is not None:
        keep = keep * loss_mask.float()
    if ignore_index is not None:
        keep = keep * (labels != ignore_index)
    return keep / keep.sum().clamp_min(1.0)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ops: ChunkOps,
    *,
    chunk_tokens: int | None = None,
    loss_mask: torch.Tensor | None = None,
    vocab_limit: int | None = None,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    ignore_index: int | None = None,
) -> torch.Tensor:
    """The chunk loop both kernels share. With a group, `weight` is this rank's vocab shard (ids
    vocab_start onwards) and the hidden states' gradient is this shard's part (the caller sums it
    over the group); without one, the whole vocabulary."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    if h.shape[0] != y.shape[0]:
        raise ValueError(f"{h.shape[0]} hidden rows but {y.shape[0]} labels")
    weights = token_weights(y, _flat_mask(loss_mask, y.shape[0]), ignore_index)
    return _LinearCrossEntropy.apply(
        h, weight, y, weights, chunk_tokens, vocab_limit, ops, group, vocab_start
    )


def _flat_mask(loss_mask: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if loss_mask is None:
        return None
    mask = loss_mask.reshape(-1)
    if mask.shape[0] != n:
        raise ValueError(f"{n} labels but a loss mask of {mask.shape[0]}")
    return mask


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int | None = None,
    loss_mask: torch.Tensor | None = None,
    vocab_limit: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of (hidden @ weight.T) against labels over the tokens loss_mask (0/1)
    keeps (all without one; 0 when none is kept); hidden (..., h), labels and loss_mask (...).
    Only the first vocab_limit rows of weight are classes (the rest is padding: zero gradient)."""
    return fused_linear_cross_entropy(
        hidden,
        weight,
        labels,
        TORCH_OPS,
        chunk_tokens=chunk_tokens,
        loss_mask=loss_mask,
        vocab_limit=vocab_limit,
    )


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int | None = None,
    loss_mask: torch.Tensor | None = None,
    vocab_limit: int | None = None,
) -> torch.Tensor:
    """The unfused twin: full fp32 logits, then torch's cross-entropy (`chunk_tokens` is ignored)."""
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight[:vocab_limit].t()
    mask = _flat_mask(loss_mask, logits.shape[0])
    if mask is None:
        return F.cross_entropy(logits.float(), labels.reshape(-1))
    per_token = F.cross_entropy(logits.float(), labels.reshape(-1), reduction="none")
    return (per_token * mask.float()).sum() / mask.float().sum().clamp_min(1.0)
