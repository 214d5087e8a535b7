"""A run's whole training state across tensor, pipeline and data parallelism, in and out of
checkpoints (megatrain.engine.checkpoint writes and reads the files).

Saving is collective: every rank helps gather the full single-device weights and the optimizer's
full state under canonical names (over dp, then tp, then the pipeline stages), and global rank 0
writes. Resuming scatters them back to whatever layout runs now, so a checkpoint written by one
layout resumes under any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatrain.engine.build import Trainable
from megatrain.engine.checkpoint import (
    SavedCheckpoint,
    read_checkpoint,
    rng_state,
    set_rng_state,
    write_checkpoint,
)
from megatrain.engine.config import TransformerConfig
from megatrain.engine.optimizer import MixedPrecisionOptimizer
from megatrain.engine.parallel.mappings import gather_shards, is_tensor_parallel, shard_tensor
from megatrain.engine.parallel.parallelize import full_state_dict
from megatrain.engine.parallel.pipeline import gather_to_rank0, pipeline_full_state_dict
from megatrain.engine.parallel.random import RNGStatesTracker
from megatrain.engine.parallel.state import ParallelState
from megatrain.spec import JobSpec


@dataclass(frozen=True)
class Progress:
    """Where training stands: optimizer steps taken and samples consumed (the data position)."""

    step: int = 0
    consumed_samples: int = 0


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
    if state.layout.world_size == 1:
        return [mine]
    gathered: list[Any] = [None] * state.layout.world_size if state.rank == 0 else []
    dist.gather_object(mine, gathered if state.rank == 0 else None, dst=0)
    return gathered if state.rank == 0 else None


def save_training_state(
    url: str,
    progress: Progress,
    train: Trainable,
    mcfg: TransformerConfig,
    spec: JobSpec,
    train_iters: int,
) -> SavedCheckpoint | None:
    """Write iter_{step} (collective); the SavedCheckpoint on global rank 0, None elsewhere."""
    state, model = train.model.state, train.model
    if model.chunks:
        weights = pipeline_full_state_dict(model.chunks, state)
    else:
        weights = full_state_dict(model.module, state)
    optim = gather_optimizer_state(train.optimizer, train.names, state)
    rngs = _all_rng_states(model.tracker, state)
    if state.rank != 0:
        return None
    return write_checkpoint(
        url,
        progress.step,
        weights,
        mcfg,
        {"optimizer": optim, "rng_per_rank": rngs, "layout": state.layout.as_dict()},
        {"consumed_samples": progress.consumed_samples, "train_iters": train_iters},
        spec,
    )


def resume_training_state(url: str, step: int, train: Trainable) -> Progress:
    """Load iter_{step} into this rank's shards, optimizer and RNG streams, whatever layout wrote it."""
    state, model = train.model.state, train.model
    model_state, extra, trainer_state = read_checkpoint(url, step)
    if "params" in extra.get("optimizer", {}):
        scatter_optimizer_state(train.optimizer, extra["optimizer"], train.names, state)
    else:  # a checkpoint from before the parallel engine: weights only, fresh optimizer moments
        model.load_full_weights(model_state)
    rngs = extra.get("rng_per_rank")
    # RNG streams are per rank: they carry over only when the world has the same size.
    if rngs is not None and len(rngs) == state.layout.world_size:
        set_rng_state(rngs[state.rank]["default"])
        if model.tracker is not None and rngs[state.rank]["tracker"] is not None:
            model.tracker.load_state_dict(rngs[state.rank]["tracker"])
    return Progress(trainer_state["step"], trainer_state["consumed_samples"])
