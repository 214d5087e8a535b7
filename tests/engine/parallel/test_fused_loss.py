"""The vocab-parallel fused LM head + loss (2 gloo ranks) against one process's unfused
F.cross_entropy on the whole logits: the loss, the hidden states' and the weight's gradients, for
each backend (torch, the reference twin, Triton under its interpreter), with and without sequence
parallelism, token chunks, a loss mask, ignored labels and vocabulary padding."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ._launch import run_distributed
from ._tp_common import tp_state

pytestmark = pytest.mark.distributed

B, T, C, V = 2, 6, 16, 40
BACKENDS = ("torch", "reference", "triton")


def _data(limit: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(limit)
    hidden = torch.randn(B, T, C, generator=gen)
    weight = 0.5 * torch.randn(V, C, generator=gen)
    labels = torch.randint(0, limit, (B, T), generator=gen)
    labels[0, 0] = -100  # ignored
    mask = (torch.rand(B, T, generator=gen) < 0.7).float()
    return hidden, weight, labels, mask


def _unfused(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, limit: int
):  # noqa: ANN202
    """One process: full logits, F.cross_entropy over the kept tokens; loss and both gradients."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = (h.reshape(-1, C) @ w[:limit].t()).float()
    per_token = F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100, reduction="none")
    keep = mask.reshape(-1) * (labels.reshape(-1) != -100)
    loss = (per_token * keep).sum() / keep.sum()
    (3.0 * loss).backward()
    hits = ((logits.argmax(-1) == labels.reshape(-1)) & (keep > 0)).sum()
    return loss.detach(), h.grad, w.grad, hits


def _fused_rank(rank: int, world: int, sp: bool) -> None:
    from megatrain import kernels
    from megatrain.engine.parallel.fused_loss import fused_parallel_lm_loss
    from megatrain.engine.parallel.layers import ColumnParallelLinear
    from megatrain.kernels.linear_cross_entropy import counting_token_hits

    state = tp_state(world, sp)
    local = V // world
    tol = {"rtol": 1e-5, "atol": 1e-6}
    for limit in (V - 3, local - 2):  # padding in the last shard; a last shard of padding only
        hidden, weight, labels, mask = _data(limit)
        loss_ref, grad_h, grad_w, hits_ref = _unfused(hidden, weight, labels, mask, limit)
        grad_w = torch.cat([grad_w, torch.zeros(V - grad_w.shape[0], C)])  # padding rows: no gradient
        for backend in BACKENDS:
            os.environ[kernels.ENV] = f"vocab_parallel_linear_cross_entropy={backend}"
            # The kernel itself, in 5-token chunks: its hidden gradient is this shard's part.
            fn = kernels.get("vocab_parallel_linear_cross_entropy")
            h = hidden.clone().requires_grad_()
            w = weight.chunk(world)[rank].clone().requires_grad_()
            with counting_token_hits() as hits:
                loss = fn(
                    h,
                    w,
                    labels,
                    state.tp_group,
                    rank * local,
                    chunk_tokens=5,
                    loss_mask=mask,
                    vocab_limit=limit,
                )
            # Every shard counts the kept tokens whose label is the argmax (the reference does not count).
            assert hits.calls == (backend != "reference")
            assert backend == "reference" or hits.correct == hits_ref, (backend, hits.correct, hits_ref)
            (3.0 * loss).backward()
            torch.testing.assert_close(loss, loss_ref, **tol, msg=backend)
            dist.all_reduce(h.grad, group=state.tp_group)
            torch.testing.assert_close(h.grad, grad_h, **tol, msg=backend)
            torch.testing.assert_close(w.grad, grad_w.chunk(world)[rank], **tol, msg=backend)
            # Through the engine's entry: the head's input enters the region as the head's would.
            linear = nn.Linear(C, V, bias=False)
            linear.weight.data.copy_(weight)
            head = ColumnParallelLinear.from_linear(linear, state)
            x = (hidden.chunk(world, dim=1)[rank] if sp else hidden).clone().requires_grad_()
            loss = fused_parallel_lm_loss(x, head, labels, mask, vocab_limit=limit)
            (3.0 * loss).backward()
            torch.testing.assert_close(loss, loss_ref, **tol, msg=backend)
            want_h = grad_h.chunk(world, dim=1)[rank] if sp else grad_h
            torch.testing.assert_close(x.grad, want_h, **tol, msg=backend)
            torch.testing.assert_close(head.weight.grad, grad_w.chunk(world)[rank], **tol, msg=backend)
            with torch.no_grad():  # evaluation: the loss alone
                torch.testing.assert_close(
                    fused_parallel_lm_loss(x, head, labels, mask, vocab_limit=limit), loss_ref, **tol
                )


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_vocab_parallel_fused_loss_equals_one_process(sp: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Read when triton is first imported, which may precede the rank function: set for the spawn.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_distributed(_fused_rank, 2, sp)
