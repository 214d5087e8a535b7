"""Pipeline stages: the layer stack cut into model chunks, one or more (virtual stages) per pp rank.

    model = parallelize_model(GPTModel(cfg), state, ...)      # built in full on every rank, same seed
    chunks = build_stage_modules(model, state)  # this rank's chunks; the rest is dropped
    ... schedules.PipelineSchedule(chunks, state, ...).forward_backward(batches) ...
    allreduce_tied_embedding_grads(chunks, ddp, state)      # after ddp.finish_grad_sync()

Chunk numbering (Megatron's interleaving): with pp stages and V virtual stages there are pp·V chunks
of consecutive layers; chunk c lives on stage c % pp as its local chunk c // pp. So stage s holds
chunks s, s+pp, s+2pp, …; activations flow s -> s+1 and from the last stage back to stage 0 for the
next chunk. Chunk 0 holds the embedding, chunk pp·V-1 the final norm and LM head. The zbv schedule
lays its two chunks per stage out in a V instead (stage s holds s and 2pp-1-s: schedules.stage_chunk_ids),
so stage 0 holds both the embedding and the head.

A StageModule keeps GPTModel's attribute names, and its layers sit in a ModuleDict keyed by their
global index, so `named_parameters()` yields the single-device names (`layers.5.attn.qkv.weight`):
checkpoints stay layout-free. With tied embeddings (GPT-2) and pp > 1 the last stage holds its own
copy of the (vocab-sharded) embedding as the LM head, flagged `shared` so the gradient norm counts it
once; allreduce_tied_embedding_grads sums the two gradients so both copies take identical steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatrain.engine.models.bert import encoder_embeddings
from megatrain.engine.models.gpt import GPTModel, check_inputs, positions_for, rope_for, run_layers
from megatrain.engine.parallel.mappings import is_tensor_parallel, shard_tensor
from megatrain.engine.parallel.parallelize import full_state_dict, load_full_state_dict
from megatrain.engine.parallel.schedules import stage_chunk_ids
from megatrain.engine.parallel.state import ParallelState
from megatrain.kernels.attention import Segments
from megatrain.plan.layout import LayoutError, model_problems

TP_ATTRS = ("tensor_parallel", "partition_dim", "partition_stride", "sequence_parallel")


class StageModule(nn.Module):
    """One model chunk: optionally the embedding, a run of blocks, optionally the final norm and head.

    forward: tokens (B, T) on the first chunk, else the residual stream (B, T, C) — (B, T/tp, C) under
    sequence parallelism; returns the residual stream, or the logits (B, T, V/tp) on the last chunk
    (a BERT's last chunk returns its encoder output: its losses read the heads it holds).
    Every chunk takes the micro-batch's position_ids and segment_ids (B, T): its attention layers
    need both (RoPE, the document mask), the first chunk's learned positions the former.
    """

    def __init__(self, model: GPTModel, chunk: int, num_chunks: int, start: int, end: int):
        super().__init__()
        self.config = model.config
        self.chunk, self.is_first, self.is_last = chunk, chunk == 0, chunk == num_chunks - 1
        self.recompute_context_fn = model.recompute_context_fn
        self.encoder = model.config.is_encoder
        if self.is_first:
            self.embed = model.embed
            self.pos_embed = model.pos_embed
            self.dropout = model.dropout
            if self.encoder:  # BERT's token types and post-norm embedding norm (models.bert)
                self.tokentype_embed = model.tokentype_embed
                self.embed_norm = model.embed_norm
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(start, end)})
        if self.is_last:
            self.final_norm = model.final_norm
            self.lm_head = model.lm_head
            if self.encoder:
                self.heads = model.heads
        # Set by the engine when the loss fuses the LM head (tp = 1): the last chunk then returns the
        # final norm's output and the loss applies lm_head.weight itself (the linear_cross_entropy
        # kernel).
        self.return_hidden = False
        self.use_rope = model.config.position_embedding == "rope"
        if self.use_rope:
            self.register_buffer("rope_cos", model.rope_cos, persistent=False)
            self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    @property
    def layer_range(self) -> tuple[int, int]:
        ids = [int(k) for k in self.layers]
        return (ids[0], ids[-1] + 1) if ids else (0, 0)

    def set_recompute(self, mode: str, every: int = 1) -> None:
        """As GPTModel.set_recompute, on global layer indices (the same blocks as one process)."""
        if mode not in ("none", "selective", "full"):
            raise ValueError(f"recompute mode {mode!r} is not one of none, selective, full")
        if every < 1:
            raise ValueError(f"recompute every={every} must be >= 1")
        for key, layer in self.layers.items():
            layer.recompute = mode == "full" and int(key) % every == 0
            layer.attn.recompute_core = mode == "selective"

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.is_first and self.encoder:
            check_inputs(x, self.config.seq_length, position_ids, segment_ids)
            x = encoder_embeddings(self, x, position_ids, token_type_ids)
        elif self.is_first:
            check_inputs(x, self.config.seq_length, position_ids, segment_ids)
            t = x.shape[1]
            tokens = x
            x = self.embed(tokens)  # (B, T, C), or (B, T/tp, C) under sequence parallelism
            if self.pos_embed is not None:
                x = x + self.pos_embed(positions_for(t, position_ids, tokens.device))
            x = self.dropout(x)
        rope = rope_for(self.rope_cos, self.rope_sin, position_ids) if self.use_rope else None
        segments = Segments(segment_ids) if segment_ids is not None else None
        x = run_layers(self.layers.values(), x, rope, segments, self.training, self.recompute_context_fn)
        if self.is_last:
            if self.return_hidden:
                return self.final_norm(x)  # (B, T, C)
            return self.lm_head(self.final_norm(x))  # (B, T, V/tp)
        return x


def _untie(param: nn.Parameter) -> nn.Parameter:
    """A separate copy of `param` with its tensor-parallel attributes, flagged shared (Megatron's name)."""
    copy = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
    for attr in TP_ATTRS:
        if hasattr(param, attr):
            setattr(copy, attr, getattr(param, attr))
    copy.shared = True  # type: ignore[attr-defined]
    return copy


def build_stage_modules(model: GPTModel, state: ParallelState) -> list[StageModule]:
    """This rank's chunks of a (tensor-parallelized) GPTModel, by local chunk index.

    Every rank builds the whole model from the same seed first, so each stage starts from exactly the
    weights a single process would; the blocks of other stages are dropped with `model`.
    """
    pp, v = state.pp_size, state.layout.virtual_stages
    problems = model_problems(
        state.layout, num_layers=model.config.num_layers, model="model.", par="parallelism."
    )
    if problems:
        raise LayoutError("; ".join(p["message"] for p in problems))
    ranges = state.layout.chunk_layers(model.config.num_layers)
    chunks = []
    for cid in stage_chunk_ids(state.pp_rank, pp, v, state.layout.pipeline_schedule):
        chunks.append(StageModule(model, cid, pp * v, *ranges[cid]))
    last = chunks[-1]
    if model.config.tie_embeddings and last.is_last and not chunks[0].is_first:
        last.lm_head.weight = _untie(last.lm_head.weight)
    return chunks


def tied_embedding_param(chunks: Sequence[StageModule]) -> nn.Parameter | None:
    """The parameter of this stage that takes part in the tied-embedding gradient sum, if any."""
    if not chunks[0].config.tie_embeddings:
        return None
    first, last = chunks[0], chunks[-1]
    if first.is_first and last.is_last:
        return None  # both uses on one stage: one Parameter, autograd sums the two gradients
    if first.is_first:
        return first.embed.weight
    if last.is_last:
        return last.lm_head.weight
    return None


@torch.no_grad()
def allreduce_tied_embedding_grads(chunks: Sequence[StageModule], ddp: Any, state: ParallelState) -> None:
    """Sum the embedding's and the last stage's LM-head copy's gradients (after the dp reduction).

    Collective over the embedding group (first and last stage of each (tp, dp) column). With the
    distributed optimizer a rank holds only its dp shard of the reduced gradient, and the two stages
    lay out their buffers differently, so the buckets holding the weight are all-gathered first.
    """
    group = state.groups.get("embd")
    param = tied_embedding_param(chunks)
    if group is None or param is None:
        return
    ddp.gather_grad_shards(param)
    dist.all_reduce(param.main_grad, group=group)


def stage_parameter_names(chunks: Sequence[StageModule]) -> dict[nn.Parameter, str]:
    """Single-device names of this stage's parameters; the last stage's tied head copy is embed.weight."""
    names: dict[nn.Parameter, str] = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            names[p] = "embed.weight" if getattr(p, "shared", False) else name
    return names


def gather_to_rank0(obj: Any, state: ParallelState) -> list[Any] | None:
    """Every rank's `obj` on global rank 0 (None elsewhere); plain return without a process group."""
    if state.layout.world_size == 1:
        return [obj]
    out: list[Any] = [None] * state.layout.world_size if state.rank == 0 else []
    dist.gather_object(obj, out if state.rank == 0 else None, dst=0)
    return out if state.rank == 0 else None


def pipeline_full_state_dict(
    chunks: Sequence[StageModule], state: ParallelState
) -> dict[str, torch.Tensor] | None:
    """The single-device state dict of the whole pipelined model, on global rank 0 (None elsewhere).

    Collective over the world: each stage gathers its chunks over tp, then tp rank 0 of dp rank 0
    of every stage sends its part to rank 0. A tied head copy is left out, as in one process.
    """
    part: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        part.update(full_state_dict(chunk, state))
    sender = state.tp_rank == 0 and state.dp_rank == 0 and state.coords.cp == 0
    parts = gather_to_rank0(part if sender else None, state)
    if parts is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for p in parts:
        merged.update(p or {})
    return merged


@torch.no_grad()
def load_pipeline_state_dict(
    chunks: Sequence[StageModule], full: dict[str, torch.Tensor], state: ParallelState
) -> None:
    """Copy this stage's slice of a single-device state dict into its chunks (tp-sharded)."""
    for chunk in chunks:
        keys = set(chunk.state_dict(keep_vars=True))
        part = {k: v for k, v in full.items() if k in keys}
        load_full_state_dict(chunk, part, state)
        head = getattr(chunk, "lm_head", None)
        if head is not None and getattr(head.weight, "shared", False):
            src = full["embed.weight"]
            if is_tensor_parallel(head.weight):
                src = shard_tensor(src, head.weight.partition_dim, state.tp_rank, state.tp_size)
            head.weight.copy_(src)
