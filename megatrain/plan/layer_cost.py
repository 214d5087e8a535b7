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
from megatrain.plan.links import (
    Links,
    ep_ranks_per_node,
    link,
    ring_time,
    routed_all_to_all_time,
    two_hop_times,
)
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
    linear_peak: float | None = None, moe_overlap_chunks: int = 1, tp_comm_overlap: bool = False,
    moe_two_hop: bool = False,
) -> LayerCosts:  # fmt: skip
    """Per layer and micro-batch: what thousands of layouts of one planning call share.
    `linear_peak`: the dense transformer linears' GEMMs' peak where it differs (fp8's float8 GEMMs;
    the attention core, LM head and MoE router and experts stay at `peak`, bf16's).
    `moe_overlap_chunks`: parallelism.moe_overlap_chunks (_moe_layer). `tp_comm_overlap`:
    Overlaps.tp_comm (tp_sublayer). `moe_two_hop`: parallelism.moe_dispatch nodes (_moe_layer)."""
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
    qkv, proj = gemm(h, (q + 2 * model.kv_size) / tp, at=lp), gemm(q / tp, h, at=lp)
    fc1, fc2 = gemm(h, model.fc1_width / tp, at=lp), gemm(model.ffn_hidden_size / tp, h, at=lp)
    fwd_attn_gemms, fwd_mlp = qkv + proj, fc1 + fc2
    head_dim = model.head_dim
    # Under cp each ring step computes a (s/cp × s/cp) block; balanced causal chunks give every
    # rank the same share of the attention work (1/cp of it, `tokens` queries against s keys), of
    # which a causal kernel computes the unmasked tiles only (BERT's bidirectional core: all).
    attention_eff = gemm_efficiency(s / cp, s / cp, head_dim, c) * c.attention_fraction
    causal = c.causal_attention_work if model.family == "gpt" else 1.0
    fwd_attention = causal * tokens * parts["attention"] / tp / (peak * attention_eff)
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

    # Tensor-parallel collectives of one layer and micro-batch (inside a node): per sublayer (a
    # column- then a row-parallel linear) an all-reduce each way, or with sp an all-gather +
    # reduce-scatter forward and 2 AG + RS backward: the row-parallel linear's gathered output
    # gradient, and the column-parallel one's input re-gathered beside its input-gradient GEMM and
    # that gradient reduce-scattered beside its weight-gradient GEMM (engine.parallel.layers), each
    # hidden for tp_overlap of its GEMM's time. tp_comm_overlap pipelines the other two the same way
    # behind their own GEMMs. A frozen linear gathers nothing again and has no weight gradient to
    # hide behind: AG + RS, exposed.
    bw, lat = link(pool, True)
    hide = c.tp_overlap

    def tp_sublayer(nbytes: float, col: float = 0.0, row: float = 0.0) -> tuple[float, float]:
        """(forward, backward) seconds of one sublayer's collectives on `nbytes`; `col`, `row` its
        column- and row-parallel linears' forward GEMM seconds (each backward GEMM takes as long)."""
        ar = ring_time("all_reduce", nbytes, tp, bw, lat)
        ag = ring_time("all_gather", nbytes, tp, bw, lat)
        if not sp:
            return ar, ar
        if frozen:
            return 2 * ag, 2 * ag
        under_col, under_row = max(0.0, ag - hide * col), max(0.0, ag - hide * row)
        if tp_comm_overlap:
            return under_col + under_row, under_row + 2 * under_col
        return 2 * ag, ag + 2 * under_col

    full = tokens * h * act  # the (tokens, hidden) activation, whole
    attn_fwd, attn_bwd = tp_sublayer(full, qkv, proj)
    mlp_fwd, mlp_bwd = tp_sublayer(full, fc1, fc2)
    sub_fwd, sub_bwd = mlp_fwd, mlp_bwd  # (the MLP's, which an MoE layer replaces)
    ar = ring_time("all_reduce", full, tp, bw, lat)
    ag = ring_time("all_gather", full, tp, bw, lat)
    fwd_tp = attn_fwd + mlp_fwd
    layer_tp = fwd_tp + attn_bwd + mlp_bwd

    # Recompute: every k-th layer's forward again (full), or the attention core (selective).
    share = 1.0 / recompute_every if recompute == "full" else 0.0
    layer_recompute = fwd_attention if recompute == "selective" else 0.0
    if recompute == "full":
        layer_recompute = share * (fwd_gemms + fwd_attention + elementwise / 3 + c.layer_overhead_s / 3)
        layer_tp += share * fwd_tp

    moe = (0.0, 0.0, 0.0, 0.0)
    if model.moe is not None:
        dense = _Dense(layer_compute, layer_recompute, layer_tp, fwd_gemms, fwd_mlp, fwd_attention,
                       elementwise, sub_fwd, sub_bwd, share)  # fmt: skip
        moe = _moe_layer(
            model, tp, cp, ep, frozen, tokens, act, seq_div, gemm, lp, tp_sublayer, dense, recompute, pool, c,
            moe_overlap_chunks, moe_two_hop,
        )  # fmt: skip

    head = _head_seconds(model, tp, tokens / seq_div, tokens, frozen, gemm, elementwise, bandwidth)
    edge_tp = 2 * (ag if sp else ar)  # vocab-parallel embedding forward, head input gather/grad
    return LayerCosts(layer_compute, layer_recompute, layer_tp, layer_cp, *moe, head, edge_tp)


def _head_seconds(
    model: ModelShape, tp: int, shard_tokens: float, tokens: float, frozen: bool,
    gemm: Callable[..., float], elementwise: float, bandwidth: float,
) -> float:  # fmt: skip
    """The last stage's extra work per micro-batch (the slowest stage's edge): the head's GEMMs and
    the fp32 softmax/loss over (rows, V/t). BERT scores only its masked rows, after the masked-LM
    transform (h → h) on every position of the rank's (sequence-parallel) shard."""
    h = model.hidden_size
    rows = MLM_FRACTION * tokens if model.family == "bert" else tokens
    passes = 2 if frozen else 3
    head = passes * gemm(h, model.vocab_size / tp, rows) + rows * 4 * model.vocab_size / tp * 3 / bandwidth
    if model.family == "bert":
        head += passes * gemm(h, h, shard_tokens) + 2 * elementwise
    return head


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
    c: CostConstants, overlap_chunks: int = 1, two_hop: bool = False,
) -> tuple[float, float, float, float]:  # fmt: skip
    """(compute, recompute, tp, ep) of an MoE layer: the router, this rank's num_experts/ep experts
    (each a GEMM of the tokens routed to it from the ep group: tokens·topk·ep/num_experts rows,
    smaller and slower than the dense MLP's) and the shared expert replace the MLP; the tokens are
    permuted and exchanged by two all-to-alls forward (dispatch, combine) and two backward over the
    ep group (links.routed_all_to_all_time). With two_hop (parallelism.moe_dispatch nodes: each
    token once to each node holding one of its experts, engine.parallel.expert_dedup) the copies
    that cross nodes are the nodes a token reaches: G(1 - (1 - 1/G)^k) of G nodes for k experts
    drawn uniformly, G = router_group_topk under node-limited routing (the router's groups are the
    nodes), else every node of the ep group (links.two_hop_times).

    With K = overlap_chunks > 1 (and ep > 1) the engine cuts the routed tokens into K chunks
    (megatrain.engine.parallel.expert_overlap): every chunk's dispatch is posted at once, and chunk
    c's combine as soon as its experts are done, so the wire carries D_0..D_{K-1} then C_0..C_{K-1}
    (d each, the exchange of 1/K of the rows) while the experts compute chunk after chunk (E in all
    for the direction; each expert GEMM has 1/K of the rows, at that shape's efficiency). The
    direction then takes max(2d + E, 2Kd): the experts between the first dispatch and the last
    combine, or the wire never idle. Its exposed part, beyond the experts' compute:

        exposed = max(2d, 2Kd - E)        (K = 1: 2d, nothing hidden)

    In two hops across nodes only hop 1 (r per chunk) is pipelined; hop 2 there and back (n each)
    runs with each chunk's experts: exposed = max(2r + 2Kn, 2Kr - E) (exposed_two_hop). The engine
    does not chunk two hops inside one node (there is no hop 1 to hide).

    forward with the experts' forward, backward with their backward (input and weight gradients,
    2× the forward; the input gradient only for frozen experts); a recomputed layer's forward again."""
    moe, h = model.moe, model.hidden_size
    assert moe is not None
    bandwidth = c.memory_bandwidth_gbps * 1e9
    per_node = ep_ranks_per_node(tp, cp, ep, pool.devices_per_node)
    nodes = ep // per_node
    # The engine chunks nothing without an exchange, nor the two hops inside one node.
    k = overlap_chunks if ep > 1 and (nodes > 1 or not two_hop) else 1
    routed = tokens * moe.router_topk * (moe.capacity_factor or 1.0)  # rows at this rank's experts
    local = moe.num_experts // ep
    rows = routed / local / k  # per expert and chunk
    fe = moe.ffn_hidden_size
    experts_fwd = k * local * (gemm(h, model.mlp_fc1_width(fe) / tp, rows) + gemm(fe / tp, h, rows))
    fwd_moe = gemm(h, moe.num_experts) + experts_fwd
    if moe.shared_expert_ffn_hidden_size:
        fs = moe.shared_expert_ffn_hidden_size
        fwd_moe += gemm(h, model.mlp_fc1_width(fs) / tp, at=linear_peak) + gemm(fs / tp, h, at=linear_peak)
    permute = 8 * routed * h * act / bandwidth  # permute, unpermute (× probs), each way
    compute = dense.compute + (2 if frozen else 3) * (fwd_moe - dense.fwd_mlp) + permute
    # One chunk's dispatch (or combine): 1/K of the routed rows' bytes (one copy of each token × topk).
    copy_bytes = routed / moe.router_topk * h * act / seq_div / k
    bwd_experts = (1 if frozen else 2) * experts_fwd
    if two_hop and nodes > 1:
        limited = moe.router_group_topk is not None and moe.router_num_groups == nodes
        reachable = moe.router_group_topk if limited else nodes
        node_limit = reachable * (1 - (1 - 1 / reachable) ** moe.router_topk)
        rail, node = two_hop_times(copy_bytes, moe.router_topk, ep, per_node, pool, node_limit)
        fwd_ep = exposed_two_hop(rail, node, k, experts_fwd)
        ep_s = fwd_ep + exposed_two_hop(rail, node, k, bwd_experts)
    else:
        d = routed_all_to_all_time(copy_bytes, moe.router_topk, ep, per_node, pool)
        fwd_ep = exposed_exchange(d, k, experts_fwd)
        ep_s = fwd_ep + exposed_exchange(d, k, bwd_experts)
    sub_fwd, sub_bwd = tp_sublayer(routed * h * act)  # experts see the tp group's tokens
    tp_s = dense.tp - dense.sub_fwd - dense.sub_bwd + sub_fwd + sub_bwd

    if recompute == "full":
        share = dense.share
        fwd = dense.fwd_gemms - dense.fwd_mlp + fwd_moe + dense.fwd_attention + dense.elementwise / 3
        recompute_s = share * fwd
        recompute_s += share * c.layer_overhead_s / 3
        tp_s += share * (sub_fwd - dense.sub_fwd)
        ep_s += share * fwd_ep
    else:
        recompute_s = dense.recompute
    return compute, recompute_s, tp_s, ep_s


def exposed_exchange(chunk_s: float, chunks: int, experts_s: float) -> float:
    """Seconds of one direction's dispatch and combine that the experts do not hide (_moe_layer): K
    chunks' exchanges of chunk_s each on the wire in the engine's order, experts_s of expert compute
    in all. K = 1: both exchanges whole."""
    return max(2 * chunk_s, 2 * chunks * chunk_s - experts_s)


def exposed_two_hop(rail_s: float, node_s: float, chunks: int, experts_s: float) -> float:
    """exposed_exchange for the two-hop dispatch: per chunk, hop 1 (rail_s) on the wire across nodes
    in the engine's order, while hop 2 there and back (node_s each, synchronous) runs with the
    experts, adding to their time. K = 1: both hops, both ways, one after the other."""
    return max(2 * rail_s + 2 * chunks * node_s, 2 * chunks * rail_s - experts_s)


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
