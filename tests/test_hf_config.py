"""config.json <-> model fields (megatrain.hf_config, torch-free): configs as transformers writes them
(its config classes' to_dict(), and Hub-style files in the older rope_scaling dialect), and our
exported configs read back by transformers' AutoConfig."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import (
    AutoConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
)

from megatrain.engine.config import MoEConfig, TransformerConfig, moe_config
from megatrain.hf_config import (
    HFConfigError,
    check_spec_against_hf,
    hf_config_from_model,
    model_fields_from_hf,
    spec_model_with_hf,
)
from megatrain.spec import ModelSpec, SpecError, parse_spec

_SHAPE = {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 128,
          "num_hidden_layers": 3, "vocab_size": 1000, "max_position_embeddings": 512}  # fmt: skip
LLAMA_FIELDS = {"arch": "llama", "num_layers": 3, "hidden_size": 64, "num_attention_heads": 8,
                "num_query_groups": 2, "ffn_hidden_size": 128, "vocab_size": 1000, "seq_length": 512,
                "norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None, "tie_embeddings": False,
                "qkv_bias": False}  # fmt: skip
# Llama 3.1 8B's config.json as published (the rope_scaling dialect of transformers 4.x).
LLAMA31 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
           "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
           "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
           "rope_theta": 500000.0, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"},
           "tie_word_embeddings": False, "vocab_size": 128256, "hidden_act": "silu",
           "attention_bias": False, "mlp_bias": False}  # fmt: skip


def test_hf_config_imports_no_torch() -> None:
    code = "import sys, megatrain.hf_config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_llama_mistral_qwen2_and_gpt2_fields() -> None:
    assert model_fields_from_hf(LlamaConfig(**_SHAPE).to_dict()) == LLAMA_FIELDS
    qwen = model_fields_from_hf(Qwen2Config(**_SHAPE, tie_word_embeddings=True).to_dict())
    assert qwen == {**LLAMA_FIELDS, "qkv_bias": True, "tie_embeddings": True}
    # Mistral's window (256) caps the default seq_length: within it, windowed attention is full attention.
    mistral = model_fields_from_hf(MistralConfig(**_SHAPE, sliding_window=256).to_dict())
    assert mistral == {**LLAMA_FIELDS, "seq_length": 256}
    gpt2 = model_fields_from_hf(GPT2Config(n_embd=64, n_head=8, n_layer=3, vocab_size=1000).to_dict())
    assert gpt2 == {"arch": "gpt2", "num_layers": 3, "hidden_size": 64, "num_attention_heads": 8,
                    "num_query_groups": 8, "ffn_hidden_size": 256, "vocab_size": 1000, "seq_length": 1024,
                    "norm_eps": 1e-5, "tie_embeddings": True}  # fmt: skip
    for fields in (qwen, mistral, gpt2):
        ModelSpec.model_validate(fields)  # every field is a valid model.* field


_MOE = {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.02}
MOE_FIELDS = {"num_experts": 8, "router_topk": 2, "router_score_function": "softmax", "aux_loss_coeff": 0.02}


def test_mixtral_and_qwen2_moe_fields() -> None:
    mixtral = model_fields_from_hf(MixtralConfig(**_SHAPE, **_MOE, num_local_experts=8).to_dict())
    assert mixtral == {**LLAMA_FIELDS, "norm_eps": 1e-5, "rope_theta": 1e6, "seq_length": 512, "moe": {
        **MOE_FIELDS, "ffn_hidden_size": 128, "layer_freq": 1, "router_pre_softmax": False}}  # fmt: skip
    qwen = Qwen2MoeConfig(
        **_SHAPE, **_MOE, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=96
    )
    assert model_fields_from_hf(qwen.to_dict()) == {**LLAMA_FIELDS, "qkv_bias": True, "moe": {
        **MOE_FIELDS, "ffn_hidden_size": 32, "layer_freq": 1, "shared_expert_ffn_hidden_size": 96,
        "shared_expert_gate": True, "router_pre_softmax": True}}  # fmt: skip
    # norm_topk_prob renormalises as Mixtral does; mlp_only_layers [1] of 3 leaves experts on layers 0 and 2.
    qwen = Qwen2MoeConfig(**_SHAPE, norm_topk_prob=True, mlp_only_layers=[1], qkv_bias=False).to_dict()
    fields = model_fields_from_hf(qwen)
    moe = fields["moe"]
    assert (moe["router_pre_softmax"], moe["layer_freq"], fields["qkv_bias"]) == (False, 2, False)
    for config in (mixtral, fields):
        spec = ModelSpec.model_validate(config)
        assert moe_config(spec) == MoEConfig(**config["moe"])


# Hub configs as published (transformers 4.x keys), trimmed of keys we do not read.
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
                "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
                "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05,
                "rope_theta": 1e6, "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2,
                "router_aux_loss_coef": 0.02, "output_router_logits": False, "vocab_size": 32000,
                "hidden_act": "silu", "tie_word_embeddings": False}  # fmt: skip
QWEN15_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
              "intermediate_size": 5632, "moe_intermediate_size": 1408,
              "shared_expert_intermediate_size": 5632,
              "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1,
              "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16,
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-06, "rope_theta": 1e6,
              "use_sliding_window": False, "sliding_window": 8192, "max_window_layers": 21,
              "router_aux_loss_coef": 0.001, "vocab_size": 151936, "hidden_act": "silu",
              "tie_word_embeddings": False}  # fmt: skip


def test_hub_moe_configs() -> None:
    mixtral = model_fields_from_hf(MIXTRAL_8X7B, seq_length=4096)
    assert (mixtral["moe"]["num_experts"], mixtral["moe"]["ffn_hidden_size"], mixtral["rope_theta"]) == (
        8, 14336, 1e6)  # fmt: skip
    qwen = model_fields_from_hf(QWEN15_MOE)
    assert (qwen["moe"]["num_experts"], qwen["moe"]["router_topk"], qwen["seq_length"]) == (60, 4, 8192)
    for fields in (mixtral, qwen):
        ModelSpec.model_validate(fields)
    # Without a theta, as transformers' MixtralConfig defaults it.
    bare = {k: v for k, v in MIXTRAL_8X7B.items() if k != "rope_theta"}
    theirs = MixtralConfig(**{k: v for k, v in bare.items() if k not in ("architectures", "model_type")})
    assert model_fields_from_hf(bare)["rope_theta"] == theirs.rope_parameters["rope_theta"] == 1e6


def test_rope_scaling_in_both_dialects() -> None:
    fields = model_fields_from_hf(LLAMA31, seq_length=8192)
    llama3 = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}  # fmt: skip
    assert (fields["rope_theta"], fields["rope_scaling"], fields["seq_length"]) == (500000.0, llama3, 8192)
    assert ModelSpec.model_validate(fields).rope_scaling.model_dump(exclude_none=True) == llama3
    # transformers 5 writes rope_parameters; its llama3 pretraining length defaults to max positions.
    params = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }
    v5 = LlamaConfig(**_SHAPE, rope_parameters=params).to_dict()
    assert model_fields_from_hf(v5)["rope_scaling"] == {**llama3, "original_max_position_embeddings": 512}
    linear = LlamaConfig(**_SHAPE, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    assert model_fields_from_hf(linear.to_dict())["rope_scaling"] == {"type": "linear", "factor": 2.0}


def _llama(**changes: Any) -> dict[str, Any]:
    return {**LLAMA31, **changes}


BAD: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("unknown model", _llama(model_type="roberta"), {}, "model_type"),
    ("o_proj bias", _llama(attention_bias=True), {}, "attention_bias"),
    ("mlp bias", _llama(mlp_bias=True), {}, "mlp_bias"),
    ("gelu llama", _llama(hidden_act="gelu"), {}, "hidden_act"),
    ("odd head_dim", _llama(head_dim=256), {}, "head_dim"),
    ("partial rotary", _llama(partial_rotary_factor=0.5), {}, "partial_rotary_factor"),
    ("yarn", _llama(rope_scaling={"rope_type": "yarn", "factor": 4.0}), {}, "rope_scaling.rope_type"),
    ("dynamic", _llama(rope_scaling=None, rope_parameters={"rope_type": "dynamic", "factor": 2.0}), {},
     "rope_parameters.rope_type"),
    ("llama3 without low_freq_factor", _llama(rope_scaling={"rope_type": "llama3", "factor": 8.0,
     "high_freq_factor": 4.0}), {}, "rope_scaling.low_freq_factor"),
    ("too long", _llama(), {"seq_length": 200000}, "max_position_embeddings"),
    ("window", MistralConfig(**_SHAPE, sliding_window=256).to_dict(), {"seq_length": 512}, "sliding_window"),
    ("qwen window", Qwen2Config(**_SHAPE, use_sliding_window=True, sliding_window=128).to_dict(),
     {"seq_length": 256}, "sliding_window"),
    ("gpt2 relu", GPT2Config(activation_function="relu").to_dict(), {}, "activation_function"),
    ("gpt2 layer scale", GPT2Config(scale_attn_by_inverse_layer_idx=True).to_dict(), {},
     "scale_attn_by_inverse_layer_idx"),
    ("missing layers", {k: v for k, v in LLAMA31.items() if k != "num_hidden_layers"}, {},
     "num_hidden_layers"),
    ("mixtral jitter", MixtralConfig(**_SHAPE, router_jitter_noise=0.1).to_dict(), {}, "router_jitter_noise"),
    ("mixtral window", MixtralConfig(**_SHAPE, sliding_window=128).to_dict(), {"seq_length": 256},
     "sliding_window"),
    # Experts on layers 1 (of 0, 1, 2): our layer_freq always includes layer 0.
    ("qwen sparse step", Qwen2MoeConfig(**_SHAPE, decoder_sparse_step=2).to_dict(), {},
     "decoder_sparse_step"),
    ("qwen dense layer 0", Qwen2MoeConfig(**_SHAPE, mlp_only_layers=[0]).to_dict(), {}, "mlp_only_layers"),
    ("qwen no experts", Qwen2MoeConfig(**_SHAPE, num_experts=0).to_dict(), {}, "num_experts"),
]  # fmt: skip


@pytest.mark.parametrize(("config", "kwargs", "key"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_unsupported_configs_name_the_key(config: dict[str, Any], kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(HFConfigError) as err:
        model_fields_from_hf(config, **kwargs)
    assert err.value.key == key and key in str(err.value)


def test_spec_checked_against_the_config() -> None:
    fields = model_fields_from_hf(LLAMA31, seq_length=8192)
    spec = {"arch": "llama", "hidden_size": 4096, "seq_length": 2048, "num_query_groups": None,
            "rope_theta": 5e5,
            "rope_scaling": {"type": "llama3", "factor": 8, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "nothing": None},
            "hidden_dropout": 0.1, "init_from": "hf:s3://models/llama"}  # fmt: skip
    assert check_spec_against_hf(spec, fields) == []  # a shorter seq_length is the spec's choice
    merged = spec_model_with_hf(spec, fields)
    assert (merged["seq_length"], merged["num_query_groups"], merged["hidden_dropout"]) == (2048, 8, 0.1)
    bad = {"hidden_size": 2048, "seq_length": 16384, "tie_embeddings": True, "rope_scaling": None,
           "rope_theta": 1e4, "arch": "gpt2", "qkv_bias": True}  # fmt: skip
    errors = check_spec_against_hf(bad, fields)
    assert [e["field"] for e in errors] == ["model.hidden_size", "model.seq_length", "model.tie_embeddings",
                                            "model.rope_theta", "model.arch", "model.qkv_bias"]  # fmt: skip
    assert errors[0]["message"] == "model.hidden_size=2048 disagrees with the checkpoint's config (4096)"
    assert "exceeds the checkpoint's maximum (8192)" in errors[1]["message"]
    moe = {"moe": {"num_experts": 8}}
    assert [e["field"] for e in check_spec_against_hf(moe, fields)] == ["model.moe"]  # a dense checkpoint


def test_moe_spec_checked_against_the_config_and_parsed() -> None:
    """How the experts compute must agree with the checkpoint; how they train is the spec's choice."""
    config = Qwen2MoeConfig(
        **_SHAPE, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=96
    )
    fields = model_fields_from_hf(config.to_dict(), seq_length=256)
    spec = {"init_from": "hf:/models/qwen-moe", "moe": {"num_experts": 8, "router_pre_softmax": True,
            "capacity_factor": 1.25, "aux_loss_coeff": 0.01, "z_loss_coeff": None}}  # fmt: skip
    assert check_spec_against_hf(spec, fields) == []
    model = spec_model_with_hf(spec, fields)
    parsed = parse_spec({"name": "x", "model": model, "data": {"train": [{"path": "/d"}]}}).model.moe
    assert parsed is not None
    assert (parsed.num_experts, parsed.ffn_hidden_size, parsed.shared_expert_ffn_hidden_size) == (8, 32, 96)
    assert (parsed.shared_expert_gate, parsed.router_pre_softmax, parsed.router_topk) == (True, True, 4)
    assert (parsed.capacity_factor, parsed.aux_loss_coeff) == (1.25, 0.01)
    bad = {
        "moe": {
            "num_experts": 4,
            "shared_expert_gate": False,
            "layer_freq": 1,
            "router_score_function": "sigmoid",
        }
    }
    errors = check_spec_against_hf(bad, fields)
    assert [e["field"] for e in errors] == ["model.moe.num_experts", "model.moe.shared_expert_gate",
                                            "model.moe.router_score_function"]  # fmt: skip
    assert errors[0]["message"] == "model.moe.num_experts=4 disagrees with the checkpoint's config (8)"


EXPORTS = {
    "gpt2": TransformerConfig.preset("tiny-gpt2", vocab_size=1024, vocab_size_unpadded=1000),
    "llama": TransformerConfig.preset("tiny-llama", rope_theta=5e5, rope_scaling={
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}),
    "llama-linear": TransformerConfig.preset("tiny-llama", rope_scaling={"type": "linear", "factor": 2.0}),
    "qwen2": TransformerConfig.preset("tiny-llama", qkv_bias=True, tie_embeddings=True),
    "mixtral": TransformerConfig.preset("tiny-llama", moe=MoEConfig(num_experts=4, router_topk=2,
                                        ffn_hidden_size=24, aux_loss_coeff=0.02)),
    # Experts on layers 0 and 2 of 3: mlp_only_layers [1].
    "qwen2_moe": TransformerConfig.preset("tiny-llama", num_layers=3, qkv_bias=True, moe=MoEConfig(
        num_experts=4, router_topk=2, ffn_hidden_size=24, layer_freq=2, shared_expert_ffn_hidden_size=40,
        shared_expert_gate=True, router_pre_softmax=True)),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_exported_config_reads_back_in_transformers(name: str, tmp_path: Path) -> None:
    cfg = EXPORTS[name]
    config = hf_config_from_model(cfg.to_dict(), dtype="float32", bos_token_id=1, eos_token_id=2)
    assert config["model_type"] == name.split("-")[0] and config["vocab_size"] == cfg.real_vocab_size
    (tmp_path / "config.json").write_text(json.dumps(config))
    theirs = AutoConfig.from_pretrained(tmp_path)
    assert theirs.to_dict()["architectures"] == config["architectures"]
    assert (theirs.vocab_size, theirs.num_hidden_layers, theirs.num_attention_heads, theirs.bos_token_id) == (
        cfg.real_vocab_size, cfg.num_layers, cfg.num_attention_heads, 1)  # fmt: skip
    if name != "gpt2":
        assert theirs.num_key_value_heads == cfg.num_query_groups
        params = {k: v for k, v in theirs.rope_parameters.items() if k != "rope_theta"}
        ours = dict(cfg.rope_scaling or {"type": "default"})
        assert params == {"rope_type": ours.pop("type"), **ours}
        assert theirs.rope_parameters["rope_theta"] == cfg.rope_theta
    # And back: the same model fields.
    fields = model_fields_from_hf(config)
    assert (fields["num_query_groups"], fields["tie_embeddings"], fields["seq_length"]) == (
        cfg.num_query_groups, cfg.tie_embeddings, cfg.seq_length)  # fmt: skip
    assert fields.get("rope_scaling") == cfg.rope_scaling and fields.get("qkv_bias", True) == cfg.has_qkv_bias
    assert moe_config(ModelSpec.model_validate(fields)) == cfg.moe


def test_export_refuses_models_transformers_cannot_express() -> None:
    gqa_gpt2 = TransformerConfig.preset("tiny-gpt2", num_query_groups=2)
    with pytest.raises(HFConfigError, match="grouped-query"):
        hf_config_from_model(gqa_gpt2.to_dict())
    with pytest.raises(HFConfigError, match="c_attn"):
        hf_config_from_model(TransformerConfig.preset("tiny-gpt2", qkv_bias=False).to_dict())
    biased_llama = TransformerConfig.preset("tiny-llama", add_bias=True)
    with pytest.raises(HFConfigError, match="add_bias"):
        hf_config_from_model(biased_llama.to_dict())


MOE_EXPORT_REFUSED = [
    ({"router_score_function": "sigmoid"}, {}, "moe.router_score_function"),
    ({"capacity_factor": 1.0}, {}, "moe.capacity_factor"),
    ({"shared_expert_ffn_hidden_size": 16}, {}, "moe.shared_expert_gate"),  # Qwen2-MoE gates it
    ({}, {"qkv_bias": True}, "qkv_bias"),  # Mixtral: no biases, no shared expert
    ({"router_pre_softmax": True}, {}, "moe.router_pre_softmax"),
    ({"layer_freq": 2}, {}, "moe.layer_freq"),
    ({}, {"position_embedding": "learned"}, "moe"),
]


@pytest.mark.parametrize(("moe", "model", "key"), MOE_EXPORT_REFUSED)
def test_moe_export_refuses_what_mixtral_and_qwen2_moe_cannot_express(
    moe: dict[str, Any], model: dict[str, Any], key: str
) -> None:
    fields = {"num_experts": 4, "router_topk": 2, "ffn_hidden_size": 24, **moe}
    cfg = TransformerConfig.preset("tiny-llama", moe=MoEConfig(**fields), **model)
    with pytest.raises(HFConfigError) as err:
        hf_config_from_model(cfg.to_dict())
    assert err.value.key == key


SPEC_RULES = [
    ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "model.rope_scaling", "low_freq_factor"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0, "low_freq_factor": 1.0}},
     "model.rope_scaling.low_freq_factor", "only for type llama3"),
    ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "model.rope_scaling.type", "linear"),
    ({"arch": "gpt2", "rope_scaling": {"type": "linear", "factor": 2.0}}, "model.rope_scaling", "arch llama"),
    ({"init_from": "hf:gpt2"}, "model.init_from", "hf:URL"),
    ({"init_from": "hf:"}, "model.init_from", "hf:URL"),
]  # fmt: skip


@pytest.mark.parametrize(("model", "field", "text"), SPEC_RULES)
def test_model_spec_rules_for_hf_fields(model: dict[str, Any], field: str, text: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec({"name": "x", "model": model, "data": {"train": [{"path": "file:///d"}]}})
    assert [(e["field"], text in e["message"]) for e in err.value.errors] == [(field, True)]


def test_model_spec_accepts_hf_init_and_fields() -> None:
    for url in ("hf:file:///models/llama", "hf:s3://bucket/llama", "hf:/models/llama"):
        spec = parse_spec(
            {"name": "x", "model": {"init_from": url, "qkv_bias": True}, "data": {"train": [{"path": "/d"}]}}
        )
        assert spec.model.init_from == url and spec.model.qkv_bias


def test_a_bert_spec_is_checked_against_a_bert_folder_key_by_key() -> None:
    """A classifier may start from a pre-training checkpoint: model.bert's heads (binary_head,
    num_labels) are the spec's choice, its norm order and token types the checkpoint's."""
    config = {"model_type": "bert", "architectures": ["BertForPreTraining"], "hidden_size": 32,
              "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
              "max_position_embeddings": 64, "vocab_size": 100, "hidden_act": "gelu",
              "type_vocab_size": 2}  # fmt: skip
    fields = model_fields_from_hf(config)
    assert fields["bert"] == {"post_layernorm": True, "num_tokentypes": 2, "binary_head": True}
    spec = {"arch": "bert", "bert": {"num_labels": 3, "post_layernorm": True}}
    assert check_spec_against_hf(spec, fields) == []
    merged = spec_model_with_hf(spec, fields)
    assert merged["bert"] == {
        "post_layernorm": True,
        "num_tokentypes": 2,
        "binary_head": True,
        "num_labels": 3,
    }
    wrong = {"arch": "bert", "bert": {"post_layernorm": False}}
    assert [e["field"] for e in check_spec_against_hf(wrong, fields)] == ["model.bert.post_layernorm"]
