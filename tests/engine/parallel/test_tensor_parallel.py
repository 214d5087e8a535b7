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

import contextlib
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import noop_context_fn

from megatrain.engine.checkpoint import model_state_for_save
from megatrain.engine.config import TransformerConfig
from megatrain.engine.models.gpt import GPTModel, lm_loss
from megatrain.engine.parallel.dims import LayoutError, ParallelDims
from megatrain.engine.parallel.parallelize import (
    full_state_dict,
    load_full_state_dict,
    parallel_lm_loss,
    parallelize_model,
)
from megatrain.engine.parallel.random import (
    MODEL_PARALLEL,
    RNGStatesTracker,
    TrackedDropout,
    checkpoint,
    manual_seed,
)
from megatrain.engine.parallel.state import ParallelState
from megatrain.engine.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    mark_sequence_parallel,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
    scatter_to_tp,
    shard_tensor,
    unshard_tensor,
    vocab_parallel_cross_entropy,
)

from ._launch import run_distributed

SEED = 1234
STEPS = 10
RTOL, ATOL = 1e-4, 1e-5  # see the module docstring


def make_config(flavour: str, **overrides: object) -> TransformerConfig:
    if flavour == "gpt2":
        cfg = TransformerConfig(
            num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=64,
            seq_length=16, vocab_size=128, position_embedding="learned", normalization="layernorm",
            activation="gelu", add_bias=True, tie_embeddings=True,
        )  # fmt: skip
    else:
        cfg = TransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64,
            seq_length=16, vocab_size=128,
        )  # fmt: skip
    return replace(cfg, **overrides)


def batches(cfg: TransformerConfig, steps: int, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Own generator: data never consumes the default stream that init and dropout use. Sequences follow
    # a fixed successor rule (next = 5·tok + 3 mod V) so that 10 steps visibly lower the loss.
    gen = torch.Generator().manual_seed(99)
    out = []
    for _ in range(steps):
        tok = torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen)
        seq = [tok]
        for _ in range(cfg.seq_length):
            seq.append((5 * seq[-1] + 3) % cfg.vocab_size)
        seq = torch.cat(seq, dim=1)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def build(
    cfg: TransformerConfig, state: ParallelState, recompute: tuple[str, int] = ("none", 1)
) -> tuple[GPTModel, RNGStatesTracker | None]:
    torch.manual_seed(SEED)
    model = GPTModel(cfg)  # the full model, identical on every rank, then sliced
    tracker = RNGStatesTracker.for_tensor_parallel(SEED, state) if state.tp_size > 1 else None
    model = parallelize_model(model, state, rng_tracker=tracker)
    model.set_recompute(*recompute)
    return model, tracker


def train(cfg: TransformerConfig, state: ParallelState, steps: int = STEPS) -> tuple[list[float], GPTModel]:
    model, _ = build(cfg, state)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.1)
    losses = []
    for x, y in batches(cfg, steps):
        loss = parallel_lm_loss(model(x), y, state)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        allreduce_sequence_parallel_grads(model, state)
        opt.step()
        losses.append(loss.item())
    return losses, model


def tp_state(tp: int, sp: bool = False) -> ParallelState:
    return ParallelState.build(ParallelDims(tp=tp, sequence_parallel=sp))


# --------------------------------------------------------------------------------------------------
# Training runs: tp (+sp) equals the single-process reference, step by step.


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


# --------------------------------------------------------------------------------------------------
# Collectives and the vocab-parallel cross-entropy.


def _collectives_rank(rank: int, world: int) -> None:
    state = tp_state(world)
    g, n = state.tp_group, state.tp_size
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(2, 4 * n, 3 * n, generator=gen)  # (B, T, C), the same on every rank
    up = torch.randn(full.shape, generator=gen)  # an upstream gradient, the same on every rank
    k = rank + 1  # rank-dependent scale, to see sums
    total = sum(range(1, n + 1))

    def run(fn, x, grad):  # noqa: ANN001, ANN202
        x = x.clone().requires_grad_()
        y = fn(x, g, n)
        y.backward(grad)
        return y.detach(), x.grad

    y, dx = run(copy_to_tp, full, k * up)
    assert torch.equal(y, full)
    torch.testing.assert_close(dx, total * up)
    y, dx = run(reduce_from_tp, k * full, up)
    torch.testing.assert_close(y, total * full)
    assert torch.equal(dx, up)
    y, dx = run(scatter_to_tp, full, up.chunk(n, -1)[rank])
    assert torch.equal(y, full.chunk(n, -1)[rank])
    assert torch.equal(dx, up)
    y, dx = run(gather_from_tp, full.chunk(n, -1)[rank], up)
    assert torch.equal(y, full)
    assert torch.equal(dx, up.chunk(n, -1)[rank])
    y, dx = run(scatter_to_sequence, full, up.chunk(n, 1)[rank])
    assert torch.equal(y, full.chunk(n, 1)[rank])
    assert torch.equal(dx, up)
    y, dx = run(gather_from_sequence, full.chunk(n, 1)[rank], k * up)
    assert torch.equal(y, full)
    torch.testing.assert_close(dx, total * up.chunk(n, 1)[rank])
    y, dx = run(reduce_scatter_to_sequence, k * full, up.chunk(n, 1)[rank])
    torch.testing.assert_close(y, total * full.chunk(n, 1)[rank])
    assert torch.equal(dx, up)
    # A sequence not divisible by tp is refused, not silently truncated.
    with pytest.raises(ValueError, match="not divisible"):
        reduce_scatter_to_sequence(full[:, :-1], g, n)

    # Standalone layers in their other modes: a gathered column output feeding a row layer that
    # scatters its own input equals the two full Linears, value and input gradient.
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(3 * n, 4 * n), torch.nn.Linear(4 * n, 2 * n)
    col = ColumnParallelLinear.from_linear(lin1, state, gather_output=True)
    row = RowParallelLinear.from_linear(lin2, state, input_is_parallel=False)
    x1, x2 = full.clone().requires_grad_(), full.clone().requires_grad_()
    y = row(col(x1))
    y.backward(up[..., : 2 * n])
    ref_y = lin2(lin1(x2))
    ref_y.backward(up[..., : 2 * n])
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(col.weight.grad, lin1.weight.grad.chunk(n, 0)[rank], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(row.weight.grad, lin2.weight.grad.chunk(n, 1)[rank], rtol=1e-5, atol=1e-6)

    # Sequence-parallel grads: flagged params summed over tp, main_grad preferred, the rest untouched.
    mod = torch.nn.Linear(3, 2)
    mark_sequence_parallel(mod.weight)
    mod.weight.grad = torch.full((2, 3), float(k))
    mod.weight.main_grad = torch.full((2, 3), 10.0 * k)
    mod.bias.grad = torch.full((2,), float(k))
    allreduce_sequence_parallel_grads(mod, state)
    assert torch.equal(mod.weight.main_grad, torch.full((2, 3), 10.0 * total))
    assert torch.equal(mod.weight.grad, torch.full((2, 3), float(k)))
    assert torch.equal(mod.bias.grad, torch.full((2,), float(k)))

    # Vocab-parallel CE vs F.cross_entropy on the full logits: value and gradient. Large logits test
    # the max subtraction; ignored labels test the mean over valid tokens.
    logits = 30 * torch.randn(3, 5, 8 * n, generator=gen)
    labels = torch.randint(0, 8 * n, (3, 5), generator=gen)
    labels[0, :2] = -100
    ref_in = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_in.reshape(-1, 8 * n), labels.reshape(-1))
    ref.backward()
    shard = logits.chunk(n, -1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, labels, state)
    loss.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(shard.grad, ref_in.grad.chunk(n, -1)[rank], rtol=1e-6, atol=1e-7)
    # bf16 logits: computed in fp32, gradient handed back in bf16.
    shard16 = logits.chunk(n, -1)[rank].bfloat16().requires_grad_()
    loss16 = vocab_parallel_cross_entropy(shard16, labels, state)
    loss16.backward()
    assert loss16.dtype == torch.float32 and shard16.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss16, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_collectives_and_vocab_parallel_cross_entropy(world: int) -> None:
    run_distributed(_collectives_rank, world)


# --------------------------------------------------------------------------------------------------
# Dropout masks across tp ranks, and recompute replaying them.


def _masks_rank(rank: int, world: int, sp: bool) -> dict:
    state = tp_state(world, sp)
    cfg = make_config("gpt2", hidden_dropout=0.5, attention_dropout=0.5)
    model, tracker = build(cfg, state)
    hidden_masks: list[torch.Tensor] = []
    attn_states: list[torch.Tensor] = []

    def record_mask(module, inputs, output):  # noqa: ANN001, ANN202
        hidden_masks.append((output == 0) & (inputs[0] != 0))

    for block in model.layers:
        block.dropout.register_forward_hook(record_mask)
        inner = block.attn.core_rng_context

        @contextlib.contextmanager
        def core_context(inner=inner):  # noqa: ANN001, ANN202 — record the stream attention draws from
            with inner():
                attn_states.append(torch.get_rng_state())
                yield

        block.attn.core_rng_context = core_context
    x, _ = batches(cfg, 1)[0]
    model(x)
    return {"hidden": hidden_masks, "attn": attn_states, "default": torch.get_rng_state()}


@pytest.mark.distributed
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_dropout_masks_across_tp_ranks(sp: bool) -> None:
    r0, r1 = run_distributed(_masks_rank, 2, sp)
    assert len(r0["hidden"]) == 4 and len(r0["attn"]) == 2  # 2 blocks × (attn, mlp) dropouts
    # Attention dropout (each rank holds different heads) draws from the per-rank stream: different.
    for a, b in zip(r0["attn"], r1["attn"], strict=True):
        assert not torch.equal(a, b)
    for a, b in zip(r0["hidden"], r1["hidden"], strict=True):
        assert 0.3 < a.float().mean() < 0.7
        if sp:
            # Sequence shards are different tokens: independent masks from the per-rank stream.
            assert a.shape[1] == 8 and not torch.equal(a, b)
        else:
            # The whole hidden state on every rank: one mask, from the shared default stream.
            assert a.shape[1] == 16 and torch.equal(a, b)
    # The default stream advanced identically on both ranks: forks never touch it.
    assert torch.equal(r0["default"], r1["default"])


def _recompute_grads(
    cfg: TransformerConfig, state: ParallelState, recompute: tuple[str, int], *, replay: bool
):
    model, _ = build(cfg, state, recompute)
    if not replay:  # negative control: recompute without restoring the tracker's streams
        model.recompute_context_fn = noop_context_fn
        for block in model.layers:
            block.attn.recompute_context_fn = noop_context_fn
    for x, y in batches(cfg, 2):  # two steps: the streams carry over between steps
        model.zero_grad(set_to_none=True)
        parallel_lm_loss(model(x), y, state).backward()
        allreduce_sequence_parallel_grads(model, state)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _recompute_rank(rank: int, world: int) -> None:
    for flavour in ("gpt2", "llama"):
        cfg = make_config(flavour, hidden_dropout=0.2, attention_dropout=0.2)
        for sp in (False, True):
            state = tp_state(world, sp)
            ref = _recompute_grads(cfg, state, ("none", 1), replay=True)
            for mode in [("full", 1), ("full", 2), ("selective", 1)]:
                got = _recompute_grads(cfg, state, mode, replay=True)
                for n, g in ref.items():
                    torch.testing.assert_close(
                        got[n], g, rtol=1e-5, atol=1e-7, msg=f"{flavour} sp={sp} {mode} {n}"
                    )
            # Without replaying the tracker the recomputed attention masks differ: the test can fail.
            bad = _recompute_grads(cfg, state, ("full", 1), replay=False)
            assert max((bad[n] - g).abs().max().item() for n, g in ref.items()) > 1e-4


@pytest.mark.distributed
def test_recompute_under_tp_replays_dropout_masks() -> None:
    run_distributed(_recompute_rank, 2)


# --------------------------------------------------------------------------------------------------
# Single process.


@pytest.mark.parametrize("mode", [("full", 1), ("full", 2), ("selective", 1)])
def test_recompute_with_dropout_gives_same_gradients(mode: tuple[str, int]) -> None:
    cfg = make_config("llama", num_layers=3, hidden_dropout=0.2, attention_dropout=0.2)
    state = ParallelState.single()
    ref = _recompute_grads(cfg, state, ("none", 1), replay=True)
    got = _recompute_grads(cfg, state, mode, replay=True)
    for n, g in ref.items():
        torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-7, msg=n)


def test_set_recompute_every() -> None:
    model = GPTModel(make_config("llama", num_layers=5))
    model.set_recompute("full", every=2)
    assert [b.recompute for b in model.layers] == [True, False, True, False, True]
    assert not any(b.attn.recompute_core for b in model.layers)
    model.set_recompute("selective")
    assert [b.recompute for b in model.layers] == [False] * 5
    assert all(b.attn.recompute_core for b in model.layers)
    with pytest.raises(ValueError, match="every"):
        model.set_recompute("full", every=0)
    with pytest.raises(ValueError, match="mode"):
        model.set_recompute("some")


def test_tracker_fork_leaves_default_stream_alone() -> None:
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    tracker = manual_seed(0, ParallelState.single())
    with tracker.fork():
        a = torch.rand(4)
    assert torch.equal(torch.rand(4), expected)  # the fork did not advance the default stream
    with tracker.fork(MODEL_PARALLEL):
        b = torch.rand(4)
    # The stream of tp rank 0 is seeded seed + 2718.
    assert torch.equal(a, torch.rand(4, generator=torch.Generator().manual_seed(2718)))
    assert not torch.equal(a, b)  # the stream advanced
    saved = tracker.state_dict()
    with tracker.fork():
        c = torch.rand(4)
    tracker.load_state_dict(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(4), c)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add(MODEL_PARALLEL, 5)
    with pytest.raises(ValueError, match="already used"):
        tracker.add("other", 2718)
    with pytest.raises(KeyError), tracker.fork("missing"):
        pass


def test_tracker_checkpoint_replays_streams() -> None:
    torch.manual_seed(0)
    tracker = RNGStatesTracker()
    tracker.add(MODEL_PARALLEL, 7)
    drop = TrackedDropout(0.5, tracker)
    x = torch.ones(64, requires_grad=True)
    masks = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        y = drop(t)
        masks.append(y.detach() == 0)
        return y * t

    checkpoint(fn, x, tracker=tracker).sum().backward()
    assert len(masks) == 2 and torch.equal(masks[0], masks[1])  # recompute drew the same mask
    # ... and the gradient is the no-recompute one: 2·mask·scale.
    torch.testing.assert_close(x.grad, 2 * 2.0 * (~masks[0]).float())
    # The stream after backward continues from where the first pass left it, not the replay.
    with tracker.fork():
        after = torch.rand(4)
    ref = RNGStatesTracker()
    ref.add(MODEL_PARALLEL, 7)
    with ref.fork():
        F.dropout(torch.ones(64), 0.5, training=True)  # the one draw of the first pass
        assert torch.equal(torch.rand(4), after)
    drop.eval()
    assert drop(x) is x


def test_shard_and_unshard_with_stride() -> None:
    full = torch.arange(24.0).reshape(8, 3)
    for size, stride in [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)]:
        shards = [shard_tensor(full, 0, r, size, stride) for r in range(size)]
        assert torch.equal(unshard_tensor(shards, 0, stride), full)
    gate, up = full[:4], full[4:]
    assert torch.equal(shard_tensor(full, 0, 1, 2, stride=2), torch.cat([gate[2:], up[2:]]))
    with pytest.raises(ValueError):
        shard_tensor(full, 0, 0, 3)


def _fake_state(tp: int, rank: int, sp: bool = False) -> ParallelState:
    """A tp layout's state for one rank without process groups: only for code that slices, never
    for a collective."""
    groups = {d: None for d in ("tp", "cp", "dp", "pp", "mp")}
    return ParallelState(ParallelDims(tp=tp, sequence_parallel=sp), rank, torch.device("cpu"), groups)


def test_parallelize_slices_the_canonical_layout() -> None:
    """What rank 1 of tp=2 holds, checked against the full model (no process group needed)."""
    cfg = make_config("llama", tie_embeddings=True)
    torch.manual_seed(SEED)
    full = GPTModel(cfg).state_dict()
    torch.manual_seed(SEED)
    model = GPTModel(cfg)
    before = torch.get_rng_state()
    state = _fake_state(2, 1, sp=True)
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
    load_full_state_dict(model, model_state_for_save(GPTModel(cfg)), _fake_state(2, 1))
    with pytest.raises(ValueError, match="missing"):
        load_full_state_dict(model, {}, _fake_state(2, 1))


def test_parallelize_checks_layout_and_dropout() -> None:
    with pytest.raises(LayoutError, match="num_query_groups=4 is not divisible by tp=8"):
        parallelize_model(GPTModel(make_config("llama")), _fake_state(8, 0))
    with pytest.raises(ValueError, match="rng_tracker"):
        parallelize_model(GPTModel(make_config("gpt2", attention_dropout=0.1)), _fake_state(2, 0))


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


def test_collectives_are_identity_at_size_one() -> None:
    x = torch.randn(2, 4, 6)
    for fn in (copy_to_tp, reduce_from_tp, scatter_to_tp, gather_from_tp, scatter_to_sequence,
               gather_from_sequence, reduce_scatter_to_sequence):  # fmt: skip
        assert fn(x, None, 1) is x
    with pytest.raises(ValueError, match="needs a process group"):
        copy_to_tp(x, None, 2)
    assert dist.is_available()
