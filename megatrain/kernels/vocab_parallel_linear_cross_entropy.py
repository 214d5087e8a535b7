"""The fused LM head + cross-entropy on a vocab-sharded head: never the (tokens × V/tp) logits.

At tensor parallelism the LM head's weight is split by vocabulary rows: rank r holds ids
[vocab_start, vocab_start + V/tp). Token chunk by token chunk, each rank computes its chunk of local
logits, their row max, Σ exp and (on the owning rank) the target logit; the ranks all-reduce those
(the max, then Σ exp and the target in one sum, as Megatron's vocab-parallel cross-entropy does),
and each rank turns its local logits into their gradient and folds it into the hidden states' and
its weight shard's gradients, as megatrain.kernels.linear_cross_entropy does on one rank.

The hidden states must be the whole sequence on every rank of the group, and the hidden gradient
returned is this shard's part: the caller enters the region through copy_to_tp (gradients summed
over tp) or, under sequence parallelism, gather_from_sequence (reduce-scattered), as the
column-parallel head's input would (megatrain.engine.parallel.parallelize.fused_parallel_lm_loss).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatrain.kernels.linear_cross_entropy import TORCH_OPS, _flat_mask, fused_linear_cross_entropy


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
    """Mean cross-entropy of hidden @ W.T against labels (global ids) with W split by rows over
    `group`, this rank's shard `weight` holding ids vocab_start onwards; the mean over tokens whose
    label is not ignore_index and whose loss_mask (0/1) is 1 (0 when none). Ids from vocab_limit on
    are padding. hidden (..., h), labels and loss_mask (...), the same on every rank."""
    return fused_linear_cross_entropy(
        hidden,
        weight,
        labels,
        TORCH_OPS,
        chunk_tokens=chunk_tokens,
        loss_mask=loss_mask,
        vocab_limit=vocab_limit,
        group=group,
        vocab_start=vocab_start,
        ignore_index=ignore_index,
    )


def _sum_forward_only(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum of x over the group, whose gradient reaches only this rank's x (Megatron's
    reduce_from_tp region), in plain ops: every rank's loss is the same number, so its gradient
    must not be summed over ranks twice."""
    total = x.detach().clone()
    dist.all_reduce(total, group=group)
    return x + (total - x.detach())


def vocab_parallel_linear_cross_entropy_reference(
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
    """The unfused twin: the whole (tokens × V/tp) fp32 logits, autograd deriving the backward
    (`chunk_tokens` is ignored)."""
    logits = (hidden.reshape(-1, hidden.shape[-1]) @ weight.t()).float()  # (N, V/tp)
    y = labels.reshape(-1)
    local_v = logits.shape[1]
    if vocab_limit is not None and vocab_limit < vocab_start + local_v:
        cols = torch.arange(vocab_start, vocab_start + local_v, device=logits.device) >= vocab_limit
        logits = logits.masked_fill(cols, float("-inf"))
    top = logits.detach().amax(dim=1)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top.unsqueeze(1)
    local = y - vocab_start
    outside = (local < 0) | (local >= local_v)
    target = (
        shifted.gather(1, local.masked_fill(outside, 0).unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0)
    )
    sum_exp = _sum_forward_only(shifted.exp().sum(dim=1), group)
    per_token = sum_exp.log() - _sum_forward_only(target, group)
    keep = (y != ignore_index).float()
    mask = _flat_mask(loss_mask, y.shape[0])
    if mask is not None:
        keep = keep * mask.float()
    return (per_token * keep).sum() / keep.sum().clamp_min(1.0)
