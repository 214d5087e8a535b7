"""This rank's part of a checkpoint as boxes of global (single-device) tensors.

A checkpoint holds every tensor under its single-device name and shape, whatever layout wrote it:
`model/{name}` (the weights, in the model's dtype), `optim/{param,exp_avg,exp_avg_sq}/{name}` (fp32 main
weights and Adam moments) and `rng/{rank}/...` (each rank's random streams). A rank holds boxes of
these tensors: an n-dimensional offset and a local tensor of the box's size (a view into its own
parameters or optimizer state, or a staged copy of one). torch.distributed.checkpoint writes each box
once (replicas are deduplicated) and, on load, reads whatever parts of the saved boxes overlap the
boxes this rank now holds: that is resharding, across tp, pp, dp and the distributed optimizer.

- A tensor-parallel shard is `stride` boxes along its partition dim (SwiGLU fc1's [gate_r; up_r] lies
  in two places of [gate; up]); anything else is one box at offset 0.
- An expert-parallel parameter (E/ep experts of the stacked (E, ...) weights) is moved along dim 0 to
  ep_rank·E/ep, after any tensor-parallel placement (experts are never tp-split along dim 0).
- The distributed optimizer owns a flat range [start, end) of a parameter's local shard: a range is
  cut into contiguous boxes (a partial row, whole rows, a partial row), each then placed like a shard.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from megatrain.engine.parallel.mappings import is_expert_parallel, is_tensor_parallel
from megatrain.engine.parallel.state import ParallelState

OPTIM_KEYS = ("param", "exp_avg", "exp_avg_sq")
VOCAB_PARAMS = ("embed.weight", "lm_head.weight")
"""Rows beyond the real vocabulary are padding whose count depends on the layout: these load across a
change of padded size (the rows both have are read; new rows keep their initial values)."""


@dataclass
class Box:
    offsets: tuple[int, ...]
    data: torch.Tensor
    """A tensor of the box's size: a view of live state (save source, load destination) or a copy."""


@dataclass
class Entry:
    """One global tensor: its single-device shape and the boxes of it this rank holds."""

    shape: tuple[int, ...]
    boxes: list[Box] = field(default_factory=list)
    write: bool = True
    """False for a copy another rank writes (a pipeline stage's copy of the tied embedding)."""


State = dict[str, Entry]


def flat_range_boxes(
    shape: tuple[int, ...], start: int, end: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements [start, end) of a row-major tensor of `shape` as contiguous boxes (offsets, sizes), in
    order: a partial leading row, whole rows, a partial trailing row (recursively in each row)."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def within(row: int, lo: int, hi: int) -> None:
        for off, size in flat_range_boxes(shape[1:], lo, hi):
            out.append(((row, *off), (1, *size)))

    row = start // inner
    if start % inner:
        hi = min(end, (row + 1) * inner)
        within(row, start % inner, hi - row * inner)
        row += 1
    full_end = end // inner
    if full_end > row:
        out.append(((row,) + (0,) * (len(shape) - 1), (full_end - row, *shape[1:])))
        row = full_end
    if end > row * inner and row * inner >= start:
        within(row, 0, end - row * inner)
    return out


def _tp_parts(p: torch.Tensor, state: ParallelState) -> tuple[int, list[tuple[int, int, int]]]:
    """(dim, [(local start, length, global start)]) of a tensor-parallel shard along its dim."""
    dim, stride = p.partition_dim, p.partition_stride  # type: ignore[attr-defined]
    local = p.shape[dim]
    length = local // stride
    tp, r = state.tp_size, state.tp_rank
    return dim, [(j * length, length, (j * tp + r) * length) for j in range(stride)]


def global_shape(p: nn.Parameter, state: ParallelState) -> tuple[int, ...]:
    shape = list(p.shape)
    if is_tensor_parallel(p) and state.tp_size > 1:
        shape[p.partition_dim] *= state.tp_size  # type: ignore[attr-defined]
    if _expert_split(p, state):
        shape[0] *= state.ep_size
    return tuple(shape)


def _expert_split(p: nn.Parameter, state: ParallelState) -> bool:
    if not (is_expert_parallel(p) and state.ep_size > 1):
        return False
    if is_tensor_parallel(p) and state.tp_size > 1 and p.partition_dim == 0:  # type: ignore[attr-defined]
        raise ValueError("an expert-parallel parameter cannot also be tensor-parallel along dim 0")
    return True


def place(
    p: nn.Parameter, local_offsets: tuple[int, ...], data: torch.Tensor, state: ParallelState
) -> Iterator[Box]:
    """A box of p's local shard in global coordinates: cut where it crosses the shard's stride parts,
    and moved to this ep rank's experts."""
    if not _expert_split(p, state):
        yield from _place_tp(p, local_offsets, data, state)
        return
    first = state.ep_rank * p.shape[0]  # the global index of this rank's first expert
    for box in _place_tp(p, local_offsets, data, state):
        yield Box((box.offsets[0] + first, *box.offsets[1:]), box.data)


def _place_tp(
    p: nn.Parameter, local_offsets: tuple[int, ...], data: torch.Tensor, state: ParallelState
) -> Iterator[Box]:
    if not (is_tensor_parallel(p) and state.tp_size > 1):
        yield Box(tuple(local_offsets), data)
        return
    dim, parts = _tp_parts(p, state)
    lo, hi = local_offsets[dim], local_offsets[dim] + data.shape[dim]
    for start, length, g in parts:
        a, b = max(lo, start), min(hi, start + length)
        if a < b:
            offsets = list(local_offsets)
            offsets[dim] = g + (a - start)
            yield Box(tuple(offsets), data.narrow(dim, a - lo, b - a))


def param_boxes(p: nn.Parameter, data: torch.Tensor, state: ParallelState) -> list[Box]:
    """The whole local shard `data` (p's shape) as boxes of the global tensor."""
    return list(place(p, (0,) * p.dim(), data, state))


def slice_boxes(p: nn.Parameter, start: int, flat: torch.Tensor, state: ParallelState) -> list[Box]:
    """Flat elements [start, start + len(flat)) of p's local shard, held in `flat`, as global boxes."""
    out: list[Box] = []
    shape = tuple(p.shape)
    for offsets, sizes in flat_range_boxes(shape, start, start + flat.numel()):
        lo = _flat_index(shape, offsets) - start
        out.extend(place(p, offsets, flat[lo : lo + math.prod(sizes)].view(sizes), state))
    return out


def _flat_index(shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    index = 0
    for size, off in zip(shape, offsets, strict=True):
        index = index * size + off
    return index


def rng_entries(rank: int, tracker_state: dict | None) -> State:
    """This rank's random streams as tensors (never pickled): torch's (and CUDA's) generator states,
    Python's Mersenne twister and the tensor-parallel tracker's streams with their seeds."""
    version, mt, gauss = random.getstate()
    py = torch.tensor([version, *mt, 0 if gauss is None else 1], dtype=torch.int64)
    tensors: dict[str, torch.Tensor] = {"torch": torch.get_rng_state(), "python": py}
    if gauss is not None:
        tensors["python_gauss"] = torch.tensor([gauss], dtype=torch.float64)
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda/{i}"] = s
    if tracker_state is not None:
        for name, s in tracker_state["states"].items():
            tensors[f"tracker/{name}"] = s
            tensors[f"tracker_seed/{name}"] = torch.tensor([tracker_state["seeds"][name]], dtype=torch.int64)
    return {
        f"rng/{rank}/{k}": Entry(tuple(t.shape), [Box((0,) * t.dim(), t.clone())]) for k, t in tensors.items()
    }


def restore_rng(tensors: dict[str, torch.Tensor]) -> dict | None:
    """Set the generators from rng_entries' tensors (keys without the rng/{rank}/ prefix); returns the
    tracker's state dict (None if there was none) for the caller's tracker."""
    torch.set_rng_state(tensors["torch"])
    py = tensors["python"].tolist()
    gauss = float(tensors["python_gauss"][0]) if py[-1] else None
    random.setstate((int(py[0]), tuple(int(v) for v in py[1:-1]), gauss))
    cuda = sorted((k for k in tensors if k.startswith("cuda/")), key=lambda k: int(k.split("/")[1]))
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    names = [k.split("/", 1)[1] for k in tensors if k.startswith("tracker/")]
    if not names:
        return None
    return {
        "states": {n: tensors[f"tracker/{n}"] for n in names},
        "seeds": {n: int(tensors[f"tracker_seed/{n}"][0]) for n in names},
    }
