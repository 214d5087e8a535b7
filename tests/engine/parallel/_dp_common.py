"""Shared pieces of the data-parallel and optimizer tests: tiny models, data, a plain-torch reference
run on the full batch, and the per-rank DataParallel + MixedPrecisionOptimizer run it is compared with.

Everything a rank needs is rebuilt from plain options (model kind, seed), so workers spawn cleanly.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatrain.engine.config import TransformerConfig
from megatrain.engine.models.gpt import GPTModel, lm_loss
from megatrain.engine.optimizer import DynamicLossScaler, MixedPrecisionOptimizer
from megatrain.engine.parallel.data import DataParallel
from megatrain.engine.parallel.state import ParallelState
from megatrain.plan.layout import Layout

# GPT-2 flavour: learned positions, LayerNorm with biases (1-D params without weight decay) and a
# tied embedding (one Parameter used by the embedding and the LM head). ~21.8k parameters.
GPT2_TINY = TransformerConfig.preset("tiny-gpt2")
# Llama flavour: RoPE, RMSNorm, SwiGLU, GQA, no biases, untied head.
LLAMA_TINY = TransformerConfig.preset("tiny-llama")

DEFAULTS: dict[str, Any] = {
    "model": "gpt2",
    "seed": 1234,
    "steps": 10,
    "global_batch": 8,
    "micro_batch": 2,
    "lr": 1e-2,
    "weight_decay": 0.1,
    "clip_grad": 0.5,  # small enough that clipping is active in the early steps
    "betas": (0.9, 0.95),
    "eps": 1e-8,
    "bucket_elements": 3000,  # ~8 buckets for the tiny GPT: overlap and many collectives exercised
    "overlap": True,
    "distributed_optimizer": False,
    "dtype": "float32",
}


def options(**overrides: Any) -> dict[str, Any]:
    unknown = set(overrides) - set(DEFAULTS) - {"fp16", "inject_inf", "record", "tp", "save_at", "load"}
    assert not unknown, unknown
    return {**DEFAULTS, **overrides}


def make_model(kind: str, seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    if kind in ("gpt2", "llama"):
        model: nn.Module = GPTModel(GPT2_TINY if kind == "gpt2" else LLAMA_TINY)
    elif kind == "odd":
        # Odd sizes so that dp shards cut through parameters.
        model = nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Tanh(), nn.Linear(13, 5))
    else:
        raise ValueError(kind)
    return model.to(dtype)


def make_batch(kind: str, step: int, seed: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one step, the same on every rank and in the reference."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    if kind in ("gpt2", "llama"):
        tokens = torch.randint(0, GPT2_TINY.vocab_size, (batch, GPT2_TINY.seq_length + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    x = torch.randn(batch, 7, generator=g)
    return x, torch.randn(batch, 5, generator=g)


def loss_fn(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y) if kind == "odd" else lm_loss(out, y)


def lr_at(opts: dict[str, Any], step: int) -> float:
    """A changing lr (linear warm-up over the run) so set_lr is exercised."""
    return opts["lr"] * (step + 1) / opts["steps"]


def named_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def reference_run(opts: dict[str, Any], skip: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Plain torch on one process: the full global batch, AdamW and clip_grad_norm_, fp32.

    Steps in `skip` compute the loss and norm but leave the parameters alone (a skipped fp16 step).
    """
    kind = opts["model"]
    model = make_model(kind, opts["seed"])
    params = list(model.parameters())
    adam = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": opts["weight_decay"]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=opts["lr"],
        betas=opts["betas"],
        eps=opts["eps"],
        foreach=True,
    )
    losses, norms = [], []
    for step in range(opts["steps"]):
        x, y = make_batch(kind, step, opts["seed"], opts["global_batch"])
        adam.zero_grad()
        loss = loss_fn(kind, model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, opts["clip_grad"])))
        for group in adam.param_groups:
            group["lr"] = lr_at(opts, step)
        if step not in skip:
            adam.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": named_params(model)}


def build(
    opts: dict[str, Any], state: ParallelState
) -> tuple[nn.Module, DataParallel, MixedPrecisionOptimizer]:
    model = make_model(opts["model"], opts["seed"], getattr(torch, opts["dtype"]))
    ddp = DataParallel(
        model,
        state,
        bucket_elements=opts["bucket_elements"],
        overlap_grad_reduce=opts["overlap"],
        use_distributed_optimizer=opts["distributed_optimizer"],
    )
    scaler = None
    if opts.get("fp16"):
        scaler = DynamicLossScaler(**opts["fp16"])
    opt = MixedPrecisionOptimizer(
        ddp,
        lr=opts["lr"],
        weight_decay=opts["weight_decay"],
        betas=opts["betas"],
        eps=opts["eps"],
        clip_grad=opts["clip_grad"],
        loss_scaler=scaler,
    )
    return model, ddp, opt


def train_steps(
    opts: dict[str, Any],
    model: nn.Module,
    ddp: DataParallel,
    opt: MixedPrecisionOptimizer,
    steps: range,
    *,
    on_microbatch_start: Any = None,
) -> dict[str, Any]:
    """The training loop the engine runs: micro-batches with no_sync, finish_grad_sync, set_lr, step."""
    kind = opts["model"]
    dp_size, dp_rank = ddp.dp_size, ddp.dp_rank
    per_rank = opts["global_batch"] // dp_size
    n_micro = per_rank // opts["micro_batch"]
    losses, results = [], []
    for step in steps:
        x, y = make_batch(kind, step, opts["seed"], opts["global_batch"])
        x, y = (
            x[dp_rank * per_rank : (dp_rank + 1) * per_rank],
            y[dp_rank * per_rank : (dp_rank + 1) * per_rank],
        )
        opt.zero_grad()
        total = torch.zeros(())
        for i in range(n_micro):
            if on_microbatch_start is not None:
                on_microbatch_start(step, i, n_micro)
            mb = slice(i * opts["micro_batch"], (i + 1) * opts["micro_batch"])
            xm = x[mb] if kind != "odd" else x[mb].to(getattr(torch, opts["dtype"]))
            with ddp.no_sync() if i < n_micro - 1 else nullcontext():
                loss = loss_fn(kind, ddp(xm), y[mb]) / n_micro
                opt.scale_loss(loss).backward()
            total += loss.detach().float()
        ddp.finish_grad_sync()
        opt.set_lr(lr_at(opts, step))
        results.append(opt.step())
        if ddp.dp_group is not None:
            dist.all_reduce(total, group=ddp.dp_group)
        losses.append(float(total) / dp_size)
    return {"losses": losses, "results": results}


def dp_worker(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """One rank of a pure data-parallel run; returns losses, step results, final params, hook events."""
    state = ParallelState.build(Layout(dp=world_size))
    model, ddp, opt = build(opts, state)
    events: list[tuple[str, int, int]] = []
    if opts.get("record"):
        # Record, for the synchronised (last) micro-batch, when each bucket's collective starts and
        # when each parameter's gradient arrives. These hooks run after DataParallel's own.
        launch = ddp._launch

        def recording_launch(bucket: Any) -> None:
            events.append(("launch", bucket.index, len(events)))
            launch(bucket)

        ddp._launch = recording_launch  # type: ignore[method-assign]
        for i, p in enumerate(ddp.params):
            p.register_post_accumulate_grad_hook(
                lambda _p, i=i: events.append(("grad", i, len(events))) if ddp.is_last_microbatch else None
            )
    out = train_steps(opts, model, ddp, opt, range(opts["steps"]))
    layout = [(b.start, b.end, len(b.params)) for b in ddp.buckets]
    straddling = sum(not sl.whole for sl in ddp.owned_slices())
    return {
        **out,
        "params": named_params(model),
        "events": events,
        "layout": layout,
        "straddling": straddling,
    }
