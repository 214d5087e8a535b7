"""The step-time model's terms, each against its formula."""

from __future__ import annotations

import dataclasses

import pytest
from plan_cases import gpu_pool

from megatrain.plan.cost import (
    GPU_CONSTANTS,
    MEGATRON_OVERLAPS,
    StepSettings,
    gemm_efficiency,
    predict_step,
    ring_time,
)
from megatrain.plan.flops import flops_per_iteration
from megatrain.plan.layout import Layout
from megatrain.plan.shapes import ModelShape

MODEL = ModelShape(num_layers=16, hidden_size=2048, num_attention_heads=16, num_query_groups=16,
                   ffn_hidden_size=8192, vocab_size=32000, seq_length=2048, activation="gelu")  # fmt: skip
SETTINGS = StepSettings(micro_batch_size=1, global_batch_size=64, precision="bf16")


def _step(layout: Layout, pool=None, **settings):
    return predict_step(MODEL, layout, dataclasses.replace(SETTINGS, **settings), pool or gpu_pool())


def test_ring_collectives() -> None:
    # 4 ranks, 1 GB at 100 GB/s, 10 us: all-reduce moves 2·3/4 of it in 6 steps, gathers half.
    assert ring_time("all_reduce", 1e9, 4, 100.0, 10.0) == pytest.approx(1.5e-2 + 6e-5)
    assert ring_time("all_gather", 1e9, 4, 100.0, 10.0) == pytest.approx(0.75e-2 + 3e-5)
    assert ring_time("all_reduce", 1e9, 1, 100.0, 10.0) == 0.0


def test_small_gemms_run_less_efficiently() -> None:
    c = GPU_CONSTANTS
    sizes = [gemm_efficiency(n, n, n, c) for n in (64, 256, 1024, 8192)]
    assert sizes == sorted(sizes) and sizes[-1] < c.max_fraction
    assert gemm_efficiency(c.half_size, c.half_size, c.half_size, c) == pytest.approx(c.max_fraction / 2)
    # The same model split 8 ways computes each GEMM at a lower efficiency: more than 1/8 of the time.
    one, eight = _step(Layout()), _step(Layout(tp=8))
    assert eight.compute_s > one.compute_s / 8


def test_useful_flops_and_mfu() -> None:
    t = _step(Layout(dp=8))
    assert t.model_flops == flops_per_iteration(MODEL, 64)
    assert t.mfu == pytest.approx(t.model_flops / t.step_time_s / 8 / 989e12)
    assert t.step_time_s == pytest.approx(
        t.compute_s + t.tp_comm_s + t.pp_comm_s + t.bubble_s + t.dp_exposed_s + t.optimizer_s + t.overhead_s
    )


def test_the_pipeline_bubble_follows_the_schedule() -> None:
    # pp=4, 16 micro-batches per step: the bubble is (pp-1)/m of the compute; interleaving divides it.
    plain = _step(Layout(pp=4, dp=2), global_batch_size=32)
    per_mb = (plain.compute_s + plain.tp_comm_s) / 16
    assert plain.bubble_s == pytest.approx(3 * per_mb)
    interleaved = _step(Layout(pp=4, dp=2, virtual_stages=2), global_batch_size=32)
    assert interleaved.bubble_s == pytest.approx(plain.bubble_s / 2)
    assert interleaved.pp_comm_s > plain.pp_comm_s  # twice the chunks to send


def test_tensor_parallel_communication() -> None:
    t = _step(Layout(tp=2))
    tokens, act = 2048, 2
    ar = ring_time("all_reduce", tokens * 2048 * act, 2, 450.0, 5.0)
    # 4 all-reduces per layer and micro-batch, plus the embedding's and the head's.
    assert t.tp_comm_s == pytest.approx(64 * (16 * 4 * ar + 2 * ar))
    # sp: per sublayer AG + RS forward, 2 AG + RS backward (5 half-all-reduces); nothing hidden, it
    # costs more than the all-reduces. The backward's input re-gather and reduce-scatter run beside
    # the column-parallel linear's GEMMs (engine.parallel.layers): with tp_overlap they hide, but
    # never below the 3 exposed ones; Megatron's --tp-comm-overlap pipelines those too.
    ag = ring_time("all_gather", tokens * 2048 * act, 2, 450.0, 5.0)
    sp_layout = Layout(tp=2, sequence_parallel=True)
    unhidden = dataclasses.replace(GPU_CONSTANTS, tp_overlap=0.0)
    sp_plain = predict_step(MODEL, sp_layout, SETTINGS, gpu_pool(), unhidden)
    assert sp_plain.tp_comm_s == pytest.approx(64 * (16 * 2 * 5 * ag + 2 * ag))
    assert sp_plain.tp_comm_s > t.tp_comm_s
    sp = _step(sp_layout)
    assert 64 * (16 * 2 * 3 * ag + 2 * ag) <= sp.tp_comm_s < sp_plain.tp_comm_s
    megatron = _step(sp_layout, overlaps=MEGATRON_OVERLAPS)
    assert megatron.tp_comm_s < 64 * (16 * 2 * 3 * ag + 2 * ag)
    assert _step(Layout(tp=1)).tp_comm_s == 0.0


def test_data_parallel_overlap_and_links() -> None:
    hidden = _step(Layout(dp=8), overlap_grad_reduce=True)
    exposed = _step(Layout(dp=8), overlap_grad_reduce=False)
    assert hidden.dp_comm_s == pytest.approx(exposed.dp_comm_s)
    assert exposed.dp_exposed_s == pytest.approx(exposed.dp_comm_s)
    assert hidden.dp_exposed_s < exposed.dp_exposed_s
    # The same dp=8 across 8 one-device nodes runs on the slower inter-node links.
    spread = _step(Layout(dp=8), gpu_pool(nodes=8, per_node=1), overlap_grad_reduce=False)
    assert spread.dp_comm_s > 5 * exposed.dp_comm_s
    # The distributed optimizer reduce-scatters the fp32 gradients (half an all-reduce) and
    # all-gathers the bf16 parameters after the step (a quarter, never hidden); it shards Adam's work.
    plain = _step(Layout(dp=8), distributed_optimizer=False)
    sharded = _step(Layout(dp=8), distributed_optimizer=True)
    assert sharded.dp_comm_s == pytest.approx(plain.dp_comm_s * 6 / 8, rel=0.05)  # (+ latencies)
    assert sharded.dp_exposed_s >= sharded.dp_comm_s / 3 and sharded.optimizer_s < plain.optimizer_s


def test_recompute_adds_forward_work() -> None:
    none, selective, full = (_step(Layout(), recompute=r) for r in ("none", "selective", "full"))
    assert none.recompute_s == 0.0 < selective.recompute_s < full.recompute_s
    assert none.step_time_s < selective.step_time_s < full.step_time_s
    # Full recompute redoes about a third of the layers' compute (their forward).
    assert full.recompute_s == pytest.approx(none.compute_s / 3, rel=0.15)
    assert full.model_flops == none.model_flops  # recompute is not useful work


def test_zero_bubble_schedules_idle_a_third_and_a_sixth_of_1f1b() -> None:
    """zb-h1 idles (p-1)(F+B-W) = (p-1)·t/3, zbv (p-1)·F/2 = (p-1)·t/6, against 1F1B's (p-1)·t
    (t a micro-batch's forward and backward on a stage); everything else is the same step, except
    that their W passes leave the data-parallel reduction unoverlapped."""
    base = _step(Layout(pp=4, dp=2))
    zb = _step(Layout(pp=4, dp=2, pipeline_schedule="zb-h1"))
    zbv = _step(Layout(pp=4, dp=2, virtual_stages=2, pipeline_schedule="zbv"))
    assert zb.bubble_s == pytest.approx(base.bubble_s / 3)
    assert zbv.bubble_s == pytest.approx(base.bubble_s / 6, rel=0.05)  # its stage time is of two chunks
    assert zb.compute_s == pytest.approx(base.compute_s)
    assert zb.dp_exposed_s >= base.dp_exposed_s
    assert zbv.step_time_s < zb.step_time_s < base.step_time_s
