"""Where the encoder families' layers and edge parameters sit on a pipeline (megatrain.plan.shapes
counts the layers themselves). Pure; no import of shapes (which imports this module).

BERT is one stack: its layers split over the stages as GPT's do. The first stage holds the word,
position and token-type embeddings (and, post-norm, the norm after them); the last the final norm
(pre-norm), the masked-LM head (dense h→h + GELU + LayerNorm, then the decoder tied to the word
embedding with a bias of its own, vocab-parallel) and the binary head (pooler h→h, classifier h→2).
With pp > 1 the last stage keeps a copy of the word embedding for the tied decoder (its gradient
all-reduced with the first stage's, Megatron's word-embedding group).

T5 is two stacks laid end to end: layers 0..Le-1 are the encoder's, Le..Le+Ld-1 the decoder's. With
pp > 1 no stage mixes them (Megatron's pipeline_model_parallel_split_rank: stages before the split
run the encoder, the rest the decoder, and every decoder stage receives the encoder's output beside
the decoder's hidden states). The embedding is shared: stage 0 holds it for the encoder and the
first decoder stage a copy for the decoder's inputs (Megatron's embedding group spans the first,
split and last stages); the last stage holds the untied LM head, or, tied, uses the first decoder
stage's copy when it is that stage and keeps one more copy otherwise. Each stack's relative
position bias table (buckets × heads, split by heads over tp) sits on every stage of its stack (as
megatrain.engine.parallel.pipeline_t5 keeps copies, their gradients summed); each stack's final
RMSNorm with its last layer.

The split (`t5_split`): given the seconds of an encoder layer, a decoder layer and the last stage's
head, try every count k of encoder stages (1..pp-1), spread the encoder's layers over k stages and
the decoder's over pp-k (extra layers away from the first and last stage, which also run the
embedding and the head), and keep the k whose slowest stage is fastest: the pipeline runs at its
slowest stage's pace, so that balances the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def family_fields(m: Any) -> dict[str, Any] | None:
    """ModelShape's fields that a spec's model.arch bert or t5 decides (`m`: its ModelSpec); None
    for the GPT family."""
    if m.arch == "bert":
        b = m.bert_block
        return {
            "family": "bert", "num_query_groups": m.query_groups, "activation": "gelu",
            "tie_embeddings": m.tied, "add_bias": True, "position_embedding": "learned",
            "normalization": "layernorm", "num_tokentypes": b.num_tokentypes,
            "binary_head": b.binary_head, "post_layernorm": b.post_layernorm,
        }  # fmt: skip
    if m.arch == "t5":
        t = m.t5_block
        return {
            "family": "t5", "num_query_groups": m.num_attention_heads,
            "activation": "geglu" if t.feed_forward == "gated-gelu" else "relu",
            "tie_embeddings": m.tied, "add_bias": False, "position_embedding": "relative",
            "normalization": "rmsnorm", "kv_channels": t.kv_channels,
            "num_decoder_layers": t.num_decoder_layers or m.num_layers,
            "decoder_seq_length": t.decoder_seq_length,
            "relative_attention_num_buckets": t.relative_attention_num_buckets,
        }  # fmt: skip
    return None


def spec_decoder_layers(m: Any) -> int:
    """A ModelSpec's decoder layers: T5's (model.t5.num_decoder_layers, else model.num_layers); 0 else."""
    return (m.t5_block.num_decoder_layers or m.num_layers) if m.arch == "t5" else 0


def family_layout_problems(m: Any, layout: Any) -> list[dict[str, str]]:
    """The rules a layout breaks for model.arch t5 (`m`: its ModelSpec), each naming its field: the
    engine runs T5 without context parallelism (its relative position biases and cross-attention
    have no ring attention) and without interleaved stages (so without zbv's V), and splits its
    pipeline at the encoder/decoder boundary; under sequence parallelism the decoder's length splits
    over tp too."""
    if m.arch != "t5":
        return []
    out: list[dict[str, str]] = []
    if layout.cp > 1:
        why = (f"parallelism.cp={layout.cp} is not supported for model.arch t5 (its relative position "
               "biases and cross-attention run without ring attention); set parallelism.cp to 1")  # fmt: skip
        out.append({"field": "parallelism.cp", "message": why})
    total = m.num_layers + spec_decoder_layers(m)
    rules = t5_split_problems(m.num_layers, total, layout.pp, layout.virtual_stages, layout.pipeline_layers)
    out += [{"field": field, "message": why} for field, why in rules]
    dec = m.t5_block.decoder_seq_length
    if dec is not None and layout.sequence_parallel and dec % layout.tp:
        why = f"model.t5.decoder_seq_length={dec} is not divisible by parallelism.tp={layout.tp} (needed for "
        why += "sequence parallelism)"
        out.append({"field": "model.t5.decoder_seq_length", "message": why})
    return out


def t5_config_fields(cfg: Any) -> dict[str, Any]:
    """The engine's T5Config (megatrain.engine.models.t5) in ModelShape's terms, beyond the fields
    of the same name."""
    return {
        "family": "t5",
        "num_query_groups": cfg.num_attention_heads,
        "seq_length": cfg.encoder_seq_length,
        "activation": "geglu" if cfg.activation == "gated-gelu" else "relu",
        "position_embedding": "relative",
        "normalization": "rmsnorm",
        "add_bias": False,
    }


def stage_layer_range(
    total: int, pp: int, stage: int, pipeline_layers: Sequence[int] | None = None
) -> tuple[int, int]:
    """[start, end) of the layers a stage holds with one model chunk per stage (the even split puts
    any remainder on the first stages, as megatrain.plan.stages.layers_on_stage)."""
    if pipeline_layers is not None:
        start = sum(pipeline_layers[:stage])
        return start, start + pipeline_layers[stage]
    base, extra = divmod(total, pp)
    start = stage * base + min(stage, extra)
    return start, start + base + (1 if stage < extra else 0)


def stack_layers_on_stage(
    m: Any, pp: int, stage: int, pipeline_layers: Sequence[int] | None = None
) -> tuple[int, int]:
    """(encoder-stack layers, decoder layers) on a stage: T5's two stacks; every other model's
    layers count as the first (one stack)."""
    if m.family != "t5":
        if pipeline_layers is not None:
            return sum(pipeline_layers[stage::pp]), 0
        base, extra = divmod(m.num_layers, pp)
        return base + (1 if stage < extra else 0), 0
    start, end = stage_layer_range(m.total_layers, pp, stage, pipeline_layers)
    encoder = max(0, min(end, m.num_layers) - start)
    return encoder, (end - start) - encoder


def first_decoder_stage(m: Any, pp: int, pipeline_layers: Sequence[int] | None = None) -> int:
    """The stage holding T5's first decoder layer (Megatron's split rank when pp > 1)."""
    for stage in range(pp):
        start, end = stage_layer_range(m.total_layers, pp, stage, pipeline_layers)
        if start <= m.num_layers < end:
            return stage
    return pp - 1


def last_encoder_stage(m: Any, pp: int, pipeline_layers: Sequence[int] | None = None) -> int:
    """The stage holding T5's last encoder layer."""
    for stage in range(pp):
        start, end = stage_layer_range(m.total_layers, pp, stage, pipeline_layers)
        if start < m.num_layers <= end:
            return stage
    return 0


def t5_split_rank(m: Any, pp: int, pipeline_layers: Sequence[int] | None = None) -> int | None:
    """The first decoder stage (Megatron's pipeline_model_parallel_split_rank, the engine's
    split_rank for megatrain.engine.parallel.pipeline_t5) of a layout that passed the T5 rules;
    None for pp = 1 (one stage holds both stacks)."""
    return None if pp == 1 else first_decoder_stage(m, pp, pipeline_layers)


def bert_edge_params(m: Any, tp: int, pp: int, stage: int) -> dict[str, int]:
    """BERT's parameters outside its layers on one stage's tensor-parallel rank, by part."""
    h, v = m.hidden_size, m.vocab_size
    out: dict[str, int] = {}
    if stage == 0:
        out["embedding"] = v * h // tp
        out["position_embedding"] = m.seq_length * h  # replicated over tp, as in Megatron
        if m.num_tokentypes:
            out["tokentype_embedding"] = m.num_tokentypes * h
        if m.post_layernorm:
            out["embedding_norm"] = 2 * h
    if stage == pp - 1:
        if not m.post_layernorm:
            out["final_norm"] = 2 * h
        # The transform runs on the residual stream (replicated weights); the decoder's bias is
        # vocab-parallel beside its (tied) weight.
        out["mlm_head"] = h * h + h + 2 * h + v // tp
        if pp > 1 or not m.tie_embeddings:
            out["lm_head"] = v * h // tp  # the decoder (tied: a copy of the word embedding)
        if m.binary_head:
            out["binary_head"] = (h * h + h) + (2 * h + 2)  # pooler, classifier
    return out


def t5_edge_params(
    m: Any, tp: int, pp: int, stage: int, pipeline_layers: Sequence[int] | None = None
) -> dict[str, int]:
    """T5's parameters outside its layers on one stage's tensor-parallel rank, by part."""
    h, v = m.hidden_size, m.vocab_size
    table = m.relative_attention_num_buckets * m.num_attention_heads // tp
    decoder_first = first_decoder_stage(m, pp, pipeline_layers)
    n_enc, n_dec = stack_layers_on_stage(m, pp, stage, pipeline_layers)
    out: dict[str, int] = {}
    if stage == 0:
        out["embedding"] = v * h // tp
    if n_enc:
        out["encoder_position_bias"] = table
    if n_dec:
        out["decoder_position_bias"] = table
    if stage == last_encoder_stage(m, pp, pipeline_layers):
        out["encoder_final_norm"] = h
    if stage == decoder_first and stage != 0:
        out["decoder_embedding"] = v * h // tp  # the decoder's copy of the shared embedding
    if stage == pp - 1:
        out["decoder_final_norm"] = h
        if not m.tie_embeddings or stage not in (0, decoder_first):
            out["lm_head"] = v * h // tp
    return out


def even_counts(layers: int, stages: int) -> list[int]:
    """`layers` over `stages`, the extra ones on the middle stages first (then the later ones)."""
    base, extra = divmod(layers, stages)
    order = sorted(range(stages), key=lambda s: (s == 0, s == stages - 1, s))
    counts = [base] * stages
    for s in order[:extra]:
        counts[s] += 1
    return counts


def t5_split(
    encoder_layers: int,
    decoder_layers: int,
    pp: int,
    encoder_s: float,
    decoder_s: float,
    head_s: float = 0.0,
) -> tuple[int, ...] | None:
    """Layers per stage (encoder stages first) whose slowest stage is fastest, or None for pp = 1 or
    when pp exceeds the layers (no stage may hold none). encoder_s, decoder_s: one layer's seconds;
    head_s: the last stage's extra (the LM head and loss)."""
    if pp == 1 or pp > encoder_layers + decoder_layers:
        return None
    best: tuple[float, tuple[int, ...]] | None = None
    for k in range(max(1, pp - decoder_layers), min(pp - 1, encoder_layers) + 1):
        enc, dec = even_counts(encoder_layers, k), even_counts(decoder_layers, pp - k)
        slowest = max(max(enc) * encoder_s, max(dec) * decoder_s, dec[-1] * decoder_s + head_s)
        if best is None or slowest < best[0]:
            best = (slowest, (*enc, *dec))
    return best[1] if best is not None else None


def t5_split_problems(
    encoder_layers: int,
    total_layers: int,
    pp: int,
    virtual_stages: int,
    pipeline_layers: Sequence[int] | None,
) -> list[tuple[str, str]]:
    """(field, why) of each pipeline rule T5 breaks: one model chunk per stage, and with pp > 1 the
    encoder/decoder boundary between two stages, no stage empty."""
    out: list[tuple[str, str]] = []
    if virtual_stages > 1:
        out.append(
            ("parallelism.virtual_stages", f"parallelism.virtual_stages={virtual_stages} is not supported "
             "for model.arch t5 (its encoder and decoder stages run the plain 1F1B schedule)")
        )  # fmt: skip
        return out
    if pp == 1 or pp > total_layers:
        return out
    if pipeline_layers is not None and (len(pipeline_layers) != pp or sum(pipeline_layers) != total_layers):
        return out  # (the general pipeline rules say why)
    ranges = [stage_layer_range(total_layers, pp, s, pipeline_layers) for s in range(pp)]
    counts = [end - start for start, end in ranges]
    bounds = {sum(counts[:s]) for s in range(pp + 1)}
    if encoder_layers not in bounds or 0 in counts:
        field = "parallelism.pipeline_layers"
        out.append(
            (field, f"model.arch t5 splits its pipeline between the encoder's {encoder_layers} layers and "
             f"the decoder's {total_layers - encoder_layers}: with parallelism.pp={pp} the layers per stage "
             f"({counts}) must put the boundary after layer {encoder_layers} between two stages and leave "
             "no stage empty; give parallelism.pipeline_layers (encoder stages first)")
        )  # fmt: skip
    return out
