"""The pauses the hang watch allows an attempt, predicted from its state and its pool's storage
(plan.attempt_times): a node's state is its ranks' parameters and optimizer state as plan.memory
counts them (itself checked against the engine's tensors in test_cost_calibration), written at
every save and read on a resume; a large model on slow storage gets more than the old flat 15
minutes, a small one far less."""

from __future__ import annotations

import pytest
from plan_cases import LLAMA_405B, gpu_pool, spec

from megatrain.plan.attempt_times import COMPILE_S, SAFETY, predict_attempt_times
from megatrain.plan.layout import Layout
from megatrain.plan.memory import from_spec


def test_the_state_is_the_nodes_ranks_parameters_and_optimizer_state() -> None:
    job, layout = spec(), Layout(tp=2, dp=4)
    pool = gpu_pool(storage_write_gbps=2.0, storage_read_gbps=4.0, startup_s=30.0)
    est = from_spec(job, layout, accelerator=pool.accelerator)
    times = predict_attempt_times(job, layout, pool, ranks=8, resuming=False)
    assert times.state_bytes == 8 * (est.params_bytes + est.optimizer_bytes)
    assert times.save_s == pytest.approx(times.state_bytes / 2e9)
    assert times.first_step_s == 30.0  # nothing to read on a fresh start
    resumed = predict_attempt_times(job, layout, pool, ranks=8, resuming=True)
    assert resumed.first_step_s == pytest.approx(30.0 + times.state_bytes / 4e9)
    # Half the ranks on this node: half the bytes through its storage link.
    assert predict_attempt_times(job, layout, pool, ranks=4, resuming=False).save_s == pytest.approx(
        times.save_s / 2
    )
    compiled = predict_attempt_times(spec(compile=True), layout, pool, ranks=8, resuming=False)
    assert compiled.first_step_s == 30.0 + COMPILE_S


def test_the_bounds_are_a_few_predictions_with_a_floor() -> None:
    small = predict_attempt_times(spec(), Layout(tp=8), gpu_pool(startup_s=20.0), ranks=8, resuming=False)
    assert small.bounds(floor_s=120.0) == {"first_step_bound_s": 120.0, "save_bound_s": 120.0}
    # Llama 3.1 405B in bf16 at tp8 pp16 dp8, the optimizer distributed: each rank holds 1/128 of the
    # bf16 weights and 1/1024 of the fp32 master and moments, ~3.5 bytes a parameter over 128 ranks.
    layout, slow = Layout(tp=8, pp=16, dp=8), gpu_pool(nodes=128, storage_read_gbps=0.25)
    big = predict_attempt_times(spec(LLAMA_405B), layout, slow, ranks=8, resuming=True)
    assert 80e9 < big.state_bytes < 120e9
    bounds = big.bounds(floor_s=120.0)
    assert bounds["save_bound_s"] == pytest.approx(SAFETY * big.state_bytes / 1e9, rel=1e-3)
    # Its resume from a shared filesystem needs more than the old flat grace, which would kill it.
    assert bounds["first_step_bound_s"] > 900.0


def test_a_model_whose_size_needs_its_tokenizer_is_not_predicted() -> None:
    job = spec({"vocab_size": None})
    tokenizer = job.data.tokenizer.model_copy(update={"type": "huggingface"})
    hf = job.model_copy(update={"data": job.data.model_copy(update={"tokenizer": tokenizer})})
    with pytest.raises(ValueError, match="vocab_size"):
        predict_attempt_times(hf, Layout(), gpu_pool(), ranks=1, resuming=False)
