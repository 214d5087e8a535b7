"""Expert parallelism that sends each token once per node, then once per rank: the two-hop dispatch
DeepSeek-V3 trains with (DeepEP), `parallelism.moe_dispatch: nodes`.

    dedup_experts(model, state, ranks_per_node)   # after parallelize_experts; needs ep > 1

AllToAllDispatcher sends one row per routed (token, expert) pair: a token whose k experts sit on
one node crosses the inter-node fabric k times. Here, with the ep group's P ranks on N nodes of R
(rank p = node·R + r; node n holds experts [n·R·L, (n+1)·R·L), L = E/P per rank):

    hop 1, the rail (ranks of the same r on every node): each token once to every node holding
        any of its experts, with its routing probabilities for that node's experts
    hop 2, the node (its R ranks): each arrived token once to every rank holding any of its experts
    experts: the rank's routed (row, expert) pairs expert-major, the grouped kernel, each output
        weighted by its probability and summed per row
    back: hop 2 reversed and summed per arrived token, hop 1 reversed and summed per token.

With `chunks` = K > 1 (parallelism.moe_overlap_chunks) and more than one node, the tokens are cut
into K chunks and hop 1 is pipelined as the pairs dispatch is (expert_overlap.pipelined): every
chunk's hop 1 is posted at once, and while chunk c's node hop, experts and node hop back run, chunk
c+1's hop 1 and chunk c-1's return are on the inter-node wire. The node hop stays synchronous (on
NVLink it is the short one: topk copies over ~9x the bandwidth against at most G across nodes).

So a token crosses nodes at most min(k, nodes it routes to) times: with node-limited routing
(model.moe.router_num_groups = N groups of experts, router_group_topk = G), at most G. On one node
(N = 1) hop 1 is local and the dispatch sends a token once per rank. Every step is an index, a
sum (kernels.moe_combine: in fp32, saving no fp32 copies) or an all-to-all with its own backward,
so autograd derives the gradients, the probabilities' included. The sum equals
AllToAllDispatcher's up to the order of its fp32 additions (partial sums travel in the
activations' dtype, as DeepEP's combine does).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from megatrain import kernels
from megatrain.engine.models.moe import Dispatcher, moe_layers
from megatrain.engine.parallel.expert import AllToAllDispatcher, all_to_all
from megatrain.engine.parallel.expert_overlap import Exchange, pipelined
from megatrain.engine.parallel.state import Group, ParallelState
from megatrain.plan.layout import LayoutError


class _Hop:
    """One all-to-all hop over `group` of `size` ranks (None and 1: this rank alone)."""

    def __init__(self, group: Group, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank

    def splits(self, counts: torch.Tensor) -> tuple[list[int], list[int]]:
        """counts (size,): rows for each peer -> (rows received from each, rows sent to each)."""
        sent = counts.tolist()
        if self.size == 1:
            return sent, sent
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.group)
        return got.tolist(), sent

    def send(self, rows: torch.Tensor, received: list[int], sent: list[int]) -> torch.Tensor:
        return all_to_all(rows, self.group, self.size, received, sent)

    def back(self, rows: torch.Tensor, received: list[int], sent: list[int]) -> torch.Tensor:
        return all_to_all(rows, self.group, self.size, sent, received)


def _fan_out(hit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hit (rows, peers) bool -> (peer, row) of each True, peer-major, and the rows per peer."""
    peer, row = hit.t().nonzero(as_tuple=True)
    return peer, row, hit.sum(0)


class NodeDispatcher(Dispatcher):
    """The two-hop, deduplicated dispatch (the module docstring). `run` only: the weighting by the
    probabilities happens where the experts are, so there is no separate dispatch/combine. With
    `chunks` > 1 and more than one node, hop 1 is pipelined in token chunks behind the node hop and
    the experts of the chunk before (expert_overlap.pipelined)."""

    def __init__(self, num_experts: int, rail: _Hop, node: _Hop, ranks_per_node: int, chunks: int = 1):
        if chunks < 1:
            raise ValueError(f"moe_overlap_chunks={chunks} must be at least 1")
        self.num_experts, self.rail, self.node, self.ranks_per_node = num_experts, rail, node, ranks_per_node
        self.local_experts = num_experts // (rail.size * node.size)
        self.chunks = chunks
        self.recomputed: list = []
        """Small graphs a checkpoint's rerun of this layer built, for its node's backward to take."""
        self.rows_sent = 0
        """Rows the last forward sent to other ranks, both hops (combine sends as many back)."""
        self.rows_sent_off_node = 0
        """Of them, hop 1's to other nodes."""

    def run(
        self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, experts: nn.Module
    ) -> torch.Tensor:
        n_tok, nodes = x.shape[0], self.rail.size
        k = min(self.chunks, n_tok) if nodes > 1 else 1  # (one node: hop 1 moves nothing to hide)
        by_node = routing_map.view(n_tok, nodes, -1)
        per_node = probs.view(n_tok, nodes, -1)
        hit = by_node.any(-1)  # (tokens, nodes): each token to each node holding one of its experts
        self.rows_sent = 0
        if k == 1:
            dest1, tok1, counts1 = _fan_out(hit)
            recv1, sent1 = self.rail.splits(counts1)
            x1 = self.rail.send(x.index_select(0, tok1), recv1, sent1)
            p1 = self.rail.send(per_node[tok1, dest1], recv1, sent1)
            m1 = self.rail.send(by_node[tok1, dest1].to(torch.uint8), recv1, sent1)
            z0 = self.rail.back(self._on_node(x1, p1, m1, experts), recv1, sent1)
            self.rows_sent_off_node = sum(sent1) - sent1[self.rail.rank]
            self.rows_sent += self.rows_sent_off_node
            return kernels.get("moe_combine", x.device.type)(z0, None, tok1, n_tok)
        bounds = [n_tok * i // k for i in range(k + 1)]
        fans = [_fan_out(hit[bounds[c] : bounds[c + 1]]) for c in range(k)]
        counts = torch.stack([f[2] for f in fans], 1)  # (nodes, K): rows for each node, per chunk
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.rail.group)  # one exchange for every chunk
        splits = [(counts[:, c].tolist(), got[:, c].tolist()) for c in range(k)]
        toks = [tok + bounds[c] for c, (_, tok, _) in enumerate(fans)]
        rows = [
            [x.index_select(0, tok), per_node[tok, dest], by_node[tok, dest].to(torch.uint8)]
            for (dest, _, _), tok in zip(fans, toks, strict=True)
        ]
        ex = Exchange(self.rail.group, splits, lambda c, t: self._on_node(*t, experts), self.recomputed)
        z0 = torch.cat(pipelined(ex, rows, list(experts.parameters())))
        sent = counts.sum(1).tolist()
        self.rows_sent_off_node = sum(sent) - sent[self.rail.rank]
        self.rows_sent += self.rows_sent_off_node
        return kernels.get("moe_combine", x.device.type)(z0, None, torch.cat(toks), n_tok)

    def _on_node(
        self, x1: torch.Tensor, p1: torch.Tensor, m1: torch.Tensor, experts: nn.Module
    ) -> torch.Tensor:
        """Tokens arrived at this node (rows, probabilities and expert mask for its experts) -> their
        outputs summed over this node's experts: hop 2, the experts, hop 2 back."""
        n1, r, lo = x1.shape[0], self.node.size, self.local_experts
        # Hop 2: each arrived token to each rank of this node holding one of its experts.
        by_rank = m1.bool().view(n1, r, lo)
        dest2, row2, counts2 = _fan_out(by_rank.any(-1))
        recv2, sent2 = self.node.splits(counts2)
        x2 = self.node.send(x1.index_select(0, row2), recv2, sent2)
        p2 = self.node.send(p1.view(n1, r, lo)[row2, dest2], recv2, sent2)
        m2 = self.node.send(by_rank[row2, dest2].to(torch.uint8), recv2, sent2).bool()
        # This rank's experts, on their (row, expert) pairs expert-major; weighted sums per row.
        expert, row = m2.t().nonzero(as_tuple=True)
        y = experts(x2.index_select(0, row), m2.sum(0).tolist())
        combine = kernels.get("moe_combine", y.device.type)  # (sums in fp32, saving no fp32 copies)
        z2 = combine(y, p2[row, expert], row, x2.shape[0])
        # Back: per arrived token over this node's ranks.
        z1 = self.node.back(z2, recv2, sent2)
        self.rows_sent += sum(sent2) - sent2[self.node.rank]
        return combine(z1, None, row2, n1)


def node_groups(state: ParallelState, ranks_per_node: int) -> tuple[_Hop, _Hop]:
    """This rank's rail and node hops within its ep group, which must be laid out node-major with
    `ranks_per_node` (R) of its ranks on each node. Collective: every rank creates every group."""
    layout, p = state.layout, state.ep_size
    if ranks_per_node < 1 or p % ranks_per_node:
        raise LayoutError(f"ep={p} is not a whole number of nodes of {ranks_per_node} ep ranks")
    rail_mine: _Hop | None = None
    node_mine: _Hop | None = None
    for ranks in layout.expert_group_ranks("ep"):
        n = len(ranks) // ranks_per_node
        rails = [ranks[i::ranks_per_node] for i in range(ranks_per_node)]  # one per local index
        nodes = [ranks[i * ranks_per_node : (i + 1) * ranks_per_node] for i in range(n)]
        for members, is_rail in [*((m, True) for m in rails), *((m, False) for m in nodes)]:
            group = dist.new_group(members) if len(members) > 1 else None
            if state.rank in members:
                hop = _Hop(group, len(members), members.index(state.rank))
                if is_rail:
                    rail_mine = hop
                else:
                    node_mine = hop
    assert rail_mine is not None and node_mine is not None
    return rail_mine, node_mine


def ep_ranks_on_node(state: ParallelState, local_world_size: int) -> int:
    """How many of this rank's ep group share each node (torchrun numbers a node's ranks
    consecutively); raises where the nodes hold unequal shares."""
    ranks = next(g for g in state.layout.expert_group_ranks("ep") if state.rank in g)
    per_node: dict[int, int] = {}
    for g in ranks:
        per_node[g // local_world_size] = per_node.get(g // local_world_size, 0) + 1
    if len(set(per_node.values())) != 1:
        raise LayoutError(f"the ep group {ranks} spreads unevenly over nodes of {local_world_size} ranks")
    return next(iter(per_node.values()))


def dedup_experts(
    model: nn.Module, state: ParallelState, ranks_per_node: int | None = None, chunks: int = 1
) -> int:
    """Swap every all-to-all dispatcher in `model` for a NodeDispatcher (ranks_per_node: of the ep
    group on each node; default from torchrun's LOCAL_WORLD_SIZE; chunks: hop 1 pipelined in that
    many token chunks); returns how many. Collective."""
    if state.ep_size == 1:
        return 0
    if ranks_per_node is None:
        ranks_per_node = ep_ranks_on_node(
            state, int(os.environ.get("LOCAL_WORLD_SIZE", state.layout.world_size))
        )
    rail, node = node_groups(state, ranks_per_node)
    count = 0
    for layer in moe_layers(model):
        d = layer.dispatcher
        if isinstance(d, AllToAllDispatcher):
            layer.dispatcher = NodeDispatcher(d.num_experts, rail, node, ranks_per_node, chunks)
            count += 1
    return count
