"""DataParallel: bucket layout, hooks, accumulation, overlap; dp runs against a one-process reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatrain.engine.parallel.data import DataParallel
from megatrain.engine.parallel.state import ParallelState
from megatrain.plan.layout import Layout

from ._dp_common import build, dp_worker, make_model, named_params, options, reference_run, train_steps
from ._launch import run_distributed

# fp32 tolerances. Losses: the dp run sums micro-batch and per-rank gradients in another order than
# one full-batch backward, ~1e-7 relative per step; measured max loss difference 5e-7 over 10 steps.
# Parameters: AdamW divides by sqrt(exp_avg_sq), so for elements whose gradient is near zero a
# rounding-level difference in the gradient changes the update by up to ~lr (1e-2) in relative
# terms; measured max 1.1e-5 absolute over 10 steps at lr 1e-2.
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-5}
PARAM_TOL = {"rtol": 1e-4, "atol": 5e-5}


def fake_state(dp: int, dp_rank: int) -> ParallelState:
    """A ParallelState with dp > 1 but no process group: enough for layout queries, never for collectives."""
    dims = Layout(dp=dp)
    return ParallelState(
        dims, dims.rank_of(dp=dp_rank), torch.device("cpu"), {d: None for d in ("tp", "cp", "dp", "pp", "mp")}
    )


def assert_close_runs(got: dict, ref: dict) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **LOSS_TOL)
    norms = torch.tensor([r.grad_norm for r in got["results"]])
    torch.testing.assert_close(norms, torch.tensor(ref["norms"]), rtol=1e-5, atol=1e-6)
    assert not any(r.skipped for r in got["results"])
    for name, value in ref["params"].items():
        torch.testing.assert_close(got["params"][name], value, **PARAM_TOL, msg=name)


# --- layout and hooks, one process -------------------------------------------------------------------


def test_layout_reverse_order_tied_once_and_views() -> None:
    model = make_model("gpt2", 0)
    ddp = DataParallel(model, ParallelState.single(), bucket_elements=3000)
    params = list(model.parameters())
    assert ddp.params == params[::-1]  # backward order
    # The tied embedding is one Parameter: one slot, counted once.
    assert model.lm_head.weight is model.embed.weight
    assert ddp.numel == sum(p.numel() for p in params) == model.num_parameters()
    # Buckets tile the buffer in order and each reaches bucket_elements (except the last).
    assert ddp.buckets[0].start == 0 and ddp.buckets[-1].end == ddp.numel
    for a, b in zip(ddp.buckets, ddp.buckets[1:], strict=False):
        assert a.end == b.start and a.numel >= 3000
    assert len(ddp.buckets) > 3
    for p in params:
        assert p.main_grad.dtype == torch.float32 and p.main_grad.shape == p.shape
        assert p.main_grad.untyped_storage().data_ptr() == ddp.grad_buffer.untyped_storage().data_ptr()


def test_frozen_params_skipped_and_forward_delegates() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model[0].weight.requires_grad_(False)
    ddp = DataParallel(model, ParallelState.single(), bucket_elements=100)
    assert ddp.numel == 3 + 6 + 2 and not hasattr(model[0].weight, "main_grad")
    x = torch.randn(5, 4)
    torch.testing.assert_close(ddp(x), model(x), rtol=0, atol=0)


def test_hook_accumulates_bf16_grads_in_fp32_and_frees_grad() -> None:
    model = nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    ddp = DataParallel(model, ParallelState.single())
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with ddp.no_sync():
        ddp(x).float().sum().backward()
    ddp(x).float().sum().backward()
    ddp.finish_grad_sync()
    assert model.weight.grad is None and model.weight.main_grad.dtype == torch.float32
    expected = 2 * x.float().sum(0).expand(8, 8)  # d(sum(x W^T))/dW: every row is sum_b x_b
    torch.testing.assert_close(model.weight.main_grad, expected, rtol=1e-2, atol=1e-2)
    ddp.zero_grad()
    assert model.weight.main_grad.abs().sum() == 0


def test_second_synchronised_backward_without_finish_is_an_error() -> None:
    model = nn.Linear(3, 3)
    ddp = DataParallel(model, ParallelState.single())
    ddp(torch.randn(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="arrived twice"):
        ddp(torch.randn(2, 3)).sum().backward()


def test_distributed_optimizer_shards_tile_every_param() -> None:
    """dp=4, odd sizes: each bucket is padded to a multiple of 4, shards cut through parameters."""
    layouts = [
        DataParallel(
            make_model("odd", 0), fake_state(4, r), bucket_elements=40, use_distributed_optimizer=True
        )
        for r in range(4)
    ]
    ddp0 = layouts[0]
    assert all(b.numel % 4 == 0 for b in ddp0.buckets)
    covered = {id(p): torch.zeros(p.numel(), dtype=torch.int32) for p in ddp0.params}
    straddling = 0
    for ddp in layouts:
        for sl in ddp.owned_slices():
            idx = next(i for i, p in enumerate(ddp.params) if p is sl.param)
            covered[id(ddp0.params[idx])][sl.start : sl.end] += 1
            straddling += not sl.whole
    assert all(bool((c == 1).all()) for c in covered.values())  # every element owned exactly once
    assert straddling >= 2
    # Params are views into the flat param buffer (for the in-place all-gather).
    for p in ddp0.params:
        assert p.untyped_storage().data_ptr() == ddp0.param_buffer.untyped_storage().data_ptr()


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_one_process_matches_reference(distributed_optimizer: bool) -> None:
    """dp=1: no collectives, gradient accumulation over 4 micro-batches, same training as plain torch."""
    opts = options(distributed_optimizer=distributed_optimizer)
    model, ddp, opt = build(opts, ParallelState.single())
    out = train_steps(opts, model, ddp, opt, range(opts["steps"]))
    assert_close_runs({**out, "params": named_params(model)}, reference_run(opts))


# --- data parallel over gloo ---------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("distributed_optimizer", "overlap"),
    [(False, True), (True, True), (True, False)],
    ids=["allreduce-overlap", "distopt-overlap", "distopt-no-overlap"],
)
def test_dp2_matches_single_process(distributed_optimizer: bool, overlap: bool) -> None:
    """dp=2, 2 micro-batches per rank, ~5 buckets, the tied GPT-2: 10 steps equal the full-batch reference."""
    opts = options(distributed_optimizer=distributed_optimizer, overlap=overlap, record=True)
    ranks = run_distributed(dp_worker, 2, opts)
    ref = reference_run(opts)
    for got in ranks:
        assert_close_runs(got, ref)
    for name in ref["params"]:  # the ranks hold bit-identical parameters
        torch.testing.assert_close(ranks[0]["params"][name], ranks[1]["params"][name], rtol=0, atol=0)

    n_buckets = len(ranks[0]["layout"])
    assert n_buckets >= 4
    first_step = ranks[0]["events"][: n_buckets + sum(n for *_, n in ranks[0]["layout"])]
    launches = [i for kind, i, _ in first_step if kind == "launch"]
    assert launches == list(range(n_buckets))  # started in order
    if overlap:
        # Bucket 0's collective started while backward was still producing gradients.
        launch0 = next(pos for kind, i, pos in first_step if kind == "launch" and i == 0)
        last_grad = max(pos for kind, _, pos in first_step if kind == "grad")
        assert launch0 < last_grad
        assert sum(1 for kind, _, pos in first_step if kind == "launch" and pos < last_grad) >= n_buckets - 1
    else:
        # Everything starts in finish_grad_sync, after the last gradient.
        last_grad = max(pos for kind, _, pos in first_step if kind == "grad")
        assert all(pos > last_grad for kind, _, pos in first_step if kind == "launch")
