"""A T5 on this rank (engine.build's steps for models.t5): built on the meta device, tensor-parallel
(parallel.parallelize_t5), cut into its pipeline stage (parallel.pipeline_t5: encoder stages before
the split rank, decoder stages from it), materialised from the seeded initial weights or a Hugging
Face folder, and the loss each rank computes: the decoder's per-token cross-entropy over the target
tokens, the LM head fused with it (the logits never materialised), on one tensor-parallel rank or
on the head's vocabulary shards.

The split rank is the layout's: the stage where its pipeline_layers (encoder stages first), else an
even split of every layer, puts the encoder's end (megatrain.plan.stacks' rules hold a layout to
it; parallelism.pipeline_split_rank resolves into pipeline_layers, megatrain.plan.split_rank).
"""

from __future__ import annotations

import random

import torch
from torch import nn

from megatrain import kernels
from megatrain.engine.build import LossFn, RankModel
from megatrain.engine.materialize import WeightSource, init_source, materialize
from megatrain.engine.microbatch import MicroBatch
from megatrain.engine.models.t5 import T5Config, T5Model
from megatrain.engine.parallel.fused_loss import fused_parallel_lm_loss
from megatrain.engine.parallel.parallelize_t5 import parallelize_t5
from megatrain.engine.parallel.pipeline_t5 import (
    T5PipelineSchedule,
    T5Stage,
    allreduce_t5_shared_grads,
    build_t5_schedule,
    build_t5_stages,
)
from megatrain.engine.parallel.random import RNGStatesTracker
from megatrain.engine.parallel.state import ParallelState
from megatrain.plan.layout import Layout
from megatrain.plan.split_rank import layout_split_rank


def t5_split_rank(cfg: T5Config, layout: Layout) -> int | None:
    """The first decoder stage of `layout` (Megatron's pipeline_model_parallel_split_rank); None
    for pp = 1. Raises ValueError (SplitError) where no stage boundary falls at the encoder's end."""
    return layout_split_rank(cfg.num_layers, cfg.num_decoder_layers, layout)


def build_t5_model(
    cfg: T5Config,
    state: ParallelState,
    seed: int,
    device: str,
    *,
    dtype: torch.dtype = torch.float32,
    weights: WeightSource | None = None,
) -> RankModel:
    """This rank's shards and stage of T5Model(cfg), as engine.build.build_model builds a GPT's:
    nothing beyond them is allocated, and any layout starts from the weights one process draws from
    `seed` (models.init with models.t5.t5_init_rule), or from `weights`."""
    torch.manual_seed(seed)
    random.seed(seed)
    with torch.device("meta"):
        model = T5Model(cfg)  # draws init_seed from the generator just seeded, allocates nothing
    num_params = model.num_parameters()
    fill = weights or init_source(model.init_seed, cfg)
    tracker = RNGStatesTracker.for_tensor_parallel(seed, state) if state.tp_size > 1 else None
    model = parallelize_t5(model, state, rng_tracker=tracker)
    split = t5_split_rank(cfg, state.layout)
    if state.pp_size == 1:
        rank = RankModel(model, [], tracker, num_params, state)
    else:
        stages = build_t5_stages(model, state, split)
        rank = RankModel(nn.ModuleList(stages), stages, tracker, num_params, state, split_rank=split)  # type: ignore[arg-type]
    del model  # the other stages' layers go with it: they were never allocated
    materialize(rank.module, rank.parameter_names(), state, cfg, device=device, dtype=dtype, fill=fill)
    return rank


def t5_loss(model: T5Model, mb: MicroBatch, state: ParallelState) -> torch.Tensor:
    """The mean cross-entropy over the micro-batch's target tokens without a pipeline: T5Model.loss
    (head and loss fused) on one tensor-parallel rank, else the decoder's output through the fused
    vocab-parallel loss on the head's shards."""
    enc_mask, dec_mask = getattr(mb, "enc_mask", None), getattr(mb, "dec_mask", None)
    dec_tokens = getattr(mb, "dec_tokens", None)
    if dec_tokens is None:
        raise ValueError("a T5 micro-batch needs dec_tokens (data: a T5 dataset's Batch)")
    if state.tp_size == 1:
        return model.loss(mb.tokens, dec_tokens, mb.labels, mb.loss_mask, enc_mask, dec_mask)
    hidden = model.decoder_hidden(model.encode(mb.tokens, enc_mask), enc_mask, dec_tokens, dec_mask)
    limit = model.config.real_vocab_size
    return fused_parallel_lm_loss(hidden, model.lm_head, mb.labels, mb.loss_mask, vocab_limit=limit)


def t5_pipeline(
    model: RankModel, micro_batch_size: int, dtype: torch.dtype, schedule: str
) -> tuple[T5PipelineSchedule, LossFn]:
    """This stage's schedule (each boundary's shape: the encoder stream, or [encoder output;
    decoder stream] past the split) and the loss its last stage feeds: the decoder's output, fused
    with the LM head as without a pipeline. Other stages never call the loss."""
    stages: list[T5Stage] = model.chunks  # type: ignore[assignment]
    state = model.state
    sched = build_t5_schedule(
        stages, state, model.split_rank, micro_batch_size, dtype=dtype, schedule=schedule
    )
    last = stages[-1]
    vocab = last.config.real_vocab_size

    def loss(hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        if state.tp_size == 1:
            fn = kernels.get("linear_cross_entropy", hidden.device.type)
            return fn(hidden, last.lm_head.weight, mb.labels, loss_mask=mb.loss_mask, vocab_limit=vocab)
        return fused_parallel_lm_loss(hidden, last.lm_head, mb.labels, mb.loss_mask, vocab_limit=vocab)

    if last.is_last:
        last.return_hidden = True
    return sched, loss


def allreduce_t5_stage_grads(model: RankModel, ddp: object) -> None:
    """Sum the gradients of the weights several stages hold (the shared embedding, each stack's
    position-bias table) over those stages, after the data-parallel reduction."""
    allreduce_t5_shared_grads(model.chunks, model.state, ddp)  # type: ignore[arg-type]
