"""The Triton cross-entropy chunk kernels and the fused LM head + loss built on them, under Triton's
interpreter on CPU, against the PyTorch twins: loss and every gradient, over shapes × dtypes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatrain.kernels.linear_cross_entropy import linear_cross_entropy_reference

pytest.importorskip("triton", reason="triton is not installed")
# tests/conftest.py has set TRITON_INTERPRET=1 where there is no CUDA: the kernels run on CPU.
from megatrain.kernels.triton.cross_entropy import (  # noqa: E402
    cross_entropy_grad_,
    cross_entropy_rows_,
    cross_entropy_stats,
    linear_cross_entropy,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (loss, gradient) tolerances: the kernels compute in fp32, 16-bit logits and gradients are rounded.
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3)}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, grad: bool = False) -> None:
    tol = TOL[dtype][1 if grad else 0]
    scale = want.abs().max().clamp_min(1e-6)  # gradients are ~1/n: tolerances relative to their size
    torch.testing.assert_close(got.float() / scale, want.float() / scale, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(4, 33), (9, 64), (3, 5000)])  # 5000: two blocks of 4096
def test_rows_kernel_loss_and_gradient(rows: int, vocab: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows * vocab)
    logits = (4 * torch.randn(rows, vocab, generator=g)).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[0] = -1  # no label here: no target term, no onehot
    weights = torch.rand(rows, generator=g)
    got_grad = logits.clone()
    labels[1] = int(logits[1].float().argmax())  # a row predicted right: at least one hit
    x = logits.float().requires_grad_()
    target = x.gather(1, labels.clamp_min(0)[:, None]).squeeze(1) * (labels >= 0)
    want = torch.logsumexp(x, 1) - target
    (want * weights).sum().backward()
    got, hit = cross_entropy_rows_(got_grad, labels, weights)
    _close(got, want.detach(), dtype)
    argmax = logits.float().argmax(1)
    assert torch.equal(hit, (labels == argmax) & (labels >= 0)) and hit[1] and not hit[0]
    _close(got_grad, x.grad, dtype, grad=True)
    assert got_grad.dtype == dtype  # written over the logits, in their dtype
    untouched = logits.clone()
    _close(cross_entropy_rows_(untouched, labels, None)[0], want.detach(), dtype)
    assert torch.equal(untouched, logits)  # without weights the logits are only read


@pytest.mark.parametrize("dtype", DTYPES)
def test_stats_and_grad_kernels(dtype: torch.dtype) -> None:
    """The vocab-parallel halves: a shard's row statistics, then its gradient from the rows' global
    max and Σ exp."""
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(6, 40, generator=g)).to(dtype)
    labels = torch.tensor([0, 39, -1, 7, -1, 20])
    x = logits.float()
    top, total, target = cross_entropy_stats(logits, labels)
    torch.testing.assert_close(top, x.amax(1))
    _close(total, (x - x.amax(1, keepdim=True)).exp().sum(1), dtype)
    torch.testing.assert_close(target, x.gather(1, labels.clamp_min(0)[:, None]).squeeze(1) * (labels >= 0))
    # As if other shards held a larger max and added to Σ exp.
    top_all = top + torch.rand(6, generator=g)
    total_all = (x - top_all[:, None]).exp().sum(1) + torch.rand(6, generator=g)
    weights = torch.rand(6, generator=g)
    softmax = (x - top_all[:, None]).exp() / total_all[:, None]
    want = (softmax - F.one_hot(labels.clamp_min(0), 40) * (labels >= 0)[:, None]) * weights[:, None]
    got = cross_entropy_grad_(logits.clone(), labels, top, top_all, total_all, weights)
    _close(got, want, dtype, grad=True)


def _loss_and_grads(fn, hidden, weight, labels, **kw):  # noqa: ANN001, ANN003, ANN202
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w, labels, **kw)
    (2.5 * loss).backward()  # an upstream scale, applied in backward
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tokens,hidden_size,vocab,chunk,masked,limit",
    [(16, 32, 48, None, False, None), (13, 32, 64, 5, True, None), (10, 16, 40, 4, True, 33)],
)
def test_linear_cross_entropy_matches_reference(
    tokens: int,
    hidden_size: int,
    vocab: int,
    chunk: int | None,
    masked: bool,
    limit: int | None,
    dtype: torch.dtype,
) -> None:
    g = torch.Generator().manual_seed(tokens + vocab)
    hidden = torch.randn(tokens, hidden_size, generator=g).to(dtype)
    weight = (0.3 * torch.randn(vocab, hidden_size, generator=g)).to(dtype)
    labels = torch.randint(0, limit or vocab, (tokens,), generator=g)
    mask = (torch.rand(tokens, generator=g) < 0.6).float() if masked else None
    kw = {"chunk_tokens": chunk, "loss_mask": mask, "vocab_limit": limit}
    want = _loss_and_grads(linear_cross_entropy_reference, hidden, weight, labels, **kw)
    got = _loss_and_grads(linear_cross_entropy, hidden, weight, labels, **kw)
    _close(got[0], want[0], dtype)
    _close(got[1], want[1], dtype, grad=True)
    _close(got[2], want[2], dtype, grad=True)
    assert got[1].dtype == dtype and got[2].dtype == dtype
    if limit is not None:
        assert not got[2][limit:].any()  # padding rows: no gradient
    with torch.no_grad():  # evaluation: the loss alone
        _close(linear_cross_entropy(hidden, weight, labels, **kw), want[0], dtype)


def _train_losses(backend: str, monkeypatch: pytest.MonkeyPatch, steps: int = 3) -> list[float]:
    from megatrain import kernels
    from megatrain.engine.config import TransformerConfig
    from megatrain.engine.models.gpt import GPTModel

    monkeypatch.setenv(kernels.ENV, f"linear_cross_entropy={backend}")
    # A padded vocabulary (real 100 of 128 ids) and a loss mask: every argument of the kernel in use.
    cfg = TransformerConfig.preset("tiny-llama", vocab_size=128, vocab_size_unpadded=100)
    torch.manual_seed(0)
    model = GPTModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    # One sequence, seen every step (so the loss falls): the interpreter runs a program per token row.
    tokens = torch.randint(0, 100, (1, cfg.seq_length + 1), generator=gen)
    mask = (torch.rand(1, cfg.seq_length, generator=gen) < 0.8).float()
    losses = []
    for _ in range(steps):
        loss = model.loss(tokens[:, :-1], tokens[:, 1:], mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_model_trains_to_the_same_losses_as_with_the_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Llama, 3 AdamW steps: the LM loss through the Triton kernel (interpreted) equals the
    torch twin's step by step (fp32; only the kernels' rounding differs)."""
    twin = _train_losses("torch", monkeypatch)
    triton_losses = _train_losses("triton", monkeypatch)
    assert twin[-1] < twin[0]  # it learns, so the comparison covers updated weights
    assert triton_losses == pytest.approx(twin, rel=1e-5)
