"""Mixture-of-experts MLP (Mixtral, Qwen-MoE, DeepSeek-V3 style), single-device.

MoELayer replaces the dense MLP on layers i with i % layer_freq == 0 (TransformerConfig.moe). Its
parts, with N tokens, C hidden, E experts, k = router_topk, M = routed (token, expert) pairs:

    router(x (N, C)) -> probs (N, E) fp32, 0 where not routed; routing_map (N, E) bool
        top-k per token; with a capacity factor the dropped pairs are False in the map, 0 in probs
    dispatcher.dispatch(x (N, C), probs, routing_map) -> expert_x (M, C), tokens_per_expert list[int]
        rows grouped by (local) expert, expert-major, token order within an expert
    experts(expert_x (M, C), tokens_per_expert) -> (M, C)
    dispatcher.combine(expert_y (M, C)) -> (N, C)     each token's Σ prob·y over its experts
    MoELayer(cfg).forward(x (B, T, C)) -> (B, T, C)   router + dispatcher + experts + shared expert

The dispatcher keeps what combine needs from its dispatch (one dispatch, then one combine, per
forward). PermuteDispatcher permutes on one device; expert parallelism swaps in an all-to-all one
with the same two methods. Expert weights are stacked: experts.fc1_weight (E, 2F or F, C) ([gate; up]
rows for SwiGLU, as the dense MLP's fc1), experts.fc2_weight (E, C, F), experts.fc1_bias (E, 2F or
F) and experts.fc2_bias (E, C) only with cfg.add_bias; they run as one `grouped_mlp` kernel.

Routing is in fp32. The load-balancing (aux) and z losses reach the gradient through
MoEAuxLossAutoScaler on the router's probs, scaled by `router.aux_loss_scale` (the training loop sets
it per micro-batch: the micro-batch's token share × the fp16 loss scale), so the losses the model
returns stay the LM loss. Each router accumulates RouterStats for the metrics (training forwards
only, never a recompute).

Parallel hooks (identity here; megatrain.engine.parallel.parallelize sets them): MoELayer.enter and
.leave wrap the routed part (tensor parallelism: copy/all-reduce, or all-gather/reduce-scatter of
the sequence); router.aux_grad_fraction and experts.fc2_bias_fraction are 1/tp where every tp rank
adds its part of a replicated term to partial sums.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatrain import kernels
from megatrain.engine.config import MoEConfig, TransformerConfig
from megatrain.engine.models.gpt import MLP
from megatrain.engine.parallel import lanes
from megatrain.kernels.grouped_mlp import grouped_mlp_lora


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Returns x unchanged; in backward gives `aux_loss` the gradient `scale` (Megatron's pattern):
    the aux loss joins the objective with weight `scale` without being returned by the model."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        aux_grad = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device)
        return grad, aux_grad, None


def _recording() -> bool:
    """Whether a forward should count towards the router statistics: training with gradients, and
    not a recompute (those run inside a backward pass, whose graph task id is not -1)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


class RouterStats:
    """What one router saw over a log interval, kept on its device (no host sync per step)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.reset()

    def reset(self) -> None:
        self.forwards = 0
        """Training forwards recorded (one per micro-batch)."""
        self.tokens: torch.Tensor | None = None
        """(E,) float64: (token, expert) pairs the router chose, before capacity dropping."""
        self.aux_loss: torch.Tensor | None = None
        """Σ over forwards of the aux loss (× aux_loss_coeff), likewise z_loss."""
        self.z_loss: torch.Tensor | None = None
        self.dropped: torch.Tensor | None = None
        """Pairs dropped for capacity."""

    def add(self, tokens: torch.Tensor, aux: torch.Tensor, z: torch.Tensor, dropped: torch.Tensor) -> None:
        values = (tokens.double(), aux.detach().double(), z.detach().double(), dropped.double())
        if self.tokens is None:
            self.tokens, self.aux_loss, self.z_loss, self.dropped = values
        else:
            assert self.aux_loss is not None and self.z_loss is not None and self.dropped is not None
            self.tokens = self.tokens + values[0]
            self.aux_loss, self.z_loss = self.aux_loss + values[1], self.z_loss + values[2]
            self.dropped = self.dropped + values[3]
        self.forwards += 1


class TopKRouter(nn.Module):
    """x (N, C) -> probs (N, E) fp32 (0 where not routed), routing_map (N, E) bool.

    softmax: softmax over all experts, then the top-k, whose probabilities are the weights,
    renormalised to sum to 1 over the k (Mixtral) unless router_pre_softmax (Qwen2-MoE).
    sigmoid: a sigmoid per expert, the top-k, weights renormalised over the chosen k.
    Group-limited routing: experts in router_num_groups contiguous groups, each group scored by the
    sum of its top (k / router_group_topk) scores, the token's experts chosen within its best
    router_group_topk groups. Capacity: each expert keeps its ceil(capacity_factor·N·k/E) most
    probable tokens and drops the rest (Megatron's "probs" policy); None is dropless.
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        moe = _moe(cfg)
        self.moe = moe
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)  # weight (E, C)
        self.aux_loss_scale = 1.0
        """The aux losses' gradient weight: the micro-batch's token share × the fp16 loss scale."""
        self.aux_grad_fraction = 1.0
        """This replica's part of that gradient (1/tp where tp ranks each add theirs to a sum)."""
        self.sequence_shards = 1
        """Ranks the micro-batch's sequences are split over (context parallelism sets it, with
        `sum_counts`, a sum of the per-expert counts over them): the aux loss balances the whole."""
        self.sum_counts: Callable[[torch.Tensor], torch.Tensor] = _identity
        self.stats = RouterStats(moe.num_experts)

    def scores(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, C) -> logits and scores (N, E), fp32."""
        logits = F.linear(x.float(), self.gate.weight.float())
        if self.moe.router_score_function == "sigmoid":
            return logits, torch.sigmoid(logits)
        return logits, torch.softmax(logits, dim=-1)

    def select(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """scores (N, E) -> the top-k expert ids (N, k) and their weights (N, k)."""
        moe, k = self.moe, self.moe.router_topk
        candidates = scores
        if moe.router_num_groups is not None and moe.router_group_topk is not None:
            n, groups = scores.shape[0], moe.router_num_groups
            per_group = scores.view(n, groups, -1)  # (N, G, E/G)
            best = max(1, k // moe.router_group_topk)
            group_scores = per_group.topk(best, dim=-1).values.sum(-1)  # (N, G)
            chosen = group_scores.topk(moe.router_group_topk, dim=-1).indices  # (N, g)
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
            keep = keep.unsqueeze(-1).expand_as(per_group).reshape_as(scores)  # (N, E)
            candidates = scores.masked_fill(~keep, float("-inf"))
        top, idx = candidates.topk(k, dim=-1)  # (N, k)
        if moe.router_score_function == "sigmoid":
            top = top / (top.sum(-1, keepdim=True) + 1e-20)
        elif not moe.router_pre_softmax:
            top = top / top.sum(-1, keepdim=True)  # = softmax over the k logits (as transformers divides)
        return idx, top

    def capacity(self, num_tokens: int) -> int:
        """Tokens each expert keeps per micro-batch (num_tokens when dropless)."""
        cf = self.moe.capacity_factor
        if cf is None:
            return num_tokens
        return min(num_tokens, math.ceil(cf * num_tokens * self.moe.router_topk / self.moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        n = x.shape[0]
        logits, scores = self.scores(x)
        idx, weights = self.select(scores)
        probs = torch.zeros_like(scores).scatter(1, idx, weights)  # (N, E)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, idx, True)
        tokens = routing_map.sum(0)  # (E,) chosen pairs per expert, before dropping
        cap = self.capacity(n)
        dropped = torch.zeros((), device=x.device)
        if cap < n:
            # Each expert keeps its `cap` most probable routed tokens; unrouted ones have prob 0.
            kept = torch.zeros_like(routing_map).scatter_(0, probs.topk(cap, dim=0).indices, True)
            dropped = (routing_map & ~kept).sum()
            routing_map = routing_map & kept
            probs = probs * routing_map
        aux = self.aux_loss(scores, tokens, n)
        z = self.z_loss(logits)
        if self.training and _recording():
            self.stats.add(tokens, aux, z, dropped)
        total = aux + z
        if total.requires_grad and (moe.aux_loss_coeff > 0 or moe.z_loss_coeff > 0):
            probs = MoEAuxLossAutoScaler.apply(probs, total, self.aux_loss_scale * self.aux_grad_fraction)
        return probs, routing_map

    def aux_loss(self, scores: torch.Tensor, tokens: torch.Tensor, n: int) -> torch.Tensor:
        """Switch/GShard load balancing × aux_loss_coeff: E·Σ_e f_e·P_e with f_e the fraction of the
        N·k chosen pairs that went to e and P_e the mean score of e (sigmoid scores normalised per
        token first, so they sum to 1 as softmax's do). 1·coeff when perfectly balanced."""
        moe = self.moe
        if moe.aux_loss_coeff == 0:
            return scores.new_zeros(())
        if moe.router_score_function == "sigmoid":
            scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        # Over the whole micro-batch when its sequences are split over ranks: global counts, this
        # rank's scores over the global token count; × shards, so that the ranks' mean (the gradient
        # and the logged figure are averaged over them) is the whole micro-batch's aux loss.
        shards, total = self.sequence_shards, n * self.sequence_shards
        fraction = self.sum_counts(tokens).float() / (total * moe.router_topk)  # (E,) no gradient
        mean_prob = scores.sum(0) / total  # (E,) this rank's part of the mean
        return shards * moe.aux_loss_coeff * moe.num_experts * (fraction * mean_prob).sum()

    def z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        """ST-MoE's z-loss × z_loss_coeff: the mean over tokens of logsumexp(logits)²."""
        if self.moe.z_loss_coeff == 0:
            return logits.new_zeros(())
        return self.moe.z_loss_coeff * torch.logsumexp(logits, dim=-1).square().mean()


class Dispatcher:
    """What MoELayer runs its routed part through: dispatch, the experts, combine (an expert-parallel
    dispatcher may pipeline the three: engine.parallel.expert_overlap)."""

    def dispatch(
        self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        raise NotImplementedError

    def combine(self, expert_y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def run(
        self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, experts: nn.Module
    ) -> torch.Tensor:
        """x (N, C) -> the routed experts' weighted sum (N, C)."""
        expert_x, tokens_per_expert = self.dispatch(x, probs, routing_map)
        return self.combine(experts(expert_x, tokens_per_expert))


class PermuteDispatcher(Dispatcher):
    """Single-device dispatch: the routed (token, expert) pairs gathered expert-major, and combined
    back with their probabilities. Keeps the permutation between dispatch and combine."""

    def __init__(self) -> None:
        self._token_idx: torch.Tensor | None = None
        self._weights: torch.Tensor | None = None
        self._num_tokens = 0

    def dispatch(
        self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        # nonzero on (E, N) lists the pairs expert-major, tokens in order within an expert.
        expert_idx, token_idx = routing_map.t().nonzero(as_tuple=True)  # (M,) each
        self._token_idx, self._num_tokens = token_idx, x.shape[0]
        self._weights = probs.t()[expert_idx, token_idx]  # (M,) fp32, differentiable
        tokens_per_expert = routing_map.sum(0).tolist()
        return x.index_select(0, token_idx), tokens_per_expert  # (M, C)

    def combine(self, expert_y: torch.Tensor) -> torch.Tensor:
        token_idx, weights = self._token_idx, self._weights
        if token_idx is None or weights is None:
            raise RuntimeError("combine() needs a dispatch() first")
        self._token_idx = self._weights = None
        # (N, C): each token's k weighted rows summed in fp32; saves the rows, not fp32 copies.
        return kernels.get("moe_combine", expert_y.device.type)(
            expert_y, weights, token_idx, self._num_tokens
        )


class GroupedExperts(nn.Module):
    """E expert MLPs with stacked weights, run as one grouped_mlp kernel over their token groups."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        moe = _moe(cfg)
        e, c, f = moe.num_experts, cfg.hidden_size, moe.ffn_hidden_size
        self.activation = cfg.activation
        width = 2 * f if cfg.activation == "swiglu" else f
        self.fc1_weight = nn.Parameter(torch.empty(e, width, c))
        self.fc2_weight = nn.Parameter(torch.empty(e, c, f))
        self.fc1_bias = nn.Parameter(torch.zeros(e, width)) if cfg.add_bias else None
        self.fc2_bias = nn.Parameter(torch.zeros(e, c)) if cfg.add_bias else None
        self.fc2_bias_fraction = 1.0
        """Scales fc2's bias: 1/tp where tp ranks add partial outputs (the sum then holds it once)."""
        self.lora: nn.Module | None = None
        """LoRA adapters per expert (engine.lora.ExpertLoRA: factors(), scale, enabled), if attached."""
        std = cfg.init_method_std
        self.reset_parameters(std, std / math.sqrt(2.0 * cfg.num_layers))

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        """As the dense MLP: fc1 normal(0, std), fc2 normal(0, std/sqrt(2·layers)), biases zero."""
        nn.init.normal_(self.fc1_weight, 0.0, std)
        nn.init.normal_(self.fc2_weight, 0.0, out_std)
        for b in (self.fc1_bias, self.fc2_bias):
            if b is not None:
                nn.init.zeros_(b)

    @property
    def num_experts(self) -> int:
        return self.fc1_weight.shape[0]

    def forward(self, expert_x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        fc2_bias = self.fc2_bias
        if fc2_bias is not None and self.fc2_bias_fraction != 1.0:
            fc2_bias = fc2_bias * self.fc2_bias_fraction
        lora = self.lora
        if lora is not None and lora.enabled:
            weights = (self.fc1_weight, self.fc2_weight, self.fc1_bias, fc2_bias, self.activation)
            return grouped_mlp_lora(expert_x, tokens_per_expert, *weights, lora.factors(), lora.scale)
        fn = kernels.get("grouped_mlp", expert_x.device.type)
        return fn(
            expert_x,
            tokens_per_expert,
            self.fc1_weight,
            self.fc2_weight,
            self.fc1_bias,
            fc2_bias,
            self.activation,
        )


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class MoELayer(nn.Module):
    """x (B, T, C) -> (B, T, C): the routed experts' weighted sum, plus the shared expert if any."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        moe = _moe(cfg)
        self.router = TopKRouter(cfg)
        self.dispatcher: Dispatcher = PermuteDispatcher()
        self.experts = GroupedExperts(cfg)
        self.shared_expert: MLP | None = None
        if moe.shared_expert_ffn_hidden_size is not None:
            shared = dataclasses.replace(cfg, ffn_hidden_size=moe.shared_expert_ffn_hidden_size, moe=None)
            self.shared_expert = MLP(shared)
        # Qwen2-MoE: the shared expert's output scaled per token by sigmoid(x · gate) (weight (1, C)).
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_expert_gate:
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        # Around the routed part: tensor parallelism enters its region here and leaves it after.
        self.enter: Callable[[torch.Tensor], torch.Tensor] = _identity
        self.leave: Callable[[torch.Tensor], torch.Tensor] = _identity

    @torch.compiler.disable  # data-dependent group sizes: eager even inside a compiled block
    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' output for x (B, T, C) -> (B, T, C)."""
        tokens = self.enter(x)  # (B, T', C): T' = T, or the whole sequence under sequence parallelism
        flat = tokens.reshape(-1, tokens.shape[-1])  # (N, C)
        probs, routing_map = self.router(flat)
        with lanes.exclusive(self.dispatcher):  # it keeps this call's splits from dispatch to combine
            y = self.dispatcher.run(flat, probs, routing_map, self.experts)  # (N, C)
        return self.leave(y.view_as(tokens))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.routed(x)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared  # (B, T, 1) * (B, T, C)
            y = y + shared
        return y


def _moe(cfg: TransformerConfig) -> MoEConfig:
    if cfg.moe is None:
        raise ValueError("an MoE layer needs TransformerConfig.moe")
    return cfg.moe


def moe_layers(module: nn.Module) -> Iterator[MoELayer]:
    """Every MoELayer inside `module` (a model, a pipeline chunk, a DataParallel wrapper)."""
    for m in module.modules():
        if isinstance(m, MoELayer):
            yield m


def set_aux_loss_scale(module: nn.Module, scale: float) -> None:
    """The aux losses' gradient weight for the next forwards (see TopKRouter.aux_loss_scale)."""
    for layer in moe_layers(module):
        layer.router.aux_loss_scale = scale
