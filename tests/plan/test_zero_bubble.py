"""The zero-bubble schedules in the planner (megatrain/plan/zero_bubble.py): what a stage holds from
B to W, against the engine's orders and its deferred weight gradients; zbv's V of layers; zb-h1 and
zbv as candidates of parallelism auto, chosen where fastest and refused where they do not fit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from plan_cases import gpu_pool, spec

from megatrain.engine.config import TransformerConfig
from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.parallel.zero_bubble import zb_h1_actions, zbv_actions, zbv_chunk_ids
from megatrain.kernels.grad_accumulation import deferring_weight_grads
from megatrain.plan.bounds import layer_state_bytes, saved_per_token
from megatrain.plan.cost import StepSettings, StepTime, predict_step
from megatrain.plan.layout import Layout
from megatrain.plan.memory import GiB, estimate_memory, from_spec
from megatrain.plan.planner import HEADROOM, plan
from megatrain.plan.shapes import ModelShape, layer_params, shape_of_spec
from megatrain.plan.zero_bubble import (
    deferred_bytes_per_token,
    deferred_per_layer,
    last_stage_floor,
    stage_ordered,
    weight_grad_moments,
    zbv_layers,
    zero_bubble_pipelines,
)
from megatrain.spec import parse_spec

ORDERS = {"zb-h1": zb_h1_actions, "zbv": zbv_actions}
# 16 layers of a 70B-wide model on single-GPU nodes (tp = 1): memory needs pp >= 4, and at pp = 8
# interleaving has at most two chunks per stage, where zbv's bubble is a third of theirs.
DEEP = {"num_layers": 16, "hidden_size": 8192, "num_attention_heads": 64, "num_query_groups": 8,
        "ffn_hidden_size": 28672, "seq_length": 4096, "vocab_size": 32000}  # fmt: skip
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
            seq_length=16, vocab_size=128)  # fmt: skip


def _front(schedule: str, pp: int, stage: int, m: int) -> tuple[tuple[int, int], ...]:
    """Walk the engine's order: (chunks holding activations, chunks waiting for W) after each action,
    and keep the moments no other one beats in both (largest activations first)."""
    held = pending = 0
    seen = set()
    for a in ORDERS[schedule](pp, stage, m):
        held += {"F": 1, "B": 0, "W": -1}[a.kind]
        pending += {"F": 0, "B": 1, "W": -1}[a.kind]
        seen.add((held, pending))
    front = [p for p in seen if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in seen)]
    return tuple(sorted(front, reverse=True))


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_pending_weight_gradients_are_what_the_engine_orders_hold(schedule: str) -> None:
    for pp in range(2, 10):
        for m in range(1, 41):
            for stage in range(pp):
                assert weight_grad_moments(schedule, pp, stage, m) == _front(schedule, pp, stage, m), (
                    pp,
                    m,
                    stage,
                )
    # Many micro-batches: zb-h1's stage s defers s W passes (+ one in flight), zbv's 2s (+ one).
    assert [weight_grad_moments("zb-h1", 4, s, 16)[-1][1] for s in range(4)] == [1, 2, 3, 4]
    assert [weight_grad_moments("zbv", 4, s, 16)[-1] for s in range(4)] == [(8, 1), (5, 3), (6, 5), (7, 7)]


def _fused(model: torch.nn.Module) -> None:
    """What DataParallel sets up: every weight's gradient accumulates into an fp32 main_grad."""
    for p in model.parameters():
        p.grad_accumulation_fusion = True  # type: ignore[attr-defined]
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)  # type: ignore[attr-defined]


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_layers_deferred_weight_gradients_hold_what_is_counted(recompute: str) -> None:
    """The engine's B defers each fused linear's dyᵀx: the closures hold dy (tokens × out) of qkv,
    proj, fc1, fc2; a recomputed layer's inputs x too (its saved activations are only its input)."""
    cfg = TransformerConfig(**TINY)
    torch.manual_seed(0)
    model = GPTModel(cfg)
    model.set_recompute(recompute)
    _fused(model)
    tokens = torch.randint(0, 128, (2, 16))
    deferred: list = []
    with deferring_weight_grads(deferred):
        model.loss(tokens, tokens).backward()  # the fused head + loss defers nothing
    assert len(deferred) == 4 * cfg.num_layers
    dy = sum(f.args[1].nbytes for f in deferred)
    x = sum(f.args[2].nbytes for f in deferred)
    m, n_tokens = ModelShape.of(cfg), 2 * 16
    per_layer = deferred_bytes_per_token(m, tp=1, sp=False, act=4, recomputed=recompute == "full")
    counted_x = 0 if recompute == "none" else x  # (kept ones are the layer's saved activations)
    assert dy + counted_x == n_tokens * cfg.num_layers * per_layer
    assert dy == n_tokens * cfg.num_layers * 4 * (64 + 2 * 32 + 64 + 2 * 96 + 64)  # q+2kv, h, 2f, h


def test_the_memory_estimate_holds_the_deferred_gradients_until_w() -> None:
    kw = dict(pp=4, num_microbatches=16, fused_loss=True)
    m = ModelShape(**DEEP)
    zb = estimate_memory(m, pipeline_schedule="zb-h1", **kw)
    per_mb = 4 * 4096 * deferred_bytes_per_token(m, tp=1, sp=False, act=2)  # 4 layers, bf16
    # The last stage holds pp micro-batches and waits for all of their W passes.
    assert zb.stage == 3 and zb.breakdown["activations_deferred_weight_grads"] == pytest.approx(4 * per_mb)
    plain = estimate_memory(m, pipeline_schedule="1f1b", stage=3, **kw)
    assert "activations_deferred_weight_grads" not in plain.breakdown
    assert zb.total_bytes > plain.total_bytes + 4 * per_mb
    # float8 linears compute their weight gradients in B: nothing waits.
    fp8 = estimate_memory(m, pipeline_schedule="zb-h1", precision="fp8", **kw)
    assert "activations_deferred_weight_grads" not in fp8.breakdown
    # zbv's last stage peaks in its cool-down: 7 of 8 half-chunks held, all 7 waiting for W.
    v = estimate_memory(m, pipeline_schedule="zbv", virtual_stages=2, stage=3, **kw)
    assert v.breakdown["microbatches_in_flight"] == 3.5
    assert v.breakdown["activations_deferred_weight_grads"] == pytest.approx(3.5 * per_mb)


def test_zbv_layers_sit_where_the_engine_puts_them() -> None:
    # Global chunks in the engine's order; stage s holds chunks s and 2p-1-s (the V).
    counts = (1, 2, 3, 4, 5, 6, 7, 8)
    staged = stage_ordered(counts, 4, "zbv")
    assert staged is not None
    for s in range(4):
        assert staged[s] + staged[4 + s] == sum(counts[c] for c in zbv_chunk_ids(s, 4))
    lay = Layout(pp=16, virtual_stages=2, pipeline_schedule="zbv", pipeline_layers=zbv_layers(61, 16))
    per_stage = [sum(b - a for c, (a, b) in enumerate(lay.chunk_layers(61)) if c in zbv_chunk_ids(s, 16))
                 for s in range(16)]  # fmt: skip
    # The first stage embeds and, with the V's last chunk, scores: it gets the fewest layers.
    assert per_stage == [2] + [4] * 14 + [3]
    m = ModelShape(**{**DEEP, "num_layers": 61})
    kw = dict(pp=16, pipeline_schedule="zbv", virtual_stages=2, num_microbatches=32,
              pipeline_layers=lay.pipeline_layers)  # fmt: skip
    layer, vocab_rows = layer_params(m, 1), 8192 * 32000
    assert estimate_memory(m, stage=1, **kw).num_params == 4 * layer
    assert estimate_memory(m, stage=15, **kw).num_params == 3 * layer
    first = estimate_memory(m, stage=0, **kw)
    assert first.num_params == 2 * layer + 2 * vocab_rows + 8192  # embedding, head, final norm
    assert "activations_log_probs" in first.breakdown  # the loss's tensors, there
    assert "activations_log_probs" not in estimate_memory(m, stage=15, **kw).breakdown


def test_the_step_time_follows_the_v() -> None:
    """(1, 3, 3, 1) in the V puts chunks 0 and 3 (2 layers, the embedding, the head) on stage 0 and
    6 layers on stage 1: the slowest stage sets the pace, as the engine runs it."""
    m, settings = (
        ModelShape(**{**DEEP, "num_layers": 8}),
        StepSettings(micro_batch_size=1, global_batch_size=16),
    )

    def zbv(split: tuple[int, ...]) -> StepTime:
        lay = Layout(pp=2, dp=8, virtual_stages=2, pipeline_schedule="zbv", pipeline_layers=split)
        return predict_step(m, lay, settings, gpu_pool(nodes=2))

    even, lopsided = zbv((2, 2, 2, 2)), zbv((1, 3, 3, 1))
    assert lopsided.compute_s == pytest.approx(even.compute_s * 6 / 4, rel=0.1)
    # Its first stage holds both the embedding and the head: the most gradients to reduce.
    plain = predict_step(m, Layout(pp=2, dp=8, virtual_stages=2), settings, gpu_pool(nodes=2))
    assert even.dp_comm_s > plain.dp_comm_s


def test_a_deep_pipeline_plans_zbv() -> None:
    """At pp=8 over 16 layers 1F1B interleaves at most two chunks per stage; zbv's bubble is a third
    of that, and its memory fits 80 GB."""
    result = plan(spec(DEEP, global_batch_size=32), gpu_pool(nodes=16, per_node=1), 16)
    c = result.choice
    assert (c.layout.pipeline_schedule, c.layout.virtual_stages, c.layout.pp) == ("zbv", 2, 8)
    one_f_one_b = [t for r, t, _ in result.runners_up if r.layout.pipeline_schedule == "1f1b"]
    assert one_f_one_b and result.time.step_time_s < min(t.step_time_s for t in one_f_one_b)
    interleaved = dataclasses.replace(c.layout, pipeline_schedule="1f1b", pipeline_layers=None)
    settings = StepSettings(micro_batch_size=c.micro_batch_size, global_batch_size=32)
    assert (
        result.time.bubble_s
        < 0.4 * predict_step(ModelShape(**DEEP), interleaved, settings, gpu_pool()).bubble_s
    )
    assert result.memory.total_bytes <= HEADROOM * 80 * GiB
    # What it stores keeps the schedule (and the V's layer order).
    applied = c.apply(spec(DEEP, global_batch_size=32))
    assert applied.parallelism.pipeline_schedule == "zbv"
    assert tuple(applied.parallelism.pipeline_layers or ()) == (c.layout.pipeline_layers or ())


def test_zero_bubble_is_refused_where_its_memory_does_not_fit() -> None:
    """On 48 GB devices the same zbv needs more than the budget (pp micro-batches' activations and
    output gradients on its last stage): 1F1B at pp=8 is chosen though zbv is predicted faster."""
    s, pool = spec(DEEP, global_batch_size=32), gpu_pool(nodes=16, per_node=1, memory_gib=48)
    result = plan(s, pool, 16)
    c = result.choice
    assert c.layout.pipeline_schedule == "1f1b" and c.layout.pp == 8 and c.recompute == "none"
    zbv = dataclasses.replace(c, layout=dataclasses.replace(
        c.layout, pipeline_schedule="zbv", virtual_stages=2, pipeline_layers=zbv_layers(16, 8)))  # fmt: skip
    search_settings = result.time  # (the chosen one's prediction)
    est = from_spec(zbv.apply(s), zbv.layout, accelerator=pool.accelerator)
    assert est.total_bytes > HEADROOM * 48 * GiB >= result.memory.total_bytes
    faster = plan(zbv.apply(s), gpu_pool(nodes=16, per_node=1), 16)  # explicit, where it fits
    assert faster.time.step_time_s < search_settings.step_time_s


@pytest.mark.parametrize(("schedule", "v"), [("zb-h1", 1), ("zbv", 2)])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_planners_zero_bubble_floor_never_exceeds_the_estimate(
    schedule: str, v: int, recompute: str
) -> None:
    """The pruning bound (last_stage_floor) stays below the full estimate of the last stage."""
    m, pp, n_micro = ModelShape(**DEEP), 8, 16
    split = zbv_layers(16, pp) if schedule == "zbv" else None
    for tp, sp in ((1, False), (2, True)):
        est = estimate_memory(m, tp=tp, sequence_parallel=sp, pp=pp, dp=2, pipeline_schedule=schedule,
                              virtual_stages=v, pipeline_layers=split, num_microbatches=n_micro,
                              recompute=recompute, distributed_optimizer=True, fused_loss=True,
                              stage=pp - 1)  # fmt: skip
        floor = last_stage_floor(
            m, schedule, pp, v, n_micro, stage_ordered(split, pp, schedule), tokens=4096.0,
            kept=saved_per_token(m, "bf16", tp, sp)[recompute],
            deferred=deferred_per_layer(m, "bf16", tp, sp), state=layer_state_bytes(m, "bf16", tp, 2),
            full_every=1 if recompute == "full" else None,
        )  # fmt: skip
        assert 0.5 * est.total_bytes < floor <= est.total_bytes


def test_t5_is_planned_without_zero_bubble_candidates() -> None:
    t5 = parse_spec({"name": "t5", "model": {"arch": "t5", "num_layers": 4, "hidden_size": 256,
                     "num_attention_heads": 4, "seq_length": 128, "vocab_size": 1024},
                     "data": {"train": [{"dataset": "corpus"}],
                              "tokenizer": {"type": "hf", "path": "/t5.json"}},  # (never read)
                     "training": {"global_batch_size": 8}})  # fmt: skip
    assert zero_bubble_pipelines(t5.model, shape_of_spec(t5, 1024), 2) == []
    llama = spec()
    assert [p[:2] for p in zero_bubble_pipelines(llama.model, shape_of_spec(llama, 32000), 2)] == [
        ("zb-h1", 1),
        ("zbv", 2),
    ]
