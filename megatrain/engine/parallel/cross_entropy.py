"""The vocab-parallel cross-entropy: the LM loss from each rank's vocabulary shard of the logits.

The logits are never gathered: each rank holds (N, V/tp) and the ranks exchange two numbers per row
(the global max, then the target logit and the sum of exponentials), as Megatron's
vocab_parallel_cross_entropy does. The backward is local to the shard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatrain.engine.parallel.mappings import check_group
from megatrain.engine.parallel.state import Group, ParallelState
from megatrain.kernels.linear_cross_entropy import exp_below_max_


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        group: Group,
        rank: int,
        ignore_index: int,
        loss_mask: torch.Tensor | None,
        vocab_limit: int | None,
    ) -> torch.Tensor:
        # logits (N, V/tp) this rank's vocab slice, labels (N,) global ids. fp32 throughout.
        x = logits.float()
        local_v = x.shape[-1]
        start = rank * local_v
        if vocab_limit is not None and vocab_limit < start + local_v:
            # Padding rows past the real vocabulary: probability 0, so no loss and no gradient.
            cols = torch.arange(start, start + local_v, device=x.device) >= vocab_limit
            x = x.masked_fill(cols, float("-inf"))
        # Subtract the global max for a stable exp (a constant per row: no gradient through it).
        row_max = x.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        x = x - row_max.unsqueeze(-1)
        outside = (labels < start) | (labels >= start + local_v)
        local_labels = (labels - start).masked_fill(outside, 0)
        target = x.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = exp_below_max_(x)  # reuse the buffer: (N, V/tp); padding columns (-inf) become 0
        # One all-reduce for both sums: the target logit (held by one rank) and Σ exp.
        sums = torch.stack([target, exp.sum(dim=-1)])
        dist.all_reduce(sums, group=group)
        target, sum_exp = sums[0], sums[1]
        # Each row's weight: 0 for an ignored label, else its loss-mask value (0/1) or 1.
        valid = (labels != ignore_index).float()
        if loss_mask is not None:
            valid = valid * loss_mask.float()
            count = valid.sum().clamp_min(1.0)  # 0, not nan, when no token counts
        else:
            count = valid.sum()  # nan when every label is ignored, like F.cross_entropy
        per_token = (sum_exp.log() - target) * valid
        loss = per_token.sum() / count
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_labels, outside, valid, count)
        ctx.logits_dtype, ctx.consumed = logits.dtype, False
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # d loss / d logits = (softmax - onehot) / count on every valid row: local to the shard.
        if ctx.consumed:
            raise RuntimeError("vocab_parallel_cross_entropy supports one backward: it reuses its softmax")
        ctx.consumed = True
        softmax, local_labels, outside, valid, count = ctx.saved_tensors
        g = softmax  # modified in place: no second (N, V/tp) fp32 buffer, as Megatron does
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local_labels] -= (~outside).to(g.dtype)
        g.mul_((valid * (grad / count)).unsqueeze(-1))
        return g.to(ctx.logits_dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    state: ParallelState,
    ignore_index: int = -100,
    loss_mask: torch.Tensor | None = None,
    vocab_limit: int | None = None,
) -> torch.Tensor:
    """Mean next-token cross-entropy from this rank's vocab shard of the logits, never gathering them.

    logits (B, T, V/tp) — rank r holds vocabulary ids [r·V/tp, (r+1)·V/tp); labels (B, T); loss_mask
    (B, T) of 0/1 or None. Equals F.cross_entropy on the full logits (fp32, mean over tokens whose
    label is not ignore_index and whose mask is 1; 0 when a mask leaves no token). With vocab_limit,
    the ids from vocab_limit on (padding) are left out of the softmax, as if the logits stopped there.
    """
    if state.tp_size == 1 and vocab_limit is not None:
        logits = logits[..., :vocab_limit]
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    flat_mask = loss_mask.reshape(-1) if loss_mask is not None else None
    if state.tp_size == 1:
        if flat_mask is None:
            return F.cross_entropy(flat_logits.float(), flat_labels, ignore_index=ignore_index)
        per_token = F.cross_entropy(
            flat_logits.float(), flat_labels, ignore_index=ignore_index, reduction="none"
        )
        weights = (flat_labels != ignore_index).float() * flat_mask.float()
        return (per_token * weights).sum() / weights.sum().clamp_min(1.0)
    check_group(state.tp_group, state.tp_size)
    return _VocabParallelCrossEntropy.apply(
        flat_logits, flat_labels, state.tp_group, state.tp_rank, ignore_index, flat_mask, vocab_limit
    )
