"""MixedPrecisionOptimizer: loss scaling, global grad norm over tp×dp, ZeRO-1 sharding, bf16, checkpoints."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from megatrain.engine.config import train_config
from megatrain.engine.optimizer import (
    DynamicLossScaler,
    MixedPrecisionOptimizer,
    build_optimizer,
    clip_grad_norm,
    global_grad_norm,
)
from megatrain.engine.parallel.data import DataParallel
from megatrain.engine.parallel.state import ParallelState
from megatrain.plan.layout import Layout
from megatrain.spec import parse_spec

from ..helpers import tiny_spec
from ._dp_common import build, dp_worker, make_model, named_params, options, reference_run, train_steps
from ._launch import run_distributed
from .test_data_parallel import LOSS_TOL, PARAM_TOL, assert_close_runs

# --- one process -------------------------------------------------------------------------------------


def test_loss_scaler_hysteresis_backoff_growth() -> None:
    s = DynamicLossScaler(initial_scale=1024, min_scale=256, growth_interval=3, hysteresis=2)
    scales = []
    for found_inf in [False, True, True, False, False, False, True, True, True, True]:
        s.update(found_inf)
        scales.append(s.scale)
    # 2nd inf backs off (hysteresis 2); 3 clean steps grow and restore hysteresis; then the floor.
    assert scales == [1024, 1024, 512, 512, 512, 1024, 1024, 512, 256, 256]
    restored = DynamicLossScaler()
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


def test_global_grad_norm_and_clip_match_torch() -> None:
    g = torch.Generator().manual_seed(0)
    grads = [
        torch.randn(5, 3, generator=g),
        torch.randn(7, generator=g) * 3,
        torch.randn(2, 2, 2, generator=g),
    ]
    state = ParallelState.single()
    ref = [t.clone().requires_grad_() for t in grads]
    for r, t in zip(ref, grads, strict=True):
        r.grad = t.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm=1.0)
    assert global_grad_norm([(t, False) for t in grads], state) == pytest.approx(float(ref_norm), rel=1e-6)
    norm = clip_grad_norm([(t, False) for t in grads], 1.0, state)
    assert norm == pytest.approx(float(ref_norm), rel=1e-6)
    for r, t in zip(ref, grads, strict=True):
        torch.testing.assert_close(t, r.grad, rtol=1e-6, atol=1e-7)
    # Below the threshold nothing changes.
    before = [t.clone() for t in grads]
    clip_grad_norm([(t, False) for t in grads], 100.0, state)
    for a, b in zip(before, grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_build_optimizer_from_train_config(tmp_path: Path, precision: str) -> None:
    spec = parse_spec(
        tiny_spec(tmp_path / "c.jsonl", precision=precision, loss_scale_window=7, adam_beta2=0.95)
    )
    cfg = train_config(spec, 1)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    opt = build_optimizer(DataParallel(model, ParallelState.single()), cfg)
    assert opt.adam.param_groups[0]["weight_decay"] == cfg.weight_decay
    assert opt.adam.param_groups[1]["weight_decay"] == 0.0  # biases and norm weights
    assert len(opt.adam.param_groups[0]["params"]) == 1 and len(opt.adam.param_groups[1]["params"]) == 3
    assert opt.adam.param_groups[0]["betas"] == (cfg.adam_beta1, 0.95) and opt.clip_grad == cfg.clip_grad
    if precision == "fp16":
        assert opt.scaler is not None and opt.loss_scale == cfg.initial_loss_scale
        assert opt.scaler.growth_interval == 7 and opt.scaler.hysteresis == cfg.hysteresis
    else:
        assert opt.scaler is None and opt.loss_scale == 1.0


def test_fp32_main_params_alias_model_params() -> None:
    opts = options(model="odd")
    model, ddp, opt = build(opts, ParallelState.single())
    assert all(aliased for aliased in opt._aliased)
    assert {m.data_ptr() for m in opt._mains} == {p.data_ptr() for p in model.parameters()}
    # bf16 params get fp32 copies.
    _, _, opt16 = build(options(model="odd", dtype="bfloat16"), ParallelState.single())
    assert all(m.dtype == torch.float32 for m in opt16._mains) and not any(opt16._aliased)


# --- distributed workers ------------------------------------------------------------------------------

INJECT = frozenset({2, 3, 7})


def fp16_worker(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """fp16 params; rank 1 alone puts an inf into one gradient element at the steps in INJECT."""
    state = ParallelState.build(Layout(dp=world_size))
    model, ddp, opt = build(opts, state)
    last_bias = model[3].bias  # offset 0 of the buffer: owned by dp rank 0 with the distributed optimizer
    inject = {"on": False}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if inject["on"]:
            grad = grad.clone()
            grad[0] = math.inf
        return grad

    last_bias.register_hook(poison)
    snapshots, changed = [], []

    def on_microbatch_start(step: int, i: int, n: int) -> None:
        inject["on"] = rank == 1 and step in INJECT and i == n - 1
        if i == 0:
            snapshots.append(named_params(model))

    out = {"losses": [], "results": []}
    for step in range(opts["steps"]):
        o = train_steps(opts, model, ddp, opt, range(step, step + 1), on_microbatch_start=on_microbatch_start)
        out["losses"] += o["losses"]
        out["results"] += o["results"]
        after = named_params(model)
        changed.append(any(not torch.equal(after[k], v) for k, v in snapshots[-1].items()))
    sd = opt.full_state_dict({p: n for n, p in model.named_parameters()})
    return {**out, "changed": changed, "params": named_params(model), "scaler_state": sd["loss_scaler"]}


def tp_dp_norm_worker(rank: int, world_size: int) -> dict[str, Any]:
    """tp=2 × dp=2 with hand-made shards: a tensor-parallel weight (rows split over tp) and a
    replicated bias. Full gradients come from one seed; dp rank d holds (d + 1)·G, so the
    dp average is 1.5·G."""
    state = ParallelState.build(Layout(tp=2, dp=2))
    g = torch.Generator().manual_seed(3)
    full_w, full_b = torch.randn(8, 7, generator=g), torch.randn(5, generator=g)
    rows = slice(4 * state.tp_rank, 4 * state.tp_rank + 4)

    # The reusable function: whole grads on every rank, no dp sharding.
    w, b = full_w[rows].clone(), full_b.clone()
    norm = clip_grad_norm([(w, True), (b, False)], 1.0, state)

    # The optimizer, with DataParallel averaging over dp (and sharding with the distributed optimizer).
    opt_norms = {}
    for distributed_optimizer in (False, True):
        module = nn.Module()
        module.w = nn.Parameter(torch.zeros(4, 7))
        module.w.tensor_parallel = True
        module.b = nn.Parameter(torch.zeros(5))
        ddp = DataParallel(module, state, bucket_elements=10, use_distributed_optimizer=distributed_optimizer)
        opt = MixedPrecisionOptimizer(ddp, lr=1e-3, clip_grad=1.0)
        module.w.main_grad.copy_(full_w[rows] * (state.dp_rank + 1))
        module.b.main_grad.copy_(full_b * (state.dp_rank + 1))
        ddp.finish_grad_sync()
        opt_norms[distributed_optimizer] = opt.step().grad_norm
    return {"clip_norm": norm, "clipped": (w, b), "opt_norms": opt_norms, "tp_rank": state.tp_rank}


def resume_worker(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Train save_at steps, take the full state (and check it round-trips exactly), train on."""
    state = ParallelState.build(Layout(dp=world_size))
    model, ddp, opt = build(opts, state)
    names = {p: n for n, p in model.named_parameters()}
    first = train_steps(opts, model, ddp, opt, range(opts["save_at"]))
    sd = opt.full_state_dict(names)
    opt.load_full_state_dict(sd, names)
    again = opt.full_state_dict(names)
    for name, entry in sd["params"].items():
        for k, t in entry.items():
            assert torch.equal(t, again["params"][name][k]), (name, k)
    rest = train_steps(opts, model, ddp, opt, range(opts["save_at"], opts["steps"]))
    return {
        "losses": first["losses"] + rest["losses"],
        "results": first["results"] + rest["results"],
        "params": named_params(model),
        "state": sd if rank == 0 else None,
    }


# --- distributed tests ---------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["allreduce", "distopt"])
def test_fp16_inf_on_one_rank_skips_everywhere(distributed_optimizer: bool) -> None:
    """With the distributed optimizer the inf lands in rank 0's shard only; rank 1 must skip too."""
    scaler = {"initial_scale": 1024.0, "min_scale": 1.0, "growth_interval": 3, "hysteresis": 2}
    opts = options(
        model="odd",
        dtype="float16",
        fp16=scaler,
        distributed_optimizer=distributed_optimizer,
        bucket_elements=40,
    )
    ranks = run_distributed(fp16_worker, 2, opts)
    skipped = [s in INJECT for s in range(opts["steps"])]
    # inf at 2: hysteresis 2 -> 1; at 3: halve; 3 clean steps (4-6): double, hysteresis back to 2;
    # inf at 7: hysteresis 2 -> 1, no back-off.
    scales = [1024, 1024, 1024, 512, 512, 512, 1024, 1024, 1024, 1024]
    for got in ranks:
        assert [r.skipped for r in got["results"]] == skipped
        assert [r.loss_scale for r in got["results"]] == scales
        assert got["changed"] == [not s for s in skipped]  # skipped steps leave the params untouched
        assert all(math.isnan(r.grad_norm) == r.skipped for r in got["results"])
        assert got["scaler_state"]["scale"] == 1024 and got["scaler_state"]["growth_tracker"] == 2
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name])
    # Gradients were unscaled: the norms of the applied steps match an fp32 run that skips the same
    # steps. fp16 forward/backward (11-bit mantissa) through 3 layers: 1e-2 relative.
    ref = reference_run(opts, skip=INJECT)
    for step, r in enumerate(ranks[0]["results"]):
        if not r.skipped:
            assert r.grad_norm == pytest.approx(ref["norms"][step], rel=1e-2)
    for name, value in ref["params"].items():
        torch.testing.assert_close(ranks[0]["params"][name], value, rtol=1e-2, atol=2e-3)


@pytest.mark.distributed
def test_dp4_distributed_optimizer_with_straddling_params() -> None:
    """dp=4, odd sizes, 40-element buckets: several params are split between two ranks' shards."""
    opts = options(model="odd", distributed_optimizer=True, bucket_elements=40, global_batch=8, micro_batch=1)
    ranks = run_distributed(dp_worker, 4, opts)
    ref = reference_run(opts)
    assert sum(r["straddling"] for r in ranks) >= 2
    for got in ranks:
        assert_close_runs(got, ref)


@pytest.mark.distributed
def test_bf16_params_with_fp32_main_params_track_fp32() -> None:
    """bf16 model (forward, backward, params) with fp32 main params and grads, distributed optimizer.

    The Llama flavour: GPT-2's key bias has an exactly zero true gradient, so AdamW turns rounding
    noise into ±lr steps there and no tolerance short of lr·steps would be meaningful for it.
    Losses: bf16 activations (8 significant bits) change the loss by ~1e-5 relative here (measured
    9e-5 max): 1e-3. Grad norms: measured 1.4e-3 relative: 1e-2. Parameters: bf16 storage rounds
    each value to 8 significant bits (±2e-3 for norm weights near 1, which move only ~0.04 in 10
    steps) and AdamW amplifies gradient rounding on small gradients, so compare distances: the
    bf16 run must stay within 20% of the distance the fp32 run travelled (measured ≤ 11%, norm
    weights; ≤ 2.5% for matrices).
    """
    opts = options(model="llama", dtype="bfloat16", distributed_optimizer=True)
    ranks = run_distributed(dp_worker, 2, opts)
    ref = reference_run(opts)
    init = named_params(make_model("llama", opts["seed"]))
    for got in ranks:
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-3, atol=0
        )
        norms = torch.tensor([r.grad_norm for r in got["results"]])
        torch.testing.assert_close(norms, torch.tensor(ref["norms"]), rtol=1e-2, atol=0)
        for name, value in ref["params"].items():
            travelled = float((value - init[name]).norm())
            assert float((got["params"][name] - value).norm()) <= 0.2 * travelled, name
    # bf16 did change the run: it is not secretly fp32.
    assert ranks[0]["losses"] != pytest.approx(ref["losses"], rel=1e-7)


@pytest.mark.distributed
def test_grad_norm_over_tp_and_dp() -> None:
    """Tensor-parallel shards count on every tp rank, replicated grads once; with the distributed
    optimizer the dp shards are summed too. Both equal the one-process norm of the whole tensors."""
    ranks = run_distributed(tp_dp_norm_worker, 4)
    g = torch.Generator().manual_seed(3)
    full_w, full_b = torch.randn(8, 7, generator=g), torch.randn(5, generator=g)
    # One process, whole tensors: tp shards concatenated, the replicated bias once.
    ref = [full_w.clone().requires_grad_(), full_b.clone().requires_grad_()]
    ref[0].grad, ref[1].grad = full_w.clone(), full_b.clone()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref, 1.0))
    for got in ranks:
        assert got["clip_norm"] == pytest.approx(ref_norm, rel=1e-6)
        rows = slice(4 * got["tp_rank"], 4 * got["tp_rank"] + 4)
        torch.testing.assert_close(got["clipped"][0], ref[0].grad[rows], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got["clipped"][1], ref[1].grad, rtol=1e-6, atol=1e-7)
        for opt_norm in got["opt_norms"].values():  # dp average of 1·G and 2·G
            assert opt_norm == pytest.approx(1.5 * ref_norm, rel=1e-6)


@pytest.mark.distributed
def test_full_state_dict_from_dp2_resumes_on_dp1() -> None:
    """Save at step 6 of a dp=2 distributed-optimizer run; a dp=1 run with another bucket layout and
    a freshly initialised model loads it and continues exactly as the dp=2 run did (fp32 tolerance)."""
    opts = options(distributed_optimizer=True, save_at=6)
    ranks = run_distributed(resume_worker, 2, opts)
    sd = ranks[0]["state"]
    assert sd["steps"] == 6 and sd["loss_scaler"] is None
    assert set(sd["params"]) == set(named_params(build(opts, ParallelState.single())[0]))

    one = options(distributed_optimizer=False, bucket_elements=10_000, seed=opts["seed"] + 1, save_at=6)
    model, ddp, opt = build(one, ParallelState.single())
    opt.load_full_state_dict(sd, {p: n for n, p in model.named_parameters()})
    one["seed"] = opts["seed"]  # same data as the dp=2 run from here on
    rest = train_steps(one, model, ddp, opt, range(6, opts["steps"]))
    torch.testing.assert_close(torch.tensor(rest["losses"]), torch.tensor(ranks[0]["losses"][6:]), **LOSS_TOL)
    for name, value in ranks[0]["params"].items():
        torch.testing.assert_close(named_params(model)[name], value, **PARAM_TOL, msg=name)
    # And the dp=2 run itself matched the uninterrupted one-process reference.
    assert_close_runs(ranks[0], reference_run(opts))
