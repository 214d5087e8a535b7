"""Mixture-of-experts bookkeeping for the training loop: each micro-batch's aux-loss gradient scale,
and the routers' statistics reduced into one metrics row per log interval.

Each router accumulates RouterStats over the interval's training forwards (models.moe). At a log
interval every rank calls `moe_metrics` (collective): counts are summed over the ranks that hold
other tokens (dp, and cp where it exists), then over pipeline stages, which hold other layers;
tensor-parallel ranks route the same tokens and hold the same figures. The figures:

    moe_aux_loss           mean over MoE layers and micro-batches of the aux loss (× its coeff)
    moe_z_loss             likewise (only when z_loss_coeff > 0)
    moe_dropped_fraction   dropped / chosen (token, expert) pairs (only with a capacity factor)
    moe_load_imbalance     per layer max / mean of its tokens per expert over the interval,
                           averaged over the MoE layers (1.0: perfectly balanced)
    moe_tokens_per_expert  chosen pairs per expert, summed over layers and the interval
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatrain.engine.config import MoEConfig
from megatrain.engine.microbatch import MicroBatch
from megatrain.engine.models.moe import MoELayer, moe_layers
from megatrain.engine.parallel.state import ParallelState

TOKEN_AXES = ("dp", "cp")
"""Axes whose ranks route different tokens through the same layers."""


def set_microbatch_aux_scale(
    layers: Sequence[MoELayer], mb: MicroBatch, denominator: float, loss_scale: float
) -> None:
    """Before a micro-batch's forward: scale the aux losses' gradient as its LM loss is scaled, by
    its token share (microbatch.token_share: num_loss_tokens / denominator) × the fp16 loss scale."""
    share = 0.0 if mb.num_loss_tokens == 0 or denominator == 0 else mb.num_loss_tokens / denominator
    for layer in layers:
        layer.router.aux_loss_scale = share * loss_scale


def moe_metrics(module: nn.Module, moe: MoEConfig | None, state: ParallelState) -> dict[str, Any]:
    """The interval's router figures (above) on every rank, and the statistics reset. Collective over
    dp, cp and pp: every rank calls it, those holding no MoE layer too. {} for a dense model."""
    if moe is None:
        return {}
    e = moe.num_experts
    layers = list(moe_layers(module))
    device = state.device
    # (L, E) chosen pairs per local layer, and per-layer sums of aux, z, dropped and forwards.
    counts = torch.zeros(len(layers), e, dtype=torch.float64, device=device)
    sums = torch.zeros(len(layers), 4, dtype=torch.float64, device=device)
    for i, layer in enumerate(layers):
        s = layer.router.stats
        if s.tokens is not None:
            assert s.aux_loss is not None and s.z_loss is not None and s.dropped is not None
            counts[i] = s.tokens
            sums[i] = torch.stack([s.aux_loss, s.z_loss, s.dropped, torch.tensor(float(s.forwards))])
        s.reset()
    flat = torch.cat([counts.flatten(), sums.flatten()])
    for axis in TOKEN_AXES:
        group = state.groups.get(axis)
        if group is not None:
            dist.all_reduce(flat, group=group)
    counts, sums = flat[: counts.numel()].view_as(counts), flat[counts.numel() :].view_as(sums)
    mean = counts.mean(1)  # (L,)
    imbalance = torch.where(mean > 0, counts.amax(1) / mean.clamp_min(1e-30), torch.zeros_like(mean))
    active = (mean > 0).double()
    # [Σ imbalance, layers with tokens, aux, z, dropped, forwards, chosen pairs, tokens per expert (E)]
    total = torch.cat(
        [
            torch.stack([imbalance.sum(), active.sum()]),
            sums.sum(0),
            counts.sum().reshape(1),
            counts.sum(0),
        ]
    )
    if state.pp_group is not None:
        dist.all_reduce(total, group=state.pp_group)
    imb, n_layers, aux, z, dropped, forwards, pairs = total[:7].tolist()
    tokens = total[7:].tolist()
    row: dict[str, Any] = {
        "moe_aux_loss": aux / forwards if forwards else 0.0,
        "moe_load_imbalance": imb / n_layers if n_layers else 0.0,
        "moe_tokens_per_expert": [round(t) for t in tokens],
    }
    if moe.z_loss_coeff > 0:
        row["moe_z_loss"] = z / forwards if forwards else 0.0
    if moe.capacity_factor is not None:
        row["moe_dropped_fraction"] = dropped / pairs if pairs else 0.0
    return row
