"""Pipeline test pieces: 4-layer tiny models, a plain-torch one-process reference, and the rank worker
that runs a (tp × dp × pp) layout with the engine's pipeline, DataParallel and optimizer.

AdamW runs with eps 1e-6 (see test_tensor_parallel: GPT-2's key bias has an exactly-zero true
gradient whose rounding noise eps 1e-8 would turn into layout-dependent steps).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatrain.engine.models.gpt import GPTModel, lm_loss
from megatrain.engine.optimizer import DynamicLossScaler, MixedPrecisionOptimizer
from megatrain.engine.parallel.data import DataParallel
from megatrain.engine.parallel.mappings import allreduce_sequence_parallel_grads
from megatrain.engine.parallel.parallelize import parallel_lm_loss, parallelize_model
from megatrain.engine.parallel.pipeline import (
    allreduce_tied_embedding_grads,
    build_stage_modules,
    pipeline_full_state_dict,
)
from megatrain.engine.parallel.random import RNGStatesTracker
from megatrain.engine.parallel.schedules import PipelineSchedule, pipeline_loss
from megatrain.engine.parallel.state import ParallelState
from megatrain.plan.layout import Layout

from ._dp_common import GPT2_TINY, LLAMA_TINY

MODELS = {"gpt2": replace(GPT2_TINY, num_layers=4), "llama": replace(LLAMA_TINY, num_layers=4)}

DEFAULTS: dict[str, Any] = {
    "model": "llama",
    "layers": 4,
    "seed": 1234,
    "steps": 6,
    "global_batch": 8,
    "micro_batch": 2,
    "lr": 1e-2,
    "weight_decay": 0.1,
    "clip_grad": 0.5,  # active in the early steps: the global norm must be right across stages
    "eps": 1e-6,
    "tp": 1,
    "dp": 1,
    "pp": 2,
    "virtual_stages": 1,
    "sequence_parallel": False,
    "schedule": "1f1b",
    "layer_split": None,
    "distributed_optimizer": False,
    "bucket_elements": 3000,
    "loss_scale": None,
}


def options(**overrides: Any) -> dict[str, Any]:
    unknown = set(overrides) - set(DEFAULTS)
    assert not unknown, unknown
    return {**DEFAULTS, **overrides}


def model_config(opts: dict[str, Any]) -> Any:
    return replace(MODELS[opts["model"]], num_layers=opts["layers"])


def make_batch(opts: dict[str, Any], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = MODELS[opts["model"]]
    g = torch.Generator().manual_seed(opts["seed"] * 1000 + step)
    tokens = torch.randint(0, cfg.vocab_size, (opts["global_batch"], cfg.seq_length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def lr_at(opts: dict[str, Any], step: int) -> float:
    return opts["lr"] * (step + 1) / opts["steps"]


def reference_run(opts: dict[str, Any]) -> dict[str, Any]:
    """One process, the full batch, torch's AdamW and clip_grad_norm_."""
    torch.manual_seed(opts["seed"])
    model = GPTModel(model_config(opts))
    params = list(model.parameters())
    adam = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": opts["weight_decay"]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=opts["lr"],
        eps=opts["eps"],
        foreach=True,
    )
    losses, norms = [], []
    for step in range(opts["steps"]):
        x, y = make_batch(opts, step)
        adam.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, opts["clip_grad"])))
        for group in adam.param_groups:
            group["lr"] = lr_at(opts, step)
        adam.step()
        losses.append(loss.item())
    state = {
        n: t.detach().clone()
        for n, t in model.state_dict().items()
        if n != "lm_head.weight" or not model.config.tie_embeddings
    }
    return {"losses": losses, "norms": norms, "params": state}


def pp_worker(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """One rank of a pipelined run; rank 0 returns losses, grad norms and the gathered weights."""
    dims = Layout(
        tp=opts["tp"],
        dp=opts["dp"],
        pp=opts["pp"],
        sequence_parallel=opts["sequence_parallel"],
        virtual_stages=opts["virtual_stages"],
        pipeline_schedule=opts["schedule"],
        pipeline_layers=opts["layer_split"],
    )
    state = ParallelState.build(dims)
    cfg = model_config(opts)
    torch.manual_seed(opts["seed"])
    model = GPTModel(cfg)
    tracker = RNGStatesTracker.for_tensor_parallel(opts["seed"], state) if dims.tp > 1 else None
    model = parallelize_model(model, state, rng_tracker=tracker)
    chunks = build_stage_modules(model, state)
    del model
    wrapper = nn.ModuleList(chunks)
    ddp = DataParallel(
        wrapper,
        state,
        bucket_elements=opts["bucket_elements"],
        use_distributed_optimizer=opts["distributed_optimizer"],
    )
    scaler = DynamicLossScaler(initial_scale=opts["loss_scale"]) if opts["loss_scale"] else None
    opt = MixedPrecisionOptimizer(
        ddp,
        lr=opts["lr"],
        weight_decay=opts["weight_decay"],
        betas=(0.9, 0.999),
        eps=opts["eps"],
        clip_grad=opts["clip_grad"],
        loss_scaler=scaler,
    )
    mb = opts["micro_batch"]
    seq = cfg.seq_length // (dims.tp if dims.sequence_parallel else 1)
    sched = PipelineSchedule(chunks, state, (mb, seq, cfg.hidden_size), torch.float32, opts["schedule"])
    per_rank = opts["global_batch"] // dims.dp
    n_micro = per_rank // mb
    losses, norms, scales = [], [], []
    for step in range(opts["steps"]):
        x, y = make_batch(opts, step)
        lo = state.dp_rank * per_rank
        batches = [
            (x[lo + i * mb : lo + (i + 1) * mb], y[lo + i * mb : lo + (i + 1) * mb]) for i in range(n_micro)
        ]
        opt.zero_grad()
        total = sched.forward_backward(
            batches,
            lambda logits, mb: parallel_lm_loss(logits, mb.labels, state) / n_micro,
            scale_loss=opt.scale_loss,
            before_backward=lambda last: setattr(ddp, "is_last_microbatch", last),
        )
        ddp.finish_grad_sync()
        allreduce_tied_embedding_grads(chunks, ddp, state)
        allreduce_sequence_parallel_grads(wrapper, state)
        opt.set_lr(lr_at(opts, step))
        result = opt.step()
        loss = pipeline_loss(total, state)
        if state.dp_group is not None:
            dist.all_reduce(loss, group=state.dp_group)
        losses.append(float(loss) / dims.dp)
        norms.append(result.grad_norm)
        scales.append(result.loss_scale)
    weights = pipeline_full_state_dict(chunks, state)
    times = sched.times
    return {
        "losses": losses,
        "norms": norms,
        "scales": scales,
        "params": weights,
        "bubble": times.bubble_fraction,
        "wait_s": times.wait_s,
        "compute_s": times.compute_s,
    }
