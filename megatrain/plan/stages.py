"""How a pipeline cuts a model: layers per stage and model chunk (even, or as pipeline_layers
says), which of a stage's layers are MoE layers, and the uneven cut the planner proposes. Pure
(no torch), like megatrain.plan.shapes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatrain.plan.shapes import ModelShape


def layers_on_stage(
    num_layers: int, pp: int, stage: int, pipeline_layers: Sequence[int] | None = None
) -> int:
    """Layers are split evenly (the engine needs num_layers divisible by pp × virtual stages then;
    any remainder would go to the first stages), or as `pipeline_layers` says: one count per model
    chunk, chunk c on stage c % pp (megatrain.plan.layout.Layout.chunk_layers)."""
    if pipeline_layers is not None:
        return sum(pipeline_layers[stage::pp])
    base, extra = divmod(num_layers, pp)
    return base + (1 if stage < extra else 0)


def moe_layers_on_stage(
    m: ModelShape, pp: int, stage: int, pipeline_layers: Sequence[int] | None = None, virtual_stages: int = 1
) -> int:
    """How many of a stage's layers are MoE layers (layer i is when i % layer_freq == 0); the stage's
    model chunks hold contiguous layer ranges, chunk c on stage c % pp."""
    if m.moe is None:
        return 0
    L, f = m.num_layers, m.moe.layer_freq
    if pipeline_layers is not None:
        counts = list(pipeline_layers)
    elif virtual_stages > 1 and L % (pp * virtual_stages) == 0:
        counts = [L // (pp * virtual_stages)] * (pp * virtual_stages)
    else:
        base, extra = divmod(L, pp)
        counts = [base + (1 if i < extra else 0) for i in range(pp)]
    out, start = 0, 0
    for c, n in enumerate(counts):
        if c % pp == stage:
            out += -(-(start + n) // f) - -(-start // f)  # multiples of f in [start, start + n)
        start += n
    return out


def balanced_layers(num_layers: int, pp: int, v: int) -> tuple[int, ...] | None:
    """Layers per model chunk (chunk c on stage c % pp) when pp·v does not divide num_layers, else
    None (the even split). The extra layers go to the middle stages first: the first stage also runs
    the embedding and the last the LM head and the loss (as Llama 3 405B's 126 layers over pp=16)."""
    chunks = pp * v
    base, extra = divmod(num_layers, chunks)
    if not extra:
        return None
    order = sorted(range(chunks), key=lambda c: (c % pp == pp - 1, c % pp == 0, c))
    counts = [base] * chunks
    for c in order[:extra]:
        counts[c] += 1
    return tuple(counts)


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})
