"""From configs to a trainable model on this rank: build on the meta device, parallelise, split into
pipeline stages, materialise this rank's shards (engine.materialize), cast, wrap for recompute /
compile, attach data parallelism and the optimizer (in that order, torchtitan's), and pick the loss
each rank computes. A T5Config's model takes the same steps in engine.build_t5."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from megatrain import kernels
from megatrain.engine.config import LoRAConfig, TrainConfig, TransformerConfig
from megatrain.engine.dpo import head_logps
from megatrain.engine.fp8 import enable_fp8
from megatrain.engine.lora import attach_lora, quantize_nf4
from megatrain.engine.materialize import (
    WeightSource,
    init_source,
    materialize,
    with_adapters,
    with_fallback,
)
from megatrain.engine.microbatch import MicroBatch
from megatrain.engine.models.bert import model_class
from megatrain.engine.models.gpt import compile_layers
from megatrain.engine.models.t5 import T5Config, T5Model
from megatrain.engine.optimizer import MixedPrecisionOptimizer, build_optimizer
from megatrain.engine.parallel.bert_loss import encoder_loss
from megatrain.engine.parallel.context import parallelize_context
from megatrain.engine.parallel.data import DataParallel
from megatrain.engine.parallel.expert import parallelize_experts
from megatrain.engine.parallel.expert_dedup import dedup_experts
from megatrain.engine.parallel.expert_overlap import overlap_experts
from megatrain.engine.parallel.fused_loss import fused_parallel_lm_loss
from megatrain.engine.parallel.parallelize import parallel_lm_loss, parallelize_model
from megatrain.engine.parallel.pipeline import (
    StageModule,
    allreduce_tied_embedding_grads,
    build_stage_modules,
    stage_parameter_names,
)
from megatrain.engine.parallel.pipeline_t5 import T5Stage, t5_stage_parameter_names
from megatrain.engine.parallel.random import RNGStatesTracker
from megatrain.engine.parallel.schedules import PipelineSchedule
from megatrain.engine.parallel.state import ParallelState
from megatrain.spec import ParallelismSpec

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
"""The model weights' dtype per precision: fp8 keeps bf16 weights (cast to float8 per GEMM)."""

LossFn = Callable[[torch.Tensor, MicroBatch], torch.Tensor]
"""(last stage's output, micro-batch) -> the mean loss over the micro-batch's loss tokens."""


ModelConfig = TransformerConfig | T5Config
"""What a model is built from: a GPT or BERT (TransformerConfig), or a T5 (models.t5.T5Config)."""


@dataclass
class RankModel:
    """This rank's share of the model: the whole (tensor-parallel) GPTModel / T5Model, or its
    pipeline chunks."""

    module: nn.Module
    """What DataParallel wraps: the model, or an nn.ModuleList of this stage's chunks."""
    chunks: list[StageModule]
    """This stage's model chunks by local index (empty without pipeline parallelism; a T5's one
    T5Stage)."""
    tracker: RNGStatesTracker | None
    num_params: int
    """Parameters of the whole single-device model."""
    state: ParallelState
    split_rank: int | None = None
    """A T5 pipeline's first decoder stage; None otherwise."""

    def parameter_names(self) -> dict[nn.Parameter, str]:
        """Canonical (single-device) name of every unique parameter; a tied head is `embed.weight`."""
        if self.chunks and isinstance(self.chunks[0], T5Stage):
            return t5_stage_parameter_names(self.chunks)  # type: ignore[arg-type]
        if self.chunks:
            return stage_parameter_names(self.chunks)
        return {p: name for name, p in self.module.named_parameters()}


def build_model(
    mcfg: ModelConfig,
    state: ParallelState,
    seed: int,
    device: str,
    *,
    dtype: torch.dtype = torch.float32,
    weights: WeightSource | None = None,
    lora: LoRAConfig | None = None,
    adapters: WeightSource | None = None,
) -> RankModel:
    """This rank's shards and stages, and nothing more: the model is built and parallelised on the
    meta device, then only what this rank keeps is allocated (in `dtype`, on `device`) and filled
    from `weights` (a Hugging Face folder read by slice, say), else from the initial values one
    process would draw from `seed` (models.init): any layout starts from the very same weights.
    With `lora`, the model is frozen and its target linears get adapters (engine.lora), drawn from
    `seed` too, or filled from `adapters` (a PEFT folder: interop.peft_load)."""
    if isinstance(mcfg, T5Config):
        if lora is not None:
            raise ValueError("LoRA adapters are for arch gpt2 and llama; a T5 trains in full")
        from megatrain.engine.build_t5 import build_t5_model  # it builds on this module

        return build_t5_model(mcfg, state, seed, device, dtype=dtype, weights=weights)
    torch.manual_seed(seed)
    random.seed(seed)
    with torch.device("meta"):
        model = model_class(mcfg)(mcfg)  # draws init_seed from the generator just seeded, allocates nothing
    num_params = model.num_parameters()
    fill = init_source(model.init_seed, mcfg)
    if lora is not None and (weights is not None or adapters is not None):
        fill = with_adapters(weights or fill, adapters or fill)
    elif weights is not None:
        fill = with_fallback(weights, fill)  # a head the weights lack starts from its initial values
    tracker = RNGStatesTracker.for_tensor_parallel(seed, state) if state.tp_size > 1 else None
    model = parallelize_model(model, state, rng_tracker=tracker)
    if lora is not None:
        attach_lora(model, lora, mcfg, state, tracker)
    parallelize_experts(model, state)  # this ep rank's experts, the all-to-all dispatcher
    model = parallelize_context(model, state)
    if state.pp_size == 1:
        rank = RankModel(model, [], tracker, num_params, state)
    else:
        chunks = build_stage_modules(model, state)
        rank = RankModel(nn.ModuleList(chunks), chunks, tracker, num_params, state)
    del model  # the other stages' blocks go with it: they were never allocated
    convert = quantize_nf4 if lora is not None and lora.quantize_base else None
    materialize(
        rank.module,
        rank.parameter_names(),
        state,
        mcfg,
        device=device,
        dtype=dtype,
        fill=fill,
        convert=convert,
    )
    return rank


@dataclass
class Trainable:
    """A RankModel made ready to train: cast, wrapped, data-parallel, with its optimizer and loss."""

    model: RankModel
    ddp: DataParallel
    optimizer: MixedPrecisionOptimizer
    names: dict[nn.Parameter, str]
    pipeline: PipelineSchedule | None
    loss: LossFn | None
    """The pipeline's last-stage loss on (output, micro-batch); None without a pipeline (see `lm_loss`)."""
    logps: LossFn | None = None
    """Preference training with a pipeline: the last stage's (B,) row log-probs on (output,
    micro-batch) (engine.dpo.head_logps); None otherwise."""
    microbatch_lanes: bool = False
    """parallelism.moe_overlap_microbatches without a pipeline: each micro-batch's forward runs
    beside the one before's backward (engine.parallel.lanes; a pipeline pairs them itself)."""

    def allreduce_shared_grads(self) -> None:
        """Sum the gradients of weights several pipeline stages hold over those stages, after the
        data-parallel reduction: a GPT's tied embedding and LM head, a T5's shared embedding and
        position-bias tables. Nothing without a pipeline."""
        chunks = self.model.chunks
        if chunks and isinstance(chunks[0], T5Stage):
            from megatrain.engine.build_t5 import allreduce_t5_stage_grads

            allreduce_t5_stage_grads(self.model, self.ddp)
        elif chunks:
            allreduce_tied_embedding_grads(chunks, self.ddp, self.model.state)


def make_trainable(
    model: RankModel,
    cfg: TrainConfig,
    par: ParallelismSpec,
    precision: str,
    mcfg: ModelConfig,
) -> Trainable:
    state = model.state
    dtype = PARAM_DTYPES[precision]
    model.module.to(dtype=dtype)
    t5 = isinstance(mcfg, T5Config)  # (the spec refuses compile for a T5: its layers are no blocks)
    if precision == "fp8":
        enable_fp8(model.module, cfg.fp8_recipe, cfg.fp8_backend)
    if par.moe_dispatch == "nodes":
        # Each token once per node, then per rank (ep > 1); hop 1 pipelined in chunks.
        dedup_experts(model.module, state, chunks=par.moe_overlap_chunks)
    else:
        overlap_experts(model.module, par.moe_overlap_chunks)  # the all-to-alls behind the experts
    for part in model.chunks or [model.module]:  # GPTModel / StageModule, T5Model / T5Stage
        part.set_recompute(cfg.recompute, every=cfg.recompute_every)
        if cfg.compile and not t5:
            compile_layers(part)
    ddp = DataParallel(
        model.module,
        state,
        bucket_elements=par.grad_bucket_elements,
        overlap_grad_reduce=par.overlap_grad_reduce,
        # Sharded over the weight replicas: dp×cp ranks (cp ranks hold the same weights).
        use_distributed_optimizer=par.distributed_optimizer and state.dp_cp_size > 1,
    )
    optimizer = build_optimizer(ddp, cfg)
    pipeline, loss, logps = None, None, None
    if model.chunks and t5:
        from megatrain.engine.build_t5 import t5_pipeline

        pipeline, loss = t5_pipeline(model, cfg.micro_batch_size, dtype, state.layout.pipeline_schedule)
    elif model.chunks:
        assert isinstance(mcfg, TransformerConfig)
        # The residual between stages: (B, T/cp, C), and T/(cp·tp) under sequence parallelism.
        seq = mcfg.seq_length // state.cp_size // (state.tp_size if state.sequence_parallel else 1)
        pipeline = PipelineSchedule(
            model.chunks,
            state,
            (cfg.micro_batch_size, seq, mcfg.hidden_size),
            dtype,
            state.layout.pipeline_schedule,
            lanes=par.moe_overlap_microbatches and state.ep_size > 1,
        )
        loss = _pipeline_loss(model.chunks, state, mcfg.real_vocab_size)
        if cfg.dpo is not None:
            logps = _pipeline_logps(model.chunks, mcfg.real_vocab_size, state)
    lanes = par.moe_overlap_microbatches and state.ep_size > 1 and pipeline is None  # (a pipeline's own)
    return Trainable(model, ddp, optimizer, model.parameter_names(), pipeline, loss, logps, lanes)


def lm_loss(model: nn.Module, batch: MicroBatch, state: ParallelState) -> torch.Tensor:
    """The LM loss without a pipeline, the mean over the micro-batch's loss tokens: the head fused
    with the cross-entropy over token chunks, on one tensor-parallel rank (GPTModel.loss) or on the
    head's vocab shards (fused_parallel_lm_loss); the logits are never materialised."""
    # DataParallel's forward is a pass-through (its work hangs on parameter hooks).
    plain = model.module if isinstance(model, DataParallel) else model
    if isinstance(plain, T5Model):  # the decoder's targets (engine.build_t5)
        from megatrain.engine.build_t5 import t5_loss

        return t5_loss(plain, batch, state)
    if plain.config.is_encoder:  # BERT: its heads on the masked positions (parallel.bert_loss)
        return encoder_loss(plain.hidden_states(batch.tokens, **batch.model_inputs), plain, batch, state)
    if state.tp_size == 1:
        return plain.loss(batch.tokens, batch.labels, batch.loss_mask, **batch.model_inputs)
    hidden = plain.hidden_states(batch.tokens, **batch.model_inputs)  # (B, T, C), T/tp under sp
    limit = plain.config.real_vocab_size
    return fused_parallel_lm_loss(hidden, plain.lm_head, batch.labels, batch.loss_mask, vocab_limit=limit)


def _pipeline_loss(chunks: list[StageModule], state: ParallelState, vocab: int) -> LossFn:
    """The loss a pipeline's last chunk feeds: its final norm's output, fused with the LM head over
    token chunks as without a pipeline (on one tensor-parallel rank, or on the head's vocab shards);
    over the first `vocab` ids (the rest is padding). Other ranks never call it."""
    last = chunks[-1] if chunks and chunks[-1].is_last else None
    if last is None:
        return lambda out, mb: parallel_lm_loss(out, mb.labels, state, mb.loss_mask, vocab_limit=vocab)
    last.return_hidden = True
    if last.config.is_encoder:
        return lambda hidden, mb: encoder_loss(hidden, last, mb, state)
    if state.tp_size == 1:
        return lambda hidden, mb: kernels.get("linear_cross_entropy", hidden.device.type)(
            hidden, last.lm_head.weight, mb.labels, loss_mask=mb.loss_mask, vocab_limit=vocab
        )
    return lambda hidden, mb: fused_parallel_lm_loss(
        hidden, last.lm_head, mb.labels, mb.loss_mask, vocab_limit=vocab
    )


def _pipeline_logps(chunks: list[StageModule], vocab: int, state: ParallelState) -> LossFn:
    """The (B,) row log-probs a pipeline's last chunk feeds (preference training): its final norm's
    output through the LM head. Other ranks never call it."""
    last = chunks[-1] if chunks and chunks[-1].is_last else None
    if last is None:
        return lambda out, mb: out.new_zeros(out.shape[0])
    last.return_hidden = True
    return lambda hidden, mb: head_logps(hidden, last.lm_head, mb, vocab, state)
