from __future__ import annotations

import math

import pytest
import torch

from megatrain.engine.config import TransformerConfig
from megatrain.engine.models.gpt import GPTModel, lm_loss


def make_config(**kw) -> TransformerConfig:
    flavour = "tiny-gpt2" if kw.pop("gpt2", False) else "tiny-llama"
    return TransformerConfig.preset(flavour, **{"ffn_hidden_size": 48, **kw})


GPT2 = {"gpt2": True}
LLAMA: dict = {}


@pytest.mark.parametrize("flavour", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_shapes_and_loss(flavour: dict) -> None:
    torch.manual_seed(0)
    model = GPTModel(make_config(**flavour))
    tokens = torch.randint(0, 128, (3, 16))
    logits = model(tokens)
    assert logits.shape == (3, 16, 128)
    loss = lm_loss(logits, torch.randint(0, 128, (3, 16)))
    # At init the logits are small, so the loss on unrelated labels is close to ln(vocab).
    assert abs(loss.item() - math.log(128)) < 0.2
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("flavour", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_causal_mask(flavour: dict) -> None:
    torch.manual_seed(0)
    model = GPTModel(make_config(**flavour)).eval()
    tokens = torch.randint(0, 128, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = torch.randint(0, 128, (2, 6))
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert (a[:, 10:] - b[:, 10:]).abs().max() > 1e-3  # the future part does change


def test_tied_embeddings_and_param_names() -> None:
    model = GPTModel(make_config(**GPT2))
    assert model.lm_head.weight is model.embed.weight
    names = dict(model.named_parameters())
    assert "lm_head.weight" not in names  # counted once
    expected = {"pos_embed.weight", "layers.0.attn.qkv.weight", "layers.0.attn.proj.bias",
                "layers.1.mlp.fc1.weight", "layers.1.mlp.fc2.weight", "final_norm.bias"}  # fmt: skip
    assert expected <= set(names)
    llama = GPTModel(make_config())
    assert llama.lm_head.weight is not llama.embed.weight
    assert not any(n.endswith(".bias") for n, _ in llama.named_parameters())
    # Fused QKV: H query heads + 2·G key/value heads; fused gate+up.
    assert llama.layers[0].attn.qkv.weight.shape == ((4 + 2 * 2) * 8, 32)
    assert llama.layers[0].mlp.fc1.weight.shape == (2 * 48, 32)


def test_init_scales_output_projections() -> None:
    torch.manual_seed(0)
    cfg = make_config(num_layers=8, hidden_size=256, num_attention_heads=8, num_query_groups=8,
                      ffn_hidden_size=1024, init_method_std=0.02)  # fmt: skip
    model = GPTModel(cfg)
    layer = model.layers[0]
    assert abs(layer.attn.qkv.weight.std().item() - 0.02) < 0.001
    scaled = 0.02 / math.sqrt(2 * 8)
    assert abs(layer.attn.proj.weight.std().item() - scaled) < 0.0005
    assert abs(layer.mlp.fc2.weight.std().item() - scaled) < 0.0005
    assert torch.all(layer.attn_norm.weight == 1)


def test_gqa_equals_mha_with_replicated_kv() -> None:
    """A GQA model equals the MHA model whose key/value heads repeat each group's head."""
    torch.manual_seed(0)
    gqa = GPTModel(make_config(num_query_groups=2)).eval()
    mha = GPTModel(make_config(num_query_groups=4)).eval()
    state = gqa.state_dict()
    hd, heads, groups = 8, 4, 2
    for i in range(2):
        w = state[f"layers.{i}.attn.qkv.weight"].view(groups, heads // groups + 2, hd, 32)
        q, k, v = w[:, : heads // groups], w[:, heads // groups], w[:, heads // groups + 1]
        # MHA layout: per head (= group of one) [q_h, k_h, v_h]; head h uses group h // 2's K/V.
        rows = []
        for h in range(heads):
            g = h // (heads // groups)
            rows += [q[g, h % (heads // groups)], k[g], v[g]]
        state[f"layers.{i}.attn.qkv.weight"] = torch.cat(rows)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 128, (2, 16))
    torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_gives_same_gradients(mode: str) -> None:
    torch.manual_seed(0)
    model = GPTModel(make_config())
    tokens = torch.randint(0, 128, (2, 16))
    lm_loss(model(tokens), tokens).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_recompute(mode)
    lm_loss(model(tokens), tokens).backward()
    for r, p in zip(ref, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r, rtol=1e-5, atol=1e-7)


def test_geglu_mlp_fuses_gate_and_up_and_plans_like_swiglu() -> None:
    from megatrain.plan.flops import layer_forward_flops
    from megatrain.plan.memory import estimate_memory

    torch.manual_seed(0)
    cfg = make_config(activation="geglu")
    mlp = GPTModel(cfg).layers[0].mlp
    assert mlp.fc1.weight.shape == (2 * 48, cfg.hidden_size)  # [gate; up]
    x = torch.randn(2, 5, cfg.hidden_size)
    gate, up = mlp.fc1(x).chunk(2, dim=-1)
    want = mlp.fc2(torch.nn.functional.gelu(gate, approximate="tanh") * up)
    torch.testing.assert_close(mlp(x), want)
    # The planner counts it as SwiGLU: three GEMMs and the same saved activations; GELU differs.
    swiglu, gelu = make_config(activation="swiglu"), make_config(activation="gelu")
    assert layer_forward_flops(cfg) == layer_forward_flops(swiglu) != layer_forward_flops(gelu)
    assert estimate_memory(cfg) == estimate_memory(swiglu) != estimate_memory(gelu)
