"""The GPU cost constants against the published runs they were fitted on and checked with
(megatrain.plan.published; BENCHMARKS.md "Planner calibrated on published runs"): the errors of the
fitted rows and the held-out ones, pinned where they stand, and `parallelism: auto` against
Megatron-LM's own layouts."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatrain.plan.cost import StepSettings, predict_step
from megatrain.plan.published import (
    BRIDGE,
    LLAMA3,
    MEGATRON_README,
    MEGATRON_STRONG,
    MIXTRAL,
    RUNS,
    PublishedRun,
    h100_pool,
    plan_auto,
    predict,
    spec_of,
)
from megatrain.plan.shapes import shape_of_spec

MEGATRON = [r for r in RUNS if r.source in (MEGATRON_README, MEGATRON_STRONG)]


def test_a_published_tflops_figure_becomes_tokens_by_megatrons_own_formula() -> None:
    # Megatron-LM's num_floating_point_operations for its GPT (MHA, 4h GELU MLP) per token:
    # 72·l·h²·(1 + s/6h + V/12lh); the 1.7B row's 408.8 TFLOP/s are 36,259 tokens/s per GPU.
    run = RUNS[0]
    s, h, layers, vocab = 4096, 2048, 24, 131072
    per_token = 72 * layers * h * h * (1 + s / (6 * h) + vocab / (12 * layers * h))
    assert run.published_tokens_per_gpu == pytest.approx(408.8e12 / per_token)
    assert round(run.published_tokens_per_gpu) == 36259


def test_the_fitted_rows_are_within_5_percent() -> None:
    train = [r for r in RUNS if not r.held_out]
    assert [r.name for r in train] == ["GPT 1.7B", "GPT 16B", "GPT 70B", "GPT 177B", "GPT 462B"]
    errors = [predict(r).error for r in train]
    assert all(abs(e) < 0.05 for e in errors), errors  # (0.1%, -1.7%, -0.5%, +2.8%, -1.4%)
    assert math.sqrt(sum(math.log1p(e) ** 2 for e in errors) / len(errors)) < 0.025


HELD_OUT_BF16 = [r for r in RUNS if r.held_out and r.source in (MEGATRON_README, MEGATRON_STRONG, MIXTRAL)]


@pytest.mark.parametrize("run", HELD_OUT_BF16, ids=lambda r: f"{r.name}-{r.gpus}")
def test_the_held_out_megatron_rows_are_within_10_percent(run: PublishedRun) -> None:
    # 7.1B -0.6%, 32B +2.1%, 119B +3.8%, 314B -4.5%; the 177B on 96 / 4,608 GPUs +4.7% / -3.2%;
    # Mixtral 8x7B -0.6% (before the fit: -10%, -21%, -1.5%, -1.0%, +5.7%, -6.0%, +17.5%).
    assert abs(predict(run).error) < 0.10


def test_llama3_misses_by_the_recompute_our_memory_estimate_forces() -> None:
    """Meta shards gradients over dp (FSDP); our stack keeps the whole fp32 buffer (11.9 GiB at
    8K), which leaves the published layout only full recompute (-24%). Without it the same layout
    is predicted within 5% of the paper: the miss is the memory model's, not the step time's."""
    for run in [r for r in RUNS if r.source == LLAMA3 and r.model["seq_length"] == 8192]:
        pred = predict(run)
        assert pred.choice.recompute == "full" and -0.30 < pred.error < -0.15
        c = pred.choice
        settings = StepSettings(micro_batch_size=c.micro_batch_size, global_batch_size=run.global_batch,
                                recompute="none", overlaps=run.overlaps)  # fmt: skip
        spec = spec_of(run)
        t = predict_step(
            shape_of_spec(spec, run.model["vocab_size"]), c.layout, settings, h100_pool(run.gpus)
        )
        assert t.tokens_per_s / run.gpus / run.published_tokens_per_gpu == pytest.approx(1.0, abs=0.05)
    long = next(r for r in RUNS if r.source == LLAMA3 and r.model["seq_length"] == 131072)
    assert abs(predict(long).error) < 0.15  # (-7.0%, with full recompute; cp=16 over 2 nodes)


def test_fp8_runs_stay_outside_the_fit() -> None:
    # Transformer Engine's fp8 (casts fused into the norms) where the model prices torchao's, and
    # full recompute again: 34-39% slow. Pinned so that a change in either shows.
    for run in [r for r in RUNS if r.source == BRIDGE]:
        assert -0.45 < predict(run).error < -0.25


def test_parallelism_auto_claims_little_over_megatrons_own_layouts() -> None:
    """Before the fit `parallelism: auto` predicted layouts up to 11% faster than Megatron-LM's own
    (up to 30% at one sequence per micro-batch): pp for tp, because tp's collectives and the
    data-parallel ring across nodes were priced too dear. Now at most 3%."""
    for run in MEGATRON:
        auto = plan_auto(run).time.tokens_per_s / run.gpus
        assert auto / predict(run).tokens_per_gpu - 1 < 0.05, run.name


def test_the_fit_is_a_minimum_of_its_grid() -> None:
    """Each fitted constant moved one grid step either way makes the fitted rows fit worse."""
    from megatrain.plan.cost_constants import GPU_CONSTANTS

    train = [r for r in RUNS if not r.held_out]

    def rms(**fields: float) -> float:
        c = dataclasses.replace(GPU_CONSTANTS, **fields)
        return math.sqrt(sum(math.log1p(predict(r, c).error) ** 2 for r in train) / len(train))

    best = rms()
    c = GPU_CONSTANTS
    for name, step in (("max_fraction", 0.01), ("elementwise_bytes", 30.0), ("dp_overlap", 0.1)):
        for sign in (-1, 1):
            assert rms(**{name: getattr(c, name) + sign * step}) > best, (name, sign)
    assert rms(tp_overlap=0.0) > best
