"""The encoder families' blocks of the model spec: `model.bert` (arch bert) and `model.t5` (arch t5),
apart from spec.py. What each arch implies (norms, positions, activation, biases) is its flavour
(megatrain.engine.config.FLAVOURS); these blocks hold what a family adds."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from megatrain.spec_base import Strict as _Strict
from megatrain.spec_base import rule as _rule
from megatrain.spec_errors import Problem


class BertSpec(_Strict):
    """BERT (arch bert): a bidirectional encoder with learned positions, LayerNorm, exact GELU,
    biases, the masked-LM head tied to the embedding, and optionally the sentence-order head."""

    binary_head: bool = True
    """The pooler and two-way classifier trained on sentence order (Megatron's SOP; Hugging Face's
    next-sentence head holds the same weights). false: masked-LM only (BertForMaskedLM)."""
    post_layernorm: bool = False
    """false: Megatron's BERT (pre-norm blocks and a final norm). true: the original BERT and
    Hugging Face's layout (a norm after the embeddings and after each residual add); an export to
    Hugging Face needs it."""
    num_tokentypes: int = Field(2, ge=0, le=1024)
    """Token-type (sentence A / B) embeddings; 0: none."""
    num_labels: int | None = Field(None, ge=1, le=100_000)
    """A sequence classifier with this many labels (kind finetune on JSONL records of `text`, an
    optional `text_pair` and an integer `label`): the pooler and a classifier of num_labels outputs
    take the pre-training heads' place (BertForSequenceClassification). None: a masked-LM pretrainer."""


class T5Spec(_Strict):
    """T5 (arch t5): an encoder (model.num_layers) and a decoder with cross-attention, relative
    position buckets, RMSNorm without mean, no biases."""

    num_decoder_layers: int | None = Field(None, ge=1, le=1024)
    """None: as many as the encoder (model.num_layers)."""
    kv_channels: int | None = Field(None, ge=1, le=1 << 14)
    """Each head's width (T5's d_kv); None: hidden_size / num_attention_heads (t5-11b differs)."""
    feed_forward: Literal["relu", "gated-gelu"] = "gated-gelu"
    """relu: T5 v1.0 (tied head, decoder output scaled by hidden_size^-0.5). gated-gelu: T5 v1.1 and
    flan-t5 (untied head)."""
    relative_attention_num_buckets: int = Field(32, ge=1, le=4096)
    """Relative positions fall into this many buckets (half per direction in the encoder): exact for
    the nearest, logarithmic out to relative_attention_max_distance."""
    relative_attention_max_distance: int = Field(128, ge=1, le=1 << 20)
    """Distances beyond it share the last bucket."""
    decoder_seq_length: int | None = Field(None, ge=1, le=1 << 20)
    """The decoder's (target) length; None: model.seq_length (the encoder's)."""


FAMILY_FEATURES = {"moe": "model.moe (mixture of experts)", "num_query_groups": "model.num_query_groups"}
"""What gpt2/llama hold and the encoder families do not (None / absent for bert and t5)."""


def family_problems(model: Any) -> list[Problem]:
    """The rules between model.arch and the other model fields, each naming its field."""
    out: list[Problem] = []
    for arch in ("bert", "t5"):
        if getattr(model, arch) is not None and model.arch != arch:
            out.append(_rule(f"model.{arch}", f"model.{arch} is only for arch {arch} (this is {model.arch})"))
    if model.arch not in ("bert", "t5"):
        return out
    for field, what in FAMILY_FEATURES.items():
        value = getattr(model, field)
        if value is not None and not (field == "num_query_groups" and value == model.num_attention_heads):
            out.append(_rule(f"model.{field}", f"{what} is not available for arch {model.arch}"))
    if model.arch == "bert" and model.activation not in (None, "gelu"):
        out.append(_rule("model.activation", "arch bert runs the GELU MLP: model.activation must be gelu"))
    if model.arch == "t5" and model.activation is not None:
        why = "arch t5 sets its MLP with model.t5.feed_forward (relu or gated-gelu), not model.activation"
        out.append(_rule("model.activation", why))
    t5 = model.t5
    if t5 is not None and t5.relative_attention_num_buckets < 4:
        why = "model.t5.relative_attention_num_buckets must be at least 4 (2 exact buckets per direction)"
        out.append(_rule("model.t5.relative_attention_num_buckets", why))
    elif t5 is not None and t5.relative_attention_max_distance <= t5.relative_attention_num_buckets // 2:
        why = (
            f"model.t5.relative_attention_max_distance={t5.relative_attention_max_distance} must exceed "
            f"half of model.t5.relative_attention_num_buckets ({t5.relative_attention_num_buckets // 2})"
        )
        out.append(_rule("model.t5.relative_attention_max_distance", why))
    if model.arch == "t5" and model.qkv_bias:
        out.append(_rule("model.qkv_bias", "arch t5 has no biases: model.qkv_bias must be unset"))
    return out


DECODER_KINDS = ("dpo", "eval")
"""Kinds that need a causal LM (preference pairs, lm-eval's log-likelihoods). A BERT serves
embeddings (kind serve: OpenAI's /v1/embeddings)."""


def bert_job_problems(spec: Any) -> list[Problem]:
    """The rules between arch bert and the rest of a job spec, each naming its field."""
    if spec.model.arch != "bert":
        return []
    out: list[Problem] = []
    if spec.kind in DECODER_KINDS:
        why = f"kind {spec.kind} needs a decoder (gpt2 or llama); arch bert pretrains, fine-tunes or serves"
        out.append(_rule("kind", why))
    labels = spec.model.bert_block.num_labels
    if spec.kind == "finetune" and labels is None:
        why = "kind finetune with arch bert trains a sequence classifier: set model.bert.num_labels"
        out.append(_rule("model.bert.num_labels", why))
    if labels is not None and spec.kind != "finetune":
        why = f"model.bert.num_labels makes a sequence classifier, trained by kind finetune (not {spec.kind})"
        out.append(_rule("model.bert.num_labels", why))
    if labels is not None and spec.model.bert is not None and not spec.model.bert.binary_head:
        why = "a sequence classifier reads the pooled first token: model.bert.binary_head must be true"
        out.append(_rule("model.bert.binary_head", why))
    if spec.data.tokenizer.type != "hf":
        why = (
            "arch bert needs data.tokenizer type hf: a WordPiece tokenizer.json with [CLS], [SEP] and [MASK]"
        )
        out.append(_rule("data.tokenizer", why))
    if spec.data.packing:
        out.append(_rule("data.packing", "arch bert makes sentence-pair samples: data.packing must be unset"))
    if spec.training.method != "full":
        why = f"training.method {spec.training.method} is for arch gpt2 and llama; arch bert trains in full"
        out.append(_rule("training.method", why))
    if spec.training.eval_tasks:
        why = "training.eval_tasks are lm-eval tasks for a decoder; arch bert reports its validation loss"
        out.append(_rule("training.eval_tasks", why))
    return out


T5_ATTENTION_BACKENDS = ("auto", "sdpa")
"""T5's attention runs torch's SDPA: its relative position biases enter as an additive float mask."""


def t5_job_problems(spec: Any) -> list[Problem]:
    """The rules between arch t5 and the rest of a job spec, each naming its field: it pretrains
    (span corruption) or fine-tunes (text to text), in full, from an hf tokenizer, one pair per row,
    without compile (the engine compiles decoder blocks only); recompute (full: every
    recompute_every-th layer of each stack; selective: the attention cores) and fp8 (every layer's
    linears, cross-attention's too) run as for GPT."""
    if spec.model.arch != "t5":
        return []
    out: list[Problem] = []
    t = spec.training
    if spec.kind in (*DECODER_KINDS, "serve"):  # (its generation has no server yet)
        why = f"kind {spec.kind} needs a decoder (arch gpt2 or llama); arch t5 pretrains or fine-tunes"
        out.append(_rule("kind", why))
    if spec.data.tokenizer.type != "hf":
        why = (
            "arch t5 needs data.tokenizer type hf: a tokenizer.json with an end token ([EOS] or </s>) "
            "and, to pretrain, [CLS] [SEP] [MASK] [BOS] and the <extra_id_N> sentinels"
        )
        out.append(_rule("data.tokenizer", why))
    if spec.data.packing:
        out.append(
            _rule("data.packing", "arch t5 trains one input/target pair per row: data.packing must be unset")
        )
    if t.method != "full":
        out.append(
            _rule(
                "training.method",
                f"training.method {t.method} is not available for arch t5 (it trains in full)",
            )
        )
    if t.eval_tasks:
        why = "training.eval_tasks are lm-eval tasks for a decoder; arch t5 reports its validation loss"
        out.append(_rule("training.eval_tasks", why))
    if t.compile:
        out.append(_rule("training.compile", "training.compile is not available for arch t5 yet"))
    if spec.model.attention_backend not in T5_ATTENTION_BACKENDS:
        why = (
            f"model.attention_backend {spec.model.attention_backend} is not available for arch t5: it runs "
            "torch's SDPA (its position biases are an additive mask); use auto or sdpa"
        )
        out.append(_rule("model.attention_backend", why))
    return out
