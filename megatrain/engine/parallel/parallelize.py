"""Tensor (+ sequence) parallelism applied to a single-device GPTModel by module replacement.

    torch.manual_seed(seed)                       # same on every rank: the full model is identical
    model = GPTModel(cfg)                         # full init on every rank (CPU is fine) ...
    tracker = manual_seed(seed, state)            # ... model-parallel RNG stream per tp rank
    model = parallelize_model(model, state, rng_tracker=tracker)   # ... then sliced into shards
    model.to(device).set_recompute(mode, every)  # either order: blocks are kept, only Linears swapped
    loss = parallel_lm_loss(model(tokens), labels, state)
    loss.backward(); <data-parallel grad sync>; allreduce_sequence_parallel_grads(model, state)

Replacements, per block: attn.qkv and mlp.fc1 -> ColumnParallelLinear, attn.proj and mlp.fc2 ->
RowParallelLinear, attention head/group counts -> H/tp and G/tp (the group-by-group qkv layout hands
each rank whole groups); embed -> VocabParallelEmbedding; lm_head -> ColumnParallelLinear over the
vocabulary, output left sharded (the loss is vocab-parallel), sharing the embedding's shard when tied.
An MoE layer's experts are split per expert the same way (parallel.moe_tensor).

With sequence parallelism the residual stream between blocks is a sequence shard (B, T/tp, C): the
embedding reduce-scatters along T, learned positions are looked up for the local slice, qkv/fc1/
lm_head all-gather along T (keeping only their shard for backward), proj/fc2 reduce-scatter; norms,
RowParallel biases and positions are flagged `sequence_parallel` (allreduce_sequence_parallel_grads
sums their gradients over tp) and hidden dropout draws per-rank masks from the tracker, since ranks
hold different tokens.

full_state_dict gathers the shards back into GPTModel's names and layout (inspection, tests) and
load_full_state_dict slices canonical tensors into this rank's shards (Hugging Face imports), experts
over ep too (parallel.expert);
checkpoints never gather: each rank writes its own shards (megatrain.engine.checkpoint).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from megatrain.engine.models.gpt import GPTModel, lm_loss
from megatrain.engine.models.moe import MoELayer
from megatrain.engine.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatrain.engine.parallel.expert import gather_experts, shard_experts
from megatrain.engine.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelPositionEmbedding,
    VocabParallelEmbedding,
)
from megatrain.engine.parallel.mappings import (
    gather_shards,
    is_expert_parallel,
    is_tensor_parallel,
    mark_sequence_parallel,
    shard_tensor,
)
from megatrain.engine.parallel.moe_tensor import parallelize_moe_layer
from megatrain.engine.parallel.random import MODEL_PARALLEL, RNGStatesTracker, TrackedDropout
from megatrain.engine.parallel.state import ParallelState
from megatrain.plan.layout import LayoutError, model_problems


def parallelize_model(
    model: GPTModel, state: ParallelState, *, rng_tracker: RNGStatesTracker | None = None
) -> GPTModel:
    """Shard `model` (built in full, identically on every tp rank) for tensor parallelism, in place.

    rng_tracker: required when tp > 1 and the model has dropout; it gives attention dropout (sharded
    heads) and, with sequence parallelism, hidden dropout per-rank masks, and makes recompute replay
    the tracker's streams. The returned model's forward gives the local vocab shard of the logits.
    """
    if state.tp_size == 1:
        return model
    cfg = model.config
    tp, sp = state.tp_size, state.sequence_parallel
    problems = model_problems(
        state.layout,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        vocab_size=cfg.vocab_size,
        seq_length=cfg.seq_length,
        # The experts' widths (an MoE model): checked here, before any layer is swapped.
        moe_ffn_hidden_size=cfg.moe.ffn_hidden_size if cfg.moe is not None else None,
        shared_expert_ffn_hidden_size=cfg.moe.shared_expert_ffn_hidden_size if cfg.moe is not None else None,
        model="model.",
        par="parallelism.",  # the words of the spec's 422 (layout_problems), rule for rule
    )
    if problems:
        raise LayoutError("invalid parallel layout: " + "; ".join(p["message"] for p in problems))
    has_dropout = cfg.hidden_dropout > 0 or cfg.attention_dropout > 0
    if rng_tracker is None and has_dropout:
        raise ValueError("tensor parallelism with dropout needs an rng_tracker (see parallel.random)")
    if rng_tracker is not None and MODEL_PARALLEL not in rng_tracker.names:
        raise ValueError(f"the rng_tracker has no {MODEL_PARALLEL!r} stream")
    swiglu = cfg.activation == "swiglu"  # the experts' activation (MoE runs swiglu or gelu)

    for block in model.layers:
        attn, mlp = block.attn, block.mlp
        attn.qkv = ColumnParallelLinear.from_linear(attn.qkv, state)
        attn.proj = RowParallelLinear.from_linear(attn.proj, state)
        attn.num_heads //= tp
        attn.num_groups //= tp
        if isinstance(mlp, MoELayer):
            parallelize_moe_layer(mlp, state, swiglu)  # experts split per expert, like fc1/fc2
        else:
            # fc1 rows are [gate; up]: each rank needs its slice of both (stride 2), not a contiguous chunk.
            mlp.fc1 = ColumnParallelLinear.from_linear(mlp.fc1, state, stride=2 if cfg.gated_mlp else 1)
            mlp.fc2 = RowParallelLinear.from_linear(mlp.fc2, state)
        if sp:
            _mark_norm(block.attn_norm)
            _mark_norm(block.mlp_norm)
        if rng_tracker is not None:
            if cfg.attention_dropout > 0:
                attn.core_rng_context = functools.partial(rng_tracker.fork, MODEL_PARALLEL)
            attn.recompute_context_fn = rng_tracker.checkpoint_context
            if sp:
                block.dropout = TrackedDropout(cfg.hidden_dropout, rng_tracker)

    model.embed = VocabParallelEmbedding.from_embedding(model.embed, state)
    if sp and model.pos_embed is not None:
        model.pos_embed = SequenceParallelPositionEmbedding(model.pos_embed, state)
    if sp:
        _mark_norm(model.final_norm)
    if cfg.is_encoder:
        _parallelize_encoder_parts(model, state)
    if rng_tracker is not None:
        model.recompute_context_fn = rng_tracker.checkpoint_context
        if sp:
            model.dropout = TrackedDropout(cfg.hidden_dropout, rng_tracker)
    # The full head is no longer needed once sliced; a tied head shares the embedding's shard
    # (both are (V/tp, C) rows [r·V/tp, (r+1)·V/tp)).
    head = ColumnParallelLinear.from_linear(model.lm_head, state)
    if cfg.tie_embeddings:
        head.weight = model.embed.weight
    model.lm_head = head
    return model


def _parallelize_encoder_parts(model: GPTModel, state: ParallelState) -> None:
    """A BERT's own parts (models.bert). Under sequence parallelism token types are looked up for
    the local slice (as learned positions), and the embedding norm and the masked-LM transform run
    on the sequence shard, so their gradients are summed over tp; the pooler and classifier read the
    whole first token (parallel.bert_loss) and stay plain replicas. The decoder's bias is split
    over the vocabulary with the head (ColumnParallelLinear.from_linear)."""
    if not state.sequence_parallel:
        return
    if model.tokentype_embed is not None:
        model.tokentype_embed = SequenceParallelPositionEmbedding(model.tokentype_embed, state)
    if model.embed_norm is not None:
        _mark_norm(model.embed_norm)
    for part in (model.heads.lm_transform, model.heads.lm_norm):  # a classifier has neither
        if part is not None:
            _mark_norm(part)


def _mark_norm(norm: nn.Module) -> None:
    for p in norm.parameters():
        mark_sequence_parallel(p)


def parallel_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    state: ParallelState,
    loss_mask: torch.Tensor | None = None,
    vocab_limit: int | None = None,
) -> torch.Tensor:
    """The LM loss for a parallelized model's logits: vocab-parallel CE when tp > 1, else lm_loss;
    the mean over the tokens loss_mask keeps, over the first vocab_limit ids (the rest is padding)."""
    if state.tp_size == 1:
        return lm_loss(logits[..., :vocab_limit] if vocab_limit else logits, labels, loss_mask)
    return vocab_parallel_cross_entropy(logits, labels, state, loss_mask=loss_mask, vocab_limit=vocab_limit)


def _canonical_keys(model: GPTModel) -> list[str]:
    """GPTModel's state-dict keys as checkpoints hold them: a tied head is stored once, as embed."""
    keys = list(model.state_dict(keep_vars=True))
    # A pipeline chunk may hold only one end (or neither) of the tied pair.
    if model.config.tie_embeddings and "lm_head.weight" in keys:
        keys.remove("lm_head.weight")
    return keys


@torch.no_grad()
def full_state_dict(model: GPTModel, state: ParallelState, *, to_cpu: bool = True) -> dict[str, torch.Tensor]:
    """The single-device state dict of a (possibly) tensor-parallel model: shards all-gathered over tp.

    Collective over the tp group (every tp rank must call it), and over ep for the experts (gathered
    along dim 0 too). Same keys and layouts as checkpoint.model_state_for_save(GPTModel): a tied
    lm_head is omitted. Tensors are detached copies, moved to CPU one at a time when to_cpu, so the
    device never holds more than one gathered tensor.
    """
    params = model.state_dict(keep_vars=True)
    out: dict[str, torch.Tensor] = {}
    for name in _canonical_keys(model):
        p = params[name]
        t = p.detach()
        if is_tensor_parallel(p) and state.tp_size > 1:
            t = gather_shards(t, p.partition_dim, p.partition_stride, state.tp_group, state.tp_size)
        else:
            t = t.clone()
        if is_expert_parallel(p):
            t = gather_experts(t, state)
        out[name] = t.cpu() if to_cpu else t.contiguous()
    return out


@torch.no_grad()
def load_full_state_dict(model: GPTModel, full: dict[str, torch.Tensor], state: ParallelState) -> None:
    """Copy a single-device state dict into a (possibly) tensor-parallel model: this rank's shards.

    Accepts the checkpoint form (tied lm_head absent) or GPTModel.state_dict() (tied head present and
    ignored). Raises ValueError naming missing/unexpected keys or a shape that does not fit.
    """
    params = model.state_dict(keep_vars=True)
    keys = _canonical_keys(model)
    allowed = set(params)
    missing = [k for k in keys if k not in full]
    unexpected = [k for k in full if k not in allowed]
    if missing or unexpected:
        raise ValueError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")
    for name in keys:
        p, src = params[name], full[name]
        if is_expert_parallel(p):
            src = shard_experts(src, state)
        if is_tensor_parallel(p):
            src = shard_tensor(src, p.partition_dim, state.tp_rank, state.tp_size, p.partition_stride)
        if src.shape != p.shape:
            raise ValueError(f"{name}: shape {tuple(src.shape)} does not fit this rank's {tuple(p.shape)}")
        p.copy_(src)
