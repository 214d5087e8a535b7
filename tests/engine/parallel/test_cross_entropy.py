"""The vocab-parallel cross-entropy against F.cross_entropy on the full logits (gloo ranks on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatrain.engine.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatrain.engine.parallel.state import ParallelState

from ._launch import run_distributed
from ._tp_common import tp_state


def _cross_entropy_rank(rank: int, world: int) -> None:
    state = tp_state(world)
    n = state.tp_size
    gen = torch.Generator().manual_seed(0)
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
    # A loss mask: the mean over the kept tokens (ignored labels stay out too), masked rows get no
    # gradient; an all-zero mask gives 0, not nan.
    mask = (torch.rand(3, 5, generator=gen) < 0.5).float()
    mask[1, 0] = 1.0
    keep = (mask.reshape(-1) > 0) & (labels.reshape(-1) != -100)
    ref_in = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_in.reshape(-1, 8 * n)[keep], labels.reshape(-1)[keep])
    ref.backward()
    for st in (state, ParallelState.single()):
        part = logits.chunk(st.tp_size, -1)[rank if st.tp_size > 1 else 0].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(part, labels, st, loss_mask=mask)
        loss.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
        want = ref_in.grad.chunk(st.tp_size, -1)[rank if st.tp_size > 1 else 0]
        torch.testing.assert_close(part.grad, want, rtol=1e-6, atol=1e-7)
    # A vocabulary limit (padding rows past it, here reaching into the second-to-last shard when
    # n > 2): equal to F.cross_entropy on the logits cut at the limit, padding gets no gradient.
    limit = 8 * n - 11
    labels_in = labels.clamp(max=limit - 1)
    ref_in = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_in[..., :limit].reshape(-1, limit), labels_in.reshape(-1))
    ref.backward()
    for st in (state, ParallelState.single()):
        part = logits.chunk(st.tp_size, -1)[rank if st.tp_size > 1 else 0].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(part, labels_in, st, vocab_limit=limit)
        loss.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
        want = ref_in.grad.chunk(st.tp_size, -1)[rank if st.tp_size > 1 else 0]
        torch.testing.assert_close(part.grad, want, rtol=1e-6, atol=1e-7)
    zero = logits.chunk(n, -1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(zero, labels, state, loss_mask=torch.zeros(3, 5))
    loss.backward()
    assert loss.item() == 0.0 and not zero.grad.any()


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_cross_entropy(world: int) -> None:
    run_distributed(_cross_entropy_rank, world)
