"""Initial weights as a pure function of (seed, parameter name, element index).

A rank that keeps a slice of a parameter draws that slice alone and gets exactly the values one
process building the whole model would hold there, whatever the layout: nothing is drawn from a
stream shared across parameters, so no rank has to generate (or hold) what it does not keep.

A parameter of shape (n0, ..., nk) is seen as rows of its last dimension (its leading dimensions
flattened; a vector is a column). Rows are grouped in blocks of about BLOCK_ELEMENTS values (the
row count per block fixed by the row length, the last block holding what is left: all fixed by the
parameter's shape, never by a layout), and each block is drawn whole, in fp32 on the CPU,
from a generator seeded by a hash of (seed, name, block index): a slice costs the blocks it touches,
and a rank holds one block beyond its shard. Column-parallel shards (rows) touch only their own
blocks; row-parallel shards (columns) touch every block of the parameter and keep their columns.
The draw is the same on every device (generated on the CPU, then copied), so a GPU run starts from
the weights a CPU test checks.

The distribution per name is GPTModel's (Megatron's): normal(0, std) for weights and embeddings,
normal(0, std/sqrt(2·layers)) for the projections into the residual stream (attn.proj, mlp.fc2, the
experts' and shared expert's fc2), ones for norm weights, zeros for biases.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterator

import torch

from megatrain.engine.config import TransformerConfig

BLOCK_ELEMENTS = 1 << 20
"""About 4 MiB of fp32 per block: the bounded chunk a rank holds beyond its shard while drawing."""

SCALED = ("attn.proj.weight", "mlp.fc2.weight", "shared_expert.fc2.weight", "experts.fc2_weight")
"""Weights that write into the residual stream: drawn with std/sqrt(2·layers)."""


def draw_base_seed() -> int:
    """One draw from torch's global CPU generator: `torch.manual_seed(s)` then building the model
    (whole, or any rank's shards) gives the same weights."""
    return int(torch.randint(0, 2**62, (1,), device="cpu", generator=torch.default_generator))


def init_rule(name: str, cfg: TransformerConfig) -> tuple[str, float]:
    """("normal", std) | ("ones", 0) | ("zeros", 0) for a canonical (single-device) parameter name
    (LoRA adapters' rules are engine.lora.lora_init_rule's)."""
    if name.endswith("norm.weight"):
        return "ones", 0.0
    if name.endswith(("bias", "norm.bias")):
        return "zeros", 0.0
    std = cfg.init_method_std
    if name.endswith(SCALED):
        return "normal", std / math.sqrt(2.0 * cfg.num_layers)
    return "normal", std


def rows_per_block(row_length: int) -> int:
    return max(1, BLOCK_ELEMENTS // max(1, row_length))


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@torch.no_grad()
def fill_box(
    out: torch.Tensor,
    *,
    seed: int,
    name: str,
    shape: tuple[int, ...],
    offsets: tuple[int, ...],
    rule: tuple[str, float],
) -> None:
    """Fill `out`, the box of the full parameter `name` (of `shape`) starting at `offsets`, with its
    initial values (any dtype and device; a box of a box is the same values)."""
    kind, std = rule
    if kind == "ones":
        out.fill_(1.0)
        return
    if kind == "zeros":
        out.zero_()
        return
    if kind not in ("normal", "uniform"):
        raise ValueError(f"{name}: unknown initialisation rule {kind!r}")
    if len(shape) == 0:
        raise ValueError(f"{name}: a scalar parameter has no initialisation rule")
    for dest, first, col in box_row_runs(shape, offsets, out):
        rows, cols = (math.prod(shape[:-1]), shape[-1]) if len(shape) > 1 else (shape[0], 1)
        _fill_rows(dest, seed, name, rows, cols, first, col, std, uniform=kind == "uniform")


def box_row_runs(
    shape: tuple[int, ...], offsets: tuple[int, ...], out: torch.Tensor
) -> Iterator[tuple[torch.Tensor, int, int]]:
    """The box `out` at `offsets` of a tensor of `shape` as runs of consecutive rows of the tensor's
    leading dimensions flattened (a vector: rows of one column): (a (m, w) view of out, the first
    row, the first column). Each index of the dimensions before the last two is one run."""
    if len(shape) == 1:
        shape, offsets, out = (shape[0], 1), (offsets[0], 0), out.view(-1, 1)
    lead = [range(o, o + s) for o, s in zip(offsets[:-2], out.shape[:-2], strict=True)]
    for idx in itertools.product(*lead):
        dest = out[tuple(i - o for i, o in zip(idx, offsets, strict=False))] if idx else out
        flat = 0
        for i, n in zip(idx, shape[:-2], strict=False):
            flat = flat * n + i
        yield dest, flat * shape[-2] + offsets[-2], offsets[-1]


def _fill_rows(
    dest: torch.Tensor,
    seed: int,
    name: str,
    rows: int,
    cols: int,
    first: int,
    col: int,
    std: float,
    uniform: bool = False,
) -> None:
    """dest (m, w) = rows [first, first+m), columns [col, col+w) of the parameter's flattened rows:
    normal(0, std), or uniform in ±std."""
    m, w = dest.shape
    k = rows_per_block(cols)
    for block in range(first // k, (first + m - 1) // k + 1):
        gen = torch.Generator(device="cpu").manual_seed(_block_seed(seed, name, block))
        # Always the whole block: CPU normal_ fills in vectorised groups, so a value depends on the
        # size of the tensor drawn, which must not depend on the slice asked for.
        count = min(k, rows - block * k)  # the last block is shorter: fixed by the shape alone
        values = torch.empty(count, cols, dtype=torch.float32, device="cpu")
        if uniform:
            values.uniform_(-std, std, generator=gen)
        else:
            values.normal_(0.0, std, generator=gen)
        lo, hi = max(first, block * k), min(first + m, (block + 1) * k)
        part = values[lo - block * k : hi - block * k, col : col + w]
        dest[lo - first : hi - first].copy_(part)
