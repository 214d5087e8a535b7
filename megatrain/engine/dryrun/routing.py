"""Balanced routing for the dryrun: the one place it departs from the engine's code path.

How many tokens go to each expert is data (a `nonzero` of the routing map and the counts read to the
host as the all-to-all's splits), and fake tensors hold none. The dryrun therefore swaps every MoE
layer's dispatcher for `BalancedDispatcher`: the router still runs (its logits, softmax, top-k and
aux losses are real ops on real shapes), but the (token, expert) pairs are taken as perfectly
balanced, each expert receiving N·k/E of the N·k pairs, which is what the planner assumes
(megatrain.plan.moe_memory). Everything after the split is the engine's: the permuted rows are
gathered with their probabilities as PermuteDispatcher does, exchanged by the same all-to-all,
regrouped expert-major with the same `_chunk_order`, run through the same grouped experts, and
combined by the engine's own `combine` (unchanged).
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from megatrain.engine.models.moe import moe_layers
from megatrain.engine.parallel.expert import AllToAllDispatcher, _all_gather_single, _chunk_order, all_to_all
from megatrain.engine.parallel.state import ParallelState


class BalancedDispatcher(AllToAllDispatcher):
    """AllToAllDispatcher with the routing counts fixed at the balanced ones (see the module docstring)."""

    def __init__(self, num_experts: int, topk: int, state: ParallelState):
        super().__init__(num_experts, state.ep_group, state.ep_size, state.ep_rank)
        self.topk = topk

    def _balanced_pairs(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Expert-major pairs: expert e takes the c = N·k/E consecutive pair slots [e·c, (e+1)·c),
        slot j naming token j mod N, so each token reaches k distinct experts (k ≤ E)."""
        e, pairs = self.num_experts, n * self.topk
        counts = [pairs // e + (1 if i < pairs % e else 0) for i in range(e)]
        with unset_fake_temporarily():  # host integers: real tensors
            expert_idx = torch.repeat_interleave(torch.arange(e), torch.tensor(counts))
        token_idx = torch.arange(pairs, device=device) % n
        return expert_idx.to(device), token_idx, counts

    def dispatch(  # type: ignore[override]
        self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        expert_idx, token_idx, counts = self._balanced_pairs(x.shape[0], x.device)
        local = self._local  # PermuteDispatcher's state, as its dispatch leaves it for combine
        local._token_idx, local._num_tokens = token_idx, x.shape[0]
        local._weights = probs.t()[expert_idx, token_idx]  # (M,) fp32, differentiable
        permuted = x.index_select(0, token_idx)  # (M, C)
        p, n_local = self.size, self.local_experts
        if p == 1:
            self._splits, self._order = None, None
            return permuted, counts
        # The counts' all-gather still runs (its buffer is the engine's); its values are not read.
        mine = torch.tensor(counts, device=x.device)
        _all_gather_single(mine.new_empty(p * self.num_experts), mine, group=self.group)
        with unset_fake_temporarily():  # host integers, as the engine's `.cpu()` table
            # Every rank routes the same balanced counts: table[source, destination, local expert].
            table = torch.tensor(counts).view(1, p, n_local).expand(p, p, n_local)
            input_splits = table[self.rank].sum(1).tolist()
            received = table[:, self.rank].contiguous()  # (P, L)
            output_splits = received.sum(1).tolist()
            order = _chunk_order(received) if n_local > 1 else None
            local_counts = received.sum(0).tolist()
        self._splits = (output_splits, input_splits)
        self.rows_sent = sum(input_splits) - input_splits[self.rank]
        self.rows_received = sum(output_splits) - output_splits[self.rank]
        rows = all_to_all(permuted, self.group, p, output_splits, input_splits)
        if n_local == 1:
            self._order = None
            return rows, [sum(output_splits)]
        assert order is not None
        self._order = order.to(rows.device)
        return rows.index_select(0, self._order), local_counts


def balance_routing(model: nn.Module, state: ParallelState) -> int:
    """Swap every MoE layer's dispatcher in `model` for a BalancedDispatcher; returns how many."""
    count = 0
    for layer in moe_layers(model):
        moe = layer.router.moe
        layer.dispatcher = BalancedDispatcher(moe.num_experts, moe.router_topk, state)
        count += 1
    return count
