"""BERT's Hugging Face tensor names (BertForPreTraining / BertForMaskedLM) <-> BertModel's canonical
ones (models.bert): q, k and v regrouped into our fused qkv (one group per head), the post-norm
blocks' norms after attention and after the MLP, the masked-LM transform and decoder bias, the
pooler and next-sentence (sentence-order) classifier when the model has a binary head."""

from __future__ import annotations

from megatrain.engine.config import TransformerConfig
from megatrain.engine.interop.hf_mapping import Rule, _same, _vocab, group_qkv, split_qkv

IGNORED_BERT = ("embeddings.position_ids", "cls.predictions.decoder.weight", "cls.predictions.decoder.bias")
"""Buffers and tied copies some checkpoints carry: the position ids, the decoder (the embedding) and
its bias (cls.predictions.bias)."""
BERT_BINARY_HEAD = (
    "pooler.dense.weight",
    "pooler.dense.bias",
    "cls.seq_relationship.weight",
    "cls.seq_relationship.bias",
)
"""A pre-training checkpoint's pooler and next-sentence classifier: unused by a model without one."""


def bert_rules(cfg: TransformerConfig, prefix: str = "bert.") -> list[Rule]:
    h = cfg.num_attention_heads
    p = prefix

    rules = [
        _vocab("embed.weight", f"{p}embeddings.word_embeddings.weight", cfg),
        Rule(
            "pos_embed.weight",
            (f"{p}embeddings.position_embeddings.weight",),
            lambda t: (t,),
            lambda t: t[: cfg.seq_length],
        ),
    ]
    if cfg.num_tokentypes:
        rules.append(_same("tokentype_embed.weight", f"{p}embeddings.token_type_embeddings.weight"))
    if cfg.post_layernorm:
        rules += [
            _same("embed_norm.weight", f"{p}embeddings.LayerNorm.weight"),
            _same("embed_norm.bias", f"{p}embeddings.LayerNorm.bias"),
        ]
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}.", f"{p}encoder.layer.{i}."
        for kind in ("weight", "bias"):
            q, k, v = (f"{hf}attention.self.{x}.{kind}" for x in ("query", "key", "value"))
            rules.append(
                Rule(
                    f"{ours}attn.qkv.{kind}",
                    (q, k, v),
                    lambda t: split_qkv(t, h, h),
                    lambda q_, k_, v_: group_qkv(q_, k_, v_, h, h),
                )
            )
            rules += [
                _same(f"{ours}attn.proj.{kind}", f"{hf}attention.output.dense.{kind}"),
                _same(f"{ours}attn_norm.{kind}", f"{hf}attention.output.LayerNorm.{kind}"),
                _same(f"{ours}mlp.fc1.{kind}", f"{hf}intermediate.dense.{kind}"),
                _same(f"{ours}mlp.fc2.{kind}", f"{hf}output.dense.{kind}"),
                _same(f"{ours}mlp_norm.{kind}", f"{hf}output.LayerNorm.{kind}"),
            ]
    if cfg.masked_lm:
        rules += [
            _same("heads.lm_transform.weight", "cls.predictions.transform.dense.weight"),
            _same("heads.lm_transform.bias", "cls.predictions.transform.dense.bias"),
            _same("heads.lm_norm.weight", "cls.predictions.transform.LayerNorm.weight"),
            _same("heads.lm_norm.bias", "cls.predictions.transform.LayerNorm.bias"),
            _vocab("lm_head.bias", "cls.predictions.bias", cfg),
        ]
    if cfg.binary_head:
        # A pre-training checkpoint's next-sentence classifier, or a sequence classifier's own.
        classifier = "cls.seq_relationship" if cfg.masked_lm else "classifier"
        rules += [
            _same("heads.pooler.weight", f"{p}pooler.dense.weight"),
            _same("heads.pooler.bias", f"{p}pooler.dense.bias"),
            _same("heads.classifier.weight", f"{classifier}.weight"),
            _same("heads.classifier.bias", f"{classifier}.bias"),
        ]
    return rules


FRESH_HEAD = ("heads.classifier.weight", "heads.classifier.bias")
"""A sequence classifier's own head: a folder without it (a pre-trained BERT) starts it from the
seeded initial values, as transformers' from_pretrained starts BertForSequenceClassification."""


def unused_by(cfg: TransformerConfig, name: str) -> bool:
    """Whether a folder's tensor `name` is one this BERT leaves unused: a pre-training checkpoint's
    heads under a model without them (no binary head; a classifier, which has no masked-LM head and
    a classifier of its own)."""
    if not cfg.binary_head and name.endswith(BERT_BINARY_HEAD):
        return True
    return not cfg.masked_lm and (name.startswith("cls.") or name.endswith(IGNORED_BERT))
