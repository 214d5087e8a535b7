"""Predicted step time of a training step: a model, its layout and settings, on a pool's hardware.

Pure arithmetic (no torch, no database), cheap enough to score thousands of layouts in a planning
call. Every term follows what the engine really does (megatrain.engine.parallel):

- **Compute**: each GEMM of a layer (qkv, proj, fc1, fc2; their tensor-parallel shards) and the LM
  head run at `peak × efficiency(M, K, N)`, a saturating curve of the GEMM's size:
  `max_fraction · g / (g + half_size)` with g the geometric mean of M, K, N. Small per-tp GEMMs
  (a narrow hidden size split 8 ways, few tokens) run well below the peak; big ones approach
  `max_fraction`. Backward is two GEMMs of the same shape per forward one (3× in all). The
  attention core runs at `attention_fraction` of a GEMM of its size, a causal one computing
  `causal_attention_work` of its counted FLOPs (the unmasked tiles). Memory-bound elementwise work
  (norms, RoPE, SwiGLU, residuals) moves `elementwise_bytes` per token and hidden unit through
  memory; every layer and micro-batch also pays a fixed `layer_overhead_s` (kernel launches,
  autograd, Python: what dominates a tiny model on a CPU).
- **fp8**: the transformer linears' GEMMs run at the pool's fp8 peak (the attention core, LM head
  and MoE router and experts at bf16's); their float8 casts stream through memory
  (`layer_cost.fp8_cast_bytes`). MFU stays against the bf16 peak, as the engine reports it.
- **LoRA** (a frozen model with trained adapters): a frozen linear's backward computes only its
  input's gradient (one GEMM per forward one, 2× in all, the LM head and MoE experts too), nor does
  sequence parallelism gather its input again (2 all-gathers + 2 reduce-scatters backward); the
  adapters' own GEMMs, passes and rank-r collectives follow megatrain.plan.lora_cost. Data
  parallelism reduces, and the optimizer updates, the adapters only.
- **Recompute**: full adds each recomputed layer's forward again (its tp collectives too);
  selective adds the attention core's forward.
- **Tensor parallelism**: per layer and micro-batch, 2 all-reduces forward and 2 backward of the
  (tokens, hidden) activations; with sequence parallelism 2 all-gathers + 2 reduce-scatters forward
  and 4 all-gathers + 2 reduce-scatters backward (the column-parallel linears gather their input
  again for the weight gradient). Ring costs, inside a node (tp never leaves one):
  all-reduce `2(t-1)/t · B/bw + 2(t-1)·latency`, all-gather or reduce-scatter half of it. The
  column-parallel backward's re-gather and reduce-scatter run beside its two GEMMs, each hiding
  for `tp_overlap` of its GEMM's time; the rest is exposed, unless Overlaps.tp_comm pipelines every
  collective with its GEMM the same way (Megatron's --tp-comm-overlap; layer_cost).
- **Pipeline**: each micro-batch chunk waits for one activation and one gradient (latency + bytes /
  bandwidth, inter-node unless the whole job fits one node); the bubble is (pp-1)/virtual_stages
  stage-micro-batch times (1F1B: (pp-1)/m of the step, interleaved: divided by virtual_stages).
- **Data parallelism**: the fp32 gradient buffer is all-reduced (reduce-scattered with the
  distributed optimizer, whose updated parameter shards are then all-gathered, exposed unless
  Overlaps.param_gather runs them under the next step's first forward). With overlap_grad_reduce
  buckets start while the last micro-batch's backward runs: only what exceeds `dp_overlap` of that
  backward is exposed, and never less than the last bucket. Across nodes the ring runs at the NICs
  of the group's ranks on a node together (links.ring_link): dp=48 at tp=1 pushes through 8 NICs.
- **Optimizer**: Adam reads and writes ~32 bytes per parameter this rank owns (sharded by the
  distributed optimizer) at the memory bandwidth, plus a fixed per-step cost.
- **Context parallelism**: a rank holds seq/cp tokens of each sequence (two mirrored chunks, so the
  causal work is balanced: every rank does 1/cp of it). Ring attention passes this rank's K and V
  cp-1 times forward and K, V, dK, dV cp-1 times backward, over NVLink when the tp·cp ranks fit a
  node; each pass overlaps one block's attention, so each ring step costs the slower of the two and
  only the excess is added (cp_comm_s). Gradients are reduced over dp·cp.
- **Mixture of experts**: an MoE layer runs the router, the rank's num_experts/ep experts (each a
  GEMM of tokens·topk·ep/num_experts rows: the tokens routed to it from the ep group, at the lower
  efficiency of that smaller shape) and the shared expert in place of the MLP, and permutes the
  routed tokens through memory. Expert parallelism adds two all-to-alls of topk·tokens·hidden per
  MoE layer forward (dispatch, combine) and two backward (ep_comm_s), at NVLink for the peers on the
  node and the inter-node link for the rest; with node-limited routing (router groups = the ep
  group's nodes) each token crosses nodes once per node it is routed to, at most router_group_topk
  (megatrain.plan.links.routed_all_to_all_time). With moe_overlap_chunks = K > 1 the exchanges of K
  token chunks hide behind the experts' compute: per direction only max(2d, 2Kd - experts) is
  exposed, d one chunk's exchange (megatrain.plan.layer_cost._moe_layer); K = 1 hides nothing.
  With moe_overlap_microbatches each of 1F1B's steady pairs (max(0, M - pp) on the first stage,
  its warm-up one longer) runs a forward beside another micro-batch's backward, each exchange
  behind the other's compute: a pair exposes only what exceeds that compute, and at least one
  exchange (the last wait, with the other lane done) (lanes_hidden_s).
  Routed experts' gradients are reduced over their expert-data-parallel group (dp·cp/ep ranks) and
  their optimizer state sharded over it.
  Useful FLOPs, and so MFU, are the active ones (megatrain.plan.flops).

- **BERT** runs GPT's layers (bidirectional attention costs what causal attention is counted at)
  and on its last stage the masked-LM transform on every position and the vocabulary projection on
  the masked rows only (megatrain.plan.activation_memory.MLM_FRACTION). **T5**: its encoder layers
  over the encoder's tokens, its decoder layers over the decoder's with cross-attention, the LM head
  over the decoder's tokens, pipeline stages split between the two (megatrain.plan.t5_cost,
  megatrain.plan.stacks); tokens_per_s counts encoder tokens.

Two sets of constants: GPU defaults (H100-class, sane for A100/B200), fitted to published
Megatron-Core H100 runs (megatrain.plan.published), and this project's CPU hosts, calibrated by
benchmarks/planner_engine.py against the engine running under torchrun/gloo (see BENCHMARKS.md
"Layout planner" for the figures).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

from megatrain.plan.cost_constants import (  # noqa: F401  (re-exported)
    CPU_CONSTANTS,
    CPU_LINKS,
    GPU_CONSTANTS,
    CostConstants,
    constants_for,
    gemm_efficiency,
)
from megatrain.plan.flops import flops_per_iteration
from megatrain.plan.layer_cost import LayerCosts, layer_costs, plus_adapters
from megatrain.plan.layout import Layout
from megatrain.plan.links import Links, all_to_all_time, ep_ranks_per_node, link, ring_link, ring_time
from megatrain.plan.pool import PoolSpec
from megatrain.plan.shapes import ModelShape, lora_expert_params, lora_stage_params
from megatrain.plan.stages import layers_on_stage, moe_layers_on_stage
from megatrain.plan.t5_cost import t5_layer_costs, t5_stage_seconds
from megatrain.plan.zero_bubble import edge_stages, schedule_stage_params, stage_ordered


@dataclass(frozen=True)
class Overlaps:
    """Communication a training stack hides behind compute beyond what every stack does (the
    data-parallel reduce under the last backward; under sequence parallelism the backward's
    re-gather and reduce-scatter beside the column-parallel linear's GEMMs). The engine does neither
    of these; Megatron-Core's published runs did both (megatrain.plan.published)."""

    tp_comm: bool = False
    """--tp-comm-overlap: every sequence-parallel all-gather and reduce-scatter pipelined with its GEMM."""
    param_gather: bool = False
    """--overlap-param-gather: the distributed optimizer's parameter all-gather runs under the next
    step's first forward instead of after the optimizer step."""


ENGINE_OVERLAPS = Overlaps()
MEGATRON_OVERLAPS = Overlaps(tp_comm=True, param_gather=True)


@dataclass(frozen=True)
class StepSettings:
    """What besides the layout decides a step's time."""

    micro_batch_size: int
    global_batch_size: int
    recompute: str = "none"
    recompute_every: int = 1
    distributed_optimizer: bool = True
    precision: str = "bf16"
    overlap_grad_reduce: bool = True
    grad_bucket_elements: int = 40_000_000
    moe_overlap_chunks: int = 1
    """parallelism.moe_overlap_chunks: an MoE layer's all-to-alls pipelined behind its experts in
    this many token chunks (megatrain.plan.layer_cost._moe_layer)."""
    moe_dispatch: str = "pairs"
    """parallelism.moe_dispatch: "nodes" sends a token across nodes once per node it reaches
    (megatrain.plan.layer_cost._moe_layer)."""
    moe_overlap_microbatches: bool = False
    """parallelism.moe_overlap_microbatches: 1F1B's steady pairs in lanes (lanes_hidden_s)."""
    overlaps: Overlaps = ENGINE_OVERLAPS
    """What the training stack hides beyond the engine (Megatron-Core's flags, for its published runs)."""


@dataclass(frozen=True)
class StepTime:
    """A predicted step, in seconds by part; the parts on the critical path add up to step_time_s."""

    step_time_s: float
    compute_s: float
    """Every micro-batch through the slowest stage: GEMMs, attention, elementwise, overheads."""
    recompute_s: float
    """The part of compute_s that recomputes activations."""
    tp_comm_s: float
    pp_comm_s: float
    bubble_s: float
    dp_comm_s: float
    """The data-parallel collectives' whole duration."""
    dp_exposed_s: float
    """The part of dp_comm_s that backward does not hide."""
    optimizer_s: float
    overhead_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    model_flops: float
    """Useful FLOPs of one step (no recompute), the numerator of MFU: active FLOPs for MoE."""
    cp_comm_s: float = 0.0
    """Ring attention's K/V passes that block attention does not hide."""
    ep_comm_s: float = 0.0
    """The MoE layers' all-to-alls (dispatch and combine, forward, backward, recomputed)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


ZERO_BUBBLE = ("zb-h1", "zbv")


def lanes_hidden_s(exchange_s: float, compute_s: float, one_exchange_s: float) -> float:
    """Seconds of a micro-batch's exposed all-to-alls (exchange_s, forward and backward) that a
    steady pair in lanes hides behind the other lane's compute (compute_s, a micro-batch's forward
    and backward): all of them but max(one exchange, exchange_s - compute_s)."""
    return max(0.0, exchange_s - max(min(one_exchange_s, exchange_s), exchange_s - compute_s))


def pipeline_bubble_s(schedule: str, pp: int, v: int, t_mb: float) -> float:
    """A step's idle time on a stage whose micro-batch (forward + backward) takes t_mb: 1F1B's
    (pp-1)/v micro-batches; the zero-bubble schedules' with forward, input gradient and weight
    gradient a third of t_mb each (backward = 2 x forward): zb-h1 (pp-1)(F+B-W) = (pp-1)·t/3, zbv
    (pp-1)·F/2 = (pp-1)·t/6 (engine.parallel.zero_bubble, exact in its simulation)."""
    if pp <= 1:
        return 0.0
    if schedule == "zb-h1":
        return (pp - 1) * t_mb / 3
    if schedule == "zbv":
        return (pp - 1) * t_mb / 6
    return (pp - 1) / v * t_mb


@lru_cache(maxsize=4096)
def _stage_layers(
    model: ModelShape, pp: int, v: int, pipeline_layers: tuple[int, ...] | None
) -> tuple[list[int], list[int], list[int]]:
    """The stages worth timing (the edges and the heaviest), and every stage's layers and MoE layers."""
    layers = [layers_on_stage(model.total_layers, pp, st, pipeline_layers) for st in range(pp)]
    moes = [moe_layers_on_stage(model, pp, st, pipeline_layers, v) for st in range(pp)]
    if model.family == "t5":  # (encoder and decoder layers differ: every stage is a candidate)
        return list(range(pp)), layers, moes
    heaviest = max(range(pp), key=lambda st: (layers[st], moes[st]))
    return sorted({0, pp - 1, heaviest}), layers, moes


@lru_cache(maxsize=4096)
def _stage_param_counts(
    model: ModelShape, tp: int, pp: int, ep: int, v: int, pipeline_layers: tuple[int, ...] | None,
    stages: tuple[int, ...], schedule: str = "1f1b",
) -> tuple[int, int]:  # fmt: skip
    """(trainable parameters, of them routed experts) of the rank of `stages` holding the most: a
    LoRA run's adapters (its routed experts' adapters, if any, counted as the experts)."""
    if model.lora is not None:
        counts = [
            (lora_stage_params(model, tp, pp, st, pipeline_layers, v, ep),
             moe_layers_on_stage(model, pp, st, pipeline_layers, v) * lora_expert_params(model, tp, ep))
            for st in stages
        ]  # fmt: skip
        return max(counts)
    counts = max(
        (schedule_stage_params(model, tp, pp, st, pipeline_layers, ep, v, schedule) for st in stages),
        key=lambda p: sum(p.values()),
    )
    return sum(counts.values()), counts.get("experts", 0)


@lru_cache(maxsize=256)
def _flops_per_iteration(model: ModelShape, global_batch_size: int) -> float:
    return flops_per_iteration(model, global_batch_size, model.seq_length)


def _worst_stage(
    lc: LayerCosts, candidates: list[int], layers: list[int], moes: list[int], pp: int, c: CostConstants,
    edges: tuple[int, int] | None = None,
) -> tuple[float, tuple[float, float, float, float, float]]:  # fmt: skip
    """One micro-batch's time on the slowest candidate stage, and its (compute, recompute, tp, cp,
    ep) parts: its dense and MoE layers, the embedding's and head's share on the edge stages
    (`edges`: the stages that embed and score, zero_bubble.edge_stages; default 0 and pp - 1)."""
    embeds, scores = edges or (0, pp - 1)
    layer_compute, layer_recompute, layer_tp, layer_cp = lc[:4]
    moe_compute, moe_recompute, moe_tp, moe_ep, head, edge_tp = lc[4:]
    stage_times, stage_parts = [], []
    for stage in candidates:
        n_moe = moes[stage]
        n = layers[stage] - n_moe
        recompute = n * layer_recompute + n_moe * moe_recompute
        compute = n * layer_compute + n_moe * moe_compute + recompute
        compute += c.microbatch_overhead_s / (1 if pp == 1 else 2)
        comm = n * layer_tp + n_moe * moe_tp
        cp_ep = (n + n_moe) * layer_cp + n_moe * moe_ep
        if stage == scores:
            compute += head
            comm += edge_tp / 2
        if stage == embeds:
            comm += edge_tp / 2
        stage_times.append(compute + comm + cp_ep)
        stage_parts.append((compute, recompute, comm, (n + n_moe) * layer_cp, n_moe * moe_ep))
    worst = max(range(len(stage_times)), key=lambda i: stage_times[i])
    return stage_times[worst], stage_parts[worst]


def _dp_comm(
    params: float, experts: float, layout: Layout, settings: StepSettings, pool: PoolSpec, act: int
) -> tuple[float, float, int]:
    """(reduce seconds, gather seconds, buckets) of data parallelism over the worst stage's
    parameters (gradient buffer fp32): dense ones over dp·cp ranks, routed experts over their
    expert-data-parallel group of dp·cp/ep; all-reduce, or reduce-scatter + all-gather under the
    distributed optimizer, each bucket paying the link's latency per ring hop."""
    tp, dp, cp, ep = layout.tp, layout.dp, layout.cp, layout.ep
    shards = dp * cp
    dist_opt = settings.distributed_optimizer and shards > 1
    buckets = max(1, math.ceil(params / settings.grad_bucket_elements))
    reduce_s = gather_s = 0.0
    # Group members sit tp apart (dense) or tp·ep apart (routed experts): a node holds this many,
    # each with its own NIC on a GPU node (a CPU host's slots share one).
    for n_params, ranks, apart in ((params - experts, shards, tp), (experts, shards // ep, tp * ep)):
        if ranks <= 1 or n_params <= 0:
            continue
        per_node = min(ranks, max(1, pool.devices_per_node // apart))
        if pool.is_cpu and per_node < ranks:
            per_node = 1
        bw_dp, lat_dp = ring_link(pool, ranks, per_node)
        n_buckets = max(1, round(buckets * n_params / params))
        if dist_opt:
            reduce_s += ring_time("reduce_scatter", 4.0 * n_params, ranks, bw_dp, 0.0)
            gather_s += ring_time("all_gather", n_params * act, ranks, bw_dp, 0.0)
            reduce_s += n_buckets * (ranks - 1) * lat_dp * 1e-6
            gather_s += n_buckets * (ranks - 1) * lat_dp * 1e-6
        else:
            reduce_s += ring_time("all_reduce", 4.0 * n_params, ranks, bw_dp, 0.0)
            reduce_s += n_buckets * 2 * (ranks - 1) * lat_dp * 1e-6
    return reduce_s, gather_s, buckets


def _pp_comm_s(layout: Layout, pool: PoolSpec, message_bytes: float, micro_batches: int) -> float:
    """A stage's sends and receives of one step: each micro-batch's activation forward and its
    gradient back, per model chunk, plus the pipeline's fill."""
    if layout.pp == 1:
        return 0.0
    bw, lat = link(pool, layout.world_size <= pool.devices_per_node)
    p2p = lat * 1e-6 + message_bytes / (bw * 1e9)
    return 2 * p2p * (micro_batches * layout.virtual_stages + layout.pp - 1)


def _dp_exposed(
    reduce_s: float, gather_s: float, buckets: int, compute_mb: float, layout: Layout,
    settings: StepSettings, c: CostConstants,
) -> float:  # fmt: skip
    """What of the data-parallel reduce and gather the step waits for. The reduce hides under the
    last micro-batch's backward (2/3 of its compute, `compute_mb` without recompute) but for its
    last bucket; a zero-bubble schedule's W passes add weight gradients after the last backward,
    so its reduction starts when they are done (engine.parallel.schedules), not overlapped. The
    gather hides under the first forward only where the stack overlaps it (Overlaps.param_gather)."""
    if layout.dp * layout.cp == 1:
        return reduce_s + gather_s
    exposed_reduce = reduce_s
    if settings.overlap_grad_reduce and layout.pipeline_schedule not in ZERO_BUBBLE:
        exposed_reduce = max(reduce_s / buckets, reduce_s - c.dp_overlap * (2 / 3) * compute_mb)
    exposed_gather = gather_s
    if settings.overlaps.param_gather:  # (bucket by bucket under the first forward)
        exposed_gather = max(gather_s / buckets, gather_s - c.dp_overlap * compute_mb / 3)
    return exposed_reduce + exposed_gather


def predict_step(
    model: ModelShape,
    layout: Layout,
    settings: StepSettings,
    pool: PoolSpec,
    constants: CostConstants | None = None,
) -> StepTime:
    """The predicted time of one training step (see the module docstring for every term)."""
    c = constants or constants_for(pool)
    tp, pp, dp, cp, ep, v = layout.tp, layout.pp, layout.dp, layout.cp, layout.ep, layout.virtual_stages
    sp = layout.sequence_parallel and tp > 1
    act = 4 if settings.precision == "fp32" else 2
    # fp8: the transformer linears' GEMMs at the pool's fp8 peak, everything else at bf16's.
    fp8 = settings.precision == "fp8"
    peak = pool.peak("bf16" if fp8 else settings.precision) * 1e12
    linear_peak = pool.peak("fp8") * 1e12 if fp8 else None
    s, h = model.seq_length, model.hidden_size
    tokens = settings.micro_batch_size * s / cp  # per rank and micro-batch
    m = layout.micro_batches(settings.global_batch_size, settings.micro_batch_size)
    bandwidth = c.memory_bandwidth_gbps * 1e9
    seq_div = tp if sp else 1
    links = Links.of(pool)
    lc = layer_costs(
        model, tp, cp, ep, sp, settings.micro_batch_size, settings.recompute, settings.recompute_every,
        act, peak, links, c, linear_peak, settings.moe_overlap_chunks, settings.overlaps.tp_comm,
        settings.moe_dispatch == "nodes",
    )  # fmt: skip
    if model.lora is not None:
        lc = plus_adapters(
            lc, model, tp, cp, sp, settings.micro_batch_size, settings.recompute, settings.recompute_every,
            act, peak, links, c,
        )  # fmt: skip

    # The edges (embedding, head) and the stage with the most layers (an uneven split's middle).
    split = stage_ordered(layout.pipeline_layers, pp, layout.pipeline_schedule)  # (zbv's V: c on c % pp)
    candidates, layers, moes = _stage_layers(model, pp, v, split)
    p2p_tokens = tokens
    if model.family == "t5":
        enc, dec = t5_layer_costs(
            model, tp, sp, settings.micro_batch_size, settings.recompute, settings.recompute_every, act,
            peak, links, c, linear_peak,
        )  # fmt: skip
        t_mb, parts = t5_stage_seconds(model, enc, dec, pp, layout.pipeline_layers, c)
        # A decoder stage's message carries the encoder's output beside the decoder's hidden states.
        p2p_tokens = settings.micro_batch_size * (model.seq_length + model.dec_seq_length)
    else:
        t_mb, parts = _worst_stage(
            lc, candidates, layers, moes, pp, c, edge_stages(pp, layout.pipeline_schedule)
        )
    compute_mb, recompute_mb, tp_mb, cp_mb, ep_mb = parts

    compute_s = m * compute_mb
    tp_comm_s = m * tp_mb
    bubble_s = pipeline_bubble_s(layout.pipeline_schedule, pp, v, t_mb)
    pp_comm_s = _pp_comm_s(layout, pool, p2p_tokens * h * act / seq_div, m)

    params, experts = _stage_param_counts(
        model, tp, pp, ep, v, split, tuple(candidates), layout.pipeline_schedule
    )
    reduce_s, gather_s, buckets = _dp_comm(params, experts, layout, settings, pool, act)
    shards = dp * cp
    dp_exposed_s = _dp_exposed(reduce_s, gather_s, buckets, compute_mb - recompute_mb, layout, settings, c)

    dist_opt = settings.distributed_optimizer and shards > 1
    owned = (params - experts) / shards + experts / (shards // ep) if dist_opt else params
    optimizer_s = (32.0 * owned + 4.0 * params) / bandwidth
    overhead_s = c.step_overhead_s

    cp_comm_s, ep_comm_s = m * cp_mb, m * ep_mb
    if settings.moe_overlap_microbatches and ep > 1:
        pairs = max(0, m - pp)  # the first stage's: one more warm-up forward than 1F1B's
        ep_comm_s -= pairs * lanes_hidden_s(ep_mb, compute_mb + tp_mb, lc.moe_ep / 4)
    step = compute_s + tp_comm_s + cp_comm_s + ep_comm_s + bubble_s + pp_comm_s + dp_exposed_s
    step += optimizer_s + overhead_s
    useful = _flops_per_iteration(model, settings.global_batch_size)
    world = layout.world_size
    tflops = useful / step / world / 1e12
    return StepTime(
        step_time_s=step,
        compute_s=compute_s,
        recompute_s=m * recompute_mb,
        tp_comm_s=tp_comm_s,
        pp_comm_s=pp_comm_s,
        bubble_s=bubble_s,
        dp_comm_s=reduce_s + gather_s,
        dp_exposed_s=dp_exposed_s,
        optimizer_s=optimizer_s,
        overhead_s=overhead_s,
        tokens_per_s=settings.global_batch_size * s / step,
        tflops_per_gpu=tflops,
        mfu=tflops * 1e12 / peak,
        model_flops=useful,
        cp_comm_s=cp_comm_s,
        ep_comm_s=ep_comm_s,
    )


__all__ = [
    "ENGINE_OVERLAPS",
    "MEGATRON_OVERLAPS",
    "CPU_CONSTANTS",
    "CPU_LINKS",
    "GPU_CONSTANTS",
    "CostConstants",
    "Overlaps",
    "StepSettings",
    "StepTime",
    "all_to_all_time",
    "constants_for",
    "ep_ranks_per_node",
    "gemm_efficiency",
    "lanes_hidden_s",
    "predict_step",
    "ring_time",
]
