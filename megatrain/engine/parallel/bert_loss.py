"""BERT's losses from the encoder's output, on one device or tensor-parallel (+ sequence-parallel).

The masked-LM loss needs only the masked positions (~15% of the tokens): the head's transform runs
where the residual stream lives (the local sequence shard under sequence parallelism, its weights
flagged sequence_parallel so their gradients are summed over tp), the result enters the tensor-
parallel region (all-gathered along T, or copy_to_tp), and only the masked rows are projected onto
this rank's vocabulary shard and scored by the vocab-parallel cross-entropy: the (tokens × vocab)
logits of the unmasked positions are never computed.

The sentence-order head reads the first token, which under sequence parallelism lives on tp rank 0:
it is broadcast to the other ranks, every rank computes the same (tiny) binary loss, and the
gradient goes back to rank 0's shard once (replicated pooler and classifier weights get equal
gradients everywhere, as their replicas must).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatrain import kernels
from megatrain.engine.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatrain.engine.parallel.mappings import copy_to_tp, gather_from_sequence
from megatrain.engine.parallel.state import ParallelState
from megatrain.kernels.linear_cross_entropy import add_token_hits


class EncoderLosses(NamedTuple):
    mlm: torch.Tensor
    """Mean masked-LM loss over the loss tokens (0 when none)."""
    binary: torch.Tensor | None
    """Mean sentence-order loss over the rows; None without a binary head or labels."""
    mlm_correct: torch.Tensor
    """Masked tokens whose label was the argmax (detached, a count)."""
    binary_correct: torch.Tensor | None
    """Rows whose sentence-order label was the argmax (detached)."""


@dataclass
class BinaryCounts:
    """What counting_binary() collects on this rank: Σ rows · sentence-order loss, Σ correct, rows
    (0-dim tensors on the device: no host sync until a log interval reads them)."""

    loss_sum: torch.Tensor | None = None
    correct: torch.Tensor | None = None
    rows: int = 0

    def add(self, mean: torch.Tensor, correct: torch.Tensor, rows: int) -> None:
        total = mean.detach().float() * rows
        self.loss_sum = total if self.loss_sum is None else self.loss_sum + total
        c = correct.float()
        self.correct = c if self.correct is None else self.correct + c
        self.rows += rows

    def as_tensor(self, device: torch.device | str) -> torch.Tensor:
        """(Σ loss, Σ correct, rows) as one fp32 tensor (zeros when nothing counted)."""
        if self.loss_sum is None or self.correct is None:
            return torch.zeros(3, device=device)
        return torch.stack([self.loss_sum, self.correct, self.correct.new_tensor(float(self.rows))])


_BINARY: ContextVar[BinaryCounts | None] = ContextVar("megatrain_binary_counts", default=None)


@contextlib.contextmanager
def counting_binary() -> Iterator[BinaryCounts]:
    """Count the sentence-order losses and hits of the encoder losses run within (the training
    loop's sop_loss and sop_accuracy)."""
    counts = BinaryCounts()
    token = _BINARY.set(counts)
    try:
        yield counts
    finally:
        _BINARY.reset(token)


class _FirstToken(torch.autograd.Function):
    """hidden (B, T/tp, C), a sequence shard -> the sequence's first token (B, C) on every tp rank."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, state: ParallelState) -> torch.Tensor:  # type: ignore[override]
        ctx.state, ctx.shape = state, hidden.shape
        first = hidden[:, 0].contiguous() if state.tp_rank == 0 else hidden.new_empty(hidden[:, 0].shape)
        dist.broadcast(first, dist.get_global_rank(state.tp_group, 0), group=state.tp_group)
        return first

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        out = grad.new_zeros(ctx.shape)
        if ctx.state.tp_rank == 0:  # every rank computed the same loss: one copy of its gradient
            out[:, 0] = grad
        return out, None


def first_token(hidden: torch.Tensor, sequence_parallel: bool, state: ParallelState | None) -> torch.Tensor:
    """(B, C): the first token's hidden state, wherever the residual stream holds it."""
    if state is None or state.tp_size == 1 or not sequence_parallel:
        return hidden[:, 0]
    out: torch.Tensor = _FirstToken.apply(hidden, state)
    return out


@torch.no_grad()
def _vocab_parallel_correct(
    logits: torch.Tensor, labels: torch.Tensor, state: ParallelState | None, vocab_limit: int
) -> torch.Tensor:
    """How many rows' labels are the argmax of (N, V/tp) vocab-sharded logits over the first
    vocab_limit ids (a tie counts)."""
    if state is None or state.tp_size == 1:
        return (logits.argmax(-1) == labels).sum()
    start = state.tp_rank * logits.shape[-1]
    cols = torch.arange(start, start + logits.shape[-1], device=logits.device)
    logits = logits.float().masked_fill(cols >= vocab_limit, float("-inf"))  # padding rows never win
    best = logits.max(-1).values
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=state.tp_group)
    mine = (labels >= start) & (labels < start + logits.shape[-1])
    local = (labels - start).clamp(0, logits.shape[-1] - 1)
    hit = mine & (logits.gather(1, local[:, None]).squeeze(1) >= best)
    count = hit.sum()
    dist.all_reduce(count, group=state.tp_group)
    return count


def encoder_losses(
    hidden: torch.Tensor,
    holder: Any,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None,
    binary_labels: torch.Tensor | None,
    state: ParallelState | None = None,
) -> EncoderLosses:
    """The masked-LM and sentence-order losses of the encoder output `hidden` (B, T, C), or (B,
    T/tp, C) under sequence parallelism. `holder` has `heads` (models.bert.BertHeads) and `lm_head`
    (a Linear, or a ColumnParallelLinear whose output stays vocab-sharded): a BertModel or its last
    pipeline chunk. labels and loss_mask (B, T): the original ids at the masked positions;
    binary_labels (B,) or None."""
    heads, head = holder.heads, holder.lm_head
    cfg = holder.config
    sp = bool(getattr(head, "sequence_parallel", False))
    tp = state.tp_size if state is not None else 1
    binary = binary_correct = None
    if heads.classifier is not None and binary_labels is not None:
        logits2 = heads.class_logits(first_token(hidden, sp, state)).float()  # (B, classes)
        binary = F.cross_entropy(logits2, binary_labels)
        binary_correct = (logits2.detach().argmax(-1) == binary_labels).sum()
        cp = state.cp_size if state is not None else 1
        counts = _BINARY.get()
        if counts is not None and (cp == 1 or state is None or state.cp_rank == 0):
            counts.add(binary, binary_correct, int(binary_labels.shape[0]))
        if cp > 1:
            # Only cp rank 0 holds the first token (its first chunk is the sequence's start). The
            # replicas' gradients are averaged over dp·cp: it carries the whole loss, cp times.
            assert state is not None
            binary = binary * cp if state.cp_rank == 0 else binary * 0.0
            binary_correct = binary_correct if state.cp_rank == 0 else binary_correct * 0
    if not cfg.masked_lm:  # a sequence classifier: its classifier's loss alone (and a graph)
        none = hidden.sum() * 0.0
        return EncoderLosses(none, binary, none.detach(), binary_correct)
    x = heads.transform(hidden)
    if tp > 1:
        assert state is not None
        x = gather_from_sequence(x, state.tp_group, tp) if sp else copy_to_tp(x, state.tp_group, tp)
    mask = loss_mask.reshape(-1) > 0 if loss_mask is not None else None
    rows = x.reshape(-1, x.shape[-1])
    targets = labels.reshape(-1)
    if mask is not None:
        keep = mask.nonzero().squeeze(1)  # the masked positions only
        rows, targets = rows.index_select(0, keep), targets.index_select(0, keep)
    # The `linear` kernel, as every Linear runs: under DataParallel it adds the weight gradient
    # straight into main_grad. The decoder weight is the embedding's, whose lookup does so too; a
    # plain F.linear's gradient would reach the same parameter as .grad beside the fused one's
    # placeholder, and be dropped.
    logits = kernels.get("linear", rows.device.type)(rows, head.weight, head.bias)  # (N, V/tp)
    limit = cfg.real_vocab_size
    if rows.shape[0] == 0:
        mlm = logits.sum() * 0.0  # no masked token here: no loss, zero gradients (and a graph)
    else:
        mlm = vocab_parallel_cross_entropy(
            logits, targets, state or _ONE_DEVICE, vocab_limit=limit if limit < cfg.vocab_size else None
        )
    limited = logits.detach() if tp > 1 else logits.detach()[:, :limit]
    return EncoderLosses(mlm, binary, _vocab_parallel_correct(limited, targets, state, limit), binary_correct)


class _OneDevice:
    """The ParallelState fields vocab_parallel_cross_entropy reads, for one device."""

    tp_size = 1


_ONE_DEVICE: Any = _OneDevice()


def encoder_loss(hidden: torch.Tensor, holder: Any, mb: Any, state: ParallelState | None) -> torch.Tensor:
    """A micro-batch's loss for the training loop: the masked-LM mean over its loss tokens plus the
    sentence-order mean times mb.binary_scale (token_share then weighs the first by its tokens and
    the second by its rows); the masked-LM hits go to counting_token_hits (token accuracy)."""
    losses = encoder_losses(hidden, holder, mb.labels, mb.loss_mask, mb.binary_labels, state)
    if holder.config.masked_lm:  # a classifier has no masked token to count
        add_token_hits(losses.mlm_correct)
    if losses.binary is None:
        return losses.mlm
    return losses.mlm + losses.binary * mb.binary_scale
