"""Named RNG streams for tensor parallelism (Megatron's CUDA RNG tracker, for any device), no globals.

Two kinds of randomness exist under tensor parallelism:
  - the default generator, seeded the same on every tp rank: dropout on tensors that every tp rank
    holds whole (the hidden states without sequence parallelism) draws the same mask everywhere;
  - the tracker's "model-parallel" stream, seeded seed + 2718 + tp_rank: dropout on tensors that are
    split across tp ranks (attention heads, sequence shards) runs under `tracker.fork()` so each rank
    draws its own mask, as if one device had drawn one mask for the whole tensor.

`fork(name)` swaps the device's default generator state for the stream's, runs the block, stores the
advanced stream state and swaps the default one back, so the default stream never sees the draws.
Recompute: `checkpoint_context` is a torch.utils.checkpoint `context_fn` that snapshots every stream
when a checkpointed region starts and replays that snapshot while the region is recomputed (torch
already restores the default generator itself).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import noop_context_fn

from megatrain.engine.parallel.state import ParallelState

MODEL_PARALLEL = "model-parallel"
"""The stream that differs across tensor-parallel ranks."""
MODEL_PARALLEL_SEED_OFFSET = 2718
"""Megatron's offset: the model-parallel stream of tp rank r is seeded seed + 2718 + r."""


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


class RNGStatesTracker:
    """Named generator states for one device; `fork(name)` makes a stream the device's default."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: dict[str, int] = {}

    @classmethod
    def for_tensor_parallel(cls, seed: int, state: ParallelState) -> RNGStatesTracker:
        """A tracker with the model-parallel stream seeded seed + 2718 + tp_rank (Megatron's scheme).

        The default generator is not touched: seed it with the same `seed` on every tp rank
        (torch.manual_seed), or use `manual_seed` below, which does both.
        """
        tracker = cls(state.device)
        tracker.add(MODEL_PARALLEL, seed + MODEL_PARALLEL_SEED_OFFSET + state.tp_rank)
        return tracker

    @property
    def names(self) -> list[str]:
        return list(self._states)

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        if seed in self._seeds.values():
            # Two streams from one seed would draw identical masks: a silent correlation.
            raise ValueError(f"seed {seed} is already used by another RNG stream")
        # A fresh generator yields the seeded state without disturbing the default one.
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        self._states[name] = gen.get_state()
        self._seeds[name] = seed

    def get_states(self) -> dict[str, torch.Tensor]:
        """A snapshot (the state tensors are replaced, never mutated, so a shallow copy suffices)."""
        return dict(self._states)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = dict(states)

    def state_dict(self) -> dict[str, Any]:
        """For checkpoints: restoring it makes a resumed run draw the same masks."""
        return {"states": {k: v.clone() for k, v in self._states.items()}, "seeds": dict(self._seeds)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._states = {k: v.clone() for k, v in sd["states"].items()}
        self._seeds = dict(sd["seeds"])

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL) -> Iterator[None]:
        """Run the block with stream `name` as the device's default generator."""
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} was never added (have {self.names})")
        original = _get_state(self.device)
        _set_state(self._states[name], self.device)
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device)
            _set_state(original, self.device)

    def checkpoint_context(
        self,
    ) -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
        """A torch.utils.checkpoint `context_fn`: (forward context, recompute context).

        The forward context snapshots every stream as the checkpointed region starts; the recompute
        context replays that snapshot during the recompute and then puts back the streams as they
        were, so the recompute draws the first pass's masks and later forks are unaffected.
        """
        snapshot: dict[str, torch.Tensor] = {}

        @contextlib.contextmanager
        def forward() -> Iterator[None]:
            snapshot.update(self.get_states())
            yield

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            current = self.get_states()
            self.set_states({**current, **snapshot})
            try:
                yield
            finally:
                self.set_states(current)

        return forward(), recompute()


def manual_seed(seed: int, state: ParallelState) -> RNGStatesTracker:
    """Megatron's model_parallel_cuda_manual_seed: the default generator (CPU and every device)
    seeded `seed` on every rank, and a tracker whose model-parallel stream is per tp rank."""
    torch.manual_seed(seed)
    return RNGStatesTracker.for_tensor_parallel(seed, state)


def checkpoint(fn: Callable[..., Any], *args: Any, tracker: RNGStatesTracker | None = None) -> Any:
    """Non-reentrant torch.utils.checkpoint that also replays the tracker's streams in recompute."""
    context_fn = tracker.checkpoint_context if tracker is not None else noop_context_fn
    return torch_checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)


class TrackedDropout(nn.Module):
    """nn.Dropout that draws its mask from a tracker stream (for tensors split across tp ranks)."""

    def __init__(self, p: float, tracker: RNGStatesTracker, stream: str = MODEL_PARALLEL):
        super().__init__()
        self.p = p
        self.tracker = tracker
        self.stream = stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.tracker.fork(self.stream):
            return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}, stream={self.stream!r}"
