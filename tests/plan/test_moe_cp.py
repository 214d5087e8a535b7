"""Mixture of experts, expert and context parallelism in the planner: FLOPs, parameters, memory,
step-time terms and the candidates (each against a hand count or its formula)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from plan_cases import gpu_pool, spec

import megatrain.plan.planner as planner
from megatrain.plan.cost import StepSettings, all_to_all_time, predict_step
from megatrain.plan.flops import flops_per_iteration, flops_per_token
from megatrain.plan.layout import Layout
from megatrain.plan.memory import estimate_memory
from megatrain.plan.planner import PlanError, plan
from megatrain.plan.shapes import ModelShape, MoEShape, param_counts, stage_params
from megatrain.spec import parse_spec

# Two layers, layer 0 MoE (layer_freq 2), layer 1 dense: every number below is counted by hand.
TINY = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                  ffn_hidden_size=128, vocab_size=256, seq_length=32,
                  moe=MoEShape(num_experts=4, router_topk=2, ffn_hidden_size=96, layer_freq=2))  # fmt: skip
SEVEN_B = {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 32,
           "ffn_hidden_size": 11008, "seq_length": 131072, "vocab_size": 32000}  # fmt: skip
# One layer (no pipeline) and two heads (tp <= 2): only expert parallelism can split 64 experts.
WIDE_MOE = {"num_layers": 1, "hidden_size": 1024, "num_attention_heads": 2, "num_query_groups": 2,
            "ffn_hidden_size": 2048, "seq_length": 1024,
            "moe": {"num_experts": 64, "router_topk": 2}}  # fmt: skip


def test_moe_flops_count_the_router_and_topk_experts_by_hand() -> None:
    attention_gemms = 2 * 64 * (64 + 128) + 2 * 64 * 64  # qkv + proj
    core = 2 * 2 * 32 * 64  # QK^T and attention·V over all 32 keys
    dense_mlp = 3 * 2 * 64 * 128  # SwiGLU: gate, up, down
    moe_mlp = 2 * 64 * 4 + 3 * 2 * 64 * (2 * 96)  # router + 2 routed experts of width 96
    forward = 2 * (attention_gemms + core) + dense_mlp + moe_mlp + 2 * 64 * 256  # + LM head
    assert flops_per_token(TINY) == 3 * forward
    assert flops_per_iteration(TINY, 8) == 3 * forward * 8 * 32
    # A shared expert counts on every token; the engine's config (any object with these fields) too.
    cfg = SimpleNamespace(**{f.name: getattr(TINY, f.name) for f in dataclasses.fields(TINY)})
    cfg.kv_size = TINY.kv_size
    cfg.moe = SimpleNamespace(**{**dataclasses.asdict(TINY.moe), "shared_expert_ffn_hidden_size": 32})
    assert flops_per_token(cfg) == 3 * (forward + 3 * 2 * 64 * 32)


def test_total_and_active_parameters() -> None:
    dense_layer = (64 * 192 + 64 * 64) + 2 * 64 + (64 * 256 + 128 * 64)  # attention, norms, MLP
    expert = 64 * 192 + 96 * 64
    moe_layer = (64 * 192 + 64 * 64) + 2 * 64 + 64 * 4  # router instead of the MLP ...
    edges = 2 * 256 * 64 + 64  # embedding, LM head, final norm
    total = dense_layer + moe_layer + 4 * expert + edges
    assert param_counts(TINY) == {"total": total, "active": total - 2 * expert}
    mixtral = ModelShape(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                         ffn_hidden_size=14336, vocab_size=32000, seq_length=4096,
                         moe=MoEShape(num_experts=8, router_topk=2, ffn_hidden_size=14336))  # fmt: skip
    counts = param_counts(mixtral)  # published: 46.7B total, 12.9B active
    assert round(counts["total"] / 1e9, 1) == 46.7 and round(counts["active"] / 1e9, 1) == 12.9


def test_experts_split_over_ep_and_tp_and_their_state_over_dp_cp_over_ep() -> None:
    parts = stage_params(TINY, tp=2, pp=1, stage=0, ep=2)
    assert parts["experts"] == (4 // 2) * (64 * 192 + 96 * 64) // 2  # 2 whole experts, split by tp
    dense = sum(parts.values()) - parts["experts"]
    assert (
        dense == (64 * 192 + 64 * 64) + 2 * (2 * 64) + (64 * 256 + 128 * 64) // 2 + 64 * 4 + 2 * 256 * 32 + 64
    )
    est = estimate_memory(TINY, tp=2, dp=2, cp=2, ep=2, precision="bf16", distributed_optimizer=True)
    n = dense + parts["experts"]
    assert (est.num_params, est.params_bytes, est.grads_bytes) == (n, 2 * n, 4 * n)
    # Dense state sharded over dp·cp = 4 ranks, the experts' over their dp·cp/ep = 2.
    assert est.optimizer_bytes == 12 * dense / 4 + 12 * parts["experts"] / 2
    assert est.breakdown["params_experts"] == 2 * parts["experts"]
    with pytest.raises(ValueError, match="ep=4 must divide"):
        estimate_memory(TINY, dp=2, ep=4)


def test_moe_activations_hold_topk_routed_tokens_and_cp_divides_the_sequence() -> None:
    def with_moe(**kw: float) -> ModelShape:
        return dataclasses.replace(TINY, moe=dataclasses.replace(TINY.moe, **kw))

    one = estimate_memory(TINY, micro_batch_size=4)
    top4 = estimate_memory(with_moe(router_topk=4), micro_batch_size=4)
    capped = estimate_memory(with_moe(capacity_factor=2.0), micro_batch_size=4)
    assert top4.activations_bytes > one.activations_bytes
    assert capped.breakdown["activations_layers"] > one.breakdown["activations_layers"]
    # cp splits every per-token tensor: two ranks hold half the layers' activations each.
    halves = estimate_memory(TINY, micro_batch_size=4, cp=2)
    assert halves.breakdown["activations_layers"] == pytest.approx(one.breakdown["activations_layers"] / 2)


def test_all_to_alls_per_moe_layer_at_the_link_the_ep_group_spans() -> None:
    moe = dataclasses.replace(TINY.moe, num_experts=8, layer_freq=1)
    model = dataclasses.replace(TINY, hidden_size=1024, num_attention_heads=8, num_query_groups=8,
                                seq_length=1024, moe=moe)  # fmt: skip
    settings = StepSettings(micro_batch_size=1, global_batch_size=16, precision="bf16")
    pool = gpu_pool(nodes=2)
    t = predict_step(model, Layout(dp=8, ep=8), settings, pool)
    routed_bytes = 1024 * 2 * 1024 * 2  # tokens × topk × hidden × 2 bytes
    # 2 micro-batches × 2 MoE layers × (dispatch + combine) × (forward + backward).
    assert t.ep_comm_s == pytest.approx(2 * 2 * 4 * all_to_all_time(routed_bytes, 8, 8, pool))
    assert predict_step(model, Layout(dp=8), settings, pool).ep_comm_s == 0.0
    # The same group over two 4-GPU nodes sends half its bytes over the slower inter-node link.
    split = predict_step(model, Layout(dp=8, ep=8), settings, gpu_pool(nodes=4, per_node=4))
    assert split.ep_comm_s > 2 * t.ep_comm_s
    parts = (t.compute_s, t.tp_comm_s, t.cp_comm_s, t.ep_comm_s, t.pp_comm_s, t.bubble_s, t.dp_exposed_s,
             t.optimizer_s, t.overhead_s)  # fmt: skip
    assert t.step_time_s == pytest.approx(sum(parts))


def test_ring_attention_hides_behind_block_attention_unless_the_link_is_slow() -> None:
    model = ModelShape.of({**SEVEN_B, "num_layers": 2, "seq_length": 32768})
    settings = StepSettings(micro_batch_size=1, global_batch_size=8, precision="bf16")
    fast = predict_step(model, Layout(cp=8), settings, gpu_pool())
    slow = predict_step(model, Layout(cp=8), settings, gpu_pool(intra=0.5))
    assert 0 < fast.cp_comm_s < 0.15 * fast.compute_s  # only the merges and per-step launches
    assert slow.cp_comm_s > 10 * fast.cp_comm_s
    # Balanced chunks: each of the cp ranks computes 1/cp of the attention of the whole sequence.
    assert fast.compute_s < predict_step(model, Layout(), settings, gpu_pool()).compute_s / 4


def test_ep_and_cp_candidates_and_their_rejections() -> None:
    # 6 experts: ep=4 and ep=8 do not divide them; a 8194-token sequence cannot split into 2·cp chunks.
    s = spec(
        {**WIDE_MOE, "seq_length": 8194, "moe": {"num_experts": 6, "router_topk": 2}}, global_batch_size=8
    )
    result = plan(s, gpu_pool(memory_gib=80.0), 8)
    messages = [r.message for r in result.rejected]
    assert any("model.moe.num_experts=6 is not divisible by parallelism.ep=4" in m for m in messages), (
        messages
    )
    assert any(r.code == "divisibility" and r.numbers.get("cp") == 2 and "8194" in r.message
               for r in result.rejected), messages  # fmt: skip
    chosen = [result.choice, *(c for c, _, _ in result.runners_up)]
    assert all(6 % c.layout.ep == 0 and (c.layout.dp * c.layout.cp) % c.layout.ep == 0 for c in chosen)
    # Short sequences never try cp: a reason, not a candidate.
    short = plan(spec(WIDE_MOE, global_batch_size=8), gpu_pool(), 8)
    assert short.choice.layout.cp == 1 and short.rejected_counts["cp_chunk"] >= 1


def test_an_moe_that_fits_only_with_expert_parallelism_chooses_it() -> None:
    s = spec(WIDE_MOE, global_batch_size=64)
    result = plan(s, gpu_pool(memory_gib=2.0), 8)
    assert result.choice.layout.ep > 1
    assert all(c.layout.ep > 1 for c, _, _ in result.runners_up)
    assert result.parameters["active"] < result.parameters["total"] / 5
    for par in ({"tp": 1, "dp": 8, "ep": 1}, {"tp": 2, "dp": 4, "ep": 1}):  # the same without ep
        with pytest.raises(PlanError, match="GiB"):
            plan(parse_spec({**s.model_dump(mode="json"), "parallelism": par}), gpu_pool(memory_gib=2.0))
    explicit = plan(result.choice.apply(s), gpu_pool(memory_gib=2.0))  # written back: the same prediction
    assert explicit.choice == result.choice and explicit.time == result.time


def test_a_long_sequence_chooses_context_parallelism(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 7B model at 128K tokens on 64 H100s: cp spares the full recompute that cp=1 needs; on
    10 GiB devices nothing but cp fits at all."""
    s = spec(SEVEN_B, global_batch_size=16)
    result = plan(s, gpu_pool(nodes=8), 64)
    assert result.choice.layout.cp > 1 and result.choice.recompute != "full"
    small = plan(s, gpu_pool(nodes=8, memory_gib=10.0), 64)
    assert small.choice.layout.cp > 1
    monkeypatch.setattr(planner, "MIN_CP_CHUNK", 1 << 30)  # no cp candidates at all
    assert plan(s, gpu_pool(nodes=8), 64).choice.recompute == "full"
    with pytest.raises(PlanError, match="no layout of 64 devices fits"):
        plan(s, gpu_pool(nodes=8, memory_gib=10.0), 64)
