"""Initial weights as a function of (seed, name, index) (models.init) and the meta-device build.

Any box of a parameter drawn alone equals that box of the whole draw, across block boundaries and
for vectors, matrices and stacked experts; one process's GPTModel and build_model's materialised
shards are the same weights, and leave torch's generator in the same state.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from megatrain.engine.build import build_model
from megatrain.engine.config import MoEConfig, TransformerConfig
from megatrain.engine.models import init
from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.parallel.state import ParallelState

CFG = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=64, seq_length=16, vocab_size=128)  # fmt: skip


def _draw(
    shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...], name: str = "w"
) -> torch.Tensor:
    out = torch.empty(sizes)
    init.fill_box(out, seed=5, name=name, shape=shape, offsets=offsets, rule=("normal", 0.02))
    return out


@pytest.mark.parametrize("shape", [(1000,), (37, 29), (3, 11, 13)])
def test_any_box_is_the_same_box_of_the_whole_draw(
    shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(init, "BLOCK_ELEMENTS", 64)  # many blocks: boxes cross their boundaries
    whole = _draw(shape, (0,) * len(shape), shape)
    assert 0.015 < float(whole.std()) < 0.025
    rng = random.Random(0)
    for _ in range(20):
        offsets = tuple(rng.randrange(n) for n in shape)
        sizes = tuple(rng.randrange(n - o) + 1 for n, o in zip(shape, offsets, strict=True))
        box = _draw(shape, offsets, sizes)
        index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
        assert torch.equal(box, whole[index]), (offsets, sizes)


def test_names_and_seeds_give_independent_draws() -> None:
    a = _draw((8, 8), (0, 0), (8, 8), "a")
    assert torch.equal(a, _draw((8, 8), (0, 0), (8, 8), "a"))
    assert not torch.equal(a, _draw((8, 8), (0, 0), (8, 8), "b"))
    assert init.init_rule("layers.0.attn_norm.weight", CFG) == ("ones", 0.0)
    assert init.init_rule("layers.0.mlp.experts.fc1_bias", CFG) == ("zeros", 0.0)
    assert init.init_rule("layers.1.mlp.fc2.weight", CFG)[1] == pytest.approx(0.02 / 2)  # std/sqrt(2·2)


@pytest.mark.parametrize("moe", [False, True])
def test_the_meta_build_materialises_one_process_weights(moe: bool) -> None:
    cfg = CFG
    if moe:
        cfg = dataclasses.replace(CFG, moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=16))
    torch.manual_seed(11)
    whole = GPTModel(cfg)
    after_whole = torch.get_rng_state()
    rank = build_model(cfg, ParallelState.single(), 11, "cpu", dtype=torch.bfloat16)
    assert torch.equal(torch.get_rng_state(), after_whole)  # dropout masks and data order follow alike
    mine = rank.module.state_dict()
    for name, t in whole.state_dict().items():
        assert mine[name].dtype == torch.bfloat16
        assert torch.equal(mine[name], t.to(torch.bfloat16)), name
    assert not any(t.is_meta for t in [*rank.module.parameters(), *rank.module.buffers()])
    assert rank.num_params == whole.num_parameters()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_rank_starts_from_the_weights_a_cpu_rank_draws() -> None:
    """Drawn on the CPU and copied: a GPU run starts from the very weights the CPU tests check."""
    on_cpu = build_model(CFG, ParallelState.single(), 3, "cpu", dtype=torch.bfloat16).module.state_dict()
    gpu = ParallelState.single("cuda")
    on_gpu = build_model(CFG, gpu, 3, "cuda", dtype=torch.bfloat16).module.state_dict()
    for name, t in on_cpu.items():
        assert on_gpu[name].is_cuda and torch.equal(on_gpu[name].cpu(), t), name
