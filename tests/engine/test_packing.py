"""Sequence packing: the placement, the packed arrays, and the model on them: a packed batch gives the
same loss and gradients as its documents run one by one (tiny GPT-2 and Llama, the fused and unfused
loss, tensor (+ sequence) and pipeline parallelism on gloo against one process).

Tolerances: packing changes only which fp32 reductions run together (attention over a row instead of
a document, the loss summed over more tokens): ulps, asserted at 1e-5; a leak across documents, a
wrong position or a misplaced mask moves the loss by >= 1e-3.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from megatrain.engine.config import TransformerConfig
from megatrain.engine.data.batch import Batch
from megatrain.engine.data.packing import batch_from_samples, pack, packed_sample
from megatrain.engine.microbatch import MicroBatch, token_share
from megatrain.engine.models.gpt import GPTModel, lm_loss

from .parallel._launch import run_distributed

TOL = {"rtol": 1e-5, "atol": 1e-5}


# -- placement and arrays ----------------------------------------------------------------------------


def test_pack_places_every_document_once_within_capacity_deterministically() -> None:
    lengths = np.random.default_rng(0).integers(1, 40, size=200)
    bins = pack(lengths, 41, seed=3)
    flat = np.concatenate(bins)
    assert sorted(flat.tolist()) == list(range(200))
    assert all(lengths[b].sum() <= 41 for b in bins)
    assert [b.tolist() for b in bins] == [b.tolist() for b in pack(lengths, 41, seed=3)]
    # Best fit decreasing: samples over 90% full on these lengths (next-fit in file order: about 70%).
    assert lengths.sum() / (len(bins) * 41) > 0.9
    # Equal lengths: the seed decides the order.
    same = np.full(30, 5)
    assert [b.tolist() for b in pack(same, 20, 1)] != [b.tolist() for b in pack(same, 20, 2)]
    with pytest.raises(ValueError, match=r"document lengths must be in \[1, 41\]"):
        pack(np.array([3, 42]), 41, seed=0)


def test_a_packed_sample_restarts_positions_and_masks_across_boundaries() -> None:
    docs = [np.array([1, 2, 3]), np.array([4, 5])]
    targets = [np.array([0, 1, 1], np.uint8), np.array([0, 1], np.uint8)]
    sample = packed_sample(docs, targets, 8, pad_id=9)
    window, target, segment, position = sample
    assert window.tolist() == [1, 2, 3, 4, 5, 9, 9, 9]
    assert segment.tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert position.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    batch = batch_from_samples([sample], packed=True)
    assert batch.tokens.tolist() == [[1, 2, 3, 4, 5, 9, 9]] and batch.labels.tolist() == [
        [2, 3, 4, 5, 9, 9, 9]
    ]
    # Label 4 (the next document's first token) never counts; padding never counts.
    assert batch.loss_mask.tolist() == [[1, 1, 0, 1, 0, 0, 0]]
    assert batch.segment_ids.tolist() == [segment[:-1].tolist()]
    unpacked = batch_from_samples([packed_sample(docs[:1], targets[:1], 8, 9)], packed=False)
    assert unpacked.segment_ids is None and unpacked.position_ids is None
    assert unpacked.loss_mask.tolist() == [[1, 1, 0, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="overflow a sample of 4"):
        packed_sample(docs, targets, 4, 9)


def make_config(flavour: str) -> TransformerConfig:
    # A wide init: far from uniform predictions, so attending across documents shows in the loss.
    preset = TransformerConfig.preset(f"tiny-{flavour}")
    return replace(preset, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3)


def documents(cfg: TransformerConfig, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Documents (tokens, target flags) with a prompt part (no loss) and a response part."""
    rng = np.random.default_rng(seed)
    out = []
    for n in (9, 4, 6, 12, 3, 7, 17, 5):
        tokens = rng.integers(0, cfg.vocab_size, size=n)
        flags = np.zeros(n, np.uint8)
        flags[n // 3 :] = 1
        out.append((tokens, flags))
    return out


def packed_batch(cfg: TransformerConfig, docs: list[tuple[np.ndarray, np.ndarray]]) -> MicroBatch:
    cap = cfg.seq_length + 1
    bins = pack(np.array([len(d[0]) for d in docs]), cap, seed=0)
    samples = [packed_sample([docs[i][0] for i in b], [docs[i][1] for i in b], cap, pad_id=0) for b in bins]
    return MicroBatch.from_batch(batch_from_samples(samples, packed=True), "cpu")


def one_by_one(model: GPTModel, docs: list[tuple[np.ndarray, np.ndarray]], fused: bool) -> torch.Tensor:
    """Σ over documents of their loss-token sums, over all loss tokens: each document run alone."""
    total = sum(int(f[1:].sum()) for _, f in docs)
    loss = torch.zeros(())
    for tokens, flags in docs:
        t = torch.as_tensor(tokens).unsqueeze(0)
        mask = torch.as_tensor(flags[1:], dtype=torch.float32).unsqueeze(0)
        x, y = t[:, :-1], t[:, 1:]
        mean = model.loss(x, y, mask) if fused else lm_loss(model(x), y, mask)
        loss = loss + token_share(mean, int(mask.sum()), total)
    return loss


def packed_loss(model: GPTModel, mb: MicroBatch, fused: bool) -> torch.Tensor:
    if fused:
        return model.loss(mb.tokens, mb.labels, mb.loss_mask, **mb.model_inputs)
    return lm_loss(model(mb.tokens, **mb.model_inputs), mb.labels, mb.loss_mask)


def grads(model: GPTModel, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_a_packed_batch_equals_its_documents_one_by_one(flavour: str, fused: bool) -> None:
    cfg = make_config(flavour)
    torch.manual_seed(0)
    model = GPTModel(cfg)
    docs = documents(cfg)
    mb = packed_batch(cfg, docs)
    assert mb.tokens.shape[0] < len(docs)  # several documents per row
    assert mb.num_loss_tokens == sum(int(f[1:].sum()) for _, f in docs)
    ref = one_by_one(model, docs, fused)
    ref_grads = grads(model, ref)
    got = packed_loss(model, mb, fused)
    got_grads = grads(model, got)
    torch.testing.assert_close(got, ref, **TOL)
    assert ref_grads.keys() == got_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(got_grads[name], ref_grads[name], **TOL, msg=name)
    # Without the document mask and positions the rows mix documents: a different loss.
    plain = packed_loss(model, replace(mb, segment_ids=None, position_ids=None), fused)
    assert abs(plain.item() - ref.item()) > 1e-2


def test_recompute_keeps_the_document_mask() -> None:
    cfg = make_config("llama")
    torch.manual_seed(0)
    model = GPTModel(cfg)
    mb = packed_batch(cfg, documents(cfg))
    ref = grads(model, packed_loss(model, mb, True))
    for mode in ("selective", "full"):
        model.set_recompute(mode)
        got = grads(model, packed_loss(model, mb, True))
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], **TOL, msg=f"{mode} {name}")


# -- tensor (+ sequence) and pipeline parallelism --------------------------------------------------------


def _single(flavour: str) -> tuple[float, dict[str, torch.Tensor]]:
    cfg = make_config(flavour)
    torch.manual_seed(1234)
    model = GPTModel(cfg)
    mb = packed_batch(cfg, documents(cfg))
    loss = lm_loss(model(mb.tokens, **mb.model_inputs), mb.labels, mb.loss_mask)
    return loss.item(), grads(model, loss)


def _tp_rank(rank: int, world: int, flavour: str, sp: bool) -> dict:
    from megatrain.engine.parallel.mappings import allreduce_sequence_parallel_grads, gather_shards
    from megatrain.engine.parallel.parallelize import parallel_lm_loss, parallelize_model

    from .parallel._tp_common import tp_state

    state = tp_state(world, sp)
    cfg = make_config(flavour)
    torch.manual_seed(1234)
    model = parallelize_model(GPTModel(cfg), state)
    mb = packed_batch(cfg, documents(cfg))
    loss = parallel_lm_loss(model(mb.tokens, **mb.model_inputs), mb.labels, state, mb.loss_mask)
    loss.backward()
    allreduce_sequence_parallel_grads(model, state)
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if getattr(p, "tensor_parallel", False):
            g = gather_shards(g, p.partition_dim, p.partition_stride, state.tp_group, state.tp_size)
        out[name] = g
    return {"loss": loss.item(), "grads": out}


@pytest.mark.distributed
@pytest.mark.parametrize(("flavour", "sp"), [("gpt2", False), ("gpt2", True), ("llama", True)])
def test_tensor_parallel_packed_equals_one_process(flavour: str, sp: bool) -> None:
    ref_loss, ref_grads = _single(flavour)
    got = run_distributed(_tp_rank, 2, flavour, sp)[0]
    assert abs(got["loss"] - ref_loss) < 1e-5
    for name, g in ref_grads.items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-5, msg=name)


def _pp_rank(rank: int, world: int, fused: bool, virtual_stages: int) -> dict:
    from megatrain.engine import build
    from megatrain.engine.parallel.pipeline import build_stage_modules
    from megatrain.engine.parallel.schedules import PipelineSchedule
    from megatrain.engine.parallel.state import ParallelState
    from megatrain.plan.layout import Layout

    state = ParallelState.build(Layout(pp=2, virtual_stages=virtual_stages))
    cfg = replace(make_config("llama"), num_layers=4)
    torch.manual_seed(1234)
    chunks = build_stage_modules(GPTModel(cfg), state)
    loss_fn = build._pipeline_loss(chunks, state, cfg.real_vocab_size)
    if not fused:
        chunks[-1].return_hidden = False
        loss_fn = lambda out, mb: lm_loss(out, mb.labels, mb.loss_mask)  # noqa: E731
    mb = packed_batch(cfg, documents(cfg))
    micro = mb.split(1)  # uneven loss-token counts per micro-batch
    denominator = float(mb.num_loss_tokens)
    sched = PipelineSchedule(chunks, state, (1, cfg.seq_length, cfg.hidden_size), torch.float32)
    total = sched.forward_backward(
        micro, lambda out, m: token_share(loss_fn(out, m), m.num_loss_tokens, denominator)
    )
    named = {n: p.grad for c in chunks for n, p in c.named_parameters() if p.grad is not None}
    return {"loss": float(total), "grads": named, "counts": [m.num_loss_tokens for m in micro]}


@pytest.mark.distributed
@pytest.mark.parametrize(("fused", "virtual_stages"), [(True, 1), (False, 1), (True, 2)])
def test_pipeline_packed_equals_one_process(fused: bool, virtual_stages: int) -> None:
    cfg = replace(make_config("llama"), num_layers=4)
    torch.manual_seed(1234)
    model = GPTModel(cfg)
    mb = packed_batch(cfg, documents(cfg))
    ref = lm_loss(model(mb.tokens, **mb.model_inputs), mb.labels, mb.loss_mask)
    ref_grads = grads(model, ref)
    first, last = run_distributed(_pp_rank, 2, fused, virtual_stages)
    assert len(set(last["counts"])) > 1
    assert abs(last["loss"] - ref.item()) < 1e-5
    got = {**first["grads"], **last["grads"]}
    assert got.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(got[name], g, **TOL, msg=name)


def test_without_masks_the_token_share_is_exactly_the_mean_over_micro_batches() -> None:
    gen = torch.Generator().manual_seed(0)
    for m in (1, 2, 3, 5, 7):
        means = torch.rand(m, generator=gen) * 10
        tokens = 4 * 16  # every micro-batch: B·T loss tokens
        for mean in means:
            assert torch.equal(token_share(mean, tokens, float(m * tokens)), mean / m)
    # No loss token: every loss's mean over no token is 0, kept with its graph (backward still runs
    # on every rank) ...
    x = torch.tensor(2.0, requires_grad=True)
    zero = token_share(x * 0.0, 0, 10.0)
    zero.backward()
    assert zero.item() == 0.0 and x.grad is not None and x.grad.item() == 0.0
    # ... and what a loss adds beside its tokens (an encoder's binary head, weighed by the
    # micro-batch's binary_scale for a count of 1) keeps its share, even with no token anywhere.
    assert token_share(torch.tensor(3.0), 0, 10.0).item() == pytest.approx(0.3)
    assert token_share(torch.tensor(3.0), 0, 0.0).item() == 3.0


def test_a_micro_batch_from_a_numpy_batch() -> None:
    windows = np.arange(2 * 9).reshape(2, 9)
    plain = MicroBatch.from_batch(Batch.from_windows(windows), "cpu")
    assert plain.loss_mask is None and plain.segment_ids is None and plain.num_loss_tokens == 16
    assert plain.tokens.dtype == torch.int64 and plain.model_inputs == {
        "position_ids": None,
        "segment_ids": None,
    }
    masked = Batch.from_windows(windows)
    masked.loss_mask = np.array([[1, 0, 1, 0, 0, 0, 0, 1], [0] * 8], np.float32)
    mb = MicroBatch.from_batch(masked, "cpu")
    assert mb.num_loss_tokens == 3 and mb.loss_mask.dtype == torch.float32
    halves = mb.split(1)
    assert [h.num_loss_tokens for h in halves] == [3, 0] and halves[1].segment_ids is None
