"""Context parallelism's pieces: the load-balanced chunking, one attention block with its lse, and
ring attention's output and every gradient against full causal attention on one process.

Tolerances. fp32: ring attention merges per-block softmaxes (rescaling by exp(lse differences)) where
the reference normalises once, so results differ by rounding only; measured <= 2e-6 on these O(1)
values, asserted at 2e-5. bf16: both sides get the same bf16 inputs and compute in fp32; the ring
casts its output to bf16 (relative 2^-8 = 4e-3) and its backward reads that rounded output in
rowsum(dO∘O), so gradients carry ~4e-3 relative error on values of a few units; asserted at 3e-2
absolute, while a wrong chunk, mask or missing block moves values by O(0.1-1).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatrain import kernels
from megatrain.engine.data.batch import Batch
from megatrain.engine.microbatch import context_parallel_batch, context_parallel_index
from megatrain.engine.parallel.context import Ring, ring_attention, skipped_blocks
from megatrain.engine.parallel.state import ParallelState
from megatrain.kernels.attention import Segments, attention_reference
from megatrain.kernels.attention_block import (
    attention_block_backward_reference,
    attention_block_reference,
)
from megatrain.plan.layout import Layout, context_problems, model_problems

from ._launch import run_distributed

# --------------------------------------------------------------------------------------------------
# Chunking: which tokens each cp rank keeps.


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_index_keeps_mirrored_chunks_and_tiles_the_sequence(cp: int, chunk: int) -> None:
    t = 2 * cp * chunk
    parts = [context_parallel_index(t, r, cp) for r in range(cp)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(t))  # every token once
    work = []
    for r, idx in enumerate(parts):
        assert idx.tolist() == [
            *range(r * chunk, (r + 1) * chunk),
            *range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk),
        ]
        work.append(int((idx + 1).sum()))  # keys a query at position p attends to: p + 1
    assert len(set(work)) == 1  # the causal work is the same on every rank


def test_index_refuses_what_does_not_split() -> None:
    with pytest.raises(ValueError, match="2×cp=4"):
        context_parallel_index(6, 0, 2)
    with pytest.raises(ValueError, match="outside cp=2"):
        context_parallel_index(8, 2, 2)


def test_batch_keeps_every_field_with_true_positions() -> None:
    b, t, cp = 2, 8, 2
    tokens = np.arange(b * t).reshape(b, t)
    mask = (np.arange(b * t).reshape(b, t) % 3 != 0).astype(np.float32)
    seg = np.array([[0, 0, 0, 1, 1, 1, 1, 2], [0] * 8])
    pos = np.array([[0, 1, 2, 0, 1, 2, 3, 0], list(range(8))])
    full = Batch(tokens, tokens + 100, mask, pos, seg)
    for r in range(cp):
        idx = context_parallel_index(t, r, cp)
        part = context_parallel_batch(full, r, cp)
        for name in ("tokens", "labels", "loss_mask", "position_ids", "segment_ids"):
            np.testing.assert_array_equal(getattr(part, name), getattr(full, name)[:, idx], err_msg=name)
        assert part.num_loss_tokens == int(np.count_nonzero(mask[:, idx]))
    # Without position ids the kept tokens get their true positions; without masks nothing appears.
    plain = context_parallel_batch(Batch(tokens, tokens), 1, cp)
    np.testing.assert_array_equal(plain.position_ids, np.tile(context_parallel_index(t, 1, cp), (b, 1)))
    assert plain.loss_mask is None and plain.segment_ids is None and plain.num_loss_tokens == b * t // cp
    assert context_parallel_batch(full, 0, 1) is full


def test_skipped_blocks() -> None:
    assert skipped_blocks(1) == (3, 1)  # the causal diagonal's upper chunk pair
    assert skipped_blocks(4) == (9, 7)


# --------------------------------------------------------------------------------------------------
# One block with its lse (the kernel's reference twin).


def _qkv(b: int, h: int, g: int, t: int, hd: int = 8, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, t, hd, generator=gen) for n in (h, g, g, h)]  # q, k, v, dout


def _segments(b: int, t: int) -> torch.Tensor:
    ids = torch.zeros(b, t, dtype=torch.long)
    ids[0, t // 3 :] = 1
    ids[0, t // 3 + 3 :] = 2  # a short document in the middle
    if b > 1:
        ids[1, t - 2 :] = 1
    return ids


@pytest.mark.parametrize("packed", [False, True])
def test_block_equals_attention_and_its_backward_autograd(packed: bool) -> None:
    q, k, v, do = _qkv(2, 4, 2, 12)
    segments = Segments(_segments(2, 12)) if packed else None
    mask = segments.mask if segments is not None else None
    out, lse = attention_block_reference(q, k, v, True, mask)
    torch.testing.assert_close(out, attention_reference(q, k, v, segments), rtol=0, atol=1e-6)
    ks = torch.repeat_interleave(k, 2, dim=1)
    scores = (q @ ks.transpose(-1, -2)) / np.sqrt(8)
    allowed = torch.ones(12, 12, dtype=torch.bool).tril() if mask is None else mask
    torch.testing.assert_close(lse, scores.masked_fill(~allowed, float("-inf")).logsumexp(-1))
    # Backward from the (single block's) out and lse equals autograd through the reference.
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    attention_reference(*leaves, segments).backward(do)
    got = attention_block_backward_reference(do, q, k, v, out, lse, True, mask)
    for g, leaf in zip(got, leaves, strict=True):
        torch.testing.assert_close(g, leaf.grad, rtol=1e-5, atol=1e-6)


def test_block_rows_without_keys_are_zero_not_nan() -> None:
    q, k, v, do = _qkv(1, 2, 2, 4)
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    mask[..., 2:, :] = True
    out, lse = attention_block_reference(q, k, v, False, mask)
    assert torch.isneginf(lse[..., :2]).all() and (out[..., :2, :] == 0).all()
    assert torch.isfinite(out).all()
    grads = attention_block_backward_reference(do, q, k, v, out, lse, False, mask)
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][..., :2, :] == 0).all()


# --------------------------------------------------------------------------------------------------
# Ring attention on cp gloo ranks against full attention on one process.

T = 24  # divisible by 2·cp for cp = 2 and 4 (chunks of 6 and 3 tokens)
CASES = [  # (heads, groups, packed, dtype)
    (4, 2, False, torch.float32),
    (4, 2, True, torch.float32),
    (2, 2, True, torch.float32),
    (4, 1, False, torch.bfloat16),
    (4, 2, True, torch.bfloat16),
]


def _ring_rank(rank: int, world: int) -> list[list[torch.Tensor]]:
    ring = Ring.of(ParallelState.build(Layout(cp=world)))
    idx = torch.as_tensor(context_parallel_index(T, rank, world))
    results = []
    for h, g, packed, dtype in CASES:
        q, k, v, do = (x.to(dtype)[:, :, idx] for x in _qkv(2, h, g, T, seed=h + g))
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        segments = Segments(_segments(2, T)[:, idx]) if packed else None
        out = ring_attention(*leaves, segments, ring=ring)
        out.backward(do)
        assert out.dtype == dtype and all(leaf.grad.dtype == dtype for leaf in leaves)
        results.append([out.detach(), *(leaf.grad for leaf in leaves)])
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_full_causal_attention(cp: int) -> None:
    ranks = run_distributed(_ring_rank, cp)
    for c, (h, g, packed, dtype) in enumerate(CASES):
        q, k, v, do = (x.to(dtype) for x in _qkv(2, h, g, T, seed=h + g))
        leaves = [x.float().requires_grad_() for x in (q, k, v)]
        ref = attention_reference(*leaves, Segments(_segments(2, T)) if packed else None)
        ref.backward(do.float())
        want = [ref.detach(), *(leaf.grad for leaf in leaves)]
        tol = 2e-5 if dtype == torch.float32 else 3e-2
        for r, got in enumerate(ranks):
            idx = torch.as_tensor(context_parallel_index(T, r, cp))
            for name, a, b in zip(("out", "dq", "dk", "dv"), got[c], want, strict=True):
                torch.testing.assert_close(
                    a.float(), b[:, :, idx], rtol=0, atol=tol,
                    msg=lambda m, n=name, r=r, c=c: f"case {CASES[c]} rank {r} {n}: {m}",
                )  # fmt: skip


def test_ring_of_one_is_plain_attention() -> None:
    q, k, v, _ = _qkv(1, 4, 2, 8)
    ring = Ring.of(ParallelState.single())
    torch.testing.assert_close(ring_attention(q, k, v, ring=ring), attention_reference(q, k, v))
    with pytest.raises(ValueError, match="attention_dropout"):
        ring_attention(q, k, v, None, 0.1, ring=ring)


# --------------------------------------------------------------------------------------------------
# Layout rules (the 422's words) and the CUDA backend.


def test_layout_rules_name_the_fields() -> None:
    sp = Layout(tp=2, cp=2, sequence_parallel=True)
    assert model_problems(sp, seq_length=16) == []
    [problem] = model_problems(sp, seq_length=12, model="model.", par="parallelism.")
    assert problem["field"] == "model.seq_length"
    assert "not divisible by 2×parallelism.cp×parallelism.tp=8" in problem["message"]
    [problem] = context_problems(Layout(cp=2), attention_dropout=0.1)
    assert problem["field"] == "model.attention_dropout" and "parallelism.cp=2" in problem["message"]
    assert context_problems(Layout(), attention_dropout=0.1) == []


DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_fused_block_kernel_matches_the_twin(
    device: str, dtype: torch.dtype, causal: bool, packed: bool
) -> None:
    """The fused backend (CPU: torch's flash kernel for CPU; CUDA: flash or memory-efficient SDPA)
    against the fp32 twin on the same inputs, forward (out, lse) and backward from a merged out/lse,
    rows without keys included (packed, non-causal); bf16 at its 2^-8 rounding of out and gradients."""
    assert kernels.backends("attention_block")[0] in ("torch", "sdpa")
    fwd, bwd = kernels.get("attention_block", device), kernels.get("attention_block_backward", device)
    assert fwd is not attention_block_reference
    q, k, v, do = (x.to(device, dtype) for x in _qkv(2, 4, 2, 40, hd=16))
    ids = _segments(2, 40).to(device)
    mask = Segments(ids).mask if packed else None
    if packed and not causal:  # a block of other documents' keys: row 0 of each sequence sees none
        mask = (ids.unsqueeze(2) == (ids + (ids == 0).long()).unsqueeze(1)).unsqueeze(1)
    out, lse = fwd(q, k, v, causal, mask, 0.25)
    ref_out, ref_lse = attention_block_reference(q, k, v, causal, mask, 0.25)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref_out, rtol=0, atol=tol)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and (packed and not causal) == (not finite.all())
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=0, atol=tol)
    got = bwd(do, q, k, v, ref_out.to(dtype), ref_lse, causal, mask, 0.25)
    want = attention_block_backward_reference(do, q, k, v, ref_out.to(dtype), ref_lse, causal, mask, 0.25)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=0, atol=1e-4 if dtype == torch.float32 else 5e-2)
