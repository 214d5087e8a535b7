"""BERT: a bidirectional encoder with the masked-LM and sentence-order heads, on GPTModel's blocks.

Two orders of norms, one module: post_layernorm (the original BERT, Hugging Face's BertModel: a norm
after the embeddings and after each residual add, no final norm) or pre-norm (Megatron's BertModel:
pre-norm blocks and a final norm, nothing after the embeddings). Attention sees the whole segment
(TransformerConfig.bidirectional): padding is a segment of its own, so real tokens never attend to it.

Parameter names beyond GPTModel's (embed, pos_embed, layers.i.*, final_norm when pre-norm, lm_head,
whose weight is the embedding's), with Hugging Face's BertForPreTraining names:
  tokentype_embed.weight            bert.embeddings.token_type_embeddings   (num_tokentypes > 0)
  embed_norm.{weight,bias}          bert.embeddings.LayerNorm               (post_layernorm)
  heads.lm_transform.{weight,bias}  cls.predictions.transform.dense         (masked_lm)
  heads.lm_norm.{weight,bias}       cls.predictions.transform.LayerNorm
  lm_head.bias                      cls.predictions.bias
  heads.pooler.{weight,bias}        bert.pooler.dense                       (binary_head)
  heads.classifier.{weight,bias}    cls.seq_relationship / classifier       (binary_head)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.engine.config import TransformerConfig
from megatrain.engine.models.gpt import (
    Embedding,
    GPTModel,
    KVCache,
    LayerNorm,
    Linear,
    check_inputs,
    make_norm,
    positions_for,
    run_layers,
)
from megatrain.kernels.attention import Segments


class BertHeads(nn.Module):
    """The masked-LM transform (dense, GELU, LayerNorm; the vocabulary projection is the model's
    lm_head) and, with a binary head, the pooler and its classifier (two-way for sentence order, one
    output per label for a sequence-classification fine-tune; Megatron's name for both is the
    binary head). Without masked_lm (a classifier), no masked-LM transform."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        c = cfg.hidden_size
        self.gelu_approximate = cfg.gelu_approximate
        self.lm_transform = Linear(c, c, bias=True) if cfg.masked_lm else None
        self.lm_norm = LayerNorm(c, eps=cfg.norm_eps) if cfg.masked_lm else None
        self.pooler = Linear(c, c, bias=True) if cfg.binary_head else None
        self.classifier = Linear(c, cfg.num_classes, bias=True) if cfg.binary_head else None

    def transform(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's input: (..., C) -> (..., C)."""
        if self.lm_transform is None or self.lm_norm is None:
            raise ValueError("this BERT has no masked-LM head (a sequence classifier)")
        return self.lm_norm(F.gelu(self.lm_transform(hidden), approximate=self.gelu_approximate))

    def class_logits(self, first: torch.Tensor) -> torch.Tensor:
        """The first token's hidden state (B, C) -> the classifier's logits (B, num_classes)."""
        if self.pooler is None or self.classifier is None:
            raise ValueError("this BERT has no binary head (model.bert.binary_head is false)")
        return self.classifier(torch.tanh(self.pooler(first)))


class BertOutput(NamedTuple):
    mlm_logits: torch.Tensor | None
    """(B, T, V): every position's masked-LM logits; None for a classifier."""
    class_logits: torch.Tensor | None
    """(B, num_classes), or None without a binary head."""


def encoder_embeddings(
    module: Any,
    tokens: torch.Tensor,
    position_ids: torch.Tensor | None,
    token_type_ids: torch.Tensor | None,
) -> torch.Tensor:
    """Words + positions (+ token types), normalised when post-norm, then dropout: (B, T, C), or the
    local (B, T/tp, C) under sequence parallelism (each lookup keeps its slice). `module` holds embed,
    pos_embed, tokentype_embed, embed_norm and dropout (a BertModel or its first pipeline chunk)."""
    x = module.embed(tokens)
    x = x + module.pos_embed(positions_for(tokens.shape[1], position_ids, tokens.device))
    if module.tokentype_embed is not None:
        types = token_type_ids if token_type_ids is not None else torch.zeros_like(tokens)
        x = x + module.tokentype_embed(types)
    if module.embed_norm is not None:
        x = module.embed_norm(x)
    return module.dropout(x)


class BertModel(GPTModel):
    """tokens (B, T) -> BertOutput (masked-LM logits, sentence-order logits)."""

    def _build(self, cfg: TransformerConfig) -> None:
        if not cfg.bidirectional or cfg.position_embedding != "learned":
            raise ValueError("a BERT model is bidirectional with learned positions")
        super()._build(cfg)
        c = cfg.hidden_size
        self.tokentype_embed = Embedding(cfg.num_tokentypes, c) if cfg.num_tokentypes else None
        self.embed_norm = make_norm(cfg) if cfg.post_layernorm else None
        if cfg.post_layernorm:
            self.final_norm = nn.Identity()  # the last block's output is already normalised
        # The decoder: the embedding (tied by GPTModel.__init__) and a bias of its own.
        self.lm_head = Linear(c, cfg.vocab_size, bias=True)
        self.heads = BertHeads(cfg)

    def forward(  # type: ignore[override]
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> BertOutput:
        hidden = self.hidden_states(tokens, position_ids, segment_ids, kv_cache, token_type_ids)
        mlm = self.lm_head(self.heads.transform(hidden)) if self.config.masked_lm else None
        classes = self.heads.class_logits(hidden[:, 0]) if self.heads.classifier is not None else None
        return BertOutput(mlm, classes)

    def hidden_states(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (B, T) -> the encoder's output (B, T, C). segment_ids (B, T): tokens attend only
        within their segment (padding: a segment of its own); None: the whole row."""
        if kv_cache is not None:
            raise ValueError("an encoder does not decode with a KV cache")
        check_inputs(tokens, self.config.seq_length, position_ids, segment_ids)
        if token_type_ids is not None and token_type_ids.shape != tokens.shape:
            raise ValueError(f"token_type_ids of shape {tuple(token_type_ids.shape)} do not match tokens")
        x = encoder_embeddings(self, tokens, position_ids, token_type_ids)
        segments = Segments(segment_ids) if segment_ids is not None else None
        x = run_layers(self.layers, x, None, segments, self.training, self.recompute_context_fn)
        return self.final_norm(x)

    def loss(  # type: ignore[override]
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        binary_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Megatron's BERT loss: the mean masked-LM loss over the loss tokens plus, with a binary
        head and binary_labels (B,), the mean sentence-order loss over the rows."""
        from megatrain.engine.parallel.bert_loss import encoder_losses  # it imports this module

        hidden = self.hidden_states(tokens, position_ids, segment_ids, token_type_ids=token_type_ids)
        losses = encoder_losses(hidden, self, labels, loss_mask, binary_labels)
        return losses.mlm if losses.binary is None else losses.mlm + losses.binary


def model_class(cfg: TransformerConfig) -> type[GPTModel]:
    """The module a config builds: BertModel for an encoder, else GPTModel."""
    return BertModel if cfg.is_encoder else GPTModel
