"""Analytical per-rank memory of a training step: weights, gradients, optimizer state, activations.

Pure (no torch): the scheduler calls it on the control plane to check that a layout fits a GPU.

Model state follows Megatron's mixed-precision layout (bytes per parameter held by a rank):

    precision   params  main grads  main params  Adam m, v     total (distributed optimizer)
    bf16/fp16     2        4            4            8         18  (6 + 12/dp)
    fp8           2        4            4            8         18  (bf16 weights, float8 per GEMM)
    fp32          4        4         (alias)         8         16  (8 + 8/dp)

Gradients accumulate in an fp32 buffer of the full (unsharded) size even with the distributed
optimizer, which shards only the main params and Adam moments over the data-parallel ranks: dp·cp
of them for dense parameters, the expert-data-parallel group dp·cp/ep for routed experts (whose
weights are split over ep and tp, megatrain.plan.shapes).

Context parallelism divides every per-token tensor by cp (a rank holds seq_length/cp tokens of each
sequence); ring attention adds only transient K/V blocks. MoE layers' activations follow
megatrain.plan.moe_memory (routed tokens × router_topk, bounded by the capacity factor when set).

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models"): per layer and micro-batch sbh(34 + 5as/h) bytes at 16 bits, tensor-parallel parts divided
by t, everything divided by t with sequence parallelism, selective recompute dropping the 5as/h
(softmax) term, full recompute keeping only each layer's input. The coefficients here are those of
OUR GPTModel (counted tensor by tensor with megatrain.engine.memtrack, see tests/engine/test_memory.py):

- SDPA's flash / memory-efficient kernels (CUDA, and the CPU flash kernel torch picks for causal
  attention without a mask) keep only the output and a log-sum-exp per row: no a·s² term at all.
  The math path keeps the softmax probabilities (a·s per token) and contiguous q/k/v copies.
- The fused qkv output stays alive as one storage while K and V (views into it) are saved; RoPE
  saves rotated copies of Q and K next to it. GQA narrows K and V to kv = groups·head_dim.
- SwiGLU keeps fc1's [gate; up] output (2f) and the product (f), recomputing silu(gate) in
  backward: 3f vs GELU's 2f.
- Our RMSNorm (megatrain.kernels.rms_norm) saves its input and an fp32 1/rms per row, recomputing
  the normalised tensor in backward; nn.LayerNorm saves its input and two fp32 stats.
- The unfused loss keeps fp32 log-probabilities (4·V per token); its backward briefly holds two more
  fp32 (tokens × V) gradients, which for large vocabularies is the step's memory peak. The engine
  fuses the head with the loss at every tp (fused_loss): one chunk of fp32 logits at a time.
- fp8 (torchao's dynamic tensorwise/rowwise recipes, megatrain.kernels.fp8_linear) saves what
  bf16 saves: each float8 linear keeps its bf16 input and weight and casts them again in backward;
  under sequence parallelism qkv and fc1 keep their all-gathered input (not the shard).
  It adds only transient float8 copies (1 byte per element), counted where a layer's backward
  peaks: an MLP linear's backward holds its output gradient cast twice (for the input and the weight
  gradient), its weight and its input, each once, until both GEMMs are done. The forward's casts
  (input and weight of one linear) are smaller than that and not counted.
- RoPE's tables are cast to the model dtype with it; a 16-bit model's rotations then save fp32
  copies of the cos/sin halves (8·head_dim bytes per token and layer, not split by tp).
- Dropout (p > 0) saves a mask per dropout: 1 byte (bool) on CUDA, the model dtype on CPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from megatrain.kernels.policy import linear_cross_entropy_chunk_rows
from megatrain.plan.layout import micro_batch_size
from megatrain.plan.moe_memory import moe_backward_peak, moe_dispatch_transient, moe_layer_activations
from megatrain.plan.shapes import (
    BYTE_TOKENIZER_VOCAB,
    ModelShape,
    layer_params,
    layers_on_stage,
    moe_layers_on_stage,
    shape_of_spec,
    stage_params,
)
from megatrain.plan.startup_memory import startup_phases
from megatrain.spec import ParallelismSpec

if TYPE_CHECKING:
    from megatrain.plan.layout import Layout
    from megatrain.spec import JobSpec

Precision = Literal["fp32", "bf16", "fp16", "fp8"]
Recompute = Literal["none", "selective", "full"]

GiB = 1 << 30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one rank of the worst pipeline stage (the largest total)."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    """fp32 main params (bf16/fp16 only) and the two Adam moments, sharded with the distributed optimizer."""
    activations_bytes: int
    """Peak of activations saved for backward plus the largest transient (loss/LM-head backward,
    a recomputed layer)."""
    total_bytes: int
    """params + grads + optimizer + max(activations, optimizer-step workspace)."""
    stage: int
    """The pipeline stage these figures belong to."""
    num_params: int
    """Parameters held by this rank."""
    breakdown: dict[str, int] = field(default_factory=dict)
    stage_totals: tuple[int, ...] = ()
    """total_bytes of every pipeline stage, first to last."""
    startup_bytes: int = 0
    """The most held while a rank starts, before its first step (megatrain.plan.startup_memory): the
    largest over the stages (each may start at its own moment), or the stage asked for."""

    def gib(self) -> dict[str, float]:
        keys = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "total_bytes")
        return {k.removesuffix("_bytes"): round(getattr(self, k) / GiB, 3) for k in keys}


_ALL_STAGES = ("stage_totals", "startup_bytes")
"""MemoryEstimate's fields about every stage, not the one reported."""


def chunks_in_flight(
    schedule: str, pp: int, stage: int, num_microbatches: int, virtual_stages: int = 1
) -> int:
    """Most (micro-batch, model chunk) activations a stage holds at once under a schedule.

    all_forward_all_backward: all of them. 1F1B: the warm-up forwards plus one, min(pp - stage, M).
    Interleaved: (pp - stage - 1)·2 + (V - 1)·pp + 1, or all of them when M == pp. Equal to the
    peaks parallel.schedules.simulate finds (tested there).
    """
    total = num_microbatches * virtual_stages
    if schedule == "all_forward_all_backward":
        return total
    if virtual_stages == 1:
        return min(pp - stage, num_microbatches)
    if num_microbatches == pp:
        return total
    return min((pp - stage - 1) * 2 + (virtual_stages - 1) * pp + 1, total)


def _norm_saved(m: ModelShape, act: int) -> float:
    """Bytes per token a norm saves for backward (besides its output, the next linear's input)."""
    h = m.hidden_size
    if m.norm == "layernorm":
        return act * h + 8  # input + fp32 mean and rstd
    return act * h + 4  # input + fp32 rstd


def layer_activations(
    m: ModelShape,
    *,
    tp: int,
    sp: bool,
    act: int,
    mask: int,
    attention: str,
    selective: bool,
    gathered_inputs: bool = False,
) -> dict[str, float]:
    """Bytes per token (of the rank's micro-batch, before any sequence split) one layer saves for backward.
    gathered_inputs: with sp, qkv and fc1 save their all-gathered input instead of the shard (fp8)."""
    h, kv, f, fw, s = m.hidden_size, m.kv_size, m.ffn_hidden_size, m.fc1_width, m.seq_length
    heads = m.num_attention_heads
    seq_div = tp if sp else 1  # parts outside the tensor-parallel region shard only with sp
    rope = m.position_embedding == "rope"
    grouped = m.num_query_groups != heads
    terms: dict[str, float] = {}
    # Two norms' saved tensors, and their outputs: the inputs qkv and fc1 save for their weight grads.
    # With sp these are sequence shards: the column-parallel linears keep the shard and all-gather
    # it again in backward (megatrain.engine.parallel.layers, as Megatron does).
    terms["norms"] = 2 * _norm_saved(m, act) / seq_div
    terms["linear_inputs"] = 2 * act * h / (1 if gathered_inputs else seq_div)
    # The fused qkv output (h + 2kv wide) stays alive: SDPA saves K and V as views into it.
    qkv = act * (h + 2 * kv)
    # Q is a separate tensor after RoPE, or after regrouping GQA heads (a reshape that copies).
    if rope or grouped:
        qkv += act * h
    if rope:
        qkv += act * kv  # rotated K
    terms["qkv"] = qkv / tp
    if rope and act != 4:
        # make_trainable casts RoPE's tables with the model; each rotation saves fp32 copies of the
        # cos and sin halves it used (Q's and K's: 4 × head_dim/2 fp32 per token, whole over tp).
        terms["rope_tables"] = 8.0 * m.head_dim
    if attention == "math":
        # Contiguous q/k/v copies replace the qkv storage (K/V expanded to all heads under GQA),
        # plus the softmax probabilities (heads·s per token) unless selective recompute drops them.
        core = act * (h + 2 * h) + act * h  # q, k, v copies + the output's contiguous copy for proj
        if not selective:
            core += act * heads * s
        if m.attention_dropout > 0 and not selective:
            core += mask * heads * s
        terms["qkv"] = 0.0
        terms["attention"] = core / tp
    else:
        # Output (laid out (B, T, H, hd), so proj reads it without a copy) + fp32 log-sum-exp.
        terms["attention"] = (act * h + 4 * heads) / tp
    if m.activation in ("swiglu", "geglu"):
        terms["mlp"] = act * (fw + f) / tp  # fc1 out [gate; up], act(gate)·up (act recomputed)
    else:
        terms["mlp"] = act * 2 * f / tp  # fc1 out, gelu out
    if m.hidden_dropout > 0:
        terms["dropout_masks"] = 2 * mask * h / seq_div
    return terms


def _act_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def estimate_memory(
    model: Any,
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    cp: int = 1,
    ep: int = 1,
    sequence_parallel: bool = False,
    micro_batch_size: int = 1,
    num_microbatches_in_flight: int | None = None,
    num_microbatches: int | None = None,
    pipeline_schedule: str = "1f1b",
    virtual_stages: int = 1,
    pipeline_layers: Sequence[int] | None = None,
    precision: Precision = "bf16",
    distributed_optimizer: bool = False,
    recompute: Recompute = "none",
    recompute_every: int = 1,
    attention: Literal["flash", "math"] = "flash",
    fused_optimizer: bool = True,
    device: Literal["cuda", "cpu"] = "cuda",
    fused_loss: bool = False,
    stage: int | None = None,
) -> MemoryEstimate:
    """Per-rank bytes of one training step on the worst pipeline stage.

    num_microbatches_in_flight: activations the first stage holds at once; 1F1B keeps up to pp
    (the default), stage i one fewer per step down the pipeline. Given num_microbatches (per step
    and dp rank) instead, each stage's count follows pipeline_schedule and virtual_stages
    (chunks_in_flight; an interleaved chunk holds 1/virtual_stages of the stage's layers).
    pipeline_layers: explicit layers per model chunk (see layers_on_stage). recompute="full" checkpoints
    layers 0, k, 2k, … of each stage (k = recompute_every) and keeps only their inputs.
    attention: "flash" for SDPA's flash/memory-efficient/cuDNN kernels, "math" for the fallback.
    fused_optimizer: False for foreach AdamW, whose step allocates one fp32 temporary per parameter.
    device: only the dropout masks differ (bool on CUDA, the model dtype on CPU).
    fused_loss: the LM head and cross-entropy fused over token chunks (GPTModel.loss at tp = 1,
    the vocab-parallel fused loss at tp > 1: megatrain.kernels.vocab_parallel_linear_cross_entropy).
    cp: the sequence split over cp ranks; ep: an MoE model's routed experts split over ep ranks
    (their optimizer state sharded over dp·cp/ep with the distributed optimizer).
    stage: the figures of that pipeline stage instead of the worst one (stage_totals stay all).
    """
    m = ModelShape.of(model)
    if precision not in ("fp32", "bf16", "fp16", "fp8"):
        raise ValueError(f"precision={precision!r} must be fp32, bf16, fp16 or fp8")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r} must be none, selective or full")
    if min(tp, pp, dp, cp, ep, micro_batch_size, recompute_every) < 1:
        raise ValueError("parallel degrees, micro_batch_size and recompute_every must be >= 1")
    if (dp * cp) % ep:
        raise ValueError(f"ep={ep} must divide dp×cp={dp}×{cp}")
    sp = sequence_parallel and tp > 1
    fused = fused_loss
    in_flight_first = pp if num_microbatches_in_flight is None else num_microbatches_in_flight
    act = _act_bytes(precision)
    mask = 1 if device == "cuda" else act
    tokens = micro_batch_size * m.seq_length / cp  # per rank, before the sequence-parallel split
    h, v = m.hidden_size, m.vocab_size
    seq_div = tp if sp else 1

    # fp8 under sp: a float8 linear saves its all-gathered input (no re-gather in backward; the
    # LM head, bf16, still re-gathers).
    fp8 = precision == "fp8"

    def regathered(out: int) -> float:
        """What a column-parallel linear's backward adds under sp: its input all-gathered again
        and, for more than one sequence per micro-batch, a reorder copy of the narrower of its
        output gradient (out/t wide) and its input (megatrain.engine.parallel.layers)."""
        if not sp:
            return 0.0
        return tokens * act * (h + (min(out / tp, h) if micro_batch_size > 1 else 0))

    per_layer = layer_activations(
        m, tp=tp, sp=sp, act=act, mask=mask, attention=attention, selective=recompute == "selective",
        gathered_inputs=fp8,
    )  # fmt: skip
    layer_bytes = tokens * sum(per_layer.values())
    per_moe_layer = moe_layer_activations(m, per_layer, tp=tp, act=act) if m.moe is not None else {}
    moe_layer_bytes = tokens * sum(per_moe_layer.values())
    # Checkpointed layers keep their input (the residual stream, sharded with sp).
    checkpointed_bytes = tokens * act * h / seq_div

    # Model state bytes per parameter.
    shard = dp * cp if distributed_optimizer else 1
    expert_shard = shard // ep if distributed_optimizer else 1  # the expert-data-parallel group
    if precision == "fp32":
        param_b, grad_b, optim_b = 4.0, 4.0, 8.0 / shard  # main params alias the params
    else:
        param_b, grad_b, optim_b = 2.0, 4.0, 12.0 / shard  # fp32 main params + Adam moments

    wanted = stage
    stages: list[MemoryEstimate] = []
    for stage in range(pp):
        first, last = stage == 0, stage == pp - 1
        parts = stage_params(m, tp, pp, stage, pipeline_layers, ep, virtual_stages)
        n_params = sum(parts.values())
        n_experts = parts.get("experts", 0)
        in_flight: float = max(1, in_flight_first - stage)
        if num_microbatches is not None:
            chunks = chunks_in_flight(pipeline_schedule, pp, stage, num_microbatches, virtual_stages)
            in_flight = chunks / virtual_stages  # in whole-stage micro-batches
        n_layers = layers_on_stage(m.num_layers, pp, stage, pipeline_layers)
        n_ckpt = -(-n_layers // recompute_every) if recompute == "full" else 0
        n_moe = moe_layers_on_stage(m, pp, stage, pipeline_layers, virtual_stages)
        # Checkpointed layers are taken as dense and MoE in the stage's proportion.
        mean_layer = ((n_layers - n_moe) * layer_bytes + n_moe * moe_layer_bytes) / max(1, n_layers)

        stored: dict[str, float] = {}
        stored["layers"] = in_flight * (n_ckpt * checkpointed_bytes + (n_layers - n_ckpt) * mean_layer)
        if first and m.hidden_dropout > 0:
            stored["embedding_dropout_mask"] = in_flight * tokens * mask * h / seq_div
        transients: dict[str, float] = {}
        if last and fused:
            # The fused head + loss (megatrain.kernels.linear_cross_entropy, and its vocab-parallel
            # variant over V/t columns): the head's input is not kept; the loss's forward leaves the
            # hidden states' gradient (every token's, a partial sum at tp > 1) and an fp32 weight
            # gradient for backward, and at its peak holds one chunk of fp32 logits (plus, for a
            # 16-bit model, their cast and the chunk's weight-gradient GEMM output before it is
            # accumulated in fp32) next to, under sp, the all-gathered head input.
            vt = v / tp
            stored["final_norm"] = tokens * _norm_saved(m, act) / seq_div
            stored["fused_loss_grads"] = tokens * act * h + 4 * vt * h
            rows = linear_cross_entropy_chunk_rows(int(tokens), int(vt))
            gathered = tokens * act * h if sp else 0.0
            transients["loss_forward"] = (
                gathered + rows * vt * 4 + (rows * vt * act + act * vt * h if act != 4 else 0)
            )
            # Backward scales both in place; a 16-bit weight gradient is cast once; under sp the
            # hidden gradient is reduce-scattered to the rank's tokens.
            transients["loss_backward"] = (act * vt * h if act != 4 else 0.0) + gathered / tp
        elif last:
            # Final norm, its output (the LM head's input) and the loss's fp32 (tokens, V/t) tensor:
            # log-probs for F.cross_entropy, the softmax for the vocab-parallel loss (tp > 1).
            stored["final_norm_and_head_input"] = tokens * (_norm_saved(m, act) + act * h) / seq_div
            stored["log_probs"] = tokens * 4 * v / tp
            head_grad_temp = act * v * h / tp  # LM-head weight grad before it is accumulated
            if tp == 1:
                # F.cross_entropy's backward: fp32 grads of the log-probs and of the logits next to
                # the log-probs; then the logits' grad next to the head's weight-grad temporary.
                transients["loss_backward"] = max(
                    tokens * 8 * v, tokens * 4 * v - stored["log_probs"] + head_grad_temp
                )
            else:
                # The vocab-parallel loss turns its softmax into the logits' grad in place; only a
                # 16-bit model adds a cast of it (and the softmax is then freed before the head's grad).
                cast = tokens * act * v / tp if act != 4 else 0.0
                freed = stored["log_probs"] if act != 4 else 0.0
                transients["loss_backward"] = max(cast, cast + head_grad_temp - freed) + regathered(v)
        if n_layers:
            # A layer's backward peaks in the MLP, at one of three moments: fc2's backward (its
            # input grad and weight-grad temporary, before that is added to the accumulated
            # gradient); the activation's backward (about three f-wide grads: for SwiGLU fc2's
            # input grad, silu(gate)'s and up's); fc1's backward (its output grad, the input grad
            # and its weight-grad temporary, the MLP's saved tensors freed by then). A recomputed
            # layer first rebuilds its own activations. The loss's tensors are freed by then.
            fw, f = m.fc1_width, m.ffn_hidden_size
            rebuilt = max(layer_bytes if n_layers > n_moe else 0.0, moe_layer_bytes if n_moe else 0.0)
            rebuilt = rebuilt if n_ckpt else 0.0
            mlp_saved = tokens * per_layer["mlp"] if n_ckpt else 0.0
            # (Grads of the full-width hidden states are whole on every tensor-parallel rank.)
            fc2_backward = tokens * act * (f / tp + h) + act * f * h / tp + rebuilt
            act_backward = tokens * act * (fw + f) / tp + rebuilt
            fc1_backward = (
                tokens * act * (fw / tp + h)
                + act * h * fw / tp
                + (0 if fp8 else regathered(fw))
                + rebuilt
                - mlp_saved
            )
            if precision == "fp8":
                # float8 copies (1 byte): the output gradient twice, the weight and the input once.
                fc2_backward += tokens * (2 * h + f / tp) + f * h / tp
                fc1_backward += tokens * (2 * fw / tp + h) + h * fw / tp
            head_freed = sum(stored.get(k, 0) for k in ("final_norm_and_head_input", "final_norm",
                                                        "log_probs", "fused_loss_grads"))  # fmt: skip
            peak = max(fc2_backward, act_backward, fc1_backward) if n_layers > n_moe else 0.0
            if n_moe:
                # As fc1's backward above: a recomputed layer's expert tensors are freed by the peak.
                experts_saved = tokens * per_moe_layer["moe_experts"] if n_ckpt else 0.0
                moe_peak = moe_backward_peak(m, tokens, tp=tp, ep=ep, act=act) + rebuilt - experts_saved
                peak = max(peak, moe_peak)
                transients["moe_dispatch"] = moe_dispatch_transient(m, tokens, act=act)
            if m.tie_embeddings and first and last:
                # A tied weight's two gradients are summed before accumulation: the LM head's waits
                # in autograd's input buffer until the embedding's arrives at the end of backward.
                peak += act * v * h / tp
            transients["layer_backward"] = max(0.0, peak - head_freed)
        if cp > 1 and n_layers:
            # Ring attention's backward: the K/V block in use and the next, and fp32 dK/dV (tp-split heads).
            transients["ring_attention"] = tokens * m.kv_size * (4 * act + 8) / tp
        stored_total = sum(stored.values())
        transient = max(transients.values(), default=0.0)
        activations = int(stored_total + transient)

        params_bytes = int(n_params * param_b)
        grads_bytes = int(n_params * grad_b)
        optimizer_bytes = int(optim_b * (n_params - n_experts) + optim_b * shard / expert_shard * n_experts)
        owned = (n_params - n_experts) / shard + n_experts / expert_shard
        optimizer_workspace = 0 if fused_optimizer else int(4 * owned)
        startup = startup_phases(
            n_params, param_bytes=param_b, owned_params=owned, distributed_optimizer=distributed_optimizer
        )
        total = params_bytes + grads_bytes + optimizer_bytes + max(activations, optimizer_workspace)
        breakdown = {f"params_{k}": int(n * param_b) for k, n in parts.items()}
        breakdown.update({f"activations_{k}": int(b) for k, b in stored.items()})
        breakdown.update({f"transient_{k}": int(b) for k, b in transients.items()})
        breakdown.update({f"per_layer_{k}": int(tokens * b) for k, b in per_layer.items()})
        breakdown["optimizer_workspace"] = optimizer_workspace
        breakdown.update({f"startup_{k}": int(b) for k, b in startup.items()})
        breakdown["microbatches_in_flight"] = in_flight
        stages.append(
            MemoryEstimate(
                params_bytes=params_bytes,
                grads_bytes=grads_bytes,
                optimizer_bytes=optimizer_bytes,
                activations_bytes=activations,
                total_bytes=total,
                stage=stage,
                num_params=n_params,
                breakdown=breakdown,
                startup_bytes=int(max(startup.values())),
            )
        )
    if wanted is not None and not 0 <= wanted < pp:
        raise ValueError(f"stage={wanted} is outside pp={pp}")
    worst = stages[wanted] if wanted is not None else max(stages, key=lambda e: e.total_bytes)
    return MemoryEstimate(
        **{f.name: getattr(worst, f.name) for f in fields(MemoryEstimate) if f.name not in _ALL_STAGES},
        stage_totals=tuple(e.total_bytes for e in stages),
        startup_bytes=worst.startup_bytes if wanted is not None else max(e.startup_bytes for e in stages),
    )


def planned_precision(precision: str, accelerator: str | None) -> Precision:
    """The precision a job's ranks will run on a pool of `accelerator` ("cpu", a GPU's name, or
    None when unknown): training.precision auto is bf16 on a GPU (or an unknown pool) and fp32 on a
    CPU, where the engine picks bf16 only on CPUs with native support, which the control plane
    cannot see (megatrain.engine.runtime). An explicit precision is estimated as asked."""
    on_cpu = accelerator == "cpu"
    if precision == "auto":
        return "fp32" if on_cpu else "bf16"
    if precision not in ("fp32", "bf16", "fp16", "fp8"):
        raise ValueError(f"precision={precision!r} must be auto, fp32, bf16, fp16 or fp8")
    return cast(Precision, precision)


def from_spec(
    spec: JobSpec,
    layout: Layout,
    *,
    tokenizer_vocab: int | None = None,
    accelerator: str | None = None,
    **kwargs: Any,
) -> MemoryEstimate:
    """estimate_memory for a JobSpec on its resolved Layout (megatrain.plan.layout).

    The vocabulary is the spec's model.vocab_size, else the tokenizer's (given, or 257 for the byte
    tokenizer) padded as the engine pads it; the precision is the one the pool's devices run
    (`planned_precision` of `accelerator`); keyword arguments override the derived settings.
    """
    if tokenizer_vocab is None:
        if spec.model.vocab_size is None and spec.data.tokenizer.type != "byte":
            raise ValueError("model.vocab_size is unset: pass tokenizer_vocab for a Hugging Face tokenizer")
        tokenizer_vocab = spec.model.vocab_size or BYTE_TOKENIZER_VOCAB
    model = shape_of_spec(spec, tokenizer_vocab)
    tr = spec.training
    par = spec.parallelism if isinstance(spec.parallelism, ParallelismSpec) else ParallelismSpec()
    mbs = micro_batch_size(spec, layout)
    accum = tr.global_batch_size // (mbs * layout.dp)
    settings: dict[str, Any] = {
        "tp": layout.tp,
        "pp": layout.pp,
        "dp": layout.dp,
        "cp": layout.cp,
        "ep": layout.ep,
        "sequence_parallel": layout.sequence_parallel,
        "micro_batch_size": mbs,
        "num_microbatches": accum,
        "pipeline_schedule": layout.pipeline_schedule,
        "virtual_stages": layout.virtual_stages,
        "pipeline_layers": layout.pipeline_layers,
        "precision": planned_precision(tr.precision, accelerator),
        "distributed_optimizer": par.distributed_optimizer and layout.dp * layout.cp > 1,
        "recompute": tr.recompute,
        "recompute_every": tr.recompute_every,
        # The engine fuses the LM head with the loss at every tp (megatrain.engine.build.lm_loss).
        "fused_loss": True,
    }
    settings.update(kwargs)
    return estimate_memory(model, **settings)


def fits(estimate: MemoryEstimate, device_bytes: int, headroom: float = 0.9) -> bool:
    """Whether the estimate's step and start-up each leave (1 - headroom) of the device free for the
    allocator and kernels."""
    return max(estimate.total_bytes, estimate.startup_bytes) <= headroom * device_bytes


__all__ = [
    "MemoryEstimate",
    "ModelShape",
    "estimate_memory",
    "fits",
    "from_spec",
    "planned_precision",
    "layer_params",
    "stage_params",
    "layers_on_stage",
    "chunks_in_flight",
    "layer_activations",
]


def host_memory_bytes() -> int:
    """The memory this machine's processes may use: physical memory, or the container's cgroup v2
    limit where that is lower (what a CPU rank can allocate; a CPU node's "device" memory)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total  # "max" means no limit
