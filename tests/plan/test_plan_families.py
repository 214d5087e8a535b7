"""The planner's BERT and T5: parameter counts against transformers' own models, FLOPs against a torch
FLOP counter over them, memory and step time by stack, the T5 pipeline split and the layout rules
the engine's T5 needs (no cp, no virtual stages, the split between the stacks)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from plan_cases import gpu_pool
from torch.utils.flop_counter import FlopCounterMode

from megatrain.plan.activation_memory import MLM_FRACTION, layer_activations
from megatrain.plan.cost import StepSettings, predict_step
from megatrain.plan.flops import flops_per_iteration, flops_per_token
from megatrain.plan.layout import Layout, layout_problems, resolve_layout
from megatrain.plan.memory import estimate_memory
from megatrain.plan.planner import plan
from megatrain.plan.shapes import ModelShape, param_counts, shape_of_spec, stage_params
from megatrain.plan.stacks import t5_split, t5_split_rank
from megatrain.plan.t5_cost import t5_pipeline_layers
from megatrain.spec import JobSpec, SpecError
from megatrain.spec_errors import RULES_SINK

transformers = pytest.importorskip("transformers")


def job(model: dict[str, Any], parallelism: dict[str, Any] | None = None, gbs: int = 64) -> JobSpec:
    """A JobSpec with every rule checked (an hf tokenizer, as the encoder families need); any broken
    rule fails here."""
    raw: dict[str, Any] = {
        "name": "families", "model": model,
        "data": {"train": [{"dataset": "corpus"}], "tokenizer": {"type": "hf", "path": "/t.json"}},
        "training": {"global_batch_size": gbs, "micro_batch_size": "auto", "precision": "bf16"},
    }  # fmt: skip
    if parallelism is not None:
        raw["parallelism"] = parallelism
    sink: list[dict[str, str]] = []
    spec = JobSpec.model_validate(raw, context={RULES_SINK: sink})
    assert not sink, sink
    return spec


def bert_model(
    layers: int, hidden: int, heads: int, vocab: int, seq: int = 512, **bert: Any
) -> dict[str, Any]:
    return {"arch": "bert", "num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "seq_length": seq, "vocab_size": vocab, "bert": bert}  # fmt: skip


def t5_model(
    layers: int, dec_layers: int, d: int, heads: int, d_kv: int, d_ff: int, ff: str, vocab: int = 32128,
    seq: int = 512, dec_seq: int = 128,
) -> dict[str, Any]:  # fmt: skip
    return {"arch": "t5", "num_layers": layers, "hidden_size": d, "num_attention_heads": heads,
            "ffn_hidden_size": d_ff, "seq_length": seq, "vocab_size": vocab,
            "t5": {"num_decoder_layers": dec_layers, "kv_channels": d_kv, "feed_forward": ff,
                   "decoder_seq_length": dec_seq}}  # fmt: skip


def hf_bert(m: dict[str, Any], eager: bool = False) -> Any:
    cfg = transformers.BertConfig(
        vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], num_hidden_layers=m["num_layers"],
        num_attention_heads=m["num_attention_heads"], intermediate_size=4 * m["hidden_size"],
        max_position_embeddings=m["seq_length"], type_vocab_size=m["bert"].get("num_tokentypes", 2),
    )  # fmt: skip
    if eager:
        cfg._attn_implementation = "eager"  # (the CPU's SDPA kernel is invisible to FlopCounterMode)
    binary = m["bert"].get("binary_head", True)
    return (transformers.BertForPreTraining if binary else transformers.BertForMaskedLM)(cfg)


def hf_t5(m: dict[str, Any], eager: bool = False) -> Any:
    t = m["t5"]
    cfg = transformers.T5Config(
        vocab_size=m["vocab_size"], d_model=m["hidden_size"], d_kv=t["kv_channels"],
        d_ff=m["ffn_hidden_size"], num_layers=m["num_layers"], num_decoder_layers=t["num_decoder_layers"],
        num_heads=m["num_attention_heads"], feed_forward_proj=t["feed_forward"],
    )  # fmt: skip
    if eager:
        cfg._attn_implementation = "eager"
    untied = t["feed_forward"] == "gated-gelu"
    cfg.tie_word_embeddings = not untied  # (transformers 5's constructor always ties)
    model = transformers.T5ForConditionalGeneration(cfg)
    if untied:
        # v1.1's checkpoints: one embedding for both stacks, an lm_head of its own (transformers 5
        # unties the stacks' embeddings too when the flag is false).
        model.encoder.embed_tokens = model.decoder.embed_tokens = model.shared
    return model


def hf_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())  # (shared tensors once)


BERT_LARGE = bert_model(24, 1024, 16, 30522)
T5_11B = t5_model(24, 24, 1024, 128, 128, 65536, "relu")
PARAMETER_CASES = {
    "bert-tiny": bert_model(2, 64, 4, 256, seq=32),
    "bert-tiny-mlm-only": bert_model(2, 64, 4, 256, seq=32, binary_head=False, num_tokentypes=0),
    "bert-tiny-post-norm": bert_model(3, 64, 4, 384, seq=64, post_layernorm=True),
    "bert-large": BERT_LARGE,
    "t5-tiny-relu": t5_model(3, 2, 64, 4, 16, 128, "relu", vocab=256, seq=32, dec_seq=12),
    "t5-tiny-gated": t5_model(2, 3, 64, 4, 24, 96, "gated-gelu", vocab=256, seq=32, dec_seq=16),
    "t5-11b": T5_11B,
    "t5-v1.1-xl": t5_model(24, 24, 2048, 32, 64, 5120, "gated-gelu"),
}


@pytest.mark.parametrize("name", list(PARAMETER_CASES))
def test_parameter_counts_equal_transformers(name: str) -> None:
    m = PARAMETER_CASES[name]
    with torch.device("meta"):
        hf = hf_params(hf_bert(m) if m["arch"] == "bert" else hf_t5(m))
    shape = shape_of_spec(job(m), m["vocab_size"])
    # The engine pads the vocabulary to a multiple of 128 rows: BERT-large's 30522 become 30592,
    # each padded row an embedding row and (BERT) a decoder bias.
    padded = (shape.vocab_size - m["vocab_size"]) * (m["hidden_size"] + (1 if m["arch"] == "bert" else 0))
    assert param_counts(shape)["total"] == hf + padded


def test_the_published_sizes() -> None:
    assert param_counts(shape_of_spec(job(T5_11B), 32128))["total"] == 11_307_321_344  # "T5-11B"
    bert = dataclasses.replace(shape_of_spec(job(BERT_LARGE), 30522), vocab_size=30522)
    assert param_counts(bert)["total"] == 336_226_108  # BERT-large with its MLM and NSP heads


def test_the_engines_models_hold_what_the_planner_counts() -> None:
    from megatrain.engine.models.t5 import T5Config, T5Model

    cfg = T5Config(num_layers=3, num_decoder_layers=2, hidden_size=64, num_attention_heads=4,
                   kv_channels=24, ffn_hidden_size=96, vocab_size=256, activation="gated-gelu",
                   tie_embeddings=False)  # fmt: skip
    with torch.device("meta"):
        engine = sum(p.numel() for p in T5Model(cfg).parameters())
    assert param_counts(ModelShape.of(cfg))["total"] == engine


def test_stages_hold_the_copies_the_pipeline_keeps() -> None:
    m = shape_of_spec(job(T5_11B), 32128)
    h, v, table = m.hidden_size, m.vocab_size, 32 * m.num_attention_heads
    split = (8, 8, 8, 24)  # three encoder stages, one decoder stage (also the last)
    parts = [stage_params(m, 1, 4, s, split) for s in range(4)]
    assert [t5_split_rank(m, 4, split)] == [3]
    # Stage 0 embeds; stage 3 embeds the decoder's tokens with a copy, which is the tied head too.
    assert "embedding" in parts[0] and parts[3]["decoder_embedding"] == v * h and "lm_head" not in parts[3]
    assert [("encoder_position_bias" in p, "decoder_position_bias" in p) for p in parts] == [
        (True, False), (True, False), (True, False), (False, True)]  # fmt: skip
    total = sum(sum(p.values()) for p in parts)
    assert total == param_counts(m)["total"] + v * h + 2 * table  # one embedding copy, two tables
    # Split again with a decoder stage before the last: the tied head needs one more copy.
    parts = [stage_params(m, 1, 4, s, (12, 12, 12, 12)) for s in range(4)]
    assert parts[3]["lm_head"] == v * h and parts[2]["decoder_embedding"] == v * h


# -- FLOPs -----------------------------------------------------------------------------------------


FLOP_CASES = {
    "bert": bert_model(2, 64, 4, 256, seq=32),
    "bert-mlm-only": bert_model(2, 64, 4, 256, seq=32, binary_head=False),
    "t5-relu": t5_model(3, 2, 64, 4, 24, 128, "relu", vocab=256, seq=32, dec_seq=12),
    "t5-gated": t5_model(2, 3, 64, 4, 16, 96, "gated-gelu", vocab=256, seq=24, dec_seq=40),
}


@pytest.mark.parametrize("name", list(FLOP_CASES))
def test_flops_equal_a_torch_flop_counter_over_transformers(name: str) -> None:
    """Every matmul transformers' model runs, counted by torch, forward × 3 for a training step.
    Exact: both count the GEMMs and attention's two batched matmuls and nothing elementwise (the
    softmax, norms, GELU, the relative position bias); the counter sees attention only on the eager
    path (on a CPU, SDPA's fused kernel is not among the ops it counts)."""
    m, batch = FLOP_CASES[name], 3
    torch.manual_seed(0)
    tokens = torch.randint(0, m["vocab_size"], (batch, m["seq_length"]))
    if m["arch"] == "bert":
        model = hf_bert(m, eager=True).eval()
        inputs = {"input_ids": tokens, "token_type_ids": torch.zeros_like(tokens)}
    else:
        model = hf_t5(m, eager=True).eval()
        dec = torch.randint(0, m["vocab_size"], (batch, m["t5"]["decoder_seq_length"]))
        inputs = {"input_ids": tokens, "decoder_input_ids": dec}
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(**inputs)
    shape = shape_of_spec(job(m), m["vocab_size"])
    assert flops_per_iteration(shape, batch) == pytest.approx(3 * counter.get_total_flops(), rel=1e-12)


def test_bert_flops_are_megatrons_formula_plus_its_heads() -> None:
    m = dataclasses.replace(shape_of_spec(job(BERT_LARGE), 30522), vocab_size=30522)
    B, s, L, h, V = 256, 512, 24, 1024, 30522
    megatron = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))  # num_floating_point_operations
    heads = 3 * B * (s * 2 * h * h + 2 * h * h + 2 * h * 2)  # MLM transform per token; pooler + binary
    assert flops_per_iteration(m, B) == pytest.approx(megatron + heads, rel=1e-12)


def test_t5_flops_by_hand() -> None:
    m = shape_of_spec(job(T5_11B), 32128)
    Le = Ld = 24
    te, td, h, q, f, V = 512, 128, 1024, 128 * 128, 65536, 32128
    layer = 2 * h * 3 * q + 2 * q * h + 2 * 2 * h * f  # qkv, proj, relu MLP
    encoder = te * Le * (layer + 4 * te * q)
    decoder = td * Ld * (layer + 4 * td * q + 2 * h * q + 4 * te * q + 2 * q * h) + te * Ld * 2 * h * 2 * q
    forward = encoder + decoder + td * 2 * h * V
    assert flops_per_iteration(m, 8) == pytest.approx(3 * 8 * forward, rel=1e-12)
    assert flops_per_token(m) == pytest.approx(3 * forward / te, rel=1e-12)  # per encoder token


# -- memory ----------------------------------------------------------------------------------------


def test_bidirectional_layers_save_what_causal_ones_do() -> None:
    bert = shape_of_spec(job(BERT_LARGE), 30522)
    gpt2 = dataclasses.replace(bert, family="gpt")
    for attention in ("flash", "math"):
        saved = [
            layer_activations(m, tp=2, sp=True, act=2, mask=1, attention=attention, selective=False)
            for m in (bert, gpt2)
        ]
        assert saved[0] == saved[1]


def test_bert_scores_only_its_masked_rows() -> None:
    bert = shape_of_spec(job(BERT_LARGE), 30522)
    est = estimate_memory(bert, tp=2, micro_batch_size=8, num_microbatches=4)
    tokens = 8 * 512
    assert est.breakdown["activations_log_probs"] == int(MLM_FRACTION * tokens * 4 * bert.vocab_size / 2)
    assert est.breakdown["activations_mlm_masked_rows"] == int(MLM_FRACTION * tokens * 2 * 1024)


def test_t5_decoder_stages_hold_the_encoder_output_and_cross_attention() -> None:
    m = shape_of_spec(job(T5_11B), 32128)
    mbs, tp, split = 2, 8, (12, 12, 12, 12)
    stages = [estimate_memory(m, tp=tp, pp=4, micro_batch_size=mbs, num_microbatches=8, pipeline_layers=split,
                              stage=s, fused_loss=True) for s in range(4)]  # fmt: skip
    held = [s.breakdown.get("activations_encoder_output", 0) for s in stages]
    in_flight = [s.breakdown["microbatches_in_flight"] for s in stages]
    assert held[:2] == [0, 0]
    expected = [int(in_flight[i] * mbs * 512 * 2 * 1024) for i in (2, 3)]  # (B, Te, h) per micro-batch
    assert held[2:] == expected
    # A decoder layer's K and V over the encoder's tokens: Te/Td of its own tokens' worth, per layer.
    longer = dataclasses.replace(m, seq_length=1024)
    grow = [estimate_memory(x, tp=tp, pp=4, micro_batch_size=mbs, num_microbatches=8, pipeline_layers=split,
                            stage=2, fused_loss=True) for x in (m, longer)]  # fmt: skip
    kv = 12 * in_flight[2] * mbs * 512 * 2 * 2 * 128 * 128 / tp  # 12 layers, 512 more encoder tokens
    added = grow[1].breakdown["activations_decoder_layers"] - grow[0].breakdown["activations_decoder_layers"]
    assert added == pytest.approx(kv, rel=1e-6)
    # The encoder's position-bias mask grows with Te² on an encoder stage.
    enc = [estimate_memory(x, tp=tp, pp=4, micro_batch_size=mbs, num_microbatches=8, pipeline_layers=split,
                           stage=0) for x in (m, longer)]  # fmt: skip
    bias = [e.breakdown["activations_position_bias"] for e in enc]
    assert bias[1] == pytest.approx(4 * bias[0], rel=1e-6)


# -- the pipeline split, step time and the planner -------------------------------------------------


def test_t5_split_balances_the_slowest_stage() -> None:
    assert t5_split(12, 12, 3, encoder_s=1.0, decoder_s=2.0) == (12, 6, 6)  # decoders twice as slow
    assert t5_split(12, 12, 3, encoder_s=2.0, decoder_s=1.0) == (6, 6, 12)
    assert t5_split(24, 24, 4, 1.0, 1.0, head_s=3.0) == (12, 12, 12, 12)
    assert t5_split(2, 30, 4, 1.0, 1.0) == (2, 10, 10, 10)  # every stage keeps a layer
    assert t5_split(24, 24, 1, 1.0, 1.0) is None


def test_the_planned_split_is_the_fastest_of_the_aligned_ones() -> None:
    m = shape_of_spec(job(T5_11B), 32128)
    pool = gpu_pool()
    settings = StepSettings(micro_batch_size=4, global_batch_size=512)

    def step(split: tuple[int, ...]) -> float:
        lay = Layout(tp=2, pp=4, dp=1, sequence_parallel=True, pipeline_layers=split)
        return predict_step(m, lay, settings, pool).step_time_s

    planned = t5_pipeline_layers(m, pool, "bf16", tp=2, pp=4, sp=True, micro_batch_size=4)
    assert planned is not None and sum(planned[: t5_split_rank(m, 4, planned)]) == 24
    others = [(24, 8, 8, 8), (12, 12, 12, 12), (8, 8, 8, 24), (6, 6, 12, 24), (16, 8, 12, 12)]
    assert step(planned) <= min(step(s) for s in others) * (1 + 1e-12)


def test_t5_layouts_the_engine_will_not_run_are_refused() -> None:
    def fields(parallelism: dict[str, Any], model: dict[str, Any] = T5_11B) -> dict[str, str]:
        spec = job(model, parallelism)
        return {p["field"]: p["message"] for p in layout_problems(spec, resolve_layout_unchecked(spec))}

    cp = fields({"cp": 2, "dp": 1})
    assert "model.arch t5" in cp["parallelism.cp"]
    assert "parallelism.virtual_stages" in fields({"pp": 2, "virtual_stages": 2, "dp": 1})
    # 48 layers over pp=3: 16 a stage, the boundary after layer 24 inside stage 1.
    assert "boundary" in fields({"pp": 3, "dp": 1})["parallelism.pipeline_layers"]
    assert "parallelism.pipeline_layers" in fields({"pp": 3, "dp": 1, "pipeline_layers": [20, 8, 20]})
    assert not fields({"pp": 3, "dp": 1, "pipeline_layers": [12, 12, 24]})
    assert not fields({"pp": 4, "dp": 1})  # 12 layers a stage: the boundary between stages 1 and 2
    short_dec = t5_model(2, 2, 64, 4, 16, 128, "relu", vocab=256, seq=32, dec_seq=6)
    assert "model.t5.decoder_seq_length" in fields({"tp": 4, "sequence_parallel": True, "dp": 1}, short_dec)
    with pytest.raises(SpecError) as err:
        resolve_layout(job(T5_11B, {"cp": 2, "dp": 1}))
    assert any(e["field"] == "parallelism.cp" for e in err.value.errors)
    # BERT runs every layout GPT does, context parallelism included.
    assert not layout_problems(job(BERT_LARGE, {"cp": 2, "dp": 1}), Layout(cp=2))


def resolve_layout_unchecked(spec: JobSpec) -> Layout:
    par = spec.parallelism
    assert not isinstance(par, str)
    return Layout(tp=par.tp, pp=par.pp, dp=1, cp=par.cp, virtual_stages=par.virtual_stages,
                  sequence_parallel=par.sequence_parallel,
                  pipeline_layers=tuple(par.pipeline_layers) if par.pipeline_layers else None)  # fmt: skip


def test_the_planner_plans_t5_without_cp_or_interleaving() -> None:
    planned = plan(job(T5_11B, gbs=512), gpu_pool(memory_gib=32), 8)
    result = planned.as_dict()
    layouts = [result["layout"], *(r["layout"] for r in result["candidates"]["runners_up"])]
    assert all(lay["cp"] == 1 and lay["virtual_stages"] == 1 for lay in layouts)
    m = shape_of_spec(job(T5_11B), 32128)
    piped = [lay for lay in layouts if lay["pp"] > 1]
    assert piped, layouts  # (32 GiB devices leave pp=4 among the fastest)
    for lay in piped:
        split = tuple(lay["pipeline_layers"])
        assert sum(split[: t5_split_rank(m, lay["pp"], split)]) == 24 and min(split) > 0
    cp = [r for r in planned.rejected if r.code == "cp_unsupported"]
    assert cp and all("parallelism.cp" in r.message and "model.arch t5" in r.message for r in cp)
    assert result["parameters"]["total"] == 11_307_321_344
    assert result["predicted"]["tokens_per_s"] == pytest.approx(
        512 * 512 / result["predicted"]["step_time_s"]
    )


def test_bert_and_t5_plans_show_gpts_columns() -> None:
    gpt = plan(job({"arch": "gpt2", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
                    "seq_length": 512, "vocab_size": 30522}), gpu_pool(), 8).as_dict()  # fmt: skip
    for model in (BERT_LARGE, T5_11B):
        result = plan(job(model, gbs=256), gpu_pool(), 8).as_dict()
        assert set(result) == set(gpt) and set(result["layout"]) == set(gpt["layout"])
        assert set(result["predicted"]) == set(gpt["predicted"])
        assert set(result["predicted"]["time_breakdown"]) == set(gpt["predicted"]["time_breakdown"])
        assert 0.05 < result["predicted"]["mfu"] < 0.8
