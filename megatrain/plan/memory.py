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

A LoRA run (ModelShape.lora) trains its adapters only (megatrain.engine.lora): every other parameter
keeps its bytes (2 in bf16) with no gradient and no optimizer state, and the adapters, as any
trainable parameter, have an fp32 gradient, fp32 mains and Adam moments (18 bytes at bf16, 12 of
them sharded with the distributed optimizer). Its activations are a full run's but for the frozen
weights' gradient temporaries, plus each adapter's rank-r product (megatrain.plan.activation_memory).

Context parallelism divides every per-token tensor by cp (a rank holds seq_length/cp tokens of each
sequence); ring attention adds only transient K/V blocks. MoE layers' activations follow
megatrain.plan.moe_memory (routed tokens × router_topk, bounded by the capacity factor when set).

The encoder families: BERT's layers save what GPT-2's do (bidirectional attention keeps the same
tensors as causal); its last stage holds the masked-LM transform and scores only the masked rows
(megatrain.plan.activation_memory). T5's encoder and decoder stacks, cross-attention, the encoder
output every decoder stage holds and the position-bias masks: megatrain.plan.t5_memory.

The zero-bubble schedules (zb-h1, zbv) keep each chunk's activations until its W, and from its B to
its W the output gradients of its linears (megatrain.plan.zero_bubble): a stage's peak is the larger
of its activations' peak and its cool-down's, where up to 2s+1 chunks wait for their W on stage s.

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

from megatrain.plan.activation_memory import StepActivations, layer_activations
from megatrain.plan.layout import micro_batch_size
from megatrain.plan.shapes import (
    BYTE_TOKENIZER_VOCAB,
    NF4_BYTES,
    ModelShape,
    layer_params,
    lora_stage_params,
    nf4_stage_params,
    shape_of_spec,
    stage_params,
)
from megatrain.plan.stages import layers_on_stage, moe_layers_on_stage
from megatrain.plan.startup_memory import startup_phases
from megatrain.plan.t5_memory import T5StepActivations
from megatrain.plan.zero_bubble import (
    SPLIT_SCHEDULES,
    deferred_bytes,
    edge_stages,
    schedule_stage_params,
    stage_ordered,
    t5_deferred_bytes,
    weight_grad_moments,
)
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
    Interleaved: (pp - stage - 1)·2 + (V - 1)·pp + 1, or all of them when M == pp. zb-h1: min(pp,
    M); zbv: min(2M, M + stage + 1, 2pp). Equal to the peaks parallel.schedules.simulate finds
    (tested there).
    """
    total = num_microbatches * virtual_stages
    if schedule == "all_forward_all_backward":
        return total
    if schedule == "zb-h1":  # a chunk's activations live until its W; every stage reaches 1F1B's first
        return min(pp, num_microbatches)
    if schedule == "zbv":  # two half chunks per micro-batch, up to 2·pp of them on every stage
        return min(2 * num_microbatches, num_microbatches + stage + 1, 2 * pp)
    if virtual_stages == 1:
        return min(pp - stage, num_microbatches)
    if num_microbatches == pp:
        return total
    return min((pp - stage - 1) * 2 + (virtual_stages - 1) * pp + 1, total)


def _act_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _model_state(
    parts: dict[str, int],
    n_lora: int,
    *,
    n_nf4: int = 0,
    precision: str,
    shard: int,
    expert_shard: int,
    distributed_optimizer: bool,
    fused_optimizer: bool,
) -> dict[str, Any]:
    """Bytes of a stage's parameters (`parts`, plus n_lora adapters), their gradients and optimizer
    state, the optimizer step's workspace and the start-up phases. A LoRA run (n_lora > 0) trains the
    adapters only: the rest keep their bytes, with no gradient and no optimizer state; QLoRA holds
    n_nf4 of them in NF4 (NF4_BYTES each)."""
    if precision == "fp32":
        param_b, grad_b, optim_b = 4.0, 4.0, 8.0 / shard  # main params alias the params
    else:
        param_b, grad_b, optim_b = 2.0, 4.0, 12.0 / shard  # fp32 main params + Adam moments
    n_params = sum(parts.values()) + n_lora
    # The trainable ones, and of them the routed experts (sharded over the expert-data-parallel group).
    trainable, experts = (n_lora, 0) if n_lora else (n_params, parts.get("experts", 0))
    owned = (trainable - experts) / shard + experts / expert_shard
    weights = (n_params - n_nf4) * param_b + n_nf4 * NF4_BYTES
    startup = startup_phases(
        n_params,
        param_bytes=param_b,
        owned_params=owned,
        distributed_optimizer=distributed_optimizer,
        trainable=trainable,
        weight_bytes=weights if n_nf4 else None,
    )
    return {
        "n_params": n_params,
        "params": int(weights),
        "grads": int(trainable * grad_b),
        "optimizer": int(optim_b * (trainable - experts) + optim_b * shard / expert_shard * experts),
        "workspace": 0 if fused_optimizer else int(4 * owned),
        "startup": startup,
        "breakdown": {f"params_{k}": int(n * param_b) for k, n in parts.items()}
        | ({"params_lora": int(n_lora * param_b)} if n_lora else {}),
    }


def _stage_estimate(
    stage: int,
    state: dict[str, Any],
    stored: dict[str, float],
    transients: dict[str, float],
    acts: StepActivations,
    in_flight: float,
) -> MemoryEstimate:
    """One stage's estimate: its model state (_model_state), saved activations and largest transient."""
    activations = int(sum(stored.values()) + max(transients.values(), default=0.0))
    held = state["params"] + state["grads"] + state["optimizer"]
    breakdown = dict(state["breakdown"])
    breakdown.update({f"activations_{k}": int(b) for k, b in stored.items()})
    breakdown.update({f"transient_{k}": int(b) for k, b in transients.items()})
    breakdown.update({f"per_layer_{k}": int(acts.tokens * b) for k, b in acts.per_layer.items()})
    breakdown["optimizer_workspace"] = state["workspace"]
    breakdown.update({f"startup_{k}": int(b) for k, b in state["startup"].items()})
    breakdown["microbatches_in_flight"] = in_flight
    return MemoryEstimate(
        params_bytes=state["params"],
        grads_bytes=state["grads"],
        optimizer_bytes=state["optimizer"],
        activations_bytes=activations,
        total_bytes=held + max(activations, state["workspace"]),
        stage=stage,
        num_params=state["n_params"],
        breakdown=breakdown,
        startup_bytes=int(max(state["startup"].values())),
    )


def _check_arguments(precision: str, recompute: str, sizes: tuple[int, ...]) -> None:
    """estimate_memory's arguments: sizes are (tp, pp, dp, cp, ep, micro_batch_size, recompute_every)."""
    if precision not in ("fp32", "bf16", "fp16", "fp8"):
        raise ValueError(f"precision={precision!r} must be fp32, bf16, fp16 or fp8")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r} must be none, selective or full")
    if min(sizes) < 1:
        raise ValueError("parallel degrees, micro_batch_size and recompute_every must be >= 1")
    _, _, dp, cp, ep, _, _ = sizes
    if (dp * cp) % ep:
        raise ValueError(f"ep={ep} must divide dp×cp={dp}×{cp}")


def _peak_moments(
    schedule: str, pp: int, stage: int, in_flight_first: int | None, num_microbatches: int | None,
    virtual_stages: int, lanes: bool = False,
) -> tuple[tuple[float, float], ...]:  # fmt: skip
    """(micro-batches holding activations, of them waiting for their W) at each moment the stage can
    peak, in whole-stage micro-batches (an interleaved or zbv chunk holds 1/V of its layers).
    Without num_microbatches: the first stage holds in_flight_first (default pp), each next one fewer.
    `lanes` (1F1B's steady pairs side by side): one more warm-up forward, so one more held."""
    v = virtual_stages
    if num_microbatches is None:
        return ((max(1, (pp if in_flight_first is None else in_flight_first) + lanes - stage), 0.0),)
    if lanes:
        return ((min(pp - stage + 1, num_microbatches), 0.0),)
    if schedule in SPLIT_SCHEDULES:
        counts = weight_grad_moments(schedule, pp, stage, num_microbatches)
        return tuple((held / v, pending / v) for held, pending in counts)
    return ((chunks_in_flight(schedule, pp, stage, num_microbatches, v) / v, 0.0),)


def _stored_at_peak(
    acts: StepActivations, t5: T5StepActivations | None, moments: tuple[tuple[float, float], ...],
    stage: int, pp: int, pipeline_layers: Sequence[int] | None, recompute: Recompute,
    recompute_every: int, edges: tuple[bool, bool], counts: tuple[int, int, int],
) -> tuple[float, dict[str, float], dict[str, float]]:  # fmt: skip
    """(micro-batches in flight, stored bytes by kind, transients) at the stage's worst moment.
    edges: whether it embeds and scores; counts: its layers, MoE layers and checkpointed layers."""
    (first, last), (n_layers, n_moe, n_ckpt) = edges, counts
    options = []
    for in_flight, pending in moments:
        if t5 is not None:
            stored, transients = t5.stage(
                stage, pp, pipeline_layers, recompute=recompute, recompute_every=recompute_every,
                in_flight=in_flight,
            )  # fmt: skip
            deferred = pending and t5_deferred_bytes(
                t5, stage, pp, pipeline_layers, recompute=recompute, recompute_every=recompute_every
            )
        else:
            stored, transients = acts.stage(
                first=first, last=last, n_layers=n_layers, n_moe=n_moe, n_ckpt=n_ckpt, in_flight=in_flight
            )
            deferred = pending and deferred_bytes(acts, n_layers, n_moe, n_ckpt)
        if deferred:  # (none for float8 linears or frozen weights)
            stored["deferred_weight_grads"] = pending * deferred
        options.append((sum(stored.values()), in_flight, stored, transients))
    _, in_flight, stored, transients = max(options, key=lambda o: o[0])
    return in_flight, stored, transients


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
    microbatch_lanes: bool = False,
) -> MemoryEstimate:
    """Per-rank bytes of one training step on the worst pipeline stage.

    num_microbatches_in_flight: activations the first stage holds at once; 1F1B keeps up to pp
    (the default), stage i one fewer per step down the pipeline. Given num_microbatches (per step
    and dp rank) instead, each stage's count follows pipeline_schedule and virtual_stages
    (chunks_in_flight; an interleaved chunk holds 1/virtual_stages of the stage's layers); under
    zb-h1 and zbv, also the output gradients a chunk keeps from B to W (plan.zero_bubble), at its peak.
    pipeline_layers: explicit layers per model chunk (see layers_on_stage; zbv's in the engine's
    order, the V's down leg then its up leg). recompute="full" checkpoints layers 0, k, 2k, … of
    each stage (k = recompute_every) and keeps only their inputs.
    attention: "flash" for SDPA's flash/memory-efficient/cuDNN kernels, "math" for the fallback.
    fused_optimizer: False for foreach AdamW, whose step allocates one fp32 temporary per parameter.
    device: only the dropout masks differ (bool on CUDA, the model dtype on CPU).
    fused_loss: the LM head and cross-entropy fused over token chunks (GPTModel.loss at tp = 1,
    the vocab-parallel fused loss at tp > 1: megatrain.kernels.vocab_parallel_linear_cross_entropy).
    cp: the sequence split over cp ranks; ep: an MoE model's routed experts split over ep ranks
    (their optimizer state sharded over dp·cp/ep with the distributed optimizer).
    stage: the figures of that pipeline stage instead of the worst one (stage_totals stay all).
    microbatch_lanes: parallelism.moe_overlap_microbatches: one micro-batch more held per stage.
    A model with `lora` (ModelShape.lora) is a LoRA run: only its adapters train.
    """
    m = ModelShape.of(model)
    _check_arguments(precision, recompute, (tp, pp, dp, cp, ep, micro_batch_size, recompute_every))
    pipeline_layers = stage_ordered(pipeline_layers, pp, pipeline_schedule)  # (zbv's V: chunk c on c % pp)
    embeds, scores = edge_stages(pp, pipeline_schedule)  # (zbv's first stage runs the LM head too)
    act = _act_bytes(precision)
    # fp8 under sp: a float8 linear saves its all-gathered input (no re-gather in backward; the
    # LM head, bf16, still re-gathers).
    acts = StepActivations.of(
        m, tp=tp, sp=sequence_parallel and tp > 1, cp=cp, ep=ep, micro_batch_size=micro_batch_size,
        act=act, mask=1 if device == "cuda" else act, attention=attention,
        selective=recompute == "selective", fp8=precision == "fp8", fused_loss=fused_loss,
    )  # fmt: skip
    tokens = acts.tokens
    # T5: its encoder's layers over Te tokens (acts) and its decoder's over Td (megatrain.plan.t5_memory).
    t5 = None
    if m.family == "t5":
        t5 = T5StepActivations.of(acts, cp=cp, attention=attention, selective=recompute == "selective")
    shard = dp * cp if distributed_optimizer else 1
    expert_shard = shard // ep if distributed_optimizer else 1  # the expert-data-parallel group

    wanted = stage
    stages: list[MemoryEstimate] = []
    for stage in range(pp):
        parts = schedule_stage_params(
            m, tp, pp, stage, pipeline_layers, ep, virtual_stages, pipeline_schedule
        )
        n_lora = lora_stage_params(m, tp, pp, stage, pipeline_layers, virtual_stages, ep)
        n_nf4 = nf4_stage_params(m, tp, pp, stage, pipeline_layers, virtual_stages)
        moments = _peak_moments(pipeline_schedule, pp, stage, num_microbatches_in_flight,
                                num_microbatches, virtual_stages, microbatch_lanes)  # fmt: skip
        n_layers = layers_on_stage(m.total_layers, pp, stage, pipeline_layers)
        n_ckpt = -(-n_layers // recompute_every) if recompute == "full" else 0
        n_moe = moe_layers_on_stage(m, pp, stage, pipeline_layers, virtual_stages)
        in_flight, stored, transients = _stored_at_peak(
            acts, t5, moments, stage, pp, pipeline_layers, recompute, recompute_every,
            (stage == embeds, stage == scores), (n_layers, n_moe, n_ckpt),
        )  # fmt: skip
        if cp > 1 and n_layers:
            # Ring attention's backward: the K/V block in use and the next, and fp32 dK/dV (tp-split heads).
            transients["ring_attention"] = tokens * m.kv_size * (4 * act + 8) / tp
        state = _model_state(
            parts, n_lora, n_nf4=n_nf4, precision=precision, shard=shard, expert_shard=expert_shard,
            distributed_optimizer=distributed_optimizer, fused_optimizer=fused_optimizer,
        )  # fmt: skip
        stages.append(_stage_estimate(stage, state, stored, transients, acts, in_flight))
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
        "microbatch_lanes": par.moe_overlap_microbatches and layout.ep > 1,
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
