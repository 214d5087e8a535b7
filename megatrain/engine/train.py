"""`python -m megatrain.engine.train --spec SPEC --out DIR [--checkpoint-url URL]`: the torchrun entry point.

Runs as one process, or as N ranks under `torchrun --nproc-per-node N` (gloo on CPU, nccl on CUDA)
with the spec's layout: tensor parallelism (+ sequence parallelism), pipeline parallelism (1F1B,
interleaved with virtual stages, or all-forward-all-backward) and data parallelism with bucketed,
overlapped gradient reduction and optionally the distributed optimizer (ZeRO-1), in fp32, bf16 or
fp16 (dynamic loss scaling), with optional activation recompute. Global rank 0 writes
DIR/metrics.jsonl and DIR/events.jsonl (one flushed JSON object per line) and checkpoints; every
rank resumes from the latest complete checkpoint when one exists, whatever layout wrote it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatrain.engine.checkpoint import (
    find_latest,
    read_checkpoint,
    read_weights,
    resolve_init_from,
    rng_state,
    set_rng_state,
    write_checkpoint,
)
from megatrain.engine.config import TrainConfig, TransformerConfig, train_config, transformer_config
from megatrain.engine.data import build_datasets, build_tokenizer, microbatch_sample_ids
from megatrain.engine.data.dataset import BlendedDataset
from megatrain.engine.fused_ce import linear_cross_entropy
from megatrain.engine.memory import from_spec as memory_from_spec
from megatrain.engine.metrics import flops_per_iteration, peak_memory_bytes, peak_tflops, throughput
from megatrain.engine.models.gpt import GPTModel, compile_layers
from megatrain.engine.optimizer import MixedPrecisionOptimizer, build_optimizer
from megatrain.engine.parallel.data import DataParallel
from megatrain.engine.parallel.dims import LayoutError, ParallelDims, validate_dims
from megatrain.engine.parallel.parallelize import (
    full_state_dict,
    load_full_state_dict,
    parallel_lm_loss,
    parallelize_model,
)
from megatrain.engine.parallel.pipeline import (
    StageModule,
    allreduce_tied_embedding_grads,
    build_stage_modules,
    gather_to_rank0,
    load_pipeline_state_dict,
    pipeline_full_state_dict,
    stage_parameter_names,
)
from megatrain.engine.parallel.random import RNGStatesTracker
from megatrain.engine.parallel.schedules import PipelineSchedule, ScheduleError, check_schedule, pipeline_loss
from megatrain.engine.parallel.state import ParallelState
from megatrain.engine.parallel.tensor import (
    allreduce_sequence_parallel_grads,
    gather_shards,
    is_tensor_parallel,
    shard_tensor,
)
from megatrain.engine.timers import StepTimers
from megatrain.scheduler.planner import Layout, plan_layout
from megatrain.settings import get_settings
from megatrain.spec import JobSpec, ParallelismSpec, SpecError, load_spec

EXIT_USAGE = 2
EXIT_SIGTERM = 128 + signal.SIGTERM
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Terminated(Exception):
    """Raised from the SIGTERM handler so a cancelled run unwinds at once, not after the next step."""


class UnsupportedLayout(Exception):
    pass


@dataclass(frozen=True)
class Dist:
    """This process's place in the job; `group` is None for a single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    group: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for the optimizer step that produces `step` (1-based): warmup, then decay."""
    if cfg.warmup_iters and step <= cfg.warmup_iters:
        return cfg.lr * step / cfg.warmup_iters
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_iters) / max(1, cfg.train_iters - cfg.warmup_iters))
    if cfg.lr_schedule == "cosine":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr - (cfg.lr - cfg.min_lr) * progress


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def effective_precision(precision: str, device: str) -> str:
    """The precision a run uses: the spec's, except bf16/fp16 on a CPU that only emulates them.

    Emulated bf16 measured ~25× slower than fp32 on this project's 2-core AVX2 machine, so there
    such jobs run in fp32 unless MEGATRAIN_CPU_LOW_PRECISION=1 asks for the real thing.
    """
    if precision == "fp32" or device.startswith("cuda"):
        return precision
    if cpu_has_native_bf16() or get_settings().cpu_low_precision:
        return precision
    return "fp32"


def check_layout(layout: Layout) -> None:
    if layout.cp > 1 or layout.ep > 1:
        raise UnsupportedLayout(
            f"layout cp={layout.cp} ep={layout.ep} needs context/expert parallelism, which this engine "
            "does not run yet; it runs tensor (+sequence), pipeline and data parallelism (cp=ep=1)"
        )


def parallel_dims(layout: Layout) -> ParallelDims:
    return ParallelDims(
        tp=layout.tp,
        cp=layout.cp,
        dp=layout.dp,
        pp=layout.pp,
        ep=layout.ep,
        sequence_parallel=layout.sequence_parallel,
        virtual_stages=layout.virtual_stages,
    )


def validate_layout(dims: ParallelDims, world_size: int, mcfg: TransformerConfig) -> None:
    """LayoutError naming the numbers when the layout cannot run this model on this world."""
    validate_dims(
        dims,
        world_size,
        num_attention_heads=mcfg.num_attention_heads,
        num_query_groups=mcfg.num_query_groups,
        ffn_hidden_size=mcfg.ffn_hidden_size,
        vocab_size=mcfg.vocab_size,
        num_layers=mcfg.num_layers,
        seq_length=mcfg.seq_length,
    )


class JsonlLog:
    """Append-only JSON lines, flushed per line; a no-op on ranks other than 0."""

    def __init__(self, path: Path, enabled: bool):
        self._f = open(path, "a", buffering=1) if enabled else None  # noqa: SIM115

    def write(self, row: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps({**row, "time": time.time()}) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def _reduce_mean(value: torch.Tensor, state: ParallelState) -> float:
    """Mean over data-parallel ranks of the last pipeline stage's value (tensor-parallel ranks already
    hold the same loss; other stages hold zero and receive it)."""
    value = pipeline_loss(value, state)
    if state.dp_group is not None:
        value = value.clone()
        dist.all_reduce(value, group=state.dp_group)
        value /= state.dp_size
    return float(value.item())


def _batch(dataset: BlendedDataset, ids: list[int], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.from_numpy(dataset.batch(ids)).to(device, non_blocking=True)  # (B, T+1)
    return tokens[:, :-1], tokens[:, 1:]


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: BlendedDataset,
    cfg: TrainConfig,
    state: ParallelState,
    device: str,
    pipeline: PipelineSchedule | None = None,
    pipeline_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """Mean loss over the first eval_iters global batches of the split (the same ones every time)."""
    model.eval()
    total = torch.zeros((), device=device)
    count = 0
    for it in range(cfg.eval_iters):
        start = it * cfg.global_batch_size
        micro_ids = microbatch_sample_ids(
            start, cfg.global_batch_size, cfg.micro_batch_size, state.dp_rank, state.dp_size
        )
        if pipeline is not None:
            batches = [_batch(dataset, ids, device) for ids in micro_ids]
            assert pipeline_loss is not None
            total += pipeline.forward_only(batches, pipeline_loss)
            count += len(batches)
            continue
        for ids in micro_ids:
            x, y = _batch(dataset, ids, device)
            total += _loss(model, x, y, state)
            count += 1
    model.train()
    return _reduce_mean(total / count, state)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """The LM loss: the head fused with the cross-entropy on one tensor-parallel rank
    (GPTModel.loss), the vocab-parallel loss on the logits' shards otherwise."""
    if state.tp_size == 1:
        # DataParallel's forward is a pass-through (its work hangs on parameter hooks).
        return (model.module if isinstance(model, DataParallel) else model).loss(x, y)
    return parallel_lm_loss(model(x), y, state)


def _pipeline_loss_fn(
    chunks: list[StageModule], state: ParallelState
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss a pipeline's last chunk feeds: fused with the LM head at tp = 1, as without a
    pipeline; the vocab-parallel loss on the logits' shards otherwise. Other ranks never call it."""
    last = chunks[-1] if chunks and chunks[-1].is_last else None
    if last is not None and state.tp_size == 1:
        last.return_hidden = True
        return lambda hidden, y: linear_cross_entropy(hidden, last.lm_head.weight, y)
    return lambda logits, y: parallel_lm_loss(logits, y, state)


# -- checkpoint state across tensor and data parallelism ------------------------------------------


def parameter_names(model: GPTModel) -> dict[nn.Parameter, str]:
    """Canonical (single-device) name of every unique parameter; a tied head is `embed.weight`."""
    return {p: name for name, p in model.named_parameters()}


def _tp_gather(t: torch.Tensor, p: nn.Parameter, state: ParallelState) -> torch.Tensor:
    if is_tensor_parallel(p) and state.tp_size > 1:
        return gather_shards(t, p.partition_dim, p.partition_stride, state.tp_group, state.tp_size)
    return t


def _tp_shard(t: torch.Tensor, p: nn.Parameter, state: ParallelState) -> torch.Tensor:
    if is_tensor_parallel(p):
        return shard_tensor(t, p.partition_dim, state.tp_rank, state.tp_size, p.partition_stride)
    return t


def gather_optimizer_state(
    optimizer: MixedPrecisionOptimizer, names: dict[nn.Parameter, str], state: ParallelState
) -> dict[str, Any]:
    """The optimizer's full state under canonical names: gathered over dp, then over tp (collective)."""
    sd = optimizer.full_state_dict(names)
    by_name = {name: p for p, name in names.items()}
    sd["params"] = {
        name: {k: _tp_gather(t, by_name[name], state).cpu() for k, t in entry.items()}
        for name, entry in sd["params"].items()
    }
    if state.pp_size == 1:
        return sd
    # Each stage holds its own layers: tp rank 0 of dp rank 0 of every stage sends its part to rank 0.
    sender = state.tp_rank == 0 and state.dp_rank == 0
    parts = gather_to_rank0(sd["params"] if sender else None, state)
    merged: dict[str, Any] = {}
    for part in reversed(parts or []):  # stage 0's embedding wins over the last stage's tied copy
        merged.update(part or {})
    sd["params"] = merged
    return sd


def scatter_optimizer_state(
    optimizer: MixedPrecisionOptimizer,
    sd: dict[str, Any],
    names: dict[nn.Parameter, str],
    state: ParallelState,
) -> None:
    """Inverse of gather_optimizer_state: this rank's tp shard of each entry, then its dp slices."""
    by_name = {name: p for p, name in names.items()}
    device = next(iter(names)).device
    local = dict(sd)
    local["params"] = {
        name: {k: _tp_shard(t, by_name[name], state).to(device) for k, t in entry.items()}
        for name, entry in sd["params"].items()
        if name in by_name
    }
    optimizer.load_full_state_dict(local, names)


def _all_rng_states(tracker: RNGStatesTracker | None, state: ParallelState) -> list[dict[str, Any]] | None:
    """Every rank's RNG states, on global rank 0 (None elsewhere)."""
    mine = {"default": rng_state(), "tracker": tracker.state_dict() if tracker is not None else None}
    if state.dims.world_size == 1:
        return [mine]
    gathered: list[Any] = [None] * state.dims.world_size if state.rank == 0 else []
    dist.gather_object(mine, gathered if state.rank == 0 else None, dst=0)
    return gathered if state.rank == 0 else None


# -- the run --------------------------------------------------------------------------------------


def run(
    spec: JobSpec, out_dir: Path, checkpoint_url: str | None = None, ctx: Dist | None = None
) -> dict[str, Any]:
    """Train `spec` to training.train_iters (resuming if a checkpoint exists); returns a summary."""
    ctx = ctx or Dist()
    layout = plan_layout(spec)
    check_layout(layout)
    if layout.world_size != ctx.world_size:
        raise UnsupportedLayout(
            f"the spec's layout needs {layout.world_size} processes but {ctx.world_size} were started"
        )
    par = spec.parallelism if isinstance(spec.parallelism, ParallelismSpec) else ParallelismSpec()
    dims = parallel_dims(layout)
    cfg = train_config(spec, dims.dp)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_url = checkpoint_url or (out_dir / "checkpoints").resolve().as_uri()
    device = f"cuda:{ctx.local_rank}" if torch.cuda.is_available() else "cpu"
    precision = effective_precision(cfg.precision, device)
    log = print if ctx.is_main else (lambda *a, **k: None)
    if precision != cfg.precision:
        log(
            f"precision {cfg.precision} requested; this CPU has no native bf16, so running fp32 "
            "(MEGATRAIN_CPU_LOW_PRECISION=1 runs it anyway)",
            flush=True,
        )

    tokenizer = build_tokenizer(spec.data.tokenizer)
    mcfg = transformer_config(spec, tokenizer.vocab_size)
    try:
        validate_layout(dims, ctx.world_size, mcfg)
    except LayoutError as exc:
        raise UnsupportedLayout(str(exc)) from None
    if dims.pp > 1:
        try:
            check_schedule(layout.pipeline_schedule, dims.pp, cfg.grad_accum_steps, dims.virtual_stages)
        except ScheduleError as exc:
            raise UnsupportedLayout(str(exc)) from None
    state = ParallelState.build(dims, device)
    datasets = build_datasets(spec.data, tokenizer, mcfg.seq_length, cfg.seed)
    train_ds, valid_ds = datasets["train"], datasets["valid"]
    assert train_ds is not None

    # Same seed everywhere: every rank builds the full model identically, then keeps its shards, so
    # any layout starts from the very weights a single process would.
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    model = GPTModel(mcfg).to(device)
    num_params = model.num_parameters()
    tracker = RNGStatesTracker.for_tensor_parallel(cfg.seed, state) if dims.tp > 1 else None
    model = parallelize_model(model, state, rng_tracker=tracker)
    # With pp > 1 this rank keeps only its stage's chunks; `model` is what DataParallel wraps.
    chunks: list[StageModule] = []
    if dims.pp > 1:
        chunks = build_stage_modules(model, state, layout.pipeline_layers)
        model = nn.ModuleList(chunks)  # type: ignore[assignment]

    def load_weights(full: dict[str, torch.Tensor]) -> None:
        if chunks:
            load_pipeline_state_dict(chunks, full, state)
        else:
            load_full_state_dict(model, full, state)

    resumed_from, init_step = None, None
    latest = find_latest(ckpt_url)
    if latest is None and spec.model.init_from:
        src = resolve_init_from(spec.model.init_from, get_settings().resolved_storage_url)
        weights, init_step = read_weights(src)
        load_weights(weights)
        log(f"initialised from {src} (step {init_step})", flush=True)
    model = model.to(dtype=PARAM_DTYPES[precision])
    for part in chunks or [model]:
        part.set_recompute(cfg.recompute, every=cfg.recompute_every)
        if cfg.compile:
            compile_layers(part)
    ddp = DataParallel(
        model,
        state,
        bucket_elements=par.grad_bucket_elements,
        overlap_grad_reduce=par.overlap_grad_reduce,
        use_distributed_optimizer=par.distributed_optimizer and dims.dp > 1,
    )
    optimizer = build_optimizer(ddp, cfg)
    names = stage_parameter_names(chunks) if chunks else parameter_names(model)
    pipeline: PipelineSchedule | None = None
    if chunks:
        seq = mcfg.seq_length // (dims.tp if dims.sequence_parallel else 1)
        pipeline = PipelineSchedule(
            chunks,
            state,
            (cfg.micro_batch_size, seq, mcfg.hidden_size),
            PARAM_DTYPES[precision],
            layout.pipeline_schedule,
        )
    pipeline_loss = _pipeline_loss_fn(chunks, state)

    step, consumed = 0, 0
    if latest is not None:
        model_state, extra, trainer_state = read_checkpoint(ckpt_url, latest)
        if "params" in extra.get("optimizer", {}):
            scatter_optimizer_state(optimizer, extra["optimizer"], names, state)
        else:  # a checkpoint from before the parallel engine: weights only, fresh optimizer moments
            load_weights(model_state)
        rngs = extra.get("rng_per_rank")
        if rngs is not None and len(rngs) == dims.world_size:
            set_rng_state(rngs[state.rank]["default"])
            if tracker is not None and rngs[state.rank]["tracker"] is not None:
                tracker.load_state_dict(rngs[state.rank]["tracker"])
        step, consumed, resumed_from = trainer_state["step"], trainer_state["consumed_samples"], latest
        log(f"resumed from {ckpt_url} step {step}", flush=True)

    metrics = JsonlLog(out_dir / "metrics.jsonl", ctx.is_main)
    events = JsonlLog(out_dir / "events.jsonl", ctx.is_main)
    device_name = torch.cuda.get_device_name(device) if device.startswith("cuda") else None
    try:
        estimate = memory_from_spec(spec, layout, tokenizer_vocab=tokenizer.vocab_size)
        memory_estimate: dict[str, Any] | None = {
            "params_bytes": estimate.params_bytes,
            "grads_bytes": estimate.grads_bytes,
            "optimizer_bytes": estimate.optimizer_bytes,
            "activations_bytes": estimate.activations_bytes,
            "total_bytes": estimate.total_bytes,
            "stage_total_bytes": list(estimate.stage_totals),
        }
    except (ValueError, KeyError) as exc:  # an estimate must never stop a run
        memory_estimate = None
        log(f"no memory estimate: {exc}", flush=True)
    events.write(
        {
            "event": "started",
            "step": step,
            "num_params": num_params,
            "world_size": ctx.world_size,
            "layout": layout.as_dict(),
            "device": device_name or "cpu",
            "precision": precision,
            "distributed_optimizer": ddp.use_distributed_optimizer,
            "recompute": cfg.recompute,
            "compile": cfg.compile,
            "resumed_from": resumed_from,
            "memory_estimate": memory_estimate,
        }
    )
    log(
        f"model {num_params / 1e6:.2f}M params | layout {dims.describe()} | {precision} | device "
        f"{device_name or 'cpu'} | {cfg.grad_accum_steps} micro-batches of {cfg.micro_batch_size} per "
        f"dp rank per step | distributed optimizer {'on' if ddp.use_distributed_optimizer else 'off'}",
        flush=True,
    )
    if chunks:
        ranges = [c.layer_range for c in chunks]
        log(
            f"pipeline: {layout.pipeline_schedule} schedule"
            f"{f', interleaved over {dims.virtual_stages} virtual stages' if dims.virtual_stages > 1 else ''}"
            f" | stage 0 layers {ranges}",
            flush=True,
        )

    iter_flops = flops_per_iteration(mcfg, cfg.global_batch_size)
    peak = peak_tflops(device_name, precision, get_settings().cpu_peak_tflops)
    tokens_per_iter = cfg.global_batch_size * cfg.seq_length
    device_type = device.split(":")[0]
    last_eval: float | None = None

    def sync() -> None:
        if device_type == "cuda":
            torch.cuda.synchronize(device)

    def save(at: int) -> None:
        # Collective: every rank helps gather the full weights and optimizer state; rank 0 writes.
        weights = pipeline_full_state_dict(chunks, state) if chunks else full_state_dict(model, state)
        optim = gather_optimizer_state(optimizer, names, state)
        rngs = _all_rng_states(tracker, state)
        if ctx.is_main:
            saved = write_checkpoint(
                ckpt_url,
                at,
                weights,
                mcfg,
                {"optimizer": optim, "rng_per_rank": rngs, "layout": layout.as_dict()},
                {"consumed_samples": consumed, "train_iters": cfg.train_iters},
                spec,
            )
            events.write(
                {"event": "checkpoint_saved", "step": at, "uri": saved.uri, "size_bytes": saved.size_bytes}
            )
            log(f"checkpoint {at} saved to {saved.uri} ({saved.size_bytes} bytes)", flush=True)
        if ctx.group is not None:
            dist.barrier(group=ctx.group)

    model.train()
    loss_sum = torch.zeros((), device=device)
    interval_steps, interval_start, excluded = 0, time.perf_counter(), 0.0
    # Per-phase times; on a GPU only the log steps synchronise (and are the ones averaged).
    timers = StepTimers(device)
    skipped_steps = 0
    grad_norm, loss_scale = 0.0, None
    while step < cfg.train_iters:
        lr = lr_at(step + 1, cfg)
        timers.begin_step(sync=(step + 1) % cfg.log_interval == 0 or step + 1 == cfg.train_iters)
        optimizer.zero_grad()
        micro_ids = microbatch_sample_ids(
            consumed, cfg.global_batch_size, cfg.micro_batch_size, state.dp_rank, state.dp_size
        )
        if pipeline is not None:
            with timers("data"):
                batches = [_batch(train_ds, ids, device) for ids in micro_ids]
            n_micro = len(batches)
            fwd0, bwd0 = pipeline.times.forward_s, pipeline.times.backward_s
            loss_sum += pipeline.forward_backward(
                batches,
                lambda out, y, n=n_micro: pipeline_loss(out, y) / n,
                scale_loss=optimizer.scale_loss,
                # Gradient buckets are reduced only during this stage's last backward.
                before_backward=lambda last: setattr(ddp, "is_last_microbatch", last),
            )
            timers.add("forward", pipeline.times.forward_s - fwd0)
            timers.add("backward", pipeline.times.backward_s - bwd0)
        else:
            for m, ids in enumerate(micro_ids):
                with timers("data"):
                    x, y = _batch(train_ds, ids, device)
                # Gradient buckets are reduced only during the last micro-batch's backward.
                last = m == len(micro_ids) - 1
                with contextlib.nullcontext() if last else ddp.no_sync():
                    with timers("forward"):
                        loss = _loss(ddp, x, y, state) / len(micro_ids)
                    with timers("backward"):
                        optimizer.scale_loss(loss).backward()
                loss_sum += loss.detach()
        with timers("grad_sync"):
            ddp.finish_grad_sync()
            if chunks:
                allreduce_tied_embedding_grads(chunks, ddp, state)
            allreduce_sequence_parallel_grads(model, state)
        with timers("optimizer"):
            optimizer.set_lr(lr)
            result = optimizer.step()
        timers.end_step()
        if result.skipped:
            skipped_steps += 1
        else:
            grad_norm = result.grad_norm
        loss_scale = result.loss_scale
        step += 1
        consumed += cfg.global_batch_size
        interval_steps += 1

        if step % cfg.log_interval == 0 or step == cfg.train_iters:
            sync()
            iter_time = (time.perf_counter() - interval_start - excluded) / interval_steps
            loss_mean = _reduce_mean(loss_sum, state) / interval_steps
            rates = throughput(iter_flops, tokens_per_iter, iter_time, ctx.world_size, peak)
            row = {
                "step": step,
                "loss": loss_mean,
                "lr": lr,
                "grad_norm": grad_norm,
                **rates,
                "peak_memory_bytes": peak_memory_bytes(device),
                "iter_time_s": iter_time,
                **{f"{k}_time_s": v for k, v in timers.means().items()},
                "consumed_samples": consumed,
                "skipped_iters": skipped_steps,
            }
            if loss_scale is not None:
                row["loss_scale"] = loss_scale
            bubble = ""
            if pipeline is not None:
                row.update(_pipeline_metrics(pipeline, state, interval_steps))
                bubble = f" | bubble {row['pipeline_bubble_fraction']:.1%}"
                pipeline.times.reset()
            metrics.write(row)
            mfu = f"{rates['mfu']:.1%}" if rates["mfu"] is not None else "n/a"
            skipped = f" | skipped {skipped_steps} (loss scale {loss_scale:g})" if skipped_steps else ""
            log(
                f"step {step}/{cfg.train_iters} | loss {loss_mean:.4f} | lr {lr:.3e} | grad_norm "
                f"{grad_norm:.3f} | {rates['tokens_per_s']:.0f} tok/s | "
                f"{rates['tflops_per_device']:.3f} TFLOP/s/device | mfu {mfu} | {iter_time * 1e3:.0f} ms/it"
                f"{bubble}{skipped}",
                flush=True,
            )
            loss_sum.zero_()
            interval_steps, interval_start, excluded = 0, time.perf_counter(), 0.0
            timers.reset()
            skipped_steps = 0

        paused = time.perf_counter()
        final = step == cfg.train_iters
        if valid_ds is not None and cfg.eval_interval and (step % cfg.eval_interval == 0 or final):
            last_eval = evaluate(ddp, valid_ds, cfg, state, device, pipeline, pipeline_loss)
            if pipeline is not None:
                pipeline.times.reset()  # the bubble figure is the training schedule's
            metrics.write({"step": step, "val_loss": last_eval})
            log(f"step {step} | validation loss {last_eval:.4f}", flush=True)
        if (cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0) or final:
            save(step)
        sync()
        excluded += time.perf_counter() - paused

    events.write({"event": "finished", "step": step})
    metrics.close()
    events.close()
    return {"step": step, "consumed_samples": consumed, "val_loss": last_eval}


def _pipeline_metrics(pipeline: PipelineSchedule, state: ParallelState, steps: int) -> dict[str, Any]:
    """Per-step compute and wait seconds averaged over the stages, and the bubble: wait / (wait + compute).

    Collective over the pipeline group; every stage's schedule ends on a common barrier, so each
    stage's wait + compute is the same makespan and the fraction compares with (p-1)/(m+p-1).
    """
    t = pipeline.times
    sums = torch.tensor([t.wait_s, t.compute_s, t.wait_s], dtype=torch.float64)
    if state.pp_group is not None:
        sums = sums.to(state.device)
        dist.all_reduce(sums[:2], group=state.pp_group)
        top = sums[2:].clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=state.pp_group)
        sums[2] = top[0]
    wait, compute, worst = (float(v) for v in sums.cpu())
    pp = state.pp_size
    return {
        "pipeline_bubble_fraction": wait / (wait + compute) if wait + compute > 0 else 0.0,
        "pipeline_wait_time_s": wait / pp / max(1, steps),
        "pipeline_compute_time_s": compute / pp / max(1, steps),
        "pipeline_max_stage_wait_time_s": worst / max(1, steps),
    }


def _set_threads(local_world_size: int) -> None:
    """Share this machine's cores among the local ranks instead of each grabbing them all."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // local_world_size))


def _init_distributed() -> Dist:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if not torch.cuda.is_available():
        _set_threads(local_world)
    if world_size <= 1:
        return Dist()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")
    return Dist(
        rank=dist.get_rank(),
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world,
        group=dist.group.WORLD,
    )


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatrain.engine.train", description=__doc__)
    parser.add_argument("--spec", required=True, help="job spec (YAML or JSON)")
    parser.add_argument("--out", required=True, help="run folder for metrics.jsonl, events.jsonl")
    parser.add_argument(
        "--checkpoint-url", default=None, help="file:// or s3:// root (default OUT/checkpoints)"
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        spec = load_spec(args.spec)
        check_layout(plan_layout(spec))
    except (SpecError, UnsupportedLayout, LayoutError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    ctx = _init_distributed()
    try:
        run(spec, Path(args.out), args.checkpoint_url, ctx)
    except UnsupportedLayout as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Terminated:
        print(f"rank {ctx.rank}: terminated (SIGTERM)", file=sys.stderr, flush=True)
        return EXIT_SIGTERM
    if ctx.group is not None:
        # gloo aborts a rank whose peer tears its connections down first: leave together.
        dist.barrier(group=ctx.group)
        dist.destroy_process_group()
        # Groups our parallel state still references would be freed during interpreter
        # finalization, where gloo's worker threads can abort a finished run (SIGABRT, "terminate
        # called without an active exception"; seen about once in 15 four-process runs under
        # pytest). Everything is written and flushed by now, so leave without finalizing.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
