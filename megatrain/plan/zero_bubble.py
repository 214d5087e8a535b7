"""The zero-bubble pipeline schedules (zb-h1, zbv: megatrain.engine.parallel.zero_bubble) in the
planner's terms: what a stage holds between a chunk's B and its W, and how zbv's V orders its layers.

Between B (input gradients) and W (weight gradients) the engine keeps, for every fused linear of
the chunk's layers, the detached output gradient dy (tokens × the rank's out_features) and input x
(megatrain.kernels.grad_accumulation.deferring_weight_grads). x is the layer's saved activation,
already counted while the chunk is in flight (memory.chunks_in_flight counts a chunk until its W);
what is new:

- dy of qkv ((q + 2kv)/tp wide: column-parallel), proj (h: row-parallel, its output gradient whole),
  fc1 (fc1_width/tp) and fc2 (h); an MoE layer's routed experts (grouped GEMMs) compute their
  weight gradients in B, so only its qkv, proj and shared expert defer.
- Under sequence parallelism a column-parallel linear's W keeps the input it all-gathered in B
  (tokens × h) where its activation was the shard (tokens × h/tp).
- A layer recomputed in B (full recompute) keeps only its input as an activation: its linears'
  recomputed inputs (h, q/tp, h, f/tp wide) stay alive until W.
- float8 linears and frozen (LoRA) weights defer nothing: their gradients come in B or not at all.

How many chunks wait for their W at once follows each stage's order; the peaks here are the ones
the engine's orders give (tests/plan/test_zero_bubble.py walks them).

zbv lays its 2p chunks out in a V: stage s holds global chunks s and 2p-1-s, so its first stage both
embeds and runs the LM head and loss, its last neither, and a layout's pipeline_layers (global chunk
order) is read in the planner's order (chunk v·p + s on stage s) through stage_ordered. (Which layer
indices a stage holds is then approximate: only an MoE layer_freq > 1 would notice.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatrain.plan.activation_memory import StepActivations
from megatrain.plan.layout import Layout, model_problems
from megatrain.plan.shapes import ModelShape, stage_params
from megatrain.plan.stacks import family_layout_problems, stack_layers_on_stage
from megatrain.plan.stages import balanced_layers, layers_on_stage, moe_layers_on_stage
from megatrain.plan.t5_memory import T5StepActivations

SPLIT_SCHEDULES = ("zb-h1", "zbv")
"""Schedules whose backward is B then W (megatrain.engine.parallel.zero_bubble.SPLIT_SCHEDULES)."""


def weight_grad_moments(
    schedule: str, pp: int, stage: int, num_microbatches: int
) -> tuple[tuple[int, int], ...]:
    """(chunks holding activations, of them chunks whose W is pending) at each moment a stage's memory
    can peak under a split schedule: the Pareto front of the two counts over the stage's order.

    zb-h1 (one point): the stage's s deferred W passes plus the one in flight, min(M, s + 1,
    max(0, M - p + 1 + s) + 1) (the last stage's min(M, p)), while it holds min(p, M) micro-batches.
    zbv: the activations' peak min(2M, M + s + 1, 2p) with one W pending; and in the cool-down,
    where stage s leaves its last s chunk-0 and s chunk-1 W passes to the end, those 2s plus one,
    as far as the micro-batches exist (N = max(M, 2p - 1) of the order's slots, the rest dropped).
    """
    m, s = num_microbatches, stage
    if schedule == "zb-h1":
        return ((min(pp, m), min(m, s + 1, max(0, m - pp + 1 + s) + 1)),)
    if schedule != "zbv":
        raise ValueError(f"{schedule!r} is not a split schedule ({', '.join(SPLIT_SCHEDULES)})")
    n = max(m, 2 * pp - 1)
    peak = (min(2 * m, m + s + 1, 2 * pp), 1)
    # The cool-down's B passes of chunk 0 (from slot n - p) and chunk 1 (from n - s) that exist,
    # then one more B of chunk 0 (slot n - p + s) before the first deferred W.
    b0 = min(s, max(0, m - (n - pp)))
    b1 = min(s, max(0, m - (n - s)))
    pending = b0 + b1 + (1 if n - pp + s < m else 0)
    held = 2 * m - min(n - pp, m) - min(n - s, m)  # every F done, the steady state's W done
    late = (held, pending)
    if late[0] <= peak[0] and late[1] <= peak[1]:
        return (peak,)
    return (peak, late)


def deferred_bytes_per_token(
    m: ModelShape, *, tp: int, sp: bool, act: int, moe: bool = False, recomputed: bool = False
) -> float:
    """Bytes per token (of the rank's micro-batch) one layer holds between its B and W beyond what it
    saves for backward (the module docstring): its linears' output gradients, under sp the gathered
    inputs of its column-parallel linears, and if recomputed in B every linear's input."""
    h, q, kv = m.hidden_size, m.q_size, m.kv_size
    # (out width, in width, column-parallel) of each deferring linear; widths per tp rank.
    linears = [((q + 2 * kv) / tp, h, True), (h, q / tp, False)]
    ffn = m.ffn_hidden_size
    if moe:
        ffn = (m.moe.shared_expert_ffn_hidden_size or 0) if m.moe is not None else 0
    if ffn:
        linears += [(m.mlp_fc1_width(ffn) / tp, h, True), (h, ffn / tp, False)]
    dy = sum(out for out, _, _ in linears)
    if recomputed:
        x = sum(width for _, width, _ in linears)  # sp gathers the column-parallel ones whole
    elif sp:
        x = sum(width * (1 - 1 / tp) for _, width, column in linears if column)
    else:
        x = 0.0
    return act * (dy + x)


def deferred_per_layer(m: ModelShape, precision: str, tp: int, sp: bool) -> tuple[float, float]:
    """deferred_bytes_per_token of a (dense, MoE) layer kept, not recomputed, at a precision: none
    for float8 linears or frozen (LoRA) weights."""
    if precision == "fp8" or m.lora is not None:
        return 0.0, 0.0
    act = 4 if precision == "fp32" else 2
    dense, moe = (deferred_bytes_per_token(m, tp=tp, sp=sp, act=act, moe=moe) for moe in (False, True))
    return dense, moe


def deferred_bytes(acts: StepActivations, n_layers: int, n_moe: int, n_ckpt: int) -> float:
    """Bytes one micro-batch of a stage (n_layers, n_moe of them MoE, n_ckpt recomputed, taken as
    dense and MoE in the stage's proportion) holds between its B and its W (deferred_bytes_per_token)."""
    if acts.fp8 or not acts.trains_weights or not n_layers:
        return 0.0
    kw = {"tp": acts.tp, "sp": acts.sp, "act": acts.act}
    recomputed = n_ckpt / n_layers
    total = 0.0
    for n, moe in ((n_layers - n_moe, False), (n_moe, True)):
        if n:
            kept = deferred_bytes_per_token(acts.m, moe=moe, **kw)
            rebuilt = deferred_bytes_per_token(acts.m, moe=moe, recomputed=True, **kw)
            total += n * ((1 - recomputed) * kept + recomputed * rebuilt)
    return acts.tokens * total


def t5_deferred_bytes(
    t5: T5StepActivations, stage: int, pp: int, pipeline_layers: Sequence[int] | None, *, recompute: str,
    recompute_every: int,
) -> float:  # fmt: skip
    """deferred_bytes of a T5 stage (megatrain.plan.t5_memory): its encoder layers over the Te
    encoder tokens, its decoder layers over the Td decoder tokens, each decoder layer's cross-attention
    adding q's and o's output gradients (Td tokens) and kv's (over the Te encoder tokens)."""
    enc, dec = t5.encoder, t5.decoder
    n_enc, n_dec = stack_layers_on_stage(enc.m, pp, stage, pipeline_layers)

    def ckpt(n: int) -> int:
        return -(-n // recompute_every) if recompute == "full" else 0

    total = deferred_bytes(enc, n_enc, 0, ckpt(n_enc)) + deferred_bytes(dec, n_dec, 0, ckpt(n_dec))
    if not n_dec or dec.fp8 or not dec.trains_weights:
        return total
    m, tp, rebuilt = dec.m, dec.tp, ckpt(n_dec) / n_dec
    h, q, kv = m.hidden_size, m.q_size, m.kv_size
    # (out width, in width, column-parallel, tokens) of q, kv and o; as deferred_bytes_per_token.
    for out, width, column, tokens in ((q / tp, h, True, dec.tokens), (2 * kv / tp, h, True, enc.tokens),
                                       (h, q / tp, False, dec.tokens)):  # fmt: skip
        gathered = width * (1 - 1 / tp) if dec.sp and column else 0.0
        total += n_dec * tokens * dec.act * (out + rebuilt * width + (1 - rebuilt) * gathered)
    return total


def last_stage_floor(
    m: ModelShape, schedule: str, pp: int, v: int, num_microbatches: int, staged: tuple[int, ...] | None,
    *, tokens: float, kept: tuple[float, float], deferred: tuple[float, float], state: tuple[float, float],
    full_every: int | None = None,
) -> float:  # fmt: skip
    """A lower bound of the last stage's bytes under a split schedule (the planner's pruning: that
    stage holds the most, memory.estimate_memory the exact figure): its layers' model state and, at
    its peak moment, its micro-batches' saved activations and deferred output gradients. Per (dense,
    MoE) layer: `state` bytes, `kept` and `deferred` bytes per token of a micro-batch of `tokens`;
    under full recompute (`full_every` = k) only every k-th layer's input is counted as kept."""
    n = layers_on_stage(m.num_layers, pp, pp - 1, staged)
    n_moe = moe_layers_on_stage(m, pp, pp - 1, staged, v)

    def per_stage(per_layer: tuple[float, float]) -> float:
        return (n - n_moe) * per_layer[0] + n_moe * per_layer[1]

    saved = kept[0] * -(-n // full_every) if full_every else per_stage(kept)
    moments = weight_grad_moments(schedule, pp, pp - 1, num_microbatches)
    peak = max(held * saved + pending * per_stage(deferred) for held, pending in moments)
    return per_stage(state) + tokens * peak / v


def zbv_stage_order(pipeline_layers: Sequence[int], pp: int) -> tuple[int, ...]:
    """zbv's layers per chunk (global chunk order: the V's down leg 0..p-1 on stages 0..p-1, its up
    leg p..2p-1 on stages p-1..0) in the planner's order, chunk v·p + s on stage s."""
    return tuple(pipeline_layers[c if v == 0 else 2 * pp - 1 - c] for v in range(2) for c in range(pp))


def zbv_layers(num_layers: int, pp: int) -> tuple[int, ...] | None:
    """Layers per chunk of zbv's V (global chunk order), or None for an even split: the extra layers
    go first to the stages past the first, which runs both the embedding and the LM head and loss
    (its second chunk is the V's last); one per stage before a second."""
    chunks = 2 * pp
    base, extra = divmod(num_layers, chunks)
    if not extra:
        return None
    stage = [c if c < pp else chunks - 1 - c for c in range(chunks)]
    order = sorted(range(chunks), key=lambda c: (stage[c] == 0, c >= pp, stage[c]))
    counts = [base] * chunks
    for c in order[:extra]:
        counts[c] += 1
    return tuple(counts)


def edge_stages(pp: int, schedule: str) -> tuple[int, int]:
    """(the stage that embeds, the stage that runs the LM head and loss): zbv's V ends where it
    began, on stage 0."""
    return (0, 0) if schedule == "zbv" else (0, pp - 1)


def schedule_stage_params(
    m: ModelShape, tp: int, pp: int, stage: int, staged: Sequence[int] | None, ep: int, v: int, schedule: str
) -> dict[str, int]:
    """shapes.stage_params (`staged`: pipeline_layers in the planner's order) with the LM head on the
    stage the schedule runs it on (edge_stages): under zbv the first stage's, the last one's none."""
    parts = stage_params(m, tp, pp, stage, staged, ep, v)
    if schedule != "zbv" or stage not in (0, pp - 1):
        return parts
    layers = ("layers", "experts")
    if stage == pp - 1:
        return {k: n for k, n in parts.items() if k in layers}
    head = {k: n for k, n in stage_params(m, tp, pp, pp - 1, staged, ep, v).items() if k not in layers}
    if m.tie_embeddings:
        head.pop("lm_head", None)  # (one weight on the one stage that embeds and scores)
    return parts | head


def stage_ordered(pipeline_layers: Sequence[int] | None, pp: int, schedule: str) -> tuple[int, ...] | None:
    """A layout's pipeline_layers in the planner's order (chunk c on stage c % pp)."""
    if pipeline_layers is None or schedule != "zbv":
        return None if pipeline_layers is None else tuple(pipeline_layers)
    return zbv_stage_order(pipeline_layers, pp)


def zero_bubble_pipelines(
    model_spec: Any, m: ModelShape, pp: int
) -> list[tuple[str, int, tuple[int, ...] | None]]:
    """(schedule, virtual stages, pipeline_layers) of the zero-bubble candidates the planner tries
    at pp beside 1F1B's: zb-h1 (one chunk per stage) and zbv (two, the V, at least a layer each)
    where the layout rules allow them for this model (`model_spec`: its ModelSpec). None for T5:
    its split is balanced per candidate later (t5_cost.t5_pipeline_layers) and its zb-h1 (which the
    engine runs, zbv not) is estimated for explicit specs only."""
    out: list[tuple[str, int, tuple[int, ...] | None]] = []
    if pp < 2 or m.family == "t5":
        return out
    for schedule, v in (("zb-h1", 1), ("zbv", 2)):
        if pp * v > m.num_layers:
            continue
        split = zbv_layers(m.num_layers, pp) if schedule == "zbv" else balanced_layers(m.num_layers, pp, 1)
        lay = Layout(pp=pp, virtual_stages=v, pipeline_schedule=schedule, pipeline_layers=split)
        if not model_problems(lay, num_layers=m.num_layers) and not family_layout_problems(model_spec, lay):
            out.append((schedule, v, split))
    return out


__all__ = [
    "SPLIT_SCHEDULES",
    "deferred_bytes",
    "deferred_bytes_per_token",
    "deferred_per_layer",
    "edge_stages",
    "last_stage_floor",
    "schedule_stage_params",
    "stage_ordered",
    "t5_deferred_bytes",
    "weight_grad_moments",
    "zbv_layers",
    "zbv_stage_order",
    "zero_bubble_pipelines",
]
