"""The planner knows LoRA (training.method lora): the adapters' count equals the engine's, a frozen
base has no gradients or optimizer state and a step's FLOPs are about 4N, not 6N; Llama-3-70B LoRA
plans on 8 × 80 GB where full-parameter training does not."""

from __future__ import annotations

from dataclasses import replace

import pytest
from plan_cases import gpu_pool, spec

from megatrain.engine.config import LoRAConfig, MoEConfig, TransformerConfig, lora_config, transformer_config
from megatrain.plan.cost import StepSettings, predict_step
from megatrain.plan.cost_constants import GPU_CONSTANTS, constants_for
from megatrain.plan.flops import flops_per_iteration, flops_per_token, layer_forward_flops
from megatrain.plan.layout import Layout
from megatrain.plan.memory import estimate_memory, from_spec
from megatrain.plan.planner import HEADROOM, PlanError, plan
from megatrain.plan.shapes import (
    NF4_BYTES,
    LoRAShape,
    ModelShape,
    lora_expert_params,
    lora_layer_params,
    lora_stage_params,
    nf4_stage_params,
    param_counts,
    shape_of_spec,
)

GiB = 1 << 30
_TINY = {
    "hidden_size": 64,
    "num_attention_heads": 8,
    "ffn_hidden_size": 96,
    "seq_length": 32,
    "num_layers": 3,
}
ENGINE_MODELS = {
    "llama-gqa": TransformerConfig.preset("tiny-llama", **_TINY, num_query_groups=2),
    "gpt2": TransformerConfig.preset("tiny-gpt2", **_TINY),
    "moe": TransformerConfig.preset(
        "tiny-llama", **_TINY, num_query_groups=4,
        moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=48, layer_freq=2),
    ),
    "moe-shared": TransformerConfig.preset(
        "tiny-llama", **_TINY, num_query_groups=4,
        moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=48, shared_expert_ffn_hidden_size=40),
    ),
}  # fmt: skip
LLAMA3_70B = {"num_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, "num_query_groups": 8,
              "ffn_hidden_size": 28672, "seq_length": 4096, "vocab_size": 128256}  # fmt: skip
LORA_70B = {"method": "lora", "lora": {"rank": 16, "targets": ["qkv", "proj", "fc1", "fc2"]}}


def with_lora(model: object, **lora: object) -> ModelShape:
    return replace(ModelShape.of(model), lora=LoRAShape.of({"rank": 8, **lora}))


@pytest.mark.parametrize(
    "targets", [("qkv", "proj", "fc1", "fc2"), ("qkv",), ("fc1", "fc2"), ("proj",), ("qkv", "fc2", "experts")]
)
@pytest.mark.parametrize("name", list(ENGINE_MODELS))
def test_adapter_count_is_the_engines(name: str, targets: tuple[str, ...]) -> None:
    """The torch-free count equals LoRAConfig.num_params (itself tested equal to PEFT's)."""
    cfg = ENGINE_MODELS[name]
    lora = LoRAConfig(rank=8, targets=targets)
    assert lora_stage_params(with_lora(cfg, targets=targets), 1, 1, 0) == lora.num_params(cfg)


def test_a_spec_reports_trainable_parameters() -> None:
    s = spec(method="lora", lora={"rank": 4, "targets": ["qkv", "fc2"]})
    counts, lora = param_counts(shape_of_spec(s, 32000)), lora_config(s)
    assert lora is not None and counts["trainable"] == lora.num_params(transformer_config(s, 32000))
    assert counts["total"] == param_counts(shape_of_spec(spec(), 32000))["total"]  # the base's, as before
    assert "trainable" not in param_counts(shape_of_spec(spec(), 32000))  # a full run: every one trains


def test_llama3_70b_rank16_adapters() -> None:
    """80 layers × r·(in + out) over q, k, v, o, gate, up, down: 80 × 16 × (16384 + 9216·2 + 16384 +
    36864·3) = 207,093,760, 0.29% of the 70.55B base."""
    counts = param_counts(shape_of_spec(spec(LLAMA3_70B, **LORA_70B), 128256))
    assert counts == {"total": 70_553_706_496, "active": 70_553_706_496, "trainable": 207_093_760}


def test_adapters_split_like_their_base() -> None:
    """Column-parallel qkv and fc1: A (parts·r, in) whole, B (out/tp, r); row-parallel proj and
    fc2: A (r, in/tp), B (out, r) whole. An MoE layer carries attention's only."""
    m = with_lora(ENGINE_MODELS["moe"])
    h, kv, f, r = 64, 32, 96, 8
    qkv = 3 * r * h + r * (h + 2 * kv) // 2
    proj = r * h // 2 + r * h
    fc1 = 2 * r * h + r * 2 * f // 2
    fc2 = r * f // 2 + r * h
    assert lora_layer_params(m, 2) == qkv + proj + fc1 + fc2
    assert lora_layer_params(m, 2, moe=True) == qkv + proj
    # Layers 0 and 2 are MoE (layer_freq 2), layer 1 dense.
    assert lora_stage_params(m, 2, 1, 0) == 2 * (qkv + proj) + qkv + proj + fc1 + fc2


def test_expert_adapters_split_over_experts_and_tensor_ranks() -> None:
    """Per routed expert: fc1's A (r, h) whole and B (2F/tp, r); fc2's A (r, F/tp) and B (h, r)
    whole; E/ep experts a rank. The shared expert's fc1/fc2 adapters are a dense MLP's."""
    m = with_lora(ENGINE_MODELS["moe-shared"], targets=("fc1", "fc2", "experts"))
    h, f, s, r = 64, 48, 40, 8
    per_expert = r * h + r * 2 * f // 2 + r * f // 2 + r * h
    assert lora_expert_params(m, 2, 2) == 2 * per_expert
    shared = 2 * r * h + r * 2 * s // 2 + r * s // 2 + r * h
    assert lora_layer_params(m, 2, moe=True) == shared
    assert lora_stage_params(m, 2, 1, 0, ep=2) == 3 * (shared + 2 * per_expert)
    assert lora_stage_params(m, 1, 1, 0) == LoRAConfig(rank=8, targets=("fc1", "fc2", "experts")).num_params(
        ENGINE_MODELS["moe-shared"]
    )


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_frozen_base_has_no_gradients_or_optimizer_state(precision: str) -> None:
    cfg = ENGINE_MODELS["llama-gqa"]
    m = with_lora(cfg, rank=16)
    kw = {"tp": 2, "dp": 4, "distributed_optimizer": True, "precision": precision, "fused_loss": True}
    full, lora = estimate_memory(cfg, **kw), estimate_memory(m, **kw)
    n = lora_stage_params(m, 2, 1, 0)
    param_b = 4 if precision == "fp32" else 2
    assert lora.num_params == full.num_params + n
    assert lora.params_bytes == (full.num_params + n) * param_b
    assert lora.grads_bytes == 4 * n  # the fp32 gradient buffer: the adapters only
    assert lora.optimizer_bytes == int((8 if precision == "fp32" else 12) / 4 * n)  # sharded over dp
    assert lora.breakdown["params_lora"] == n * param_b
    # Start-up: DataParallel's flat buffers (parameters, fp32 gradients) and the fp32 mains of the
    # owned quarter are the adapters' size.
    mains = n if precision == "bf16" else 0
    assert lora.startup_bytes == int(lora.params_bytes + max(param_b * n, 4 * n + mains))
    # Activations: each adapter's rank-r product more, the base's weight-gradient temporaries less.
    # (32 tokens × r = 16 × parts: q, k, v, o, gate, up, down.)
    assert lora.breakdown["per_layer_lora"] == 32 * param_b * 16 * 7
    # (The fused loss leaves no fp32 weight gradient of the frozen head for backward.)
    head = lora.breakdown["activations_fused_loss_grads"]
    assert full.breakdown["activations_fused_loss_grads"] - head == 4 * cfg.vocab_size // 2 * cfg.hidden_size


def test_targets_left_out_keep_no_inputs_for_weight_gradients() -> None:
    """Without sp a frozen qkv or fc1 keeps no input, a frozen fc2 no MLP product (measured with the
    dryrun at Llama-3-8B, BENCHMARKS.md); under sp the sequence-parallel linears keep their shard."""
    cfg = ENGINE_MODELS["llama-gqa"]
    every = estimate_memory(with_lora(cfg), micro_batch_size=2).breakdown
    attention = estimate_memory(with_lora(cfg, targets=("qkv", "proj")), micro_batch_size=2).breakdown
    tokens, act = 2 * 32, 2
    assert every["per_layer_linear_inputs"] - attention["per_layer_linear_inputs"] == tokens * act * 64
    assert every["per_layer_mlp"] - attention["per_layer_mlp"] == tokens * act * 96
    sp = {"tp": 2, "sequence_parallel": True, "micro_batch_size": 2}
    every_sp = estimate_memory(with_lora(cfg), **sp).breakdown
    attention_sp = estimate_memory(with_lora(cfg, targets=("qkv", "proj")), **sp).breakdown
    assert every_sp["per_layer_linear_inputs"] == attention_sp["per_layer_linear_inputs"]


@pytest.mark.parametrize("name", list(ENGINE_MODELS))
def test_lora_flops_count_input_gradients_only_for_frozen_weights(name: str) -> None:
    cfg = ENGINE_MODELS[name]
    lora = LoRAConfig(rank=8)
    full = flops_per_token(cfg)
    core = cfg.num_layers * layer_forward_flops(cfg)["attention"]
    adapters = lora.num_params(cfg)
    expected = 2 * (full / 3 - core) + 3 * core + 6 * adapters
    assert flops_per_token(cfg, lora=lora) == pytest.approx(expected, rel=1e-12)
    assert flops_per_token(with_lora(cfg)) == flops_per_token(cfg, lora=lora)  # a ModelShape's own lora
    assert flops_per_iteration(cfg, 4, lora=lora) == flops_per_token(cfg, lora=lora) * 4 * cfg.seq_length


def test_llama3_70b_lora_flops_are_about_two_thirds() -> None:
    m = shape_of_spec(spec(LLAMA3_70B, **LORA_70B), 128256)
    full = flops_per_token(replace(m, lora=None))
    n = 70_553_706_496
    assert 6 * n < full < 6.7 * n  # 6N plus attention over 4,096 tokens
    assert flops_per_token(m) / full == pytest.approx(0.693, abs=0.002)


def test_a_lora_step_is_predicted_faster_with_tiny_data_parallel_traffic() -> None:
    m = shape_of_spec(spec(LLAMA3_70B, **LORA_70B), 128256)
    full_m = replace(m, lora=None)
    lay = Layout(tp=8, pp=4, dp=4, virtual_stages=2, sequence_parallel=True)
    settings = StepSettings(micro_batch_size=1, global_batch_size=64)
    pool = gpu_pool(nodes=2)
    lora, full = predict_step(m, lay, settings, pool), predict_step(full_m, lay, settings, pool)
    assert lora.model_flops == pytest.approx(full.model_flops * 0.693, rel=0.01)
    # No weight-gradient GEMMs, but the adapters' passes over their (tokens, out) updates take back
    # much of that (megatrain.plan.lora_cost).
    assert lora.compute_s < full.compute_s
    # No input gathered again for frozen linears under sp (the full model's re-gather is compared
    # unhidden: with tp_overlap it hides behind the input-gradient GEMM that LoRA also runs).
    unhidden = replace(GPU_CONSTANTS, tp_overlap=0.0)
    lora_plain, full_plain = (predict_step(x, lay, settings, pool, unhidden) for x in (m, full_m))
    assert lora_plain.tp_comm_s < full_plain.tp_comm_s
    assert lora.dp_comm_s < full.dp_comm_s / 50  # the adapters' gradients only (0.29%), and latency
    assert lora.optimizer_s < full.optimizer_s / 100
    # (0.91x: the full model hides its backward re-gather and reduce-scatter behind weight-gradient
    # GEMMs that a frozen linear does not run)
    assert lora.step_time_s < 0.95 * full.step_time_s
    assert 0.2 < lora.mfu < 1  # against the LoRA FLOPs, not 6N


def test_qlora_pays_a_dequantisation_per_gemm() -> None:
    """Each NF4 weight is dequantised forward and again backward: a memory-bound pass reading 0.53
    bytes and writing 2 per weight, each way, on top of LoRA's step (and nothing else changes)."""
    m = shape_of_spec(spec(LLAMA3_70B, **LORA_70B), 128256)
    q = replace(m, lora=replace(m.lora, quantize_base=True))
    lay = Layout(tp=8, pp=4, dp=4, virtual_stages=2, sequence_parallel=True)
    settings = StepSettings(micro_batch_size=1, global_batch_size=64)
    pool = gpu_pool(nodes=2)
    lora, qlora = predict_step(m, lay, settings, pool), predict_step(q, lay, settings, pool)
    assert qlora.model_flops == lora.model_flops and qlora.dp_comm_s == lora.dp_comm_s
    bandwidth = constants_for(pool).memory_bandwidth_gbps * 1e9
    per_pass = nf4_stage_params(q, 8, 4, 0) * (NF4_BYTES + 2) / bandwidth
    micro_batches = 64 // 4
    assert qlora.compute_s - lora.compute_s == pytest.approx(2 * per_pass * micro_batches, rel=0.05)


def test_llama3_70b_lora_fits_eight_80gb_gpus_where_full_training_does_not() -> None:
    pool = gpu_pool(nodes=1, per_node=8, memory_gib=80.0)
    full_spec = spec(LLAMA3_70B, devices=8, global_batch_size=8)
    lora_spec = spec(LLAMA3_70B, devices=8, global_batch_size=8, **LORA_70B)
    with pytest.raises(PlanError) as err:
        plan(full_spec, pool, 8)
    assert "no layout of 8 devices fits" in err.value.errors[0]["message"]
    planned = plan(lora_spec, pool, 8)
    est, lay = planned.memory, planned.choice.layout
    assert max(est.total_bytes, est.startup_bytes) <= HEADROOM * 80 * GiB
    assert planned.parameters["trainable"] == 207_093_760
    # The same layout for full-parameter training: the gradients and Adam's state it would add are
    # what LoRA saves, and the activations barely differ.
    full = from_spec(planned.choice.apply(full_spec), lay)  # (its micro-batch size and recompute)
    assert full.total_bytes > 80 * GiB
    saved = (full.grads_bytes + full.optimizer_bytes) - (est.grads_bytes + est.optimizer_bytes)
    assert full.total_bytes - est.total_bytes >= 0.99 * saved
    assert est.grads_bytes + est.optimizer_bytes < 0.01 * (full.grads_bytes + full.optimizer_bytes)


def test_qlora_holds_the_dense_linears_in_nf4() -> None:
    """QLoRA's params: the dense layers' linear weights at NF4_BYTES (the engine quantises exactly
    those: engine.lora.QUANTIZED), everything else and the adapters as LoRA's."""
    cfg = ENGINE_MODELS["llama-gqa"]
    lora, qlora = with_lora(cfg, rank=16), with_lora(cfg, rank=16, quantize_base=True)
    kw = {"tp": 2, "precision": "bf16", "fused_loss": True}
    a, b = estimate_memory(lora, **kw), estimate_memory(qlora, **kw)
    h, kv, f = cfg.hidden_size, cfg.num_query_groups * cfg.head_dim, cfg.ffn_hidden_size
    linears = cfg.num_layers * (h * (h + 2 * kv) + h * h + h * 2 * f + f * h) // 2
    assert nf4_stage_params(qlora, 2, 1, 0) == linears
    assert abs((a.params_bytes - b.params_bytes) - linears * (2 - NF4_BYTES)) <= 1
    assert (a.grads_bytes, a.optimizer_bytes) == (b.grads_bytes, b.optimizer_bytes)
    # From a spec: method qlora is LoRA with the base in NF4.
    raw = spec(LLAMA3_70B, devices=8, global_batch_size=8, method="qlora", lora={"rank": 16})
    assert shape_of_spec(raw, LLAMA3_70B["vocab_size"]).lora.quantize_base  # type: ignore[union-attr]


def test_llama3_70b_qlora_fits_one_80gb_gpu() -> None:
    """QLoRA's point: 70B's frozen base in NF4 is ~36 GiB, so one 80 GB GPU holds it; LoRA's bf16
    base (131 GiB) does not fit."""
    pool = gpu_pool(nodes=1, per_node=1, memory_gib=80.0)
    qlora = spec(LLAMA3_70B, devices=1, global_batch_size=1, method="qlora", lora={"rank": 16})
    planned = plan(qlora, pool, 1)
    assert max(planned.memory.total_bytes, planned.memory.startup_bytes) <= HEADROOM * 80 * GiB
    assert 30 * GiB < planned.memory.params_bytes < 40 * GiB
    with pytest.raises(PlanError):
        plan(spec(LLAMA3_70B, devices=1, global_batch_size=1, **LORA_70B), pool, 1)
