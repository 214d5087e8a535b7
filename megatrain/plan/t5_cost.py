"""T5's step time on a pipeline stage (megatrain.plan.cost adds the bubble, data parallelism and the
optimizer as for any model): an encoder layer is timed as a GPT layer over Te tokens
(megatrain.plan.layer_cost.layer_costs on the T5 shape), a decoder layer as one over Td tokens plus
its cross-attention, and the LM head over Td tokens.

Cross-attention, per decoder layer and micro-batch: q and proj GEMMs over the Td decoder tokens,
the kv GEMM over the Te encoder tokens (the encoder's output), the attention core's Td × Te scores;
one more sublayer's tensor-parallel collectives over Td tokens, and the encoder output's gradient
reduced over tp in backward (each rank's kv shard contributes to it; under sequence parallelism it
is all-gathered forward and reduce-scattered back). Recompute as layer_cost's: full re-runs it all
forward, selective the attention cores.

The stage's time per micro-batch: its encoder and decoder layers (megatrain.plan.stacks says which
it holds) and, on the last stage, the LM head. Every stage is timed (T5's pipelines are short); the
slowest sets the 1F1B pace. Each pipeline message carries the hidden states, and on a decoder
stage the encoder's output beside them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache

from megatrain.plan.cost_constants import CostConstants, constants_for, gemm_efficiency
from megatrain.plan.layer_cost import LayerCosts, layer_costs
from megatrain.plan.links import Links, link, ring_time
from megatrain.plan.pool import PoolSpec
from megatrain.plan.shapes import ModelShape
from megatrain.plan.stacks import stack_layers_on_stage, t5_split


@lru_cache(maxsize=4096)
def t5_layer_costs(
    model: ModelShape, tp: int, sp: bool, micro_batch_size: int, recompute: str, recompute_every: int,
    act: int, peak: float, pool: Links, c: CostConstants, linear_peak: float | None = None,
) -> tuple[LayerCosts, LayerCosts]:  # fmt: skip
    """(encoder layer, decoder layer) costs for one micro-batch on one rank; the decoder's `head`
    is the LM head over Td tokens (the encoder's is unused)."""
    args = (tp, 1, 1, sp, micro_batch_size, recompute, recompute_every, act, peak, pool, c, linear_peak)
    encoder = layer_costs(model, *args)
    te, td = model.seq_length, model.dec_seq_length
    decoder = layer_costs(replace(model, seq_length=td), *args)  # self-attention + MLP over Td
    h, q, kv = model.hidden_size, model.q_size, model.kv_size
    rows_d, rows_e = micro_batch_size * td, micro_batch_size * te
    lp = linear_peak or peak
    seq_div = tp if sp else 1
    bandwidth = c.memory_bandwidth_gbps * 1e9

    def gemm(k: float, n: float, rows: float) -> float:
        return 2 * rows * k * n / (lp * gemm_efficiency(rows, k, n, c))

    gemms = gemm(h, q / tp, rows_d) + gemm(h, 2 * kv / tp, rows_e) + gemm(q / tp, h, rows_d)
    eff = gemm_efficiency(td, te, model.head_dim, c) * c.attention_fraction
    core = rows_d * 4 * te * q / tp / (peak * eff)
    elementwise = rows_d * h * c.elementwise_bytes * act / 2 / seq_div / bandwidth / 2  # one sublayer of two
    compute = 3 * (gemms + core) + elementwise

    bw, lat = link(pool, True)
    sub, memory = rows_d * h * act, rows_e * h * act
    if sp:
        sub_s = 2 * ring_time("all_gather", sub, tp, bw, lat) + 3 * ring_time("all_gather", sub, tp, bw, lat)
        memory_s = 2 * ring_time("all_gather", memory, tp, bw, lat)
    else:
        sub_s = 2 * ring_time("all_reduce", sub, tp, bw, lat)
        memory_s = ring_time("all_reduce", memory, tp, bw, lat)
    share = 1.0 / recompute_every if recompute == "full" else 0.0
    if recompute == "full":
        recompute_s = share * (gemms + core + elementwise / 3)
    else:
        recompute_s = core if recompute == "selective" else 0.0
    decoder = decoder._replace(
        layer_compute=decoder.layer_compute + compute,
        layer_recompute=decoder.layer_recompute + recompute_s,
        layer_tp=decoder.layer_tp + sub_s + memory_s + share * sub_s / 2,
    )
    return encoder, decoder


def t5_stage_seconds(
    model: ModelShape,
    encoder: LayerCosts,
    decoder: LayerCosts,
    pp: int,
    pipeline_layers: Sequence[int] | None,
    c: CostConstants,
) -> tuple[float, tuple[float, float, float, float, float]]:
    """One micro-batch's time on the slowest stage, and its (compute, recompute, tp, cp, ep) parts
    (cp and ep are 0: T5 runs neither)."""
    worst: tuple[float, tuple[float, float, float, float, float]] | None = None
    for stage in range(pp):
        n_enc, n_dec = stack_layers_on_stage(model, pp, stage, pipeline_layers)
        recompute = n_enc * encoder.layer_recompute + n_dec * decoder.layer_recompute
        compute = n_enc * encoder.layer_compute + n_dec * decoder.layer_compute + recompute
        compute += c.microbatch_overhead_s / (1 if pp == 1 else 2)
        comm = n_enc * encoder.layer_tp + n_dec * decoder.layer_tp
        if stage == pp - 1:
            compute += decoder.head
            comm += decoder.edge_tp / 2
        if stage == 0:
            comm += encoder.edge_tp / 2
        total = compute + comm
        if worst is None or total > worst[0]:
            worst = (total, (compute, recompute, comm, 0.0, 0.0))
    assert worst is not None
    return worst


def t5_layer_seconds(encoder: LayerCosts, decoder: LayerCosts) -> tuple[float, float, float]:
    """(encoder layer, decoder layer, LM head) seconds per micro-batch: what t5_split balances."""
    enc = encoder.layer_compute + encoder.layer_recompute + encoder.layer_tp
    dec = decoder.layer_compute + decoder.layer_recompute + decoder.layer_tp
    return enc, dec, decoder.head


def t5_pipeline_layers(
    model: ModelShape, pool: PoolSpec, precision: str, *, tp: int, pp: int, sp: bool, micro_batch_size: int
) -> tuple[int, ...] | None:
    """Layers per stage, encoder stages first, balancing the stages' time on `pool` (megatrain.plan.
    stacks.t5_split, with the layers timed without recompute: it adds to both stacks alike); None
    for pp = 1."""
    if pp == 1:
        return None
    fp8 = precision == "fp8"
    peak = pool.peak("bf16" if fp8 else precision) * 1e12
    linear_peak = pool.peak("fp8") * 1e12 if fp8 else None
    act = 4 if precision == "fp32" else 2
    links, c = Links.of(pool), constants_for(pool)
    enc, dec = t5_layer_costs(model, tp, sp, micro_batch_size, "none", 1, act, peak, links, c, linear_peak)
    return t5_split(model.num_layers, model.num_decoder_layers, pp, *t5_layer_seconds(enc, dec))


__all__ = ["t5_layer_costs", "t5_layer_seconds", "t5_pipeline_layers", "t5_stage_seconds"]
