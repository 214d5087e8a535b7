"""`python -m megatrain.engine.train --spec SPEC --out DIR [--checkpoint-url URL]`: the torchrun entry point.

Runs as one process, or as N ranks under `torchrun --nproc-per-node N` (gloo on CPU, nccl on CUDA).
Only pure data parallelism (tp = pp = cp = 1, torch DDP) exists so far. Rank 0 writes
DIR/metrics.jsonl and DIR/events.jsonl (one flushed JSON object per line) and checkpoints; every
rank resumes from the latest complete checkpoint when one exists.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from megatrain.engine.checkpoint import (
    find_latest,
    load_weights_into,
    resolve_init_from,
    restore_training_state,
    save_checkpoint,
)
from megatrain.engine.config import TrainConfig, train_config, transformer_config
from megatrain.engine.data import build_datasets, build_tokenizer, microbatch_sample_ids
from megatrain.engine.data.dataset import BlendedDataset
from megatrain.engine.metrics import flops_per_iteration, peak_memory_bytes, peak_tflops, throughput
from megatrain.engine.models.gpt import GPTModel, lm_loss
from megatrain.scheduler.planner import Layout, plan_layout
from megatrain.settings import get_settings
from megatrain.spec import JobSpec, SpecError, load_spec

EXIT_USAGE = 2
EXIT_SIGTERM = 128 + signal.SIGTERM


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


def build_optimizer(model: GPTModel, cfg: TrainConfig, device: str) -> torch.optim.Optimizer:
    """AdamW; as in Megatron, 1-D parameters (biases, norm weights) get no weight decay."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    impl = {"fused": True} if device.startswith("cuda") else {"foreach": True}
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, **impl
    )


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def autocast_dtype(precision: str, device: str) -> torch.dtype | None:
    """The autocast dtype, or None for plain fp32.

    On CPUs without native bf16 (no AVX512-BF16/AMX) autocast emulates it and measured ~25×
    slower than fp32 on this project's 2-core AVX2 machine, so there bf16 falls back to fp32.
    """
    if precision != "bf16":
        return None
    if device.startswith("cuda") or cpu_has_native_bf16():
        return torch.bfloat16
    return None


def check_layout(layout: Layout) -> None:
    if layout.tp > 1 or layout.pp > 1 or layout.cp > 1 or layout.ep > 1:
        raise UnsupportedLayout(
            f"layout tp={layout.tp} pp={layout.pp} cp={layout.cp} ep={layout.ep} needs tensor/pipeline/"
            "context/expert parallelism, which arrives with the parallel engine; this engine runs "
            "data parallelism only (tp=pp=cp=ep=1)"
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


def _reduce_mean(value: torch.Tensor, ctx: Dist) -> float:
    if ctx.group is not None:
        value = value.clone()
        dist.all_reduce(value, group=ctx.group)
        value /= ctx.world_size
    return float(value.item())


def _batch(dataset: BlendedDataset, ids: list[int], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.from_numpy(dataset.batch(ids)).to(device, non_blocking=True)  # (B, T+1)
    return tokens[:, :-1], tokens[:, 1:]


@torch.no_grad()
def evaluate(
    model: GPTModel,
    dataset: BlendedDataset,
    cfg: TrainConfig,
    ctx: Dist,
    device: str,
    dtype: torch.dtype | None,
) -> float:
    """Mean loss over the first eval_iters global batches of the split (the same ones every time)."""
    model.eval()
    total = torch.zeros((), device=device)
    count = 0
    for it in range(cfg.eval_iters):
        for ids in microbatch_sample_ids(
            it * cfg.global_batch_size, cfg.global_batch_size, cfg.micro_batch_size, ctx.rank, ctx.world_size
        ):
            x, y = _batch(dataset, ids, device)
            with torch.autocast(
                device.split(":")[0], dtype=dtype or torch.float32, enabled=dtype is not None
            ):
                total += lm_loss(model(x), y)
            count += 1
    model.train()
    return _reduce_mean(total / count, ctx)


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
    cfg = train_config(spec, layout.dp)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_url = checkpoint_url or (out_dir / "checkpoints").resolve().as_uri()
    device = f"cuda:{ctx.local_rank}" if torch.cuda.is_available() else "cpu"
    dtype = autocast_dtype(cfg.precision, device)
    effective_precision = "bf16" if dtype is torch.bfloat16 else "fp32"
    log = print if ctx.is_main else (lambda *a, **k: None)
    if effective_precision != cfg.precision:
        log(f"precision {cfg.precision} requested; this CPU has no native bf16, so running fp32", flush=True)

    tokenizer = build_tokenizer(spec.data.tokenizer)
    mcfg = transformer_config(spec, tokenizer.vocab_size)
    datasets = build_datasets(spec.data, tokenizer, mcfg.seq_length, cfg.seed)
    train_ds, valid_ds = datasets["train"], datasets["valid"]
    assert train_ds is not None

    # Same seed on every rank: identical init (DDP also broadcasts rank 0's) and dropout streams.
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    model = GPTModel(mcfg).to(device)
    model.set_recompute(cfg.recompute)
    optimizer = build_optimizer(model, cfg, device)

    step, consumed, resumed_from = 0, 0, None
    latest = find_latest(ckpt_url)
    if latest is not None:
        state = restore_training_state(ckpt_url, latest, model, optimizer)
        step, consumed, resumed_from = state["step"], state["consumed_samples"], state["step"]
        log(f"resumed from {ckpt_url} step {step}", flush=True)
    elif spec.model.init_from:
        src = resolve_init_from(spec.model.init_from, get_settings().resolved_storage_url)
        log(f"initialised from {src} (step {load_weights_into(model, src)})", flush=True)

    ddp_model: torch.nn.Module = model
    if ctx.group is not None:
        ddp_model = DistributedDataParallel(
            model, device_ids=[ctx.local_rank] if device.startswith("cuda") else None, process_group=ctx.group
        )

    metrics = JsonlLog(out_dir / "metrics.jsonl", ctx.is_main)
    events = JsonlLog(out_dir / "events.jsonl", ctx.is_main)
    device_name = torch.cuda.get_device_name(device) if device.startswith("cuda") else None
    num_params = model.num_parameters()
    events.write(
        {
            "event": "started",
            "step": step,
            "num_params": num_params,
            "world_size": ctx.world_size,
            "layout": layout.as_dict(),
            "device": device_name or "cpu",
            "precision": effective_precision,
            "resumed_from": resumed_from,
        }
    )
    log(
        f"model {num_params / 1e6:.2f}M params | layout {layout.as_dict()} | device {device_name or 'cpu'} "
        f"| {cfg.grad_accum_steps} micro-batches of {cfg.micro_batch_size} per rank per step",
        flush=True,
    )

    iter_flops = flops_per_iteration(mcfg, cfg.global_batch_size)
    peak = peak_tflops(device_name, effective_precision, get_settings().cpu_peak_tflops)
    tokens_per_iter = cfg.global_batch_size * cfg.seq_length
    device_type = device.split(":")[0]
    last_eval: float | None = None

    def sync() -> None:
        if device_type == "cuda":
            torch.cuda.synchronize(device)

    def save(at: int) -> None:
        if ctx.is_main:
            saved = save_checkpoint(
                ckpt_url,
                at,
                model,
                optimizer,
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
    grad_norm = torch.zeros(())
    while step < cfg.train_iters:
        lr = lr_at(step + 1, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro_ids = microbatch_sample_ids(
            consumed, cfg.global_batch_size, cfg.micro_batch_size, ctx.rank, ctx.world_size
        )
        for m, ids in enumerate(micro_ids):
            x, y = _batch(train_ds, ids, device)
            # Gradients are all-reduced only with the last micro-batch's backward.
            no_sync = ctx.group is not None and m < len(micro_ids) - 1
            with ddp_model.no_sync() if no_sync else contextlib.nullcontext():  # type: ignore[operator]
                with torch.autocast(device_type, dtype=dtype or torch.float32, enabled=dtype is not None):
                    loss = lm_loss(ddp_model(x), y) / len(micro_ids)
                loss.backward()
            loss_sum += loss.detach()
        max_norm = cfg.clip_grad if cfg.clip_grad > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        consumed += cfg.global_batch_size
        interval_steps += 1

        if step % cfg.log_interval == 0 or step == cfg.train_iters:
            sync()
            iter_time = (time.perf_counter() - interval_start - excluded) / interval_steps
            loss_mean = _reduce_mean(loss_sum, ctx) / interval_steps
            rates = throughput(iter_flops, tokens_per_iter, iter_time, ctx.world_size, peak)
            row = {
                "step": step,
                "loss": loss_mean,
                "lr": lr,
                "grad_norm": float(grad_norm),
                **rates,
                "peak_memory_bytes": peak_memory_bytes(device),
                "iter_time_s": iter_time,
                "consumed_samples": consumed,
            }
            metrics.write(row)
            mfu = f"{rates['mfu']:.1%}" if rates["mfu"] is not None else "n/a"
            log(
                f"step {step}/{cfg.train_iters} | loss {loss_mean:.4f} | lr {lr:.3e} | grad_norm "
                f"{float(grad_norm):.3f} | {rates['tokens_per_s']:.0f} tok/s | "
                f"{rates['tflops_per_device']:.3f} TFLOP/s/device | mfu {mfu} | {iter_time * 1e3:.0f} ms/it",
                flush=True,
            )
            loss_sum.zero_()
            interval_steps, interval_start, excluded = 0, time.perf_counter(), 0.0

        paused = time.perf_counter()
        final = step == cfg.train_iters
        if valid_ds is not None and cfg.eval_interval and (step % cfg.eval_interval == 0 or final):
            last_eval = evaluate(model, valid_ds, cfg, ctx, device, dtype)
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
    except (SpecError, UnsupportedLayout, OSError) as exc:
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
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
