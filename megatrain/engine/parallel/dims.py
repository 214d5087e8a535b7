"""Parallel degrees and Megatron's rank order, as pure functions (no torch, no process groups).

Ranks are laid out tp fastest, then cp, then dp, then pp (Megatron's order): ranks that share a
tensor-parallel group are neighbours, so on a multi-GPU node they share the fastest links.

    rank = tp_rank + tp·(cp_rank + cp·(dp_rank + dp·pp_rank))
"""

from __future__ import annotations

from dataclasses import dataclass

DIMS = ("tp", "cp", "dp", "pp")
"""Dimension names, fastest-varying first."""


class LayoutError(ValueError):
    """A layout that cannot run; the message names the numbers involved."""


@dataclass(frozen=True)
class Coords:
    tp: int
    cp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class ParallelDims:
    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        for name in (*DIMS, "ep", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name}={value!r} must be a positive integer")
        if self.sequence_parallel and self.tp == 1:
            # Harmless but pointless; Megatron turns it off too. Keep the flag honest.
            object.__setattr__(self, "sequence_parallel", False)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def size(self, dim: str) -> int:
        return getattr(self, dim)

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside a world of {self.world_size}")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return Coords(tp=tp, cp=cp, dp=dp, pp=pp)

    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def group_ranks(self, *dims: str) -> list[list[int]]:
        """Every group that varies along `dims` (one or more of tp, cp, dp, pp), in a fixed order.

        E.g. group_ranks("tp") lists the tensor-parallel groups; group_ranks("tp", "pp") the
        model-parallel ones. All ranks must create groups in this same order.
        """
        unknown = [d for d in dims if d not in DIMS]
        if unknown or not dims:
            raise LayoutError(f"unknown dimensions {unknown or dims}; choose from {DIMS}")
        fixed = [d for d in DIMS if d not in dims]
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            key = tuple(getattr(c, d) for d in fixed)
            groups.setdefault(key, []).append(rank)
        return [groups[k] for k in sorted(groups)]

    def describe(self) -> str:
        sp = "+sp" if self.sequence_parallel else ""
        return f"tp={self.tp}{sp} cp={self.cp} dp={self.dp} pp={self.pp}"


def validate_dims(
    dims: ParallelDims,
    world_size: int,
    *,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    ffn_hidden_size: int | None = None,
    vocab_size: int | None = None,
    num_layers: int | None = None,
    seq_length: int | None = None,
) -> None:
    """Raise LayoutError listing every rule the layout breaks for this world and model."""
    problems: list[str] = []
    if dims.world_size != world_size:
        problems.append(
            f"tp×cp×dp×pp = {dims.tp}×{dims.cp}×{dims.dp}×{dims.pp} = {dims.world_size} "
            f"but the world has {world_size} processes"
        )
    checks = [
        ("num_attention_heads", num_attention_heads, dims.tp, "tp"),
        ("num_query_groups", num_query_groups, dims.tp, "tp"),
        ("ffn_hidden_size", ffn_hidden_size, dims.tp, "tp"),
        ("vocab_size", vocab_size, dims.tp, "tp"),
    ]
    for name, value, degree, dname in checks:
        if value is not None and value % degree:
            problems.append(f"{name}={value} is not divisible by {dname}={degree}")
    if num_layers is not None and num_layers % (dims.pp * dims.virtual_stages):
        problems.append(
            f"num_layers={num_layers} is not divisible by pp×virtual_stages={dims.pp}×{dims.virtual_stages}"
        )
    if seq_length is not None and dims.sequence_parallel and seq_length % dims.tp:
        problems.append(f"seq_length={seq_length} is not divisible by tp={dims.tp} (sequence parallelism)")
    if seq_length is not None and seq_length % (2 * dims.cp) and dims.cp > 1:
        problems.append(f"seq_length={seq_length} is not divisible by 2×cp={2 * dims.cp}")
    if (dims.dp * dims.cp) % dims.ep:
        problems.append(f"ep={dims.ep} does not divide dp×cp={dims.dp}×{dims.cp}")
    if problems:
        raise LayoutError("invalid parallel layout: " + "; ".join(problems))
