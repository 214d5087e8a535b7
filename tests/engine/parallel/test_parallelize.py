"""Tensor and sequence parallelism against a single-process reference (gloo ranks on CPU).

Tolerances: a tp run reorders fp32 reductions (RowParallel sums partial products over ranks, the
vocab-parallel CE sums exp over shards), so values differ from the reference by a few ulps per op.
Over 10 AdamW steps on these tiny models that stays near 1e-6 (measured: losses <= 1e-6, parameters
<= 2e-6); we assert rtol 1e-4 / atol 1e-5, far below what a wrong shard, a missing all-reduce or a
mismatched dropout mask produces (>= 1e-3). AdamW runs with eps 1e-6, not 1e-8: GPT-2's key bias has
an exactly-zero true gradient (softmax ignores a per-query constant), so its computed gradient is
rounding noise that eps 1e-8 would normalise into layout-dependent steps of 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from megatrain.engine.config import TransformerConfig
from megatrain.engine.models.gpt import GPTModel, lm_loss
from megatrain.engine.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatrain.engine.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatrain.engine.parallel.mappings import allreduce_sequence_parallel_grads
from megatrain.engine.parallel.parallelize import (
    full_state_dict,
    load_full_state_dict,
    parallel_lm_loss,
    parallelize_model,
)
from megatrain.engine.parallel.random import RNGStatesTracker
from megatrain.engine.parallel.state import ParallelState
from megatrain.plan.layout import LayoutError

from ._launch import run_distributed
from ._tp_common import ATOL, RTOL, SEED, batches, build, fake_state, make_config, tp_state, train

# --------------------------------------------------------------------------------------------------
# Training runs: tp (+sp) equals the single-process reference, step by step.


def model_state_for_save(model: GPTModel) -> dict[str, torch.Tensor]:
    """The single-device state dict as full_state_dict gives it: a tied head stored once."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _train_rank(rank: int, world: int, cfg: TransformerConfig, sp: bool) -> dict:
    state = tp_state(world, sp)
    losses, model = train(cfg, state)
    full = full_state_dict(model, state)
    # Round trip: loading the canonical dict back gives this rank the same shards.
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    load_full_state_dict(model, full, state)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    return {"losses": losses, "state": full if rank == 0 else None}


CASES = {
    # GPT-2: tied embeddings, biases, learned positions; hidden dropout on (identical masks across tp
    # ranks without sp, so it still equals the reference; attention dropout would not).
    "gpt2-tp2": ("gpt2", 2, False, {"hidden_dropout": 0.1}),
    "gpt2-tp2-sp": ("gpt2", 2, True, {}),
    "gpt2-tp4-sp": ("gpt2", 4, True, {}),
    # Llama: GQA 8 heads / 4 groups, SwiGLU, RoPE, untied (and tied once).
    "llama-gqa-tp2": ("llama", 2, False, {}),
    "llama-gqa-tp2-sp": ("llama", 2, True, {}),
    "llama-gqa-tp4-tied": ("llama", 4, False, {"tie_embeddings": True}),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_tensor_parallel_training_matches_single_process(case: str) -> None:
    flavour, tp, sp, overrides = CASES[case]
    cfg = make_config(flavour, **overrides)
    results = run_distributed(_train_rank, tp, cfg, sp)
    ref_losses, ref_model = train(cfg, ParallelState.single())
    ref_state = model_state_for_save(ref_model)
    for r, res in enumerate(results):
        torch.testing.assert_close(
            torch.tensor(res["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL, msg=f"rank {r}"
        )
    assert ref_losses[-1] < ref_losses[0]  # it trained
    full = results[0]["state"]
    assert list(full) == list(ref_state)  # same names, same order as a single-device checkpoint
    for name, ref in ref_state.items():
        torch.testing.assert_close(full[name], ref, rtol=RTOL, atol=ATOL, msg=name)


def test_parallelize_slices_the_canonical_layout() -> None:
    """What rank 1 of tp=2 holds, checked against the full model (no process group needed)."""
    cfg = make_config("llama", tie_embeddings=True)
    torch.manual_seed(SEED)
    full = GPTModel(cfg).state_dict()
    torch.manual_seed(SEED)
    model = GPTModel(cfg)
    before = torch.get_rng_state()
    state = fake_state(2, 1, sp=True)
    parallelize_model(model, state, rng_tracker=RNGStatesTracker.for_tensor_parallel(SEED, state))
    # Slicing draws nothing: the default stream (dropout masks later) stays the reference's.
    assert torch.equal(torch.get_rng_state(), before)
    sd = model.state_dict()
    f = cfg.ffn_hidden_size
    gate, up = full["layers.0.mlp.fc1.weight"][:f], full["layers.0.mlp.fc1.weight"][f:]
    assert torch.equal(sd["layers.0.mlp.fc1.weight"], torch.cat([gate[f // 2 :], up[f // 2 :]]))
    # qkv: rows of whole groups 2 and 3 (group-by-group layout), heads 4..7.
    qkv = full["layers.0.attn.qkv.weight"]
    assert torch.equal(sd["layers.0.attn.qkv.weight"], qkv[qkv.shape[0] // 2 :])
    assert (model.layers[0].attn.num_heads, model.layers[0].attn.num_groups) == (4, 2)
    assert torch.equal(sd["layers.0.attn.proj.weight"], full["layers.0.attn.proj.weight"][:, 32:])
    assert torch.equal(sd["embed.weight"], full["embed.weight"][64:])
    assert model.lm_head.weight is model.embed.weight  # tied: one shard
    assert isinstance(model.lm_head, ColumnParallelLinear) and not model.lm_head.gather_output
    assert isinstance(model.embed, VocabParallelEmbedding)
    assert isinstance(model.layers[0].mlp.fc2, RowParallelLinear)
    flagged = {n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
    assert flagged == {"final_norm.weight"} | {
        f"layers.{i}.{m}.weight" for i in range(2) for m in ("attn_norm", "mlp_norm")
    }
    sharded = {
        n: p.partition_dim for n, p in model.named_parameters() if getattr(p, "tensor_parallel", False)
    }
    assert sharded["layers.1.attn.proj.weight"] == 1 and sharded["layers.1.attn.qkv.weight"] == 0
    assert model.layers[0].mlp.fc1.weight.partition_stride == 2
    # Loading the canonical dict gives rank 1 exactly these shards.
    load_full_state_dict(model, model_state_for_save(GPTModel(cfg)), fake_state(2, 1))
    with pytest.raises(ValueError, match="missing"):
        load_full_state_dict(model, {}, fake_state(2, 1))


def test_parallelize_checks_layout_and_dropout() -> None:
    with pytest.raises(LayoutError, match="num_query_groups=4 is not divisible by parallelism.tp=8"):
        parallelize_model(GPTModel(make_config("llama")), fake_state(8, 0))
    with pytest.raises(ValueError, match="rng_tracker"):
        parallelize_model(GPTModel(make_config("gpt2", attention_dropout=0.1)), fake_state(2, 0))


def test_single_process_is_unchanged() -> None:
    cfg = make_config("gpt2")
    torch.manual_seed(SEED)
    ref = GPTModel(cfg)
    model, _ = build(cfg, ParallelState.single())
    x, y = batches(cfg, 1)[0]
    torch.testing.assert_close(parallel_lm_loss(model(x), y, ParallelState.single()), lm_loss(ref(x), y))
    torch.testing.assert_close(
        vocab_parallel_cross_entropy(ref(x), y, ParallelState.single()), lm_loss(ref(x), y)
    )
    state = full_state_dict(model, ParallelState.single())
    assert list(state) == list(model_state_for_save(ref))
    assert "lm_head.weight" not in state  # tied, stored once as embed.weight
    for n, t in model_state_for_save(ref).items():
        assert torch.equal(state[n], t)
    allreduce_sequence_parallel_grads(model, ParallelState.single())  # a no-op at tp=1
