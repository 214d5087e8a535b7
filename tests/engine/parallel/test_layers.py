"""The tensor-parallel layers against full nn.Linear, and what the sequence-parallel linear saves
for backward (gloo ranks on CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.parallel.layers import ColumnParallelLinear, RowParallelLinear, sequence_parallel_linear
from megatrain.engine.parallel.mappings import gather_from_sequence
from megatrain.engine.parallel.parallelize import parallelize_model
from megatrain.kernels.grad_accumulation import linear

from ._launch import run_distributed
from ._tp_common import make_config, tp_state


def _layers_rank(rank: int, world: int) -> None:
    state = tp_state(world)
    n = state.tp_size
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(2, 4 * n, 3 * n, generator=gen)  # (B, T, C), the same on every rank
    up = torch.randn(full.shape, generator=gen)  # an upstream gradient, the same on every rank

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

    # The sequence-parallel linear (gather inside, shard saved) against the unfused gather + linear.
    _check_sequence_parallel_linear(rank, state)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_column_and_row_parallel_linears(world: int) -> None:
    run_distributed(_layers_rank, world)


# --------------------------------------------------------------------------------------------------
# The sequence-parallel column linear.


def _fused(weight: nn.Parameter, main_dtype: torch.dtype = torch.float32) -> nn.Parameter:
    """Turn on gradient-accumulation fusion as DataParallel does: a main_grad buffer (pre-filled,
    to see that backward adds to it) and the flag."""
    weight.main_grad = torch.full(weight.shape, 0.5, dtype=main_dtype)  # type: ignore[attr-defined]
    weight.grad_accumulation_fusion = True  # type: ignore[attr-defined]
    return weight


def _check_sequence_parallel_linear(rank: int, state) -> None:  # noqa: ANN001
    """sequence_parallel_linear against the unfused gather_from_sequence + linear: output and every
    gradient, with and without bias, gradient-accumulation fusion and recompute."""
    # Batch 3 makes batch-first and sequence-major token orders differ; an output narrower (6) and
    # wider (12) than the input (8) takes each of the two reorder paths; batch 1 takes views only.
    for batch, out in [(3, 6), (3, 12), (1, 12)]:
        _check_sequence_parallel_linear_case(rank, state.tp_group, state.tp_size, batch, out)


def _check_sequence_parallel_linear_case(rank: int, g, n: int, batch: int, out: int) -> None:  # noqa: ANN001
    # Rank-dependent weights and upstream gradients: each rank holds its own output shard.
    gen = torch.Generator().manual_seed(10 + rank)
    x_shard = torch.randn(batch, 2, 8, generator=gen)  # (B, T/tp, C)
    w0, b0 = torch.randn(out, 8, generator=gen), torch.randn(out, generator=gen)
    dy = torch.randn(batch, 2 * n, out, generator=gen)

    def run(fn, bias: bool, fuse: bool = False, dtype: torch.dtype = torch.float32, recompute: bool = False):  # noqa: ANN001, ANN202, E501
        x = x_shard.to(dtype, copy=True).requires_grad_()  # fresh leaves: no gradient carried over
        w = nn.Parameter(w0.to(dtype, copy=True))
        b = nn.Parameter(b0.to(dtype, copy=True)) if bias else None
        if fuse:
            _fused(w)
        y = checkpoint(fn, x, w, b, use_reentrant=False) if recompute else fn(x, w, b)
        y.backward(dy.to(dtype))
        if fuse:  # the gradient went to main_grad; .grad holds the placeholder
            assert w.grad_added_to_main_grad
        grad_w = w.main_grad - 0.5 if fuse else w.grad
        return y, x.grad, grad_w, b.grad if bias else None

    def new(x, w, b):  # noqa: ANN001, ANN202
        return sequence_parallel_linear(x, w, b, g, n)

    def old(x, w, b):  # noqa: ANN001, ANN202
        return linear(gather_from_sequence(x, g, n), w, b)

    for bias in (True, False):
        ref = run(old, bias)
        for fuse, recompute in [(False, False), (True, False), (False, True), (True, True)]:
            got = run(new, bias, fuse=fuse, recompute=recompute)
            for name, a, b in zip(("y", "x.grad", "w.grad", "b.grad"), got, ref, strict=True):
                msg = f"B={batch} out={out} bias={bias} fuse={fuse} recompute={recompute} {name}"
                if b is None:
                    assert a is None, msg
                else:
                    assert a.is_contiguous(), msg
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=msg)
    # 16-bit weights, fp32 main_grad: the 16-bit GEMM is accumulated in fp32.
    ref = run(old, True)
    got = run(new, True, fuse=True, dtype=torch.bfloat16)
    assert got[2].dtype == torch.float32 and got[1].dtype == torch.bfloat16
    torch.testing.assert_close(got[2], ref[2], rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(got[1].float(), ref[1], rtol=2e-2, atol=5e-2)


# --------------------------------------------------------------------------------------------------
# What the sequence-parallel linears keep for backward.


def _saved_bytes_rank(rank: int, world: int, flavour: str) -> dict[str, list[int]]:
    """Bytes each ColumnParallelLinear of a sequence-parallel model saves for backward, parameters
    excluded, recorded with saved_tensors hooks entered around each linear's forward."""
    state = tp_state(world, sp=True)
    cfg = make_config(flavour)
    torch.manual_seed(0)
    model = parallelize_model(GPTModel(cfg), state)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[str, list[int]] = {}

    def pack(t: torch.Tensor, name: str) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved.setdefault(name, []).append(t.untyped_storage().nbytes())
        return t

    for name, module in model.named_modules():
        if isinstance(module, ColumnParallelLinear):
            hooks = torch.autograd.graph.saved_tensors_hooks(lambda t, name=name: pack(t, name), lambda t: t)
            module.register_forward_pre_hook(lambda m, args, hooks=hooks: hooks.__enter__())
            module.register_forward_hook(lambda m, args, out, hooks=hooks: hooks.__exit__(None, None, None))
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(1))
    model(tokens)
    return saved


@pytest.mark.distributed
@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_sequence_parallel_linears_save_the_shard(flavour: str) -> None:
    """Under sequence parallelism qkv, fc1 and the LM head keep their (B, T/tp, C) input shard for
    backward (as Megatron does), not the all-gathered (B, T, C): 1/tp of the bytes."""
    tp = 2
    cfg = make_config(flavour)
    shard_bytes = 2 * cfg.seq_length // tp * cfg.hidden_size * 4  # fp32, batch 2
    saved = run_distributed(_saved_bytes_rank, tp, flavour)[0]
    expected = {f"layers.{i}.{m}" for i in range(cfg.num_layers) for m in ("attn.qkv", "mlp.fc1")} | {
        "lm_head"
    }
    assert set(saved) == expected
    for name, sizes in saved.items():
        assert sizes == [shard_bytes], f"{name} saved {sizes} bytes, the shard is {shard_bytes}"
