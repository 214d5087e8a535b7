"""One layer's seconds on one rank for one micro-batch (dense and MoE; compute, recompute, tensor-,
context- and expert-parallel communication) and the LM head's: what megatrain.plan.cost sums over
a pipeline stage's layers and micro-batches. The terms are those megatrain.plan.cost's docstring
describes; thousands of layouts of one planning call share each result (lru_cache)."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import NamedTuple

from megatrain.plan.activation_memory import MLM_FRACTION
from megatrain.plan.cost_constants import CostConstants, gemm_efficiency
from megatrain.plan.flops import layer_forward_flops
from megatrain.plan.links import Links, all_to_all_time, ep_ranks_per_node, link, ring_time
from megatrain.plan.lora_cost import LoRASeconds, lora_layer_seconds
from megatrain.plan.shapes import ModelShape


class LayerCosts(NamedTuple):
    """Seconds of one layer (dense, MoE) and of the edges for one micro-batch on one rank."""

    layer_compute: float
    layer_recompute: float
    layer_tp: float
    layer_cp: float
    moe_compute: float
    moe_recompute: float
    moe_tp: float
    moe_ep: float
    head: float
    edge_tp: float


def fp8_cast_bytes(model: ModelShape, tp: int, tokens: float) -> float:
    """Memory traffic of one layer's float8 casts per micro-batch (torchao's dynamic scaling): each
    operand is read twice in 16 bits (its absolute maximum, then the cast) and written in 8, i.e. 5
    bytes per element. Inputs and weights are cast forward and again backward, output gradients
    twice in backward (for the input and the weight gradient)."""
    h, f, fw, kv, q = model.hidden_size, model.ffn_hidden_size, model.fc1_width, model.kv_size, model.q_size
    inputs = h + q / tp + h + f / tp  # qkv, proj, fc1, fc2 (a column-parallel input is whole)
    grads = (q + 2 * kv) / tp + h + fw / tp + h
    weights = h * (q + 2 * kv) / tp + q * h / tp + h * fw / tp + f * h / tp
    return 5.0 * (tokens * 2 * (inputs + grads) + 2 * weights)


@lru_cache(maxsize=16384)
def layer_costs(
    model: ModelShape, tp: int, cp: int, ep: int, sp: bool, micro_batch_size: int, recompute: str,
    recompute_every: int, act: int, peak: float, pool: Links, c: CostConstants,
    linear_peak: float | None = None,
) -> LayerCosts:  # fmt: skip
    """Per layer and micro-batch: what thousands of layouts of one planning call share.
    `linear_peak`: the dense transformer linears' GEMMs' peak where it differs (fp8's float8 GEMMs;
    the attention core, LM head and MoE router and experts stay at `peak`, bf16's)."""
    s, h = model.seq_length, model.hidden_size
    tokens = micro_batch_size * s / cp  # per rank and micro-batch
    bandwidth = c.memory_bandwidth_gbps * 1e9
    seq_div = tp if sp else 1

    def gemm(k: float, n: float, rows: float = tokens, at: float = peak) -> float:
        """Forward seconds of a (rows × k) @ (k × n) GEMM at peak `at`."""
        return 2 * rows * k * n / (at * gemm_efficiency(rows, k, n, c))

    lp = linear_peak or peak

    # One layer, one micro-batch, forward (backward is twice the GEMMs and the attention core).
    parts = layer_forward_flops(model, s)
    q = model.q_size  # h, but where T5's kv_channels differ
    fwd_attn_gemms = gemm(h, (q + 2 * model.kv_size) / tp, at=lp) + gemm(q / tp, h, at=lp)
    fwd_mlp = gemm(h, model.fc1_width / tp, at=lp) + gemm(model.ffn_hidden_size / tp, h, at=lp)
    head_dim = model.head_dim
    # Under cp each ring step computes a (s/cp × s/cp) block; balanced causal chunks give every
    # rank the same share of the attention work (1/cp of it, `tokens` queries against s keys).
    attention_eff = gemm_efficiency(s / cp, s / cp, head_dim, c) * c.attention_fraction
    fwd_attention = tokens * parts["attention"] / tp / (peak * attention_eff)
    elementwise = tokens * h * c.elementwise_bytes * act / 2 / seq_div / bandwidth
    fwd_gemms = fwd_attn_gemms + fwd_mlp
    frozen = model.lora is not None  # (the adapters' own costs: plus_adapters)
    if frozen:
        # A frozen linear's backward is its input gradient's GEMM only; the attention core's is 2×.
        layer_compute = 2 * fwd_gemms + 3 * fwd_attention + elementwise + c.layer_overhead_s
    else:
        layer_compute = 3 * (fwd_gemms + fwd_attention) + elementwise + c.layer_overhead_s
    if linear_peak is not None:
        layer_compute += fp8_cast_bytes(model, tp, tokens) / bandwidth
    layer_cp = ring_attention_seconds(model, tp, cp, tokens, act, fwd_attention, pool, c)

    # Tensor-parallel collectives of one layer and micro-batch (inside a node): per sublayer an
    # all-reduce each way, or with sp an all-gather + reduce-scatter forward and 2 AG + RS backward
    # (a frozen linear gathers no input again for a weight gradient: AG + RS).
    bw, lat = link(pool, True)

    def tp_sublayer(nbytes: float) -> tuple[float, float]:
        ar = ring_time("all_reduce", nbytes, tp, bw, lat)
        ag = ring_time("all_gather", nbytes, tp, bw, lat)
        return (2 * ag, (2 if frozen else 3) * ag) if sp else (ar, ar)

    full = tokens * h * act  # the (tokens, hidden) activation, whole
    sub_fwd, sub_bwd = tp_sublayer(full)
    ar = ring_time("all_reduce", full, tp, bw, lat)
    ag = ring_time("all_gather", full, tp, bw, lat)
    fwd_tp = 2 * sub_fwd
    layer_tp = fwd_tp + 2 * sub_bwd

    # Recompute: every k-th layer's forward again (full), or the attention core (selective).
    share = 1.0 / recompute_every if recompute == "full" else 0.0
    if recompute == "full":
        layer_recompute = share * (fwd_gemms + fwd_attention + elementwise / 3 + c.layer_overhead_s / 3)
        layer_tp += share * fwd_tp
    elif recompute == "selective":
        layer_recompute = fwd_attention
    else:
        layer_recompute = 0.0

    moe = (0.0, 0.0, 0.0, 0.0)
    if model.moe is not None:
        dense = _Dense(layer_compute, layer_recompute, layer_tp, fwd_gemms, fwd_mlp, fwd_attention,
                       elementwise, sub_fwd, sub_bwd, share)  # fmt: skip
        moe = _moe_layer(
            model, tp, cp, ep, frozen, tokens, act, seq_div, gemm, lp, tp_sublayer, dense, recompute, pool, c
        )

    # The slowest stage per micro-batch: its layers, plus the embedding (first) or head (last):
    # the head's GEMMs and the fp32 softmax/loss over (rows, V/t). BERT scores only its masked rows,
    # after the masked-LM transform (h → h) on every position of the rank's shard.
    rows = MLM_FRACTION * tokens if model.family == "bert" else tokens
    passes = 2 if frozen else 3
    head = passes * gemm(h, model.vocab_size / tp, rows) + rows * 4 * model.vocab_size / tp * 3 / bandwidth
    if model.family == "bert":
        head += passes * gemm(h, h, tokens / seq_div) + 2 * elementwise
    edge_tp = 2 * (ag if sp else ar)  # vocab-parallel embedding forward, head input gather/grad
    return LayerCosts(layer_compute, layer_recompute, layer_tp, layer_cp, *moe, head, edge_tp)


class _Dense(NamedTuple):
    """A dense layer's costs and parts (one micro-batch) that an MoE layer's are derived from."""

    compute: float
    recompute: float
    tp: float
    fwd_gemms: float
    fwd_mlp: float
    fwd_attention: float
    elementwise: float
    sub_fwd: float
    sub_bwd: float
    share: float


def _moe_layer(
    model: ModelShape, tp: int, cp: int, ep: int, frozen: bool, tokens: float, act: int, seq_div: int,
    gemm: Callable[..., float], linear_peak: float,
    tp_sublayer: Callable[[float], tuple[float, float]], dense: _Dense, recompute: str, pool: Links,
    c: CostConstants,
) -> tuple[float, float, float, float]:  # fmt: skip
    """(compute, recompute, tp, ep) of an MoE layer: the router, this rank's num_experts/ep experts
    (each a GEMM of the tokens routed to it from the ep group: tokens·topk·ep/num_experts rows,
    smaller and slower than the dense MLP's) and the shared expert replace the MLP; the tokens are
    permuted and exchanged by two all-to-alls forward (dispatch, combine) and two backward over the
    ep group, not overlapped."""
    moe, h = model.moe, model.hidden_size
    assert moe is not None
    bandwidth = c.memory_bandwidth_gbps * 1e9
    routed = tokens * moe.router_topk * (moe.capacity_factor or 1.0)  # rows at this rank's experts
    local = moe.num_experts // ep
    rows = routed / local
    fe = moe.ffn_hidden_size
    fwd_moe = gemm(h, moe.num_experts) + local * (
        gemm(h, model.mlp_fc1_width(fe) / tp, rows) + gemm(fe / tp, h, rows)
    )
    if moe.shared_expert_ffn_hidden_size:
        fs = moe.shared_expert_ffn_hidden_size
        fwd_moe += gemm(h, model.mlp_fc1_width(fs) / tp, at=linear_peak) + gemm(fs / tp, h, at=linear_peak)
    permute = 8 * routed * h * act / bandwidth  # permute, unpermute (× probs), each way
    compute = dense.compute + (2 if frozen else 3) * (fwd_moe - dense.fwd_mlp) + permute
    routed_bytes = routed * h * act / seq_div
    a2a = all_to_all_time(routed_bytes, ep, ep_ranks_per_node(tp, cp, ep, pool.devices_per_node), pool)
    sub_fwd, sub_bwd = tp_sublayer(routed * h * act)  # experts see the tp group's tokens
    tp_s = dense.tp - dense.sub_fwd - dense.sub_bwd + sub_fwd + sub_bwd
    ep_s = 4 * a2a
    if recompute == "full":
        share = dense.share
        fwd = dense.fwd_gemms - dense.fwd_mlp + fwd_moe + dense.fwd_attention + dense.elementwise / 3
        recompute_s = share * fwd
        recompute_s += share * c.layer_overhead_s / 3
        tp_s += share * (sub_fwd - dense.sub_fwd)
        ep_s += share * 2 * a2a
    else:
        recompute_s = dense.recompute
    return compute, recompute_s, tp_s, ep_s


def ring_attention_seconds(
    model: ModelShape, tp: int, cp: int, tokens: float, act: int, fwd_attention: float, pool: Links,
    c: CostConstants,
) -> float:  # fmt: skip
    """Context parallelism: the ring passes this rank's K and V (tp-split heads) cp-1 times forward
    and K, V and their gradients cp-1 times backward; each pass hides behind one block's attention
    (ring attention overlaps them), so a step costs the slower of the two. Every extra step also
    merges its partial output into the running one (online softmax: fp32 output and log-sum-exp
    read and written forward, dK/dV accumulated in fp32 backward)."""
    if cp == 1:
        return 0.0
    bw_cp, lat_cp = link(pool, tp * cp <= pool.devices_per_node)
    kv_bytes = tokens * 2 * model.kv_size * act / tp
    hop = lat_cp * 1e-6 + kv_bytes / (bw_cp * 1e9)
    block = fwd_attention / cp
    merge = tokens * (model.hidden_size + 2 * model.kv_size) / tp * 12 / (c.memory_bandwidth_gbps * 1e9)
    merge += c.ring_step_overhead_s
    return (cp - 1) * (max(hop, block) - block + max(2 * hop, 2 * block) - 2 * block + merge)


@lru_cache(maxsize=16384)
def plus_adapters(
    lc: LayerCosts, model: ModelShape, tp: int, cp: int, sp: bool, micro_batch_size: int, recompute: str,
    recompute_every: int, act: int, peak: float, pool: Links, c: CostConstants,
) -> LayerCosts:  # fmt: skip
    """A LoRA run's layer costs: the frozen base's (`lc`) plus its adapters' (megatrain.plan.lora_cost),
    recomputed with their layer under full recompute; an MoE layer's are attention's only."""
    bw, lat = link(pool, True)
    tokens = micro_batch_size * model.seq_length / cp

    def adapters(moe: bool) -> LoRASeconds:
        return lora_layer_seconds(
            model, moe=moe, tp=tp, sp=sp, tokens=tokens, act=act, peak=peak,
            bandwidth=c.memory_bandwidth_gbps * 1e9, c=c, tp_bandwidth_gbps=bw, tp_latency_us=lat,
        )  # fmt: skip

    share = 1.0 / recompute_every if recompute == "full" else 0.0
    dense, moe = adapters(False), adapters(True)
    return lc._replace(
        layer_compute=lc.layer_compute + dense.compute,
        layer_recompute=lc.layer_recompute + share * dense.forward,
        layer_tp=lc.layer_tp + dense.tp_comm + share * dense.tp_comm / 2,  # (half of it is forward)
        moe_compute=lc.moe_compute + moe.compute,
        moe_recompute=lc.moe_recompute + share * moe.forward,
        moe_tp=lc.moe_tp + moe.tp_comm + share * moe.tp_comm / 2,
    )
