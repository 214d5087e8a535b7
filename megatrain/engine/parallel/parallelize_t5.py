"""Tensor (+ sequence) parallelism applied to a single-device T5Model by module replacement.

    torch.manual_seed(seed)                       # same on every rank: the full model is identical
    model = T5Model(cfg)
    tracker = manual_seed(seed, state)            # model-parallel RNG stream per tp rank
    model = parallelize_t5(model, state, rng_tracker=tracker)
    logits = model(enc_tokens, dec_tokens, enc_mask, dec_mask)          # (B, T, V/tp)
    loss = t5_lm_loss(logits, labels, loss_mask, state, cfg.real_vocab_size)
    loss.backward(); <data-parallel grad sync>; allreduce_sequence_parallel_grads(model, state)

Replacements (parallelize.py's for GPTModel, layer for layer): self-attention qkv, cross-attention q
and kv, and fc1 become ColumnParallelLinear (qkv rows are per head [q_h; k_h; v_h] and kv rows
[k_h; v_h], so a contiguous split hands each rank whole heads; a gated fc1 is [gate; up]: stride 2);
attention and cross-attention proj and fc2 become RowParallelLinear; the shared embedding becomes
VocabParallelEmbedding and the LM head a ColumnParallelLinear over the vocabulary whose output stays
sharded (tied: it shares the embedding's shard). Each stack's relative bias table (buckets, H) is
split by columns, heads [r·H/tp, (r+1)·H/tp) on rank r: a rank adds the bias of its own heads only,
and since every head sees the whole sequence its table's gradient is complete on that rank.

Sequence parallelism runs on both stacks: the residual streams are sequence shards, (B, S/tp, C) in
the encoder and (B, T/tp, C) in the decoder, norms are flagged `sequence_parallel`, and the stacks
build their masks for the whole sequence (Encoder/Decoder.sequence_shards). The encoder's output is
a shard too; each decoder layer's kv projection, column-parallel under sequence parallelism,
all-gathers it (its gradient is reduce-scattered back), so every cross-attention sees every encoder
position. Without sequence parallelism the encoder output is whole and kv enters through copy_to_tp.

Randomness: the MLP's hidden dropout acts on an ffn/tp slice and attention dropout on H/tp heads, so
both draw from the tracker's per-rank stream; residual and embedding dropout do so only under
sequence parallelism (otherwise every tp rank holds, and drops, the same whole tensor). Recompute
(T5Model.set_recompute) replays the tracker's streams: the stacks' and the attention cores'
checkpoint context is the tracker's.

The state dict: parallelize.full_state_dict / load_full_state_dict work on a parallelized T5Model
as they are (they follow each parameter's tensor_parallel / partition_dim markers, and leave out a
tied lm_head), so there is no T5 version of them.
Not supported on a parallelized model: T5Model.loss (its fused head would see only the vocabulary
shard: use t5_lm_loss on the logits) and generate_greedy.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from megatrain.engine.models.t5 import T5Config, T5Model
from megatrain.engine.models.t5_layers import T5MLP, CrossAttention, RelativeBias, SelfAttention
from megatrain.engine.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatrain.engine.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatrain.engine.parallel.mappings import mark_sequence_parallel, mark_tensor_parallel, shard_tensor
from megatrain.engine.parallel.random import MODEL_PARALLEL, RNGStatesTracker, TrackedDropout
from megatrain.engine.parallel.state import ParallelState
from megatrain.plan.layout import Layout, LayoutError, Problem, model_problems


def t5_layout_problems(cfg: T5Config, layout: Layout) -> list[Problem]:
    """The rules a tensor-parallel layout breaks for this T5 (heads, ffn and vocabulary divisible by
    tp, both sequence lengths by tp under sequence parallelism), in the words of the spec's 422."""
    problems = model_problems(
        layout,
        num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_hidden_size,
        vocab_size=cfg.vocab_size,
        seq_length=cfg.encoder_seq_length,
        model="model.",
        par="parallelism.",
    )
    # The decoder's sequence is cut over tp too (the spec's model.t5.decoder_seq_length);
    # model_problems knows one length.
    for p in model_problems(layout, seq_length=cfg.decoder_seq_length, model="model.t5.", par="parallelism."):
        problems.append({k: v.replace("seq_length", "decoder_seq_length") for k, v in p.items()})
    return problems


def parallelize_t5(
    model: T5Model, state: ParallelState, rng_tracker: RNGStatesTracker | None = None
) -> T5Model:
    """Shard `model` (built in full, identically on every tp rank) for tensor parallelism, in place.

    rng_tracker: required when tp > 1 and the model has dropout (see the module docstring). The
    returned model's forward gives the local vocabulary shard of the logits (B, T, V/tp).
    """
    if state.tp_size == 1:
        return model
    cfg = model.config
    tp, sp = state.tp_size, state.sequence_parallel
    problems = t5_layout_problems(cfg, state.layout)
    if problems:
        raise LayoutError("invalid parallel layout: " + "; ".join(p["message"] for p in problems))
    if rng_tracker is None and (cfg.hidden_dropout > 0 or cfg.attention_dropout > 0):
        raise ValueError("tensor parallelism with dropout needs an rng_tracker (see parallel.random)")
    if rng_tracker is not None and MODEL_PARALLEL not in rng_tracker.names:
        raise ValueError(f"the rng_tracker has no {MODEL_PARALLEL!r} stream")

    def dropout(p: float, split: bool) -> nn.Module:
        """Dropout on a tensor split across tp ranks draws per-rank masks from the tracker."""
        return TrackedDropout(p, rng_tracker) if split and rng_tracker is not None else nn.Dropout(p)

    for stack in (model.encoder, model.decoder):
        _split_bias_heads(stack.rel_bias, state)
        for layer in stack.layers:
            _parallelize_self_attention(layer.attn, state, rng_tracker, cfg.attention_dropout)
            norms = [layer.attn_norm, layer.mlp_norm]
            cross = getattr(layer, "cross", None)
            if cross is not None:
                _parallelize_cross_attention(cross, state, rng_tracker, cfg.attention_dropout)
                norms.append(layer.cross_norm)
            _parallelize_mlp(layer.mlp, state, cfg.gated_mlp)
            layer.mlp.dropout = dropout(cfg.hidden_dropout, True)  # (B, T, ffn/tp)
            layer.dropout = dropout(cfg.hidden_dropout, sp)
            if sp:
                for norm in norms:
                    _mark_norm(norm)
        stack.dropout = dropout(cfg.hidden_dropout, sp)
        if rng_tracker is not None:
            # A recomputed layer redraws its per-rank dropout masks from the tracker's streams.
            stack.recompute_context_fn = rng_tracker.checkpoint_context
        if sp:
            _mark_norm(stack.final_norm)
            stack.sequence_shards = tp
    model.embed = VocabParallelEmbedding.from_embedding(model.embed, state)
    # Tied, the head is the embedding's (V/tp, C) shard: rows [r·V/tp, (r+1)·V/tp) in both.
    head = ColumnParallelLinear.from_linear(model.lm_head, state)
    if cfg.tie_embeddings:
        head.weight = model.embed.weight
    model.lm_head = head
    return model


@torch.no_grad()
def _split_bias_heads(rel_bias: RelativeBias, state: ParallelState) -> None:
    """(buckets, H) -> this rank's heads' columns (buckets, H/tp)."""
    full = rel_bias.weight
    shard = shard_tensor(full, 1, state.tp_rank, state.tp_size)
    weight = nn.Parameter(shard, requires_grad=full.requires_grad)
    mark_tensor_parallel(weight, 1)
    rel_bias.weight = weight
    rel_bias.embedding_dim = shard.shape[1]


def _parallelize_self_attention(
    attn: SelfAttention, state: ParallelState, tracker: RNGStatesTracker | None, p: float
) -> None:
    attn.qkv = ColumnParallelLinear.from_linear(attn.qkv, state)
    attn.proj = RowParallelLinear.from_linear(attn.proj, state)
    if tracker is not None and p > 0:
        attn.core_rng_context = functools.partial(tracker.fork, MODEL_PARALLEL)
    if tracker is not None:
        attn.recompute_context_fn = tracker.checkpoint_context


def _parallelize_cross_attention(
    cross: CrossAttention, state: ParallelState, tracker: RNGStatesTracker | None, p: float
) -> None:
    cross.q = ColumnParallelLinear.from_linear(cross.q, state)
    # Under sequence parallelism its input, the encoder output, is a sequence shard: all-gathered here.
    cross.kv = ColumnParallelLinear.from_linear(cross.kv, state)
    cross.proj = RowParallelLinear.from_linear(cross.proj, state)
    if tracker is not None and p > 0:
        cross.core_rng_context = functools.partial(tracker.fork, MODEL_PARALLEL)
    if tracker is not None:
        cross.recompute_context_fn = tracker.checkpoint_context


def _parallelize_mlp(mlp: T5MLP, state: ParallelState, gated: bool) -> None:
    # A gated fc1 is [gate; up]: each rank needs its slice of both (stride 2), not a contiguous chunk.
    mlp.fc1 = ColumnParallelLinear.from_linear(mlp.fc1, state, stride=2 if gated else 1)
    mlp.fc2 = RowParallelLinear.from_linear(mlp.fc2, state)


def _mark_norm(norm: nn.Module) -> None:
    for p in norm.parameters():
        mark_sequence_parallel(p)


def t5_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None,
    state: ParallelState,
    vocab_limit: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of labels (B, T) over the tokens loss_mask (0/1) keeps, from the decoder's
    logits: (B, T, V/tp) vocab-sharded under tp (the vocab-parallel cross-entropy, never gathered),
    (B, T, V) otherwise; ids from vocab_limit on are padding rows, no classes. Labels under a 0 in the
    mask may be anything (T5 data pads them with -1)."""
    if loss_mask is not None:
        labels = labels.masked_fill(loss_mask == 0, 0)  # any real id: these rows weigh 0
    return vocab_parallel_cross_entropy(logits, labels, state, loss_mask=loss_mask, vocab_limit=vocab_limit)
