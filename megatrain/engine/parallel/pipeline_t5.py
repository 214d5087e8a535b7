"""T5 over pipeline stages: the encoder on stages [0, split), the decoder on [split, pp).

    model = parallelize_t5(T5Model(cfg), state, rng_tracker=tracker)    # whole model, same seed
    stages = build_t5_stages(model, state, split_rank)    # [this rank's stage]; the rest is dropped
    sched = build_t5_schedule(stages, state, split_rank, micro_batch_size, dtype=...)
    total = sched.forward_backward(t5_micro_batches, loss_fn)
    <ddp.finish_grad_sync()>; allreduce_t5_shared_grads(stages, state, ddp)
    allreduce_sequence_parallel_grads(nn.ModuleList(stages), state)

Megatron's `pipeline_model_parallel_split_rank`: stages [0, split) cut the encoder's layers, stages
[split, pp) the decoder's, so no stage mixes the two stacks (one stage holds both only when pp = 1).

What travels. PipelineSchedule sends one tensor per stage boundary; T5 needs two streams past the
split, the decoder's residual stream and the encoder's output, which every decoder layer reads.
Both are (B, ·, C), so past the split they travel as one tensor concatenated along the sequence:
    stage s -> s+1, s+1 <= split:  the encoder stream (B, S, C); at s+1 = split, the encoder's output
    stage s -> s+1, s+1 > split:   [encoder output; decoder stream] (B, S + T, C)
(under sequence parallelism each part is the rank's sequence shard: S/tp and T/tp). The first decoder
stage embeds the decoder tokens itself. A decoder stage splits its input at S (it knows T from the
decoder tokens every stage holds), runs its layers and sends the encoder output on unchanged beside
its new stream, as an identity inside its autograd graph. Backward then needs no bookkeeping: the
gradient a decoder stage returns for the encoder part is what its own cross-attentions contributed
plus what came back from the stages after it, so the first decoder stage hands the last encoder
stage the sum over every decoder stage, exactly as one process accumulates it.

Shapes differ per boundary, so T5PipelineSchedule is PipelineSchedule with a P2P whose receives take
their boundary's shape (the schedule, its orders and its messages are unchanged); micro-batches are
T5MicroBatch, whose model_inputs give every stage the decoder tokens and both padding masks.

Weights on several stages, as the tied embedding is in GPT: the shared embedding (encoder input on
stage 0, decoder input on stage split, and the tied LM head on the last stage), the encoder's
relative bias table (every encoder stage) and the decoder's (every decoder stage). The first holder
owns each; the others hold copies flagged `shared` (counted once by the gradient norm, written once
by checkpoints), and allreduce_t5_shared_grads sums their gradients over the holders so every copy
takes the same step. Interleaved (virtual) stages are not supported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from megatrain.engine.microbatch import T5MicroBatch  # noqa: F401  (re-exported)
from megatrain.engine.models.t5 import T5Config, T5Model, decoder_attention_masks, encoder_attention_mask
from megatrain.engine.models.t5_layers import run_stack, set_recompute
from megatrain.engine.parallel.pipeline import TP_ATTRS
from megatrain.engine.parallel.schedules import PipelineSchedule
from megatrain.engine.parallel.state import Group, ParallelState
from megatrain.plan.layout import LayoutError

# -- the plan (pure) -------------------------------------------------------------------------------


class StageLayers(NamedTuple):
    """[start, end) of each stack's layers on one stage; None: none of that stack."""

    encoder: tuple[int, int] | None
    decoder: tuple[int, int] | None


def _even(n: int, parts: int) -> list[int]:
    q, r = divmod(n, parts)
    return [q + (i >= parts - r) for i in range(parts)]  # the extra layers on the later stages


def t5_stage_layers(
    cfg: T5Config, pp: int, split_rank: int | None, pipeline_layers: Sequence[int] | None = None
) -> list[StageLayers]:
    """Each stage's layers: the encoder's over stages [0, split_rank), the decoder's over
    [split_rank, pp), as even as they go (or pipeline_layers: pp counts, the encoder's first).
    Raises LayoutError naming the broken rule."""
    if pp == 1:
        return [StageLayers((0, cfg.num_layers), (0, cfg.num_decoder_layers))]
    if split_rank is None or not 0 < split_rank < pp:
        raise LayoutError(
            f"T5 over pp={pp} stages needs a split rank in [1, {pp - 1}] (encoder stages [0, split), "
            f"decoder stages [split, pp)); got {split_rank}"
        )
    n_enc, n_dec = split_rank, pp - split_rank
    if pipeline_layers is None:
        if cfg.num_layers < n_enc or cfg.num_decoder_layers < n_dec:
            raise LayoutError(
                f"{cfg.num_layers} encoder and {cfg.num_decoder_layers} decoder layers cannot fill "
                f"{n_enc} encoder and {n_dec} decoder stages: every stage needs a layer"
            )
        counts = _even(cfg.num_layers, n_enc) + _even(cfg.num_decoder_layers, n_dec)
    else:
        counts = list(pipeline_layers)
        if (
            len(counts) != pp
            or min(counts) < 1
            or sum(counts[:n_enc]) != cfg.num_layers
            or sum(counts[n_enc:]) != cfg.num_decoder_layers
        ):
            raise LayoutError(
                f"pipeline_layers={counts} must be {pp} counts >= 1, the first {n_enc} summing to the "
                f"encoder's {cfg.num_layers} layers and the rest to the decoder's {cfg.num_decoder_layers}"
            )
    out, start = [], 0
    for s, n in enumerate(counts):
        if s == n_enc:
            start = 0
        span = (start, start + n)
        out.append(StageLayers(span, None) if s < n_enc else StageLayers(None, span))
        start += n
    return out


def t5_shared_stages(pp: int, split_rank: int | None, tie_embeddings: bool) -> dict[str, tuple[int, ...]]:
    """Canonical name -> the stages holding a copy, owner first, for each weight on several stages."""
    if pp == 1:
        return {}
    assert split_rank is not None
    embed = (0, split_rank) + ((pp - 1,) if tie_embeddings and pp - 1 != split_rank else ())
    holders = {
        "embed.weight": embed,
        "encoder.rel_bias.weight": tuple(range(split_rank)),
        "decoder.rel_bias.weight": tuple(range(split_rank, pp)),
    }
    return {name: stages for name, stages in holders.items() if len(stages) > 1}


def t5_boundary_shapes(
    stage: int,
    pp: int,
    split_rank: int | None,
    micro_batch_size: int,
    encoder_seq_length: int,
    decoder_seq_length: int,
    hidden_size: int,
    sequence_shards: int = 1,
) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """(what `stage` receives, what it sends): the activation shapes of its two boundaries (None
    at the ends of the pipeline). sequence_shards: tp under sequence parallelism, else 1."""

    def boundary(b: int) -> tuple[int, ...]:  # between stages b-1 and b
        s = encoder_seq_length // sequence_shards
        t = decoder_seq_length // sequence_shards if split_rank is not None and b > split_rank else 0
        return (micro_batch_size, s + t, hidden_size)

    return (boundary(stage) if stage > 0 else None, boundary(stage + 1) if stage < pp - 1 else None)


# -- the stage module ------------------------------------------------------------------------------


class _StackPart(nn.Module):
    """One stack's share of a stage, under the stack's names: rel_bias, layers.<global index>,
    final_norm (on the stack's last stage)."""

    def __init__(self, stack: nn.Module, start: int, end: int, last: bool):
        super().__init__()
        self.rel_bias = stack.rel_bias
        self.layers = nn.ModuleDict({str(i): stack.layers[i] for i in range(start, end)})
        if last:
            self.final_norm = stack.final_norm
        self.dropout = stack.dropout
        self.sequence_shards = stack.sequence_shards
        self.recompute_context_fn = stack.recompute_context_fn

    def run(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        """x through this part's layers (run_stack: full recompute where set)."""
        fn = self.recompute_context_fn
        return run_stack(self.layers.values(), x, *args, training=self.training, context_fn=fn)


class T5Stage(nn.Module):
    """One pipeline stage of a (tensor-parallelized) T5Model, keeping T5Model's parameter names.

    forward(x, dec_tokens, enc_mask, dec_mask): x is the encoder tokens (B, S) on stage 0, else what
    the previous stage sent (module docstring). Returns what the next stage receives, or on the last
    stage the logits (B, T, V/tp), or the LM head's input (B, T, C) when return_hidden.
    """

    def __init__(self, model: T5Model, stage: int, pp: int, layers: StageLayers):
        super().__init__()
        cfg = self.config = model.config
        self.stage, self.is_first, self.is_last = stage, stage == 0, stage == pp - 1
        enc, dec = layers
        self.encoder_last = enc is not None and enc[1] == cfg.num_layers
        self.decoder_first = dec is not None and dec[0] == 0
        if self.is_first or self.decoder_first:
            self.embed = model.embed
        self.encoder = None if enc is None else _StackPart(model.encoder, *enc, last=self.encoder_last)
        self.decoder = None if dec is None else _StackPart(model.decoder, *dec, last=self.is_last)
        if self.is_last:
            self.lm_head = model.lm_head
        enc_span = (0, 0) if enc is None else enc
        dec_span = (0, 0) if dec is None else (cfg.num_layers + dec[0], cfg.num_layers + dec[1])
        self.layer_range = (
            enc_span[0] if enc is not None else dec_span[0],
            dec_span[1] if dec is not None else enc_span[1],
        )
        """[start, end) of the stage's layers, the encoder's and then the decoder's numbered end to
        end (the planner's count: megatrain.plan.stacks)."""
        self.return_hidden = False
        """Set when the loss applies the head itself (a fused linear cross-entropy at tp = 1)."""
        self.shared_groups: dict[str, Group] = {}
        """Canonical name -> the group of the stages holding that weight (build_t5_stages)."""

    def set_recompute(self, mode: str, every: int = 1) -> None:
        """As T5Model.set_recompute, on each stack's global layer indices (the layers one process
        recomputes)."""
        set_recompute((), mode, every)  # checks mode and every on a stage of either stack
        for part in (self.encoder, self.decoder):
            if part is not None:
                set_recompute(((int(k), layer) for k, layer in part.layers.items()), mode, every)

    def forward(
        self,
        x: torch.Tensor,
        dec_tokens: torch.Tensor | None = None,
        enc_mask: torch.Tensor | None = None,
        dec_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cfg = self.config
        memory = dec = None
        if self.is_first:
            if x.shape[1] > cfg.encoder_seq_length:
                raise ValueError(f"encoder sequence of {x.shape[1]} tokens exceeds {cfg.encoder_seq_length}")
            x = self.encoder.dropout(self.embed(x))  # (B, S, C), or (B, S/tp, C) under sp
        if self.encoder is not None:
            s = x.shape[1] * self.encoder.sequence_shards
            mask = encoder_attention_mask(self.encoder.rel_bias, s, enc_mask, x.dtype)
            x = self.encoder.run(x, mask)
            if not self.encoder_last:
                return x
            memory = self.encoder.dropout(self.encoder.final_norm(x))
            if self.decoder is None:
                return memory
        assert self.decoder is not None  # a stage holds one stack or more
        if dec_tokens is None:
            raise ValueError("a decoder stage needs dec_tokens (T5MicroBatch.model_inputs)")
        if dec_tokens.shape[1] > cfg.decoder_seq_length:
            raise ValueError(f"decoder sequence of {dec_tokens.shape[1]} exceeds {cfg.decoder_seq_length}")
        shards = self.decoder.sequence_shards
        if self.decoder_first:
            if memory is None:
                memory = x  # the encoder's output, from the last encoder stage
            dec = self.decoder.dropout(self.embed(dec_tokens))
        else:
            t = dec_tokens.shape[1] // shards
            memory, dec = x.split([x.shape[1] - t, t], dim=1)  # [encoder output; decoder stream]
        self_mask, cross_mask = decoder_attention_masks(
            self.decoder.rel_bias, dec.shape[1] * shards, 0, enc_mask, dec_mask, dec.dtype
        )
        dec = self.decoder.run(dec, memory, self_mask, cross_mask)
        if not self.is_last:
            return torch.cat([memory, dec], dim=1)  # (B, S + T, C): the encoder output rides along
        h = self.decoder.dropout(self.decoder.final_norm(dec))
        if cfg.tie_embeddings:
            h = h * cfg.hidden_size**-0.5  # as T5Model.decoder_hidden
        return h if self.return_hidden else self.lm_head(h)


def _copy_shared(param: nn.Parameter) -> nn.Parameter:
    """A stage's own copy of a weight another stage owns, with its tensor-parallel markers."""
    copy = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
    for attr in TP_ATTRS:
        if hasattr(param, attr):
            setattr(copy, attr, getattr(param, attr))
    copy.shared = True  # type: ignore[attr-defined]
    return copy


def build_t5_stages(model: T5Model, state: ParallelState, split_rank: int | None) -> list[T5Stage]:
    """This rank's stage of a (tensor-parallelized) T5Model, as a one-element list (the schedule's
    chunks). Every rank builds the whole model from the same seed first, so each stage starts from
    the weights one process would have; the other stages' layers go with `model`.

    Collective over the world when pp > 1: creates the groups of the stages that share a weight
    (every rank must call it, in the same order relative to other group creations)."""
    layout, pp = state.layout, state.pp_size
    if layout.virtual_stages != 1:
        raise LayoutError("T5 pipelines have no interleaved (virtual) stages: set virtual_stages to 1")
    cfg = model.config
    plan = t5_stage_layers(cfg, pp, split_rank, layout.pipeline_layers)
    stage = T5Stage(model, state.pp_rank, pp, plan[state.pp_rank])
    if pp > 1:
        assert split_rank is not None
        if stage.decoder_first and not stage.is_first:
            stage.embed.weight = _copy_shared(stage.embed.weight)
        if stage.is_last and cfg.tie_embeddings:
            # The head is the embedding: the same Parameter as this stage's copy if it has one.
            embed = getattr(stage, "embed", None)
            stage.lm_head.weight = embed.weight if embed is not None else _copy_shared(stage.lm_head.weight)
        if stage.encoder is not None and stage.stage > 0:
            stage.encoder.rel_bias.weight = _copy_shared(stage.encoder.rel_bias.weight)
        if stage.decoder is not None and stage.stage > split_rank:
            stage.decoder.rel_bias.weight = _copy_shared(stage.decoder.rel_bias.weight)
        stage.shared_groups = _shared_groups(state, t5_shared_stages(pp, split_rank, cfg.tie_embeddings))
    return [stage]


def _shared_groups(state: ParallelState, holders: dict[str, tuple[int, ...]]) -> dict[str, Group]:
    """Canonical name -> this rank's group over the stages holding the weight (within its pipeline);
    only the names this rank holds. Every rank creates every group, in one order."""
    made: dict[tuple[int, ...], dict[int, Group]] = {}
    out: dict[str, Group] = {}
    for name, stages in holders.items():
        if stages not in made:
            made[stages] = {}
            for column in state.layout.group_ranks("pp"):
                by_stage = sorted(column, key=lambda r: state.layout.coords(r).pp)
                ranks = [by_stage[s] for s in stages]
                group = dist.new_group(ranks)
                for r in ranks:
                    made[stages][r] = group
        if state.rank in made[stages]:
            out[name] = made[stages][state.rank]
    return out


def _shared_param(stage: T5Stage, name: str) -> nn.Parameter:
    if name == "embed.weight" and not hasattr(stage, "embed"):
        return stage.lm_head.weight  # the last stage's tied head
    return stage.get_parameter(name)


@torch.no_grad()
def allreduce_t5_shared_grads(stages: Sequence[T5Stage], state: ParallelState, ddp: Any = None) -> None:
    """Sum the gradients of the weights several stages hold over those stages (after the dp
    reduction: ddp.finish_grad_sync()). With ddp, main_grad (made whole first under the distributed
    optimizer); without, .grad. Collective over each sharing group, in one order on every rank."""
    stage = stages[0]
    for name, group in stage.shared_groups.items():  # t5_shared_stages' order everywhere: no deadlock
        p = _shared_param(stage, name)
        if ddp is not None:
            ddp.gather_grad_shards(p)
            grad = p.main_grad
        else:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad
        dist.all_reduce(grad, group=group)


def t5_stage_parameter_names(stages: Sequence[T5Stage]) -> dict[nn.Parameter, str]:
    """Canonical (T5Model) names of this stage's parameters; the last stage's tied head copy is
    embed.weight (pipeline.stage_parameter_names would misname the rel_bias copies)."""
    names: dict[nn.Parameter, str] = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            names[p] = "embed.weight" if name == "lm_head.weight" and stage.config.tie_embeddings else name
    return names


# -- the schedule ----------------------------------------------------------------------------------


T5PipelineSchedule = PipelineSchedule
"""A T5 stage's schedule: activation_shape is what it receives, output_shape what it sends
(t5_boundary_shapes; () at the ends of the pipeline)."""


def build_t5_schedule(
    stages: Sequence[T5Stage],
    state: ParallelState,
    split_rank: int | None,
    micro_batch_size: int,
    *,
    dtype: torch.dtype,
    encoder_seq_length: int | None = None,
    decoder_seq_length: int | None = None,
    schedule: str = "1f1b",
) -> T5PipelineSchedule:
    """The schedule of this rank's stage for micro-batches of micro_batch_size rows padded to the
    given lengths (None: the config's encoder_seq_length / decoder_seq_length)."""
    cfg = stages[0].config
    shards = state.tp_size if state.sequence_parallel else 1
    recv, send = t5_boundary_shapes(
        state.pp_rank,
        state.pp_size,
        split_rank,
        micro_batch_size,
        encoder_seq_length or cfg.encoder_seq_length,
        decoder_seq_length or cfg.decoder_seq_length,
        cfg.hidden_size,
        shards,
    )
    return T5PipelineSchedule(stages, state, recv or (), dtype, schedule, output_shape=send or ())
