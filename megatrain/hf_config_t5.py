"""Hugging Face T5 config.json -> our model fields, without torch (megatrain.hf_config dispatches
model_type t5 here; the engine's own reading, with the tensors, is megatrain.engine.interop.hf_t5).

T5 v1.0 (ReLU, the head tied to the embedding and the decoder output scaled) and v1.1 / flan-t5
(gated GELU, an untied head): transformers 5 records the scaling as scale_decoder_outputs beside an
always-true tie flag, older configs only tie; the scaling decides, as interop.hf_t5 decides."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatrain.hf_config_base import HFConfigError
from megatrain.hf_config_base import refuse as _refuse

T5_DEFAULTS: dict[str, Any] = {
    "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6, "num_heads": 8,
    "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
    "layer_norm_epsilon": 1e-6, "feed_forward_proj": "relu", "n_positions": 512, "vocab_size": 32128,
}  # fmt: skip
"""transformers' T5Config defaults, for the keys older config.json files leave out."""
FEED_FORWARD = ("relu", "gated-gelu")

T5_BLOCK_KEYS = (
    "num_decoder_layers",
    "kv_channels",
    "feed_forward",
    "relative_attention_num_buckets",
    "relative_attention_max_distance",
)
"""model.t5's fields a checkpoint decides (decoder_seq_length stays the spec's choice)."""


def t5_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """ModelSpec fields for a T5 config.json (seq_length: n_positions, nominal: relative positions
    have no limit)."""
    _refuse(config, "is_encoder_decoder", True, "an encoder-decoder")
    _refuse(config, "is_decoder", False, "an encoder-decoder")
    c = {**T5_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    if c["feed_forward_proj"] not in FEED_FORWARD:
        raise HFConfigError("feed_forward_proj", f"{c['feed_forward_proj']!r} is not one of {FEED_FORWARD}")
    heads = int(c["num_heads"])
    return {
        "arch": "t5",
        "num_layers": int(c["num_layers"]),
        "hidden_size": int(c["d_model"]),
        "num_attention_heads": heads,
        "num_query_groups": heads,
        "ffn_hidden_size": int(c["d_ff"]),
        "vocab_size": int(c["vocab_size"]),
        "seq_length": int(c["n_positions"]),
        "norm_eps": float(c["layer_norm_epsilon"]),
        "tie_embeddings": bool(
            c.get("scale_decoder_outputs", c.get("tie_word_embeddings", True) is not False)
        ),
        "t5": {
            "num_decoder_layers": int(c.get("num_decoder_layers") or c["num_layers"]),
            "kv_channels": int(c["d_kv"]),
            "feed_forward": c["feed_forward_proj"],
            "relative_attention_num_buckets": int(c["relative_attention_num_buckets"]),
            "relative_attention_max_distance": int(c["relative_attention_max_distance"]),
        },
    }
