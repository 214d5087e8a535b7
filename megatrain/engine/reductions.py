"""A step's figures over the ranks that hold them: the last pipeline stage's values, summed or
averaged over the weight replicas (dp×cp ranks); tensor-parallel ranks hold the same ones. The
training loop's log rows and validation read them (engine.loop)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatrain.engine.parallel.schedules import pipeline_loss
from megatrain.engine.parallel.state import ParallelState


def reduce_mean(value: torch.Tensor, state: ParallelState) -> float:
    """Mean over the weight replicas (dp×cp ranks) of the last pipeline stage's value (tensor-parallel
    ranks already hold the same loss; other stages hold zero and receive it)."""
    value = pipeline_loss(value, state)
    group, size = state.dp_cp_group, state.dp_cp_size
    if group is not None:
        value = value.clone()
        dist.all_reduce(value, group=group)
        value /= size
    return float(value.item())


def total_hits(hits: torch.Tensor, state: ParallelState) -> tuple[float, float]:
    """(correct tokens, fused cross-entropy calls) over every rank, from this rank's: the last
    pipeline stage's counts (the other stages hold zero) summed over the dp·cp ranks, each of which
    counts its own tokens (tensor-parallel ranks count the same tokens: not summed)."""
    hits = pipeline_loss(hits, state)
    if state.dp_cp_group is not None:
        hits = hits.clone()
        dist.all_reduce(hits, group=state.dp_cp_group)
    correct, calls = hits.tolist()
    return correct, calls


def binary_metrics(counts: torch.Tensor, state: ParallelState, name: str = "sop") -> dict[str, float]:
    """{name}_loss and {name}_accuracy of an encoder's binary head (sop: sentence order;
    classification: a classifier's labels) from this rank's Σ (loss · rows, correct, rows): the
    last stage's, summed over dp·cp (cp rank 0 alone counts the rows)."""
    counts = pipeline_loss(counts, state)
    if state.dp_cp_group is not None:
        counts = counts.clone()
        dist.all_reduce(counts, group=state.dp_cp_group)
    loss, correct, rows = counts.tolist()
    return {f"{name}_loss": loss / rows, f"{name}_accuracy": correct / rows} if rows else {}


def token_accuracy(hits: torch.Tensor, tokens: float, state: ParallelState) -> float | None:
    """The share of loss tokens whose label was the logits' argmax: `hits` this rank's (correct,
    calls), `tokens` every dp·cp rank's loss tokens. None where no fused cross-entropy counted."""
    correct, calls = total_hits(hits, state)
    return correct / tokens if calls and tokens else None
