"""How long collectives take on a pool's links: ring collectives (tp, dp), all-to-alls (ep) and
which link a group spans. Pure arithmetic for the step-time model (megatrain.plan.cost).

Bandwidths are per device and one direction, latencies one message's (megatrain.plan.pool).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from megatrain.plan.pool import PoolSpec


class Links(NamedTuple):
    """A pool's node size and link speeds (PoolSpec's fields): hashable, so cost.py can cache on it."""

    devices_per_node: int
    intra_node_bandwidth_gbps: float
    intra_node_latency_us: float
    inter_node_bandwidth_gbps: float
    inter_node_latency_us: float

    @classmethod
    def of(cls, pool: PoolSpec) -> Links:
        return cls(
            pool.devices_per_node,
            pool.intra_node_bandwidth_gbps,
            pool.intra_node_latency_us,
            pool.inter_node_bandwidth_gbps,
            pool.inter_node_latency_us,
        )


def ring_time(kind: str, nbytes: float, ranks: int, bandwidth_gbps: float, latency_us: float) -> float:
    """Seconds of a ring collective over `ranks` on `nbytes` (the whole tensor's size).

    all_reduce moves 2(n-1)/n of it per rank in 2(n-1) steps; all_gather and reduce_scatter half."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    steps = (ranks - 1) * (2 if kind == "all_reduce" else 1)
    return steps / ranks * nbytes / (bandwidth_gbps * 1e9) + steps * latency_us * 1e-6


def link(pool: PoolSpec | Links, inside_node: bool) -> tuple[float, float]:
    if inside_node:
        return pool.intra_node_bandwidth_gbps, pool.intra_node_latency_us
    return pool.inter_node_bandwidth_gbps, pool.inter_node_latency_us


def ring_link(pool: PoolSpec | Links, ranks: int, per_node: int) -> tuple[float, float]:
    """(bandwidth, latency) of a ring collective over `ranks`, `per_node` of them on each node: NVLink
    inside one node; across nodes NCCL runs a ring per GPU, each through that GPU's own NIC, so the
    group's per_node NICs share the inter-node traffic (DGX H100: 8 x 400 Gb/s per node), as long as
    NVLink carries it: min(NVLink, per_node x NIC)."""
    intra_bw, intra_lat = link(pool, True)
    if ranks <= per_node:
        return intra_bw, intra_lat
    inter_bw, inter_lat = link(pool, False)
    return min(intra_bw, max(1, per_node) * inter_bw), inter_lat


def all_to_all_time(nbytes: float, ranks: int, per_node: int, pool: PoolSpec | Links) -> float:
    """Seconds of an all-to-all in which each of `ranks` sends `nbytes` spread evenly over the group:
    (ranks-1)/ranks of it leaves the rank, the share for the `per_node` - 1 peers on its node over
    NVLink and the rest across nodes at the same time (the slower decides), plus a latency per
    doubling of the group (NCCL posts the sends together). What compute hides of it:
    megatrain.plan.layer_cost (moe_overlap_chunks)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    local = max(1, min(ranks, per_node))
    intra_bw, intra_lat = link(pool, True)
    inter_bw, inter_lat = link(pool, False)
    on_node = nbytes * (local - 1) / ranks / (intra_bw * 1e9)
    off_node = nbytes * (ranks - local) / ranks / (inter_bw * 1e9)
    latency = (intra_lat if local == ranks else inter_lat) * 1e-6 * (1 + math.log2(ranks))
    return max(on_node, off_node) + latency


def routed_all_to_all_time(
    copy_bytes: float, topk: float, ranks: int, per_node: int, pool: PoolSpec | Links
) -> float:
    """Seconds of one MoE dispatch (or combine) by the pairs dispatch over an expert-parallel group
    of `ranks`, `per_node` of them on each node: each rank sends `topk` copies of its tokens
    (`copy_bytes` one copy of all of them), spread evenly over the group (all_to_all_time)."""
    return all_to_all_time(copy_bytes * topk, ranks, per_node, pool)


def two_hop_times(
    copy_bytes: float, topk: float, ranks: int, per_node: int, pool: PoolSpec | Links, node_limit: float
) -> tuple[float, float]:
    """(hop 1, hop 2) seconds of one two-hop dispatch (or combine) over an ep group of `ranks` on
    more than one node (parallelism.moe_dispatch nodes, engine.parallel.expert_dedup; DeepEP's): hop
    1 sends a token across the inter-node fabric once to each node holding one of its experts, on
    the rail of ranks with the same index on each node; hop 2 forwards it over NVLink to the ranks
    of its experts there. `node_limit` is how many nodes a token reaches on average
    (layer_cost._moe_layer: at most router_group_topk under node-limited routing, whose router
    groups are the nodes; DeepSeek-V3: 256 experts on 8 nodes, top-8 on at most 4).

    Hop 1 moves min(topk, node_limit)·(N-1)/N copies of each token (N nodes) over the rank's NIC,
    hop 2 topk·(per_node-1)/per_node copies over NVLink (one per expert: an upper bound), each with
    a latency per doubling of its group. The engine runs them one after the other; how they hide
    behind the experts: layer_cost.exposed_two_hop."""
    nodes = ranks // per_node
    intra_bw, intra_lat = link(pool, True)
    inter_bw, inter_lat = link(pool, False)
    rail = copy_bytes * min(topk, node_limit) * (nodes - 1) / nodes / (inter_bw * 1e9)
    rail += inter_lat * 1e-6 * (1 + math.log2(nodes))
    node = 0.0
    if per_node > 1:
        node = copy_bytes * topk * (per_node - 1) / per_node / (intra_bw * 1e9)
        node += intra_lat * 1e-6 * (1 + math.log2(per_node))
    return rail, node


def ep_ranks_per_node(tp: int, cp: int, ep: int, devices_per_node: int) -> int:
    """Members of an expert-parallel group that share a node: the group's ranks sit tp·cp apart
    (ep is carved from dp×cp with tp fastest), so a node holds devices_per_node/(tp·cp) of them."""
    return max(1, min(ep, devices_per_node // (tp * cp)))


# The planner scores thousands of layouts of one model: what depends only on the model and the
# pipeline cut is computed once per planning call (ModelShape is frozen, so hashable).


__all__ = [
    "Links",
    "all_to_all_time",
    "ep_ranks_per_node",
    "link",
    "ring_link",
    "ring_time",
    "routed_all_to_all_time",
    "two_hop_times",
]
