"""The tensor/sequence-parallel collectives and parameter helpers (gloo ranks on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatrain.engine.parallel.mappings import (
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
)

from ._launch import run_distributed
from ._tp_common import tp_state


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


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_collectives(world: int) -> None:
    run_distributed(_collectives_rank, world)


def test_shard_and_unshard_with_stride() -> None:
    full = torch.arange(24.0).reshape(8, 3)
    for size, stride in [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)]:
        shards = [shard_tensor(full, 0, r, size, stride) for r in range(size)]
        assert torch.equal(unshard_tensor(shards, 0, stride), full)
    gate, up = full[:4], full[4:]
    assert torch.equal(shard_tensor(full, 0, 1, 2, stride=2), torch.cat([gate[2:], up[2:]]))
    with pytest.raises(ValueError):
        shard_tensor(full, 0, 0, 3)


def test_collectives_are_identity_at_size_one() -> None:
    x = torch.randn(2, 4, 6)
    for fn in (copy_to_tp, reduce_from_tp, scatter_to_tp, gather_from_tp, scatter_to_sequence,
               gather_from_sequence, reduce_scatter_to_sequence):  # fmt: skip
        assert fn(x, None, 1) is x
    with pytest.raises(ValueError, match="needs a process group"):
        copy_to_tp(x, None, 2)
    assert dist.is_available()
