"""megatrain.engine.moe_metrics on one process: each micro-batch's aux-loss scale, and the interval's
router figures computed by hand from the routers' statistics."""

from __future__ import annotations

import pytest
import torch

from megatrain.engine.config import MoEConfig, TransformerConfig
from megatrain.engine.microbatch import MicroBatch
from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.models.moe import moe_layers
from megatrain.engine.moe_metrics import moe_metrics, set_microbatch_aux_scale
from megatrain.engine.parallel.state import ParallelState


def model(**moe) -> GPTModel:
    cfg = TransformerConfig.preset(
        "tiny-llama",
        num_layers=3,
        moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=16, layer_freq=2, **moe),
    )  # MoE layers 0 and 2
    torch.manual_seed(0)
    return GPTModel(cfg)


def test_aux_scale_is_the_token_share_times_the_loss_scale() -> None:
    m = model()
    layers = list(moe_layers(m))
    tokens = torch.zeros(2, 8, dtype=torch.int64)
    mb = MicroBatch(tokens, tokens, loss_mask=torch.ones(2, 8).tril())  # 3 loss tokens
    set_microbatch_aux_scale(layers, mb, denominator=4.0 * mb.num_loss_tokens, loss_scale=1024.0)
    assert [layer.router.aux_loss_scale for layer in layers] == [256.0, 256.0]
    empty = MicroBatch(tokens, tokens, loss_mask=torch.zeros(2, 8))
    set_microbatch_aux_scale(layers, empty, denominator=10.0, loss_scale=1024.0)
    assert all(layer.router.aux_loss_scale == 0.0 for layer in layers)


def test_interval_figures_by_hand_and_reset() -> None:
    m = model(capacity_factor=1.0, z_loss_coeff=1e-3)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        m.loss(tokens, tokens).backward()
    layers = list(moe_layers(m))
    assert len(layers) == 2
    stats = [layer.router.stats for layer in layers]
    counts = torch.stack([s.tokens for s in stats])  # (L, E)
    aux = sum(s.aux_loss.item() for s in stats) / (2 * len(stats))  # per layer and micro-batch
    dropped = sum(s.dropped.item() for s in stats) / counts.sum().item()
    imbalance = (counts.amax(1) / counts.mean(1)).mean().item()
    row = moe_metrics(m, m.config.moe, ParallelState.single())
    assert row["moe_tokens_per_expert"] == counts.sum(0).round().long().tolist()
    assert sum(row["moe_tokens_per_expert"]) == 2 * 2 * 2 * 16 * 2  # layers × steps × tokens × k
    assert row["moe_load_imbalance"] == pytest.approx(imbalance)
    assert row["moe_aux_loss"] == pytest.approx(aux) and row["moe_z_loss"] > 0
    assert row["moe_dropped_fraction"] == pytest.approx(dropped) and dropped > 0
    assert all(s.tokens is None and s.forwards == 0 for s in stats)  # reset for the next interval
    assert moe_metrics(m, None, ParallelState.single()) == {}  # a dense model: no figures
