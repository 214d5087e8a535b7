"""What a run says when it starts: why its precision differs from the one asked for, and the
`started` event (with its console lines): what runs, where, what it trains, and the planner's memory
estimate for it."""

from __future__ import annotations

from typing import Any

import torch

from megatrain.engine.build import Trainable
from megatrain.engine.checkpoint.training import Progress
from megatrain.engine.config import TrainConfig, TransformerConfig
from megatrain.engine.models.moe import moe_layers
from megatrain.engine.runtime import Dist
from megatrain.engine.sink import RunLog
from megatrain.plan.layout import Layout
from megatrain.plan.memory import from_spec as memory_from_spec
from megatrain.spec import JobSpec


def say_precision(requested: str, precision: str, log: RunLog) -> None:
    """Say why the precision that runs is not the one the spec asked for."""
    if requested == "auto":
        why = "runs bf16 natively" if precision == "bf16" else "has no native bf16"
        log.say(f"precision auto: {precision} (this device {why})")
    elif precision == "bf16" and requested == "fp8":
        log.say(
            "precision fp8 requested; this GPU has no float8 GEMMs (compute capability < 8.9), "
            "so running bf16"
        )
    elif precision != requested:
        log.say(
            f"precision {requested} requested; this CPU has no native bf16, so running fp32 "
            "(MEGATRAIN_CPU_LOW_PRECISION=1 runs it anyway)"
        )


def device_name(device: str) -> str | None:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else None


def started_event(
    spec: JobSpec,
    layout: Layout,
    train: Trainable,
    cfg: TrainConfig,
    mcfg: TransformerConfig,
    ctx: Dist,
    start: Progress,
    resumed_from: int | None,
    tokenizer_vocab: int,
    log: RunLog,
) -> dict[str, Any]:
    """The `started` event (and its console line): what runs, where, and the planner's memory estimate."""
    device = device_name(ctx.device) or "cpu"
    dist_opt = train.ddp.use_distributed_optimizer
    log.say(
        f"model {train.model.num_params / 1e6:.2f}M params | layout {layout.describe()} | {cfg.precision} | "
        f"device {device} | {cfg.grad_accum_steps} micro-batches of {cfg.micro_batch_size} per dp rank "
        f"per step | distributed optimizer {'on' if dist_opt else 'off'}"
    )
    trainable = cfg.lora.num_params(mcfg) if cfg.lora else train.model.num_params
    if cfg.lora:
        log.say(
            f"LoRA rank {cfg.lora.rank}, alpha {cfg.lora.alpha:g} on {', '.join(cfg.lora.targets)}: "
            f"{trainable:,} trainable parameters of {train.model.num_params + trainable:,} "
            f"({100 * trainable / (train.model.num_params + trainable):.2f}%); the base is frozen"
        )
    _say_experts(train, layout, log)
    if train.model.chunks:
        v = layout.virtual_stages
        log.say(
            f"pipeline: {layout.pipeline_schedule} schedule"
            f"{f', interleaved over {v} virtual stages' if v > 1 else ''}"
            f" | stage 0 layers {[c.layer_range for c in train.model.chunks]}"
        )
    return {
        "event": "started",
        "step": start.step,
        "num_params": train.model.num_params,
        "trainable_params": trainable,
        "world_size": ctx.world_size,
        "layout": layout.as_dict(),
        "device": device,
        "precision": cfg.precision,
        "distributed_optimizer": dist_opt,
        "recompute": cfg.recompute,
        "compile": cfg.compile,
        "resumed_from": resumed_from,
        "memory_estimate": _memory_estimate(spec, layout, tokenizer_vocab, cfg.precision, log),
    }


def _say_experts(train: Trainable, layout: Layout, log: RunLog) -> None:
    """Under expert parallelism: the experts each rank holds and whether the all-to-alls are hidden."""
    layers = list(moe_layers(train.model.module))
    if layout.ep == 1 or not layers:
        return
    total, d = layers[0].router.moe.num_experts, layers[0].dispatcher
    chunks = getattr(d, "chunks", 1)
    if hasattr(d, "ranks_per_node"):
        how = f"in two hops, once per node, then per rank ({d.ranks_per_node} ep ranks per node)"
        if chunks > 1 and d.rail.size > 1:
            how += f", the hop across nodes pipelined in {chunks} token chunks"
    elif chunks > 1:
        how = f"pipelined behind the experts in {chunks} token chunks"
    else:
        how = "not overlapped"
    if train.microbatch_lanes:
        how += "; each micro-batch's forward beside the one before's backward"
    log.say(f"experts: {total // layout.ep} of {total} per rank (ep={layout.ep}) | all-to-all {how}")


def _memory_estimate(
    spec: JobSpec, layout: Layout, tokenizer_vocab: int, precision: str, log: RunLog
) -> dict[str, Any] | None:
    """The planner's per-rank memory estimate for what runs (auto precision resolved, a CPU's
    downgrade applied, not what was asked for); None, said, where it cannot make one."""
    try:
        estimate = memory_from_spec(spec, layout, tokenizer_vocab=tokenizer_vocab, precision=precision)
    except (ValueError, KeyError) as exc:  # an estimate must never stop a run
        log.say(f"no memory estimate: {exc}")
        return None
    return {
        "params_bytes": estimate.params_bytes,
        "grads_bytes": estimate.grads_bytes,
        "optimizer_bytes": estimate.optimizer_bytes,
        "activations_bytes": estimate.activations_bytes,
        "total_bytes": estimate.total_bytes,
        "stage_total_bytes": list(estimate.stage_totals),
    }
