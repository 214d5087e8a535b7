"""Dropout masks across tensor-parallel ranks, the RNG tracker, and recompute replaying its streams."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import noop_context_fn

from megatrain.engine.config import TransformerConfig
from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.parallel.mappings import allreduce_sequence_parallel_grads
from megatrain.engine.parallel.parallelize import parallel_lm_loss
from megatrain.engine.parallel.random import (
    MODEL_PARALLEL,
    RNGStatesTracker,
    TrackedDropout,
    checkpoint,
    manual_seed,
)
from megatrain.engine.parallel.state import ParallelState

from ._launch import run_distributed
from ._tp_common import batches, build, make_config, tp_state


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
