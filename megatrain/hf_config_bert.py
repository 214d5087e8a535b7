"""Hugging Face BERT config.json <-> our model fields, without torch (megatrain.hf_config dispatches
model_type bert here). transformers' BERT is the original post-norm encoder: an export needs
model.bert.post_layernorm; Megatron's pre-norm BERT has no Hugging Face layout."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatrain.hf_config_base import HFConfigError
from megatrain.hf_config_base import refuse as _refuse
from megatrain.hf_config_base import require as _require

BINARY_ARCHITECTURES = ("BertForPreTraining", "BertForNextSentencePrediction")
"""Checkpoints whose pooler and next-sentence classifier our binary head holds."""
CLASSIFIER = "BertForSequenceClassification"
BERT_BLOCK_KEYS = ("post_layernorm", "num_tokentypes")
"""model.bert's fields a checkpoint fixes (its heads are the spec's choice: a classifier may start
from a pre-training checkpoint)."""
BARE = "BertModel"
"""transformers' bare encoder (sentence-transformers' models): no pre-training heads, tensors
named without the "bert." prefix; an encoder without heads exports as one."""


def bert_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """ModelSpec fields for a BERT config.json (seq_length: max_position_embeddings)."""
    _refuse(config, "hidden_act", "gelu", "BERT's exact GELU only")
    _refuse(config, "position_embedding_type", "absolute", "learned absolute positions only")
    _refuse(config, "is_decoder", False, "an encoder")
    _refuse(config, "add_cross_attention", False, "an encoder")
    heads = _require(config, "num_attention_heads")
    architectures = config.get("architectures") or []
    return {
        "arch": "bert",
        "num_layers": _require(config, "num_hidden_layers"),
        "hidden_size": _require(config, "hidden_size"),
        "num_attention_heads": heads,
        "num_query_groups": heads,
        "ffn_hidden_size": _require(config, "intermediate_size"),
        "vocab_size": _require(config, "vocab_size"),
        "seq_length": _require(config, "max_position_embeddings"),
        "norm_eps": config.get("layer_norm_eps", 1e-12),
        "tie_embeddings": config.get("tie_word_embeddings", True),
        "bert": {
            "post_layernorm": True,
            "num_tokentypes": config.get("type_vocab_size", 2),
            "binary_head": any(a in BINARY_ARCHITECTURES + (CLASSIFIER,) for a in architectures),
            **({"num_labels": _num_labels(config)} if CLASSIFIER in architectures else {}),
        },
    }


def _num_labels(config: Mapping[str, Any]) -> int:
    """A classifier's labels, as transformers' PretrainedConfig counts them."""
    return int(config.get("num_labels") or len(config.get("id2label") or {}) or 2)


def bert_config(m: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's BERT keys for a TransformerConfig dict (HFConfigError where transformers'
    BertModel computes something else)."""
    if not m["post_layernorm"]:
        raise HFConfigError(
            "post_layernorm", "transformers' BERT is post-norm: train with model.bert.post_layernorm"
        )
    if not m["tie_embeddings"]:
        raise HFConfigError("tie_word_embeddings", "BERT's decoder is the word embedding")
    if m["gelu_approximate"] != "none" or m["activation"] != "gelu":
        raise HFConfigError("hidden_act", "BERT runs the exact GELU")
    classifier = not m.get("masked_lm", True) and m["binary_head"]
    labels = {}
    if classifier:
        n = m["num_classes"]
        labels = {"num_labels": n, "id2label": {str(i): f"LABEL_{i}" for i in range(n)},
                  "label2id": {f"LABEL_{i}": i for i in range(n)}}  # fmt: skip
    pretrainer = "BertForPreTraining" if m["binary_head"] else "BertForMaskedLM"
    architecture = CLASSIFIER if classifier else pretrainer if m.get("masked_lm", True) else BARE
    return {
        **labels,
        "architectures": [architecture],
        "model_type": "bert",
        "hidden_size": m["hidden_size"],
        "num_hidden_layers": m["num_layers"],
        "num_attention_heads": m["num_attention_heads"],
        "intermediate_size": m["ffn_hidden_size"],
        "hidden_act": "gelu",
        "max_position_embeddings": m["seq_length"],
        "type_vocab_size": max(1, m["num_tokentypes"]),
        "layer_norm_eps": m["norm_eps"],
        "hidden_dropout_prob": m["hidden_dropout"],
        "attention_probs_dropout_prob": m["attention_dropout"],
        "position_embedding_type": "absolute",
        "pad_token_id": 0,
    }
