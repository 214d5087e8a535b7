"""The single-device MoE layer (megatrain.engine.models.moe): routing, losses, dispatch, the layer
against a per-token loop written here, and a tiny MoE model that learns."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatrain.engine.config import MoEConfig, TransformerConfig
from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.models.moe import (
    MoELayer,
    PermuteDispatcher,
    TopKRouter,
    moe_layers,
    set_aux_loss_scale,
)


def config(
    activation: str = "swiglu", add_bias: bool = False, num_layers: int = 2, **moe
) -> TransformerConfig:
    """tiny-llama with MoE layers (4 experts, top-2, width 24, no aux loss unless asked)."""
    fields = {"num_experts": 4, "router_topk": 2, "ffn_hidden_size": 24, "aux_loss_coeff": 0.0, **moe}
    return TransformerConfig.preset(
        "tiny-llama", activation=activation, add_bias=add_bias, num_layers=num_layers, moe=MoEConfig(**fields)
    )


def router_with_logits(logits: torch.Tensor, **moe) -> tuple[TopKRouter, torch.Tensor]:
    """A router whose gate is the identity, so x is its logits (N, E)."""
    e = logits.shape[1]
    cfg = TransformerConfig.preset(
        "tiny-llama", hidden_size=e, num_attention_heads=1, num_query_groups=1,
        moe=MoEConfig(num_experts=e, ffn_hidden_size=8, aux_loss_coeff=0.0, **moe),
    )  # fmt: skip
    router = TopKRouter(cfg)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(e))
    return router, logits.clone().requires_grad_()


@pytest.mark.parametrize("pre_softmax", [True, False])
def test_softmax_topk_probabilities(pre_softmax: bool) -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 0.5, -1.0, 2.0]])
    router, x = router_with_logits(logits, router_topk=2, router_pre_softmax=pre_softmax)
    probs, routing_map = router(x)
    soft = logits.softmax(-1)
    expected_map = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(routing_map, expected_map)
    if pre_softmax:  # the softmax over all experts, not renormalised over the k
        torch.testing.assert_close(probs, soft * expected_map)
    else:  # Megatron's default: the softmax over the chosen k logits
        chosen = logits.masked_fill(~expected_map, float("-inf")).softmax(-1)
        torch.testing.assert_close(probs, chosen)


def test_sigmoid_scores_renormalised_over_topk() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 0.5, -1.0, 2.0]])
    router, x = router_with_logits(logits, router_topk=2, router_score_function="sigmoid")
    probs, routing_map = router(x)
    sig = torch.sigmoid(logits) * routing_map
    torch.testing.assert_close(probs, sig / sig.sum(-1, keepdim=True))
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))


def test_group_limited_routing_picks_within_best_groups() -> None:
    # 3 groups of 2 experts, each scored by the sum of its top-1 scores (k / group_topk = 2 / 2):
    # group 2 (e^4.2) and group 0 (e^4) beat group 1 (e^3.5), so expert 2 (3.5) loses to 5 and 0.
    logits = torch.tensor([[4.0, 3.9, 3.5, 3.4, -9.0, 4.2]])
    router, x = router_with_logits(logits, router_topk=2, router_num_groups=3, router_group_topk=2)
    _, routing_map = router(x)
    assert routing_map[0].nonzero().flatten().tolist() == [0, 5]
    # One group, scored by its top-2 sum: group 0 (e^4 + e^3.9) beats group 2 (e^4.2 + e^-9).
    router, x = router_with_logits(logits, router_topk=2, router_num_groups=3, router_group_topk=1)
    _, routing_map = router(x)
    assert routing_map[0].nonzero().flatten().tolist() == [0, 1]


def test_capacity_drops_lowest_probability_tokens() -> None:
    # 4 tokens, E = 2, k = 1, capacity factor 1: each expert keeps ceil(1·4·1/2) = 2 tokens.
    logits = torch.tensor([[2.0, 0.0], [3.0, 0.0], [1.0, 0.0], [0.0, 0.5]])
    # pre-softmax: top-1 weights renormalised over k = 1 would all be 1, leaving nothing to rank by.
    router, x = router_with_logits(logits, router_topk=1, capacity_factor=1.0, router_pre_softmax=True)
    assert router.capacity(4) == 2
    probs, routing_map = router(x)
    # Expert 0 was chosen by tokens 0, 1, 2: token 2 has the lowest probability and is dropped.
    assert routing_map[:, 0].tolist() == [True, True, False, False]
    assert routing_map[:, 1].tolist() == [False, False, False, True]
    assert probs[2].abs().sum() == 0
    assert router.stats.dropped is not None and router.stats.dropped.item() == 1


def test_aux_and_z_loss_values_and_gradients_through_autoscaler() -> None:
    torch.manual_seed(0)
    n, e, k, aux_c, z_c = 6, 4, 2, 0.1, 0.01
    logits = torch.randn(n, e)
    router, x = router_with_logits(logits, router_topk=k)
    router.moe = MoEConfig(
        num_experts=e, router_topk=k, ffn_hidden_size=8, aux_loss_coeff=aux_c, z_loss_coeff=z_c
    )
    router.train()
    probs, routing_map = router(x)
    # Written out: f_e = share of the n·k chosen pairs, P_e = mean softmax probability.
    soft = logits.softmax(-1)
    chosen = torch.zeros(n, e).scatter(1, logits.topk(k, -1).indices, 1.0)
    f, p = chosen.sum(0) / (n * k), soft.mean(0)
    aux = aux_c * e * (f * p).sum()
    z = z_c * (torch.logsumexp(logits, -1) ** 2).mean()
    stats = router.stats
    assert stats.forwards == 1 and stats.aux_loss is not None and stats.z_loss is not None
    torch.testing.assert_close(stats.aux_loss.float(), aux)
    torch.testing.assert_close(stats.z_loss.float(), z)
    assert stats.tokens is not None and stats.tokens.tolist() == chosen.sum(0).tolist()
    # A model whose only loss reaches the probs with zero weight gets exactly scale·d(aux + z)/dx.
    (probs * 0.0).sum().backward()
    ref = logits.clone().requires_grad_()
    soft = ref.softmax(-1)
    (aux_c * e * (f * soft.mean(0)).sum() + z_c * (torch.logsumexp(ref, -1) ** 2).mean()).backward()
    torch.testing.assert_close(x.grad, ref.grad)
    # The scale (the loop's token share × loss scale) multiplies that gradient.
    x.grad = None
    router.aux_loss_scale = 0.25
    probs, _ = router(x)
    (probs * 0.0).sum().backward()
    torch.testing.assert_close(x.grad, 0.25 * ref.grad)


def test_stats_skip_recompute_and_no_grad() -> None:
    torch.manual_seed(0)
    model = GPTModel(config(num_layers=2, layer_freq=2)).train()
    tokens = torch.randint(0, 128, (2, 16))
    model.set_recompute("full")
    model.loss(tokens, tokens).backward()  # the MoE block is recomputed in backward
    with torch.no_grad():
        model.loss(tokens, tokens)
    layers = list(moe_layers(model))
    assert len(layers) == 1 and layers[0].router.stats.forwards == 1  # layer 0 only (layer_freq 2)
    assert layers[0].router.stats.tokens is not None and layers[0].router.stats.tokens.sum() == 2 * 16 * 2


def test_dispatcher_round_trip() -> None:
    torch.manual_seed(0)
    n, c, e = 7, 5, 4
    x = torch.randn(n, c)
    routing_map = torch.zeros(n, e, dtype=torch.bool).scatter_(1, torch.randn(n, e).topk(2, -1).indices, True)
    routing_map[3] = False  # a token every expert dropped
    probs = torch.rand(n, e) * routing_map
    d = PermuteDispatcher()
    expert_x, tokens_per_expert = d.dispatch(x, probs, routing_map)
    assert tokens_per_expert == routing_map.sum(0).tolist() and expert_x.shape == (sum(tokens_per_expert), c)
    # Expert-major, token order within an expert.
    rows = [t for ex in range(e) for t in range(n) if routing_map[t, ex]]
    torch.testing.assert_close(expert_x, x[rows])
    # Identity experts: combine gives Σ prob · x over each token's experts.
    torch.testing.assert_close(d.combine(expert_x), x * probs.sum(-1, keepdim=True))


def naive_moe(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """The layer written per token: each token through each of its experts, weighted by its prob."""
    flat = x.reshape(-1, x.shape[-1])
    probs, routing_map = layer.router(flat)
    ex = layer.experts
    out = []
    for t in range(flat.shape[0]):
        y = torch.zeros_like(flat[t])
        for e in routing_map[t].nonzero().flatten().tolist():
            h = F.linear(flat[t], ex.fc1_weight[e], None if ex.fc1_bias is None else ex.fc1_bias[e])
            if ex.activation == "swiglu":
                gate, up = h.chunk(2)
                h = F.silu(gate) * up
            else:
                h = F.gelu(h, approximate="tanh")
            h = F.linear(h, ex.fc2_weight[e], None if ex.fc2_bias is None else ex.fc2_bias[e])
            y = y + probs[t, e] * h
        out.append(y)
    y = torch.stack(out).view_as(x)
    if layer.shared_expert is None:
        return y
    gate = torch.sigmoid(layer.shared_expert_gate(x)) if layer.shared_expert_gate is not None else 1.0
    return y + gate * layer.shared_expert(x)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"activation": "gelu", "add_bias": True},
        {"router_score_function": "sigmoid", "shared_expert_ffn_hidden_size": 16},
        {"capacity_factor": 1.0, "router_topk": 1},
        {"router_pre_softmax": True, "shared_expert_ffn_hidden_size": 16, "shared_expert_gate": True},
    ],
    ids=["swiglu", "gelu-bias", "sigmoid-shared", "capacity", "pre-softmax-gated-shared"],
)
def test_layer_matches_per_token_loop(kw: dict) -> None:
    torch.manual_seed(0)
    layer = MoELayer(config(**kw))
    x = torch.randn(2, 5, 32, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape
    upstream = torch.randn_like(y)  # non-uniform: a plain sum hides errors that cancel
    params = list(layer.parameters())
    grads = torch.autograd.grad((y * upstream).sum(), [x, *params])
    x_ref = x.detach().clone().requires_grad_()
    y_ref = naive_moe(layer, x_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    ref_grads = torch.autograd.grad((y_ref * upstream).sum(), [x_ref, *params])
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_moe_on_every_kth_layer_and_init() -> None:
    torch.manual_seed(0)
    cfg = config(num_layers=4, layer_freq=2, shared_expert_ffn_hidden_size=16)
    model = GPTModel(cfg)
    kinds = [type(block.mlp).__name__ for block in model.layers]
    assert kinds == ["MoELayer", "MLP", "MoELayer", "MLP"]
    experts = model.layers[0].mlp.experts
    assert experts.fc1_weight.shape == (4, 48, 32) and experts.fc2_weight.shape == (4, 32, 24)
    out_std = cfg.init_method_std / math.sqrt(2 * cfg.num_layers)
    assert abs(experts.fc2_weight.std().item() - out_std) < 0.2 * out_std
    assert abs(experts.fc1_weight.std().item() - cfg.init_method_std) < 0.1 * cfg.init_method_std
    shared = model.layers[0].mlp.shared_expert.fc2.weight
    assert abs(shared.std().item() - out_std) < 0.3 * out_std


def test_tiny_moe_model_learns() -> None:
    torch.manual_seed(0)
    model = GPTModel(config(aux_loss_coeff=1e-2, z_loss_coeff=1e-3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 128, (4, 16))
    set_aux_loss_scale(model, 1.0)
    losses = []
    for _ in range(25):
        opt.zero_grad()
        loss = model.loss(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert all(p.grad is not None for p in model.parameters())


def test_bf16_model_routes_in_fp32_and_tracks_fp32() -> None:
    torch.manual_seed(0)
    model = GPTModel(config(aux_loss_coeff=1e-2))
    tokens = torch.randint(0, 128, (2, 16))
    ref = model.loss(tokens, tokens)
    low = GPTModel(config(aux_loss_coeff=1e-2))
    low.load_state_dict(model.state_dict())
    low.to(torch.bfloat16)
    loss = low.loss(tokens, tokens)
    loss.backward()
    assert abs(loss.item() - ref.item()) < 0.05 * ref.item()
    router = low.layers[0].mlp.router
    probs, _ = router(torch.randn(5, 32, dtype=torch.bfloat16))
    assert probs.dtype == torch.float32 and router.gate.weight.grad.dtype == torch.bfloat16
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in low.parameters())
