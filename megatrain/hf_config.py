"""Hugging Face config.json <-> our model fields, without torch (the API checks specs with it).

Families: BERT (hf_config_bert), T5 (hf_config_t5: import only; interop.hf_t5 exports), GPT-2
(model_type gpt2) and the Llama family (llama, mistral, qwen2: RoPE, RMSNorm,
SwiGLU, grouped-query attention; Qwen2 adds biases on q/k/v), and its mixtures of experts (mixtral;
qwen2_moe, with a sigmoid-gated shared expert) as `model.moe`. Both config.json dialects are read:
transformers 5's `rope_parameters` and the older `rope_theta` + `rope_scaling` (which wins when both
are present, as transformers itself resolves them). Anything our model cannot compute exactly is a
`HFConfigError` naming the config key, never a silently different model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from megatrain.hf_config_base import HFConfigError  # noqa: F401  (re-exported)
from megatrain.hf_config_base import refuse as _refuse
from megatrain.hf_config_base import require as _require
from megatrain.hf_config_bert import BERT_BLOCK_KEYS, bert_config, bert_fields
from megatrain.hf_config_t5 import T5_BLOCK_KEYS, t5_fields
from megatrain.spec_moe import MoESpec

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
MOE_FAMILY = ("mixtral", "qwen2_moe")
"""Llama-family attention with MoE MLPs (model.moe)."""
SUPPORTED_MODEL_TYPES = ("gpt2", *LLAMA_FAMILY, *MOE_FAMILY, "bert", "t5")
ROPE_TYPES = ("linear", "llama3")
LLAMA3_KEYS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
GPT2_GELUS = ("gelu_new", "gelu_pytorch_tanh")
"""GPT-2's activations that equal our tanh-approximated GELU."""
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM"}  # fmt: skip
SAME_AS = {"mistral": "llama"}
"""A family whose config.json describes the same computation as another's: an export names the
family the model came from (its hf_family) where the shape alone gives the other."""
DEFAULT_THETA = {"mixtral": 1e6}
"""rope_theta where a config.json names none, as transformers' config class defaults it (else 1e4)."""
MOE_TRAINING_FIELDS = ("aux_loss_coeff", "z_loss_coeff", "capacity_factor")
"""model.moe fields that say how a model trains, not what it computes: a spec's own choice."""


def model_fields_from_hf(config: Mapping[str, Any], seq_length: int | None = None) -> dict[str, Any]:
    """ModelSpec fields (model.*) for a transformers config.json.

    seq_length: the spec's choice (<= the config's maximum); None takes max_position_embeddings
    (n_positions for GPT-2), capped at a sliding attention window, within which windowed attention
    equals the full causal attention we compute."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFConfigError("model_type", f"{model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type == "bert":
        fields = bert_fields(config)
    elif model_type == "t5":
        fields = t5_fields(config)
    else:
        fields = _gpt2_fields(config) if model_type == "gpt2" else _llama_fields(config, model_type)
    if model_type in MOE_FAMILY:
        fields["moe"] = _moe_fields(config, model_type, fields["num_layers"])
    max_len, window = fields.pop("seq_length"), fields.pop("_window", None)
    if seq_length is None:
        seq_length = min(max_len, window) if window else max_len
    if seq_length > max_len:
        raise HFConfigError("max_position_embeddings", f"{max_len} is shorter than seq_length={seq_length}")
    if window and window < seq_length:
        raise HFConfigError("sliding_window", f"{window} is smaller than seq_length={seq_length}")
    return {**fields, "seq_length": seq_length}


def _gpt2_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    _refuse(config, "activation_function", GPT2_GELUS, "GPT-2's tanh GELU only")
    _refuse(config, "scale_attn_weights", True, "attention is scaled by 1/sqrt(head_dim)")
    _refuse(config, "scale_attn_by_inverse_layer_idx", False, "no per-layer attention scale")
    _refuse(config, "add_cross_attention", False, "decoder-only")
    hidden = _require(config, "n_embd")
    heads = _require(config, "n_head")
    return {
        "arch": "gpt2",
        "num_layers": _require(config, "n_layer"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": heads,
        "ffn_hidden_size": config.get("n_inner") or 4 * hidden,
        "vocab_size": _require(config, "vocab_size"),
        "seq_length": _require(config, "n_positions", config.get("n_ctx")),
        "norm_eps": config.get("layer_norm_epsilon", 1e-5),
        "tie_embeddings": config.get("tie_word_embeddings", True),
    }


def _llama_fields(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    _refuse(config, "hidden_act", ("silu", "swish"), "SwiGLU only")
    _refuse(config, "mlp_bias", False, "the MLP has no biases")
    _refuse(config, "partial_rotary_factor", 1.0, "rotary embedding over the whole head")
    # Llama's attention_bias also puts a bias on o_proj; Qwen2's biases are on q/k/v only.
    _refuse(config, "attention_bias", False, "a bias on o_proj; only q/k/v biases (Qwen2) are supported")
    hidden = _require(config, "hidden_size")
    heads = _require(config, "num_attention_heads")
    if config.get("head_dim") not in (None, hidden // heads):
        raise HFConfigError("head_dim", f"{config['head_dim']} is not hidden_size / num_attention_heads")
    theta, scaling = _rope(config, DEFAULT_THETA.get(model_type, 10000.0))
    return {
        "arch": "llama",
        "num_layers": _require(config, "num_hidden_layers"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": config.get("num_key_value_heads") or heads,
        "ffn_hidden_size": _require(config, "intermediate_size"),
        "vocab_size": _require(config, "vocab_size"),
        "seq_length": _require(config, "max_position_embeddings"),
        "_window": _sliding_window(config, model_type),
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "tie_embeddings": config.get("tie_word_embeddings", False),
        "qkv_bias": model_type == "qwen2" or (model_type == "qwen2_moe" and config.get("qkv_bias", True)),
    }


def _sliding_window(config: Mapping[str, Any], model_type: str) -> int | None:
    if model_type in ("mistral", "mixtral"):
        return config.get("sliding_window")
    if model_type in ("qwen2", "qwen2_moe"):
        layer_types = config.get("layer_types") or []
        if config.get("use_sliding_window") or "sliding_attention" in layer_types:
            return config.get("sliding_window")
    return None


def _moe_fields(config: Mapping[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """model.moe for a Mixtral or Qwen2-MoE config. router_aux_loss_coef becomes aux_loss_coeff as it
    is (transformers averages its loss over the layers, Megatron adds each layer's)."""
    common = {"router_topk": _require(config, "num_experts_per_tok"), "router_score_function": "softmax",
              "aux_loss_coeff": float(config.get("router_aux_loss_coef", 0.001))}  # fmt: skip
    if model_type == "mixtral":
        _refuse(config, "router_jitter_noise", (0, 0.0), "no noise on the router's input in training")
        return {
            "num_experts": _require(config, "num_local_experts"),
            "ffn_hidden_size": _require(config, "intermediate_size"),
            "layer_freq": 1,
            "router_pre_softmax": False,  # top-k weights renormalised to sum to 1
            **common,
        }
    if not _require(config, "num_experts"):
        raise HFConfigError("num_experts", "0 (no layer has experts): not supported")
    shared = _require(config, "shared_expert_intermediate_size")
    if shared < 1:
        raise HFConfigError(
            "shared_expert_intermediate_size", f"{shared}: Qwen2-MoE's shared expert needs a width"
        )
    return {
        "num_experts": config["num_experts"],
        "ffn_hidden_size": _require(config, "moe_intermediate_size"),
        "layer_freq": _qwen_layer_freq(config, num_layers),
        "shared_expert_ffn_hidden_size": shared,
        "shared_expert_gate": True,
        # norm_topk_prob false: the softmax's top-k probabilities as they are (Megatron's pre-softmax).
        "router_pre_softmax": not config.get("norm_topk_prob", False),
        **common,
    }


def _qwen_layer_freq(config: Mapping[str, Any], num_layers: int) -> int:
    """Qwen2-MoE's experts are on layers i with (i + 1) % decoder_sparse_step == 0, except
    mlp_only_layers; ours on layers i % layer_freq == 0: the layer_freq giving the same layers."""
    step = config.get("decoder_sparse_step") or 1
    dense = set(config.get("mlp_only_layers") or ())
    moe = [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]
    if not moe:
        raise HFConfigError("mlp_only_layers" if dense else "decoder_sparse_step", "no layer has experts")
    for freq in range(1, num_layers + 1):
        if moe == list(range(0, num_layers, freq)):
            return freq
    key = "mlp_only_layers" if dense else "decoder_sparse_step"
    raise HFConfigError(
        key,
        f"{config.get(key)!r} puts experts on layers {moe}; model.moe.layer_freq k puts them on layers "
        "0, k, 2k, ... only",
    )


def _rope(config: Mapping[str, Any], default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and our rope_scaling ({"type", "factor", ...}) from either config dialect."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    params = dict(config.get(key) or {})
    if any(isinstance(v, Mapping) for v in params.values()):
        raise HFConfigError(key, "per-layer rope parameters are not supported")
    # As transformers resolves it: the rope dict's own theta, else the top-level key.
    v5_params = config.get("rope_parameters") or {}
    theta = float(
        params.get("rope_theta") or config.get("rope_theta") or v5_params.get("rope_theta") or default_theta
    )
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ROPE_TYPES:
        raise HFConfigError(f"{key}.rope_type", f"{kind!r} is not one of default, {', '.join(ROPE_TYPES)}")
    if "factor" not in params:
        raise HFConfigError(f"{key}.factor", "is missing")
    scaling: dict[str, Any] = {"type": kind, "factor": float(params["factor"])}
    if kind == "llama3":
        # As transformers does: the pretraining context defaults to max_position_embeddings.
        params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
        for name in LLAMA3_KEYS:
            if params.get(name) is None:
                raise HFConfigError(f"{key}.{name}", "is missing")
        scaling.update(
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    return theta, scaling


def check_spec_against_hf(model_spec: Mapping[str, Any], fields: Mapping[str, Any]) -> list[dict[str, str]]:
    """[{"field": "model.X", "message": ...}] for each explicit (non-null) model field of a spec that
    disagrees with a checkpoint's fields (model_fields_from_hf); a shorter seq_length is allowed."""
    errors = []
    for key, value in model_spec.items():
        if key == "moe" and value is not None:
            errors += _moe_errors(value, fields.get("moe"))
            continue
        if key == "bert" and isinstance(value, Mapping) and isinstance(fields.get("bert"), Mapping):
            for k in BERT_BLOCK_KEYS:  # (the heads, binary_head and num_labels, are the spec's choice)
                theirs = fields["bert"].get(k)
                if value.get(k) is not None and theirs is not None and not _same(value[k], theirs):
                    why = f"model.bert.{k}={value[k]!r} disagrees with the checkpoint's config ({theirs!r})"
                    errors.append(_error(f"bert.{k}", why))
            continue
        if key == "t5" and isinstance(value, Mapping) and isinstance(fields.get("t5"), Mapping):
            for k in T5_BLOCK_KEYS:  # (the decoder's length is the spec's choice)
                theirs = fields["t5"][k]
                if value.get(k) is not None and not _same(value[k], theirs):
                    why = f"model.t5.{k}={value[k]!r} disagrees with the checkpoint's config ({theirs!r})"
                    errors.append(_error(f"t5.{k}", why))
            continue
        if value is None or key not in fields:
            continue
        expected = fields[key]
        if key == "seq_length":
            if value > expected:
                errors.append(
                    _error(key, f"model.seq_length={value} exceeds the checkpoint's maximum ({expected})")
                )
        elif not _same(value, expected):
            errors.append(
                _error(key, f"model.{key}={value!r} disagrees with the checkpoint's config ({expected!r})")
            )
    return errors


def spec_model_with_hf(model_spec: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """A spec's model section completed from a checkpoint's fields: the spec's explicit values (which
    check_spec_against_hf found consistent) over the checkpoint's; model.moe merged field by field."""
    merged = {**fields, **{k: v for k, v in model_spec.items() if v is not None}}
    for block in ("moe", "t5", "bert"):  # merged field by field
        ours = model_spec.get(block)
        if isinstance(ours, Mapping) and isinstance(fields.get(block), Mapping):
            merged[block] = {**fields[block], **{k: v for k, v in ours.items() if v is not None}}
    return merged


def _moe_errors(spec_moe: Any, checkpoint_moe: Mapping[str, Any] | None) -> list[dict[str, str]]:
    """A spec's explicit model.moe fields against a checkpoint's (its training fields are free)."""
    if checkpoint_moe is None:
        return [_error("moe", "model.moe is set but the checkpoint's model has no experts")]
    if not isinstance(spec_moe, Mapping):
        return []  # not a mapping: the spec's own validation names it
    errors = []
    for key, value in spec_moe.items():
        if value is None or key in MOE_TRAINING_FIELDS or key not in MoESpec.model_fields:
            continue
        expected = checkpoint_moe.get(key, MoESpec.model_fields[key].default)
        if not _same(value, expected):
            errors.append(
                _error(
                    f"moe.{key}",
                    f"model.moe.{key}={value!r} disagrees with the checkpoint's config ({expected!r})",
                )
            )
    return errors


def _error(key: str, message: str) -> dict[str, str]:
    return {"field": f"model.{key}", "message": message}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        a = {k: v for k, v in a.items() if v is not None}
        b = {k: v for k, v in b.items() if v is not None}
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float | int) and isinstance(b, float | int) and not isinstance(a, bool | None):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


def hf_config_from_model(
    model: Mapping[str, Any],
    *,
    dtype: str = "bfloat16",
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> dict[str, Any]:
    """A transformers config.json for a TransformerConfig (as its to_dict()): GPT-2 for learned
    positions, Qwen2 for RoPE with q/k/v biases, else Llama (Mistral for a model that came from one:
    its hf_family); with experts, Qwen2-MoE for a shared expert, else Mixtral. vocab_size is the
    real vocabulary."""
    m = dict(model)
    qkv_bias = m["add_bias"] if m.get("qkv_bias") is None else m["qkv_bias"]
    if m.get("bidirectional"):
        return {
            **bert_config(m),
            "vocab_size": m.get("vocab_size_unpadded") or m["vocab_size"],
            "tie_word_embeddings": True,
            "initializer_range": m["init_method_std"],
            "torch_dtype": dtype,
            "dtype": dtype,
        }
    if m.get("moe") and m["position_embedding"] == "learned":
        raise HFConfigError("moe", "transformers has no GPT-2 with experts")
    if m.get("moe"):
        model_type = _moe_model_type(m, qkv_bias)
        wanted = {"normalization": "rmsnorm", "activation": "swiglu", "add_bias": False}
    elif m["position_embedding"] == "learned":
        model_type = "gpt2"
        wanted = {"normalization": "layernorm", "activation": "gelu", "add_bias": True}
        if m["num_query_groups"] != m["num_attention_heads"]:
            raise HFConfigError("num_key_value_heads", "GPT-2 has no grouped-query attention")
        if not qkv_bias:
            raise HFConfigError("qkv_bias", "GPT-2's c_attn always has a bias")
    else:
        model_type = "qwen2" if qkv_bias else "llama"
        wanted = {"normalization": "rmsnorm", "activation": "swiglu", "add_bias": False}
    family = m.get("hf_family")
    if family is not None and SAME_AS.get(family) == model_type:
        model_type = family
    for key, value in wanted.items():
        if m[key] != value:
            raise HFConfigError(key, f"{model_type} needs {key}={value!r}, this model has {m[key]!r}")
    common = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": m.get("vocab_size_unpadded") or m["vocab_size"],
        "tie_word_embeddings": m["tie_embeddings"],
        "initializer_range": m["init_method_std"],
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }
    if model_type == "gpt2":
        return {**common, **_gpt2_config(m)}
    if model_type in MOE_FAMILY:
        return {**common, **_llama_config(m, model_type), **_moe_config(m, model_type, qkv_bias)}
    return {**common, **_llama_config(m, model_type)}


def _moe_model_type(m: dict[str, Any], qkv_bias: bool) -> str:
    """qwen2_moe for a model with a shared expert (which Qwen2-MoE always gates), else mixtral (no
    q/k/v biases, MoE on every layer, top-k weights renormalised); HFConfigError for the rest."""
    moe = m["moe"]
    if moe["router_score_function"] != "softmax" or moe.get("router_num_groups") is not None:
        raise HFConfigError("moe.router_score_function", "Mixtral and Qwen2-MoE route by a plain softmax")
    if moe.get("capacity_factor") is not None:
        raise HFConfigError("moe.capacity_factor", "transformers' MoE layers drop no tokens")
    if moe.get("shared_expert_ffn_hidden_size") is not None:
        if not moe.get("shared_expert_gate"):
            raise HFConfigError("moe.shared_expert_gate", "Qwen2-MoE always gates its shared expert")
        return "qwen2_moe"
    if qkv_bias:
        raise HFConfigError("qkv_bias", "Mixtral has no q/k/v biases (Qwen2-MoE has, with a shared expert)")
    if moe.get("router_pre_softmax"):
        raise HFConfigError("moe.router_pre_softmax", "Mixtral renormalises its top-k weights")
    if moe["layer_freq"] != 1 and m["num_layers"] > 1:
        raise HFConfigError("moe.layer_freq", "Mixtral has experts on every layer")
    return "mixtral"


def _moe_config(m: dict[str, Any], model_type: str, qkv_bias: bool) -> dict[str, Any]:
    """Mixtral's or Qwen2-MoE's config.json keys (over the Llama ones)."""
    moe = m["moe"]
    common = {"num_experts_per_tok": moe["router_topk"], "router_aux_loss_coef": moe["aux_loss_coeff"],
              "output_router_logits": False, "sliding_window": None}  # fmt: skip
    if model_type == "mixtral":
        return {
            **common,
            "num_local_experts": moe["num_experts"],
            "intermediate_size": moe["ffn_hidden_size"],
            "router_jitter_noise": 0.0,
        }
    freq = moe["layer_freq"]
    return {
        **common,
        "num_experts": moe["num_experts"],
        "moe_intermediate_size": moe["ffn_hidden_size"],
        "shared_expert_intermediate_size": moe["shared_expert_ffn_hidden_size"],
        "norm_topk_prob": not moe.get("router_pre_softmax", False),
        # Every layer's MoE-ness spelled out: decoder_sparse_step counts from layer 1, ours from 0.
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(m["num_layers"]) if i % freq],
        "qkv_bias": qkv_bias,
        "use_sliding_window": False,
        "max_window_layers": m["num_layers"],
    }


def _gpt2_config(m: dict[str, Any]) -> dict[str, Any]:
    return {
        "n_layer": m["num_layers"],
        "n_embd": m["hidden_size"],
        "n_head": m["num_attention_heads"],
        "n_inner": m["ffn_hidden_size"],
        "n_positions": m["seq_length"],
        "activation_function": "gelu_new",
        "layer_norm_epsilon": m["norm_eps"],
        "resid_pdrop": m["hidden_dropout"],
        "embd_pdrop": m["hidden_dropout"],
        "attn_pdrop": m["attention_dropout"],
        "scale_attn_weights": True,
    }


def _llama_config(m: dict[str, Any], model_type: str) -> dict[str, Any]:
    rope_params: dict[str, Any] = {"rope_type": "default"}
    if m.get("rope_scaling"):
        scaling = dict(m["rope_scaling"])
        rope_params = {"rope_type": scaling.pop("type"), **scaling}
    out = {
        "num_hidden_layers": m["num_layers"],
        "hidden_size": m["hidden_size"],
        "num_attention_heads": m["num_attention_heads"],
        "num_key_value_heads": m["num_query_groups"],
        "intermediate_size": m["ffn_hidden_size"],
        "hidden_act": "silu",
        "max_position_embeddings": m["seq_length"],
        "rms_norm_eps": m["norm_eps"],
        "attention_dropout": m["attention_dropout"],
        # Both dialects, equal: transformers 5 reads rope_parameters, 4.x rope_theta + rope_scaling.
        "rope_theta": m["rope_theta"],
        "rope_scaling": rope_params if m.get("rope_scaling") else None,
        "rope_parameters": {**rope_params, "rope_theta": m["rope_theta"]},
    }
    if model_type == "llama":
        out.update(
            head_dim=m["hidden_size"] // m["num_attention_heads"], attention_bias=False, mlp_bias=False
        )
    elif model_type == "qwen2":
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=m["num_layers"])
    elif model_type == "mistral":  # full causal attention: no window
        out.update(head_dim=m["hidden_size"] // m["num_attention_heads"], sliding_window=None)
    return out
