"""The LM loss from a tensor-parallel head's input, fused with the head: the vocab-parallel logits
are never materialised (megatrain.kernels.vocab_parallel_linear_cross_entropy).

The final norm's output enters the tensor-parallel region as it would enter the ColumnParallelLinear
head: all-gathered along T under sequence parallelism (its gradient reduce-scattered back), else
through copy_to_tp (its gradient all-reduced). Each rank's kernel returns its vocab shard's part of
the hidden gradient, which those backward collectives sum, and its weight shard's gradient.
"""

from __future__ import annotations

import torch

from megatrain import kernels
from megatrain.engine.parallel.layers import ColumnParallelLinear
from megatrain.engine.parallel.mappings import copy_to_tp, gather_from_sequence


def fused_parallel_lm_loss(
    hidden: torch.Tensor,
    head: ColumnParallelLinear,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    vocab_limit: int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy of head(hidden) against labels, equal to parallel_lm_loss(head(hidden), ...).

    hidden (B, T, C), or (B, T/tp, C) under the head's sequence parallelism; labels and loss_mask
    (B, T); the mean over tokens whose label is not ignore_index and whose mask is 1. Ids from
    vocab_limit on are padding."""
    if head.bias is not None or head.gather_output:
        raise ValueError("the fused LM loss needs a bias-free head whose output stays vocab-sharded")
    if head.sequence_parallel:
        hidden = gather_from_sequence(hidden, head.tp_group, head.tp_size)  # (B, T, C)
    else:
        hidden = copy_to_tp(hidden, head.tp_group, head.tp_size)
    fn = kernels.get("vocab_parallel_linear_cross_entropy", hidden.device.type)
    vocab_start = head.tp_rank * head.weight.shape[0]  # stride 1: rank r holds a contiguous slice
    return fn(
        hidden,
        head.weight,
        labels,
        head.tp_group,
        vocab_start,
        loss_mask=loss_mask,
        vocab_limit=vocab_limit,
        ignore_index=ignore_index,
    )
