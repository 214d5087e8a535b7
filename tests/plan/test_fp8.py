"""precision fp8 in the plan: the spec rules (float8 GEMM widths per tp shard, torchao installed),
the step time (the linears' GEMMs at the fp8 peak) and the memory estimate (bf16's plus the
float8 copies)."""

from __future__ import annotations

import dataclasses

import pytest
from plan_cases import gpu_pool, spec

from megatrain.plan.cost import GPU_CONSTANTS, StepSettings, predict_step
from megatrain.plan.layer_cost import fp8_cast_bytes
from megatrain.plan.layout import Layout, resolve_layout
from megatrain.plan.memory import estimate_memory, from_spec
from megatrain.plan.planner import plan
from megatrain.plan.shapes import ModelShape
from megatrain.spec import ParallelismSpec, SpecError

FP8_PEAKS = {"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0}


def fp8_pool():
    """The planner tests' H100 pool, with its fp8 peak stated."""
    return gpu_pool().model_copy(update={"peak_tflops": FP8_PEAKS})


def _problems(model: dict | None = None, parallelism: dict | None = None, **training) -> list[str]:
    s = spec(model, precision="fp8", **training)
    if parallelism is not None:
        s = s.model_copy(update={"parallelism": ParallelismSpec(**parallelism)})
    try:
        resolve_layout(s)
    except SpecError as exc:
        return [e["message"] for e in exc.errors if e["field"] == "training.precision"]
    return []


def test_fp8_spec_rules() -> None:
    assert _problems() == []  # hidden 1024, 16 heads / 8 groups, ffn 2752: all multiples of 16
    assert spec(precision="fp8", fp8_recipe="rowwise").training.fp8_recipe == "rowwise"
    # hidden 1000: every width is off (hidden, qkv, proj; ffn 2688 = 16·168 passes).
    wrong = _problems({"hidden_size": 1000, "num_attention_heads": 8, "num_query_groups": 8})
    assert any("model.hidden_size" in m and "it is 1000" in m for m in wrong)
    assert any("qkv" in m for m in wrong) and not any("fc1" in m for m in wrong)
    # ffn 2752 splits into 1376 per shard at tp=2 (fine) but 688 = 16·43 at tp=4; 344 at tp=8 is not.
    assert _problems(parallelism={"tp": 4}) == []
    at_tp8 = _problems(parallelism={"tp": 8})
    assert any("ffn_hidden_size per tp shard" in m and "it is 344 with parallelism.tp=8" in m for m in at_tp8)
    # The weight gradient's GEMM multiplies over a micro-batch's tokens.
    tokens = _problems({"seq_length": 1000}, micro_batch_size=1)
    assert tokens and "micro_batch_size×seq_length/cp = 1000" in tokens[0]
    # An MoE model's shared expert is a dense MLP in float8 too (the routed experts stay bf16).
    moe = {"moe": {"num_experts": 4, "router_topk": 2, "shared_expert_ffn_hidden_size": 200}}
    shared = _problems(moe)
    assert shared and all("shared" in m for m in shared) and "it is 200" in shared[0]
    # Other precisions know nothing of these rules.
    assert resolve_layout(spec({"hidden_size": 1000, "num_attention_heads": 8}, precision="bf16"))


def test_fp8_needs_its_package_where_it_runs() -> None:
    """The package is judged against the nodes that run the job (megatrain.spec_packages), not by
    the layout rules (which run on the API host too)."""
    from megatrain.spec_packages import package_problems

    s = spec(precision="fp8")
    resolve_layout(s)  # no package rule here
    nodes = {"gpu-1": {"torch": "2.13.0", "torchao": "0.18.0"}, "gpu-2": {"torch": "2.13.0"}}
    [problem] = package_problems(s, nodes, "pool 'h100'")
    assert problem["field"] == "training.precision"
    assert "'torchao' package (pip install torchao)" in problem["message"]
    assert "pool 'h100''s node(s) gpu-2 cannot import" in problem["message"]
    te = spec(precision="fp8", fp8_backend="te")
    [problem] = package_problems(te, {"gpu-1": nodes["gpu-1"]}, "this worker")
    assert (
        problem["field"] == "training.fp8_backend"
        and "pip install transformer_engine[pytorch]" in problem["message"]
    )
    assert package_problems(spec(precision="bf16"), nodes, "x") == []


def test_fp8_backend_te_rules() -> None:
    """Transformer Engine runs tensorwise only."""
    s = spec(precision="fp8", fp8_backend="te", fp8_recipe="rowwise")
    with pytest.raises(SpecError) as exc:
        resolve_layout(s)
    by_field = {e["field"]: e["message"] for e in exc.value.errors}
    assert "tensorwise" in by_field["training.fp8_recipe"]


def test_the_planner_skips_tp_degrees_fp8_cannot_split() -> None:
    s = spec(precision="fp8", devices=8)
    chosen = plan(s, fp8_pool())
    assert chosen.precision == "fp8" and chosen.choice.layout.tp < 8
    assert any("ffn_hidden_size per tp shard" in r.message for r in chosen.rejected)


MODEL = ModelShape(num_layers=16, hidden_size=2048, num_attention_heads=16, num_query_groups=16,
                   ffn_hidden_size=8192, vocab_size=32000, seq_length=2048, activation="swiglu")  # fmt: skip


def test_fp8_step_time_uses_the_fp8_peak_for_the_linears() -> None:
    """The linears' GEMMs at the fp8 peak, plus the float8 casts' memory traffic (eager torchao:
    5 bytes per cast element), which at micro-batch 1 (the weights cast per 2048 tokens) eats the
    gain on this 2048-wide model, and at micro-batch 4 leaves fp8 ahead."""
    settings = StepSettings(micro_batch_size=4, global_batch_size=64, precision="bf16")
    fp8 = dataclasses.replace(settings, precision="fp8")
    pool, layout = fp8_pool(), Layout(dp=8)
    bf16_t, fp8_t = predict_step(MODEL, layout, settings, pool), predict_step(MODEL, layout, fp8, pool)
    assert fp8_t.compute_s < 0.95 * bf16_t.compute_s
    assert fp8_t.model_flops == bf16_t.model_flops  # the same useful work...
    assert fp8_t.mfu > bf16_t.mfu  # ...against the same (bf16) peak
    assert fp8_t.mfu == pytest.approx(fp8_t.model_flops / fp8_t.step_time_s / 8 / 989e12)
    # A pool that states no fp8 peak predicts fp8's GEMMs at bf16's speed (pool.peak falls back):
    # what is left is exactly the casts, per layer and micro-batch.
    no_fp8 = gpu_pool()
    extra = (
        predict_step(MODEL, layout, fp8, no_fp8).compute_s
        - predict_step(MODEL, layout, settings, no_fp8).compute_s
    )
    micro_batches = 64 // 8 // 4
    casts = fp8_cast_bytes(MODEL, 1, 4 * 2048) / (GPU_CONSTANTS.memory_bandwidth_gbps * 1e9)
    assert extra == pytest.approx(micro_batches * MODEL.num_layers * casts, rel=1e-9)
    assert casts > 0


def test_fp8_memory_is_bf16s_plus_the_float8_copies() -> None:
    """torchao's recipes save bf16 inputs and weights (cast again in backward), so fp8 saves what
    bf16 saves: no smaller. It adds a backward linear's float8 copies at the layer's peak."""
    # A small vocabulary: the loss's tensors, freed by then, would otherwise hide the layer's peak.
    model, kw = dataclasses.replace(MODEL, vocab_size=1024), {"tp": 2, "micro_batch_size": 2}
    bf16, fp8 = estimate_memory(model, precision="bf16", **kw), estimate_memory(model, precision="fp8", **kw)
    assert (fp8.params_bytes, fp8.grads_bytes, fp8.optimizer_bytes) == (
        bf16.params_bytes,
        bf16.grads_bytes,
        bf16.optimizer_bytes,
    )
    saved = {k: v for k, v in bf16.breakdown.items() if k.startswith("activations_")}
    assert saved == {k: v for k, v in fp8.breakdown.items() if k.startswith("activations_")}
    # fc1's backward (the peak): dy (tokens × 2f/tp) twice, its input (tokens × h) and weight, 1 byte each.
    tokens, h, fw = 2 * 2048, 2048, 2 * 8192 / 2
    casts = tokens * (2 * fw + h) + h * fw
    grown = fp8.breakdown["transient_layer_backward"] - bf16.breakdown["transient_layer_backward"]
    assert grown == pytest.approx(casts, abs=2)
    assert fp8.total_bytes > bf16.total_bytes
    # from_spec estimates a spec's fp8 (a GPU pool): the same model state as bf16.
    s = spec(precision="fp8")
    est = from_spec(s, resolve_layout(s), accelerator="NVIDIA H100 80GB HBM3")
    assert est.params_bytes == 2 * est.num_params and est.optimizer_bytes == 12 * est.num_params


def test_fp8_with_sequence_parallelism_saves_the_gathered_inputs() -> None:
    """Under sp the float8 linears (qkv, fc1) run on the all-gathered input and save it, where the
    bf16 ones save the shard and gather it again in backward (megatrain.engine.parallel.layers)."""
    model, kw = dataclasses.replace(MODEL, vocab_size=1024), {"tp": 4, "sequence_parallel": True}
    bf16, fp8 = estimate_memory(model, precision="bf16", **kw), estimate_memory(model, precision="fp8", **kw)
    tokens, h = 2048, 2048
    per_layer = fp8.breakdown["per_layer_linear_inputs"] - bf16.breakdown["per_layer_linear_inputs"]
    assert per_layer == pytest.approx(tokens * 2 * 2 * h * (1 - 1 / 4), abs=2)  # two inputs, bf16


def test_fp8_rules_for_t5() -> None:
    """A T5's heads are kv_channels wide (its attention widths need not be hidden_size's), and its
    decoder's linears multiply over the decoder's tokens."""
    from megatrain.spec import parse_spec

    def problems(kv_channels: int, decoder_seq_length: int) -> list[str]:
        raw = {
            "name": "t5-fp8",
            "model": {"arch": "t5", "num_layers": 2, "hidden_size": 512, "num_attention_heads": 8,
                      "seq_length": 512, "t5": {"kv_channels": kv_channels,
                                                "decoder_seq_length": decoder_seq_length}},
            "data": {"train": [{"dataset": "corpus"}], "tokenizer": {"type": "hf", "path": "/t.json"}},
            "training": {"global_batch_size": 8, "micro_batch_size": 1, "precision": "fp8"},
        }  # fmt: skip
        try:
            resolve_layout(parse_spec(raw))
        except SpecError as exc:
            return [e["message"] for e in exc.errors if e["field"] == "training.precision"]
        return []

    assert problems(kv_channels=64, decoder_seq_length=128) == []
    heads = problems(kv_channels=3, decoder_seq_length=128)  # 8 heads × 3 = 24 wide
    assert any("attention output's width" in m and "it is 24" in m for m in heads)
    assert any("qkv" in m and "it is 72" in m for m in heads)
    [tokens] = problems(kv_channels=64, decoder_seq_length=8)
    assert "micro_batch_size×t5.decoder_seq_length/cp = 8" in tokens
