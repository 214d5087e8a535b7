"""The parallel layout: one torch-free type, every rule it must satisfy, and "auto" resolved once.

The API resolves a job's layout at submission (`resolve_layout`) and stores `Layout.as_dict()` on
the job; the worker hands that stored layout to the engine, which builds its process groups from it
(`ParallelState.build(layout)`). The engine resolves a spec itself only when it runs on its own
under torchrun. Every divisibility rule lives here, in `layout_problems` (on a spec) and
`model_problems` (on bare model numbers, for the parallel layers' own callers).

Ranks are laid out tp fastest, then cp, then dp, then pp (Megatron's order): ranks that share a
tensor-parallel group are neighbours, so on a multi-GPU node they share the fastest links.

    rank = tp_rank + tp·(cp_rank + cp·(dp_rank + dp·pp_rank))

Expert parallelism carves ep out of dp×cp (Megatron's expert order: tp, then the dp×cp index split
into ep fastest and expert-data-parallel (edp) next, then pp), so an ep group is consecutive dp×cp
indices (neighbouring ranks) and edp = dp·cp/ep replicas of each expert hold the same experts:

    i = cp_rank + cp·dp_rank;  ep_rank = i % ep;  edp_rank = i // ep
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from megatrain.plan.fp8 import fp8_problems
from megatrain.plan.schedule_rules import microbatch_lane_problems, zero_bubble_problems
from megatrain.plan.split_rank import split_pipeline_layers, split_rank_problems
from megatrain.plan.stacks import family_layout_problems, spec_decoder_layers
from megatrain.spec import JobSpec, ParallelismSpec, SpecError
from megatrain.spec_attention import context_parallel_problem

AXES = ("tp", "cp", "dp", "pp")
"""Mesh axes, fastest-varying first."""

EXPERT_AXES = ("ep", "edp")
"""The expert axes, both carved from dp×cp: expert-parallel and expert-data-parallel."""

SCHEDULES = ("1f1b", "all_forward_all_backward", "zb-h1", "zbv")
"""megatrain.engine.parallel.schedules.SCHEDULES (a test keeps the two equal)."""


class LayoutError(ValueError):
    """A layout that cannot exist (a degree below 1, a rank outside the world); names the numbers."""


@dataclass(frozen=True)
class Coords:
    tp: int
    cp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class Layout:
    """Degrees of every parallelism and how the pipeline is cut; `world_size` processes run it."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    virtual_stages: int = 1
    sequence_parallel: bool = False
    pipeline_schedule: str = "1f1b"
    pipeline_layers: tuple[int, ...] | None = None
    """Layers per model chunk (chunk v·pp + stage), or None for an even split."""

    def __post_init__(self) -> None:
        for name in (*AXES, "ep", "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name}={value!r} must be a positive integer")
        if self.pipeline_schedule not in SCHEDULES:
            raise LayoutError(f"pipeline_schedule={self.pipeline_schedule!r} is not one of {SCHEDULES}")
        if self.pipeline_layers is not None and not isinstance(self.pipeline_layers, tuple):
            object.__setattr__(self, "pipeline_layers", tuple(self.pipeline_layers))
        if self.sequence_parallel and self.tp == 1:
            # Harmless but pointless; Megatron turns it off too. Keep the flag honest.
            object.__setattr__(self, "sequence_parallel", False)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside a world of {self.world_size}")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return Coords(tp=tp, cp=cp, dp=dp, pp=pp)

    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def group_ranks(self, *axes: str) -> list[list[int]]:
        """Every group that varies along `axes` (one or more of tp, cp, dp, pp), in a fixed order.

        E.g. group_ranks("tp") lists the tensor-parallel groups; group_ranks("tp", "pp") the
        model-parallel ones. All ranks must create groups in this same order.
        """
        unknown = [a for a in axes if a not in AXES]
        if unknown or not axes:
            raise LayoutError(f"unknown axes {unknown or axes}; choose from {AXES}")
        fixed = [a for a in AXES if a not in axes]
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            groups.setdefault(tuple(getattr(c, a) for a in fixed), []).append(rank)
        return [groups[k] for k in sorted(groups)]

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: the replicas of each expert (dp·cp/ep)."""
        return self.dp * self.cp // self.ep

    def expert_coords(self, rank: int) -> tuple[int, int]:
        """(ep_rank, edp_rank) of `rank`: its dp×cp index split into ep (fastest) and edp."""
        c = self.coords(rank)
        i = c.cp + self.cp * c.dp
        return i % self.ep, i // self.ep

    def expert_group_ranks(self, axis: str) -> list[list[int]]:
        """Every ep or edp group (same tp and pp coordinate, the other expert coordinate fixed), in a
        fixed order that all ranks share. Assumes ep divides dp×cp (model_problems checks it)."""
        if axis not in EXPERT_AXES:
            raise LayoutError(f"unknown expert axis {axis!r}; choose from {EXPERT_AXES}")
        if (self.dp * self.cp) % self.ep:
            raise LayoutError(f"ep={self.ep} does not divide dp×cp={self.dp}×{self.cp}")
        groups: dict[tuple[int, int, int], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            ep_rank, edp_rank = self.expert_coords(rank)
            other = edp_rank if axis == "ep" else ep_rank
            groups.setdefault((c.pp, other, c.tp), []).append(rank)
        return [groups[k] for k in sorted(groups)]

    def chunk_layers(self, num_layers: int) -> list[tuple[int, int]]:
        """[start, end) layer ranges of the pp·virtual_stages model chunks, in chunk order
        (chunk c = v·pp + stage lives on stage c % pp). Assumes the layout passed its rules."""
        n_chunks = self.pp * self.virtual_stages
        counts = self.pipeline_layers or (num_layers // n_chunks,) * n_chunks
        out, start = [], 0
        for n in counts:
            out.append((start, start + n))
            start += n
        return out

    def micro_batches(self, global_batch_size: int, micro_batch_size: int) -> int:
        """Micro-batches each data-parallel rank runs per step."""
        return global_batch_size // (micro_batch_size * self.dp)

    def describe(self) -> str:
        sp = "+sp" if self.sequence_parallel else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return f"tp={self.tp}{sp} cp={self.cp} dp={self.dp} pp={self.pp}{ep}"

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON data (what the job row stores and the engine reads back)."""
        d = asdict(self)
        d["pipeline_layers"] = list(self.pipeline_layers) if self.pipeline_layers is not None else None
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Layout:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise LayoutError(f"unknown layout fields {unknown}")
        return cls(**data)


Problem = dict[str, str]
"""{"field": "model.num_attention_heads", "message": "..."}: the shape SpecError carries."""


def _problem(field: str, message: str) -> Problem:
    return {"field": field, "message": message}


def model_problems(
    layout: Layout,
    *,
    num_layers: int | None = None,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    ffn_hidden_size: int | None = None,
    vocab_size: int | None = None,
    seq_length: int | None = None,
    moe_ffn_hidden_size: int | None = None,
    shared_expert_ffn_hidden_size: int | None = None,
    model: str = "",
    par: str = "",
) -> list[Problem]:
    """Every rule the layout breaks for a model of these shapes (the numbers left None are not
    checked). `model` and `par` prefix the names in messages ("model.", "parallelism.").

    The engine's parallel layers call this too (parallelize, moe_tensor, pipeline), so a rule they
    enforce is the rule a spec is validated against, with the same words."""
    out: list[Problem] = []
    tp = f"{par}tp={layout.tp}"
    for name, value in (
        ("num_attention_heads", num_attention_heads),
        ("num_query_groups", num_query_groups),
        ("ffn_hidden_size", ffn_hidden_size),
        # Every tp rank holds its slice of every routed expert and of the shared one (moe_tensor).
        ("moe.ffn_hidden_size", moe_ffn_hidden_size),
        ("moe.shared_expert_ffn_hidden_size", shared_expert_ffn_hidden_size),
    ):
        if value is not None and value % layout.tp:
            out.append(_problem(f"{model}{name}", f"{model}{name}={value} is not divisible by {tp}"))
    if vocab_size is not None and vocab_size % layout.tp:
        out.append(
            _problem(f"{model}vocab_size", f"the embedding's {vocab_size} rows are not divisible by {tp}")
        )
    if seq_length is not None and layout.sequence_parallel and seq_length % layout.tp:
        out.append(
            _problem(
                f"{model}seq_length",
                f"{model}seq_length={seq_length} is not divisible by {tp} (needed for sequence parallelism)",
            )
        )
    if seq_length is not None and layout.cp > 1 and seq_length % (2 * layout.cp):
        out.append(
            _problem(
                f"{model}seq_length",
                f"{model}seq_length={seq_length} is not divisible by 2×{par}cp={2 * layout.cp}",
            )
        )
    elif (
        seq_length is not None
        and layout.cp > 1
        and layout.sequence_parallel
        and seq_length % (2 * layout.cp * layout.tp)
    ):
        # Each cp rank's 2 chunks are then cut again over tp.
        out.append(
            _problem(
                f"{model}seq_length",
                f"{model}seq_length={seq_length} is not divisible by 2×{par}cp×{par}tp="
                f"{2 * layout.cp * layout.tp} (context with sequence parallelism)",
            )
        )
    if (layout.dp * layout.cp) % layout.ep:
        out.append(_problem(f"{par}ep", f"{par}ep={layout.ep} does not divide dp×cp={layout.dp}×{layout.cp}"))
    if num_layers is not None:
        out += _pipeline_problems(layout, num_layers, model, par)
    return out


def _pipeline_problems(layout: Layout, num_layers: int, model: str, par: str) -> list[Problem]:
    pp, v = layout.pp, layout.virtual_stages
    if pp > num_layers:
        return [_problem(f"{par}pp", f"{par}pp={pp} exceeds {model}num_layers={num_layers}")]
    problems = zero_bubble_problems(layout, par)
    if problems:
        return problems
    if v > 1 and pp == 1:
        return [
            _problem(
                f"{par}virtual_stages",
                f"{par}virtual_stages={v} needs {par}pp > 1 (it splits each stage's layers)",
            )
        ]
    layers = layout.pipeline_layers
    if layers is None:
        if num_layers % (pp * v):
            return [
                _problem(
                    f"{model}num_layers",
                    f"{model}num_layers={num_layers} is not divisible by {par}pp×virtual_stages={pp}×{v}; "
                    f"give {par}pipeline_layers for an uneven split",
                )
            ]
        return []
    field = f"{par}pipeline_layers"
    if len(layers) != pp * v:
        return [
            _problem(
                field,
                f"{field} must have {par}pp×virtual_stages={pp}×{v}={pp * v} entries, not {len(layers)}",
            )
        ]
    if any(n < 0 for n in layers) or sum(layers) != num_layers:
        return [
            _problem(
                field,
                f"{field}={list(layers)} sums to {sum(layers)}, not {model}num_layers={num_layers}"
                if sum(layers) != num_layers
                else f"{field}={list(layers)} must be non-negative",
            )
        ]
    return []


def batch_problems(layout: Layout, global_batch_size: int, micro_batch_size: int) -> list[Problem]:
    """The batch must split into whole micro-batches per data-parallel rank, and the interleaved
    schedule feeds micro-batches in groups of pp."""
    if global_batch_size % (micro_batch_size * layout.dp):
        return [
            _problem(
                "training.global_batch_size",
                f"training.global_batch_size={global_batch_size} is not divisible by "
                f"micro_batch_size×dp={micro_batch_size}×{layout.dp}",
            )
        ]
    m = layout.micro_batches(global_batch_size, micro_batch_size)
    if layout.virtual_stages > 1 and m % layout.pp and layout.pipeline_schedule != "zbv":
        return [
            _problem(
                "parallelism.virtual_stages",
                f"parallelism.virtual_stages={layout.virtual_stages} (interleaved 1F1B) needs the "
                f"micro-batches per step, global_batch_size/(micro_batch_size×dp) = {m}, divisible by "
                f"parallelism.pp={layout.pp}",
            )
        ]
    return []


MICRO_BATCH_FALLBACK = 4
"""training.micro_batch_size auto where no planner chose it: the largest micro-batch up to this."""


def micro_batch_size(spec: JobSpec, layout: Layout) -> int:
    """The spec's training.micro_batch_size; auto (left to a planner that did not run: a pool whose
    memory is unknown, the engine on its own) is the largest of MICRO_BATCH_FALLBACK..1 that meets
    the batch rules on `layout` (1 when none does: batch_problems then says why)."""
    tr = spec.training
    if isinstance(tr.micro_batch_size, int):
        return tr.micro_batch_size
    gbs = tr.global_batch_size
    sizes = [n for n in range(min(MICRO_BATCH_FALLBACK, gbs), 0, -1) if pairs_whole(spec, n)] or [1]
    return next((n for n in sizes if not batch_problems(layout, gbs, n)), sizes[-1])


def pairs_whole(spec: JobSpec, micro_batch_size: int) -> bool:
    """Whether a micro-batch size keeps preference pairs whole: kind dpo counts sequences, a pair's
    chosen and rejected one in the same micro-batch, so its micro-batches are even."""
    return spec.kind != "dpo" or micro_batch_size % 2 == 0


def with_micro_batch_size(spec: JobSpec, size: int | None = None, layout: Layout | None = None) -> JobSpec:
    """`spec` with training.micro_batch_size a number (what is stored and run): `size` (a planner's
    choice), else an auto one resolved on `layout` (micro_batch_size); a number written is kept."""
    if isinstance(spec.training.micro_batch_size, int):
        return spec
    if size is None:
        assert layout is not None, "an auto micro_batch_size is resolved on a layout or given"
        size = micro_batch_size(spec, layout)
    training = spec.training.model_copy(update={"micro_batch_size": size})
    return spec.model_copy(update={"training": training})


def layout_problems(spec: JobSpec, layout: Layout) -> list[Problem]:
    """Every rule `layout` breaks for `spec`'s model and batch, each naming its spec field."""
    m, tr, mbs = spec.model, spec.training, micro_batch_size(spec, layout)
    return [
        *family_layout_problems(m, layout),
        *split_rank_problems(spec, layout),
        *model_problems(
            layout,
            num_layers=m.num_layers + spec_decoder_layers(m),  # (T5's pipeline splits both stacks)
            num_attention_heads=m.num_attention_heads,
            num_query_groups=m.query_groups,
            ffn_hidden_size=m.ffn_size,
            # The rows (a multiple of 128); None (the tokenizer's, not known here) fits any power of 2.
            vocab_size=m.padded_vocab(m.vocab_size) if m.vocab_size else None,
            seq_length=m.seq_length,
            moe_ffn_hidden_size=m.moe.ffn_hidden_size if m.moe is not None else None,  # None: ffn's
            shared_expert_ffn_hidden_size=m.moe.shared_expert_ffn_hidden_size if m.moe is not None else None,
            model="model.",
            par="parallelism.",
        ),
        *batch_problems(layout, tr.global_batch_size, mbs),
        *microbatch_lane_problems(spec, layout, mbs),
        *expert_problems(layout, m.moe.num_experts if m.moe is not None else 0),
        *context_problems(layout, m.attention_dropout, m.attention_backend),
        *fp8_problems(spec, layout),
    ]


def context_problems(
    layout: Layout, attention_dropout: float, attention_backend: str = "auto"
) -> list[Problem]:
    """Ring attention (context parallelism) merges exact softmax blocks: it runs no attention dropout,
    and its own attention blocks whatever model.attention_backend names."""
    out = []
    if layout.cp > 1 and attention_dropout > 0:
        out.append(
            _problem(
                "model.attention_dropout",
                f"model.attention_dropout={attention_dropout} is not supported with parallelism.cp="
                f"{layout.cp} (ring attention runs without dropout); set it to 0",
            )
        )
    backend = context_parallel_problem(attention_backend, layout.cp)
    if backend:
        out.append(_problem("model.attention_backend", backend))
    return out


def expert_problems(layout: Layout, num_experts: int) -> list[Problem]:
    """Expert parallelism splits the routed experts: it needs some, and a whole number per rank."""
    if layout.ep == 1:
        return []
    if not num_experts:
        return [_problem("parallelism.ep", f"parallelism.ep={layout.ep} needs model.moe (no experts)")]
    if num_experts % layout.ep:
        return [
            _problem(
                "model.moe.num_experts",
                f"model.moe.num_experts={num_experts} is not divisible by parallelism.ep={layout.ep}",
            )
        ]
    return []


def resolve_layout(spec: JobSpec, world_size: int | None = None) -> Layout:
    """The layout a spec runs with, "auto" resolved; raises SpecError listing every broken rule.

    dp "auto" fills resources.devices, else `world_size` (the processes torchrun started, when the
    engine runs on its own), else 1. `parallelism: auto` is tp = pp = 1 with dp filling the devices.
    """
    par = spec.parallelism if isinstance(spec.parallelism, ParallelismSpec) else ParallelismSpec()
    devices = spec.resources.devices if spec.resources.devices is not None else world_size
    model_parallel = par.tp * par.pp * par.cp
    problems: list[Problem] = []
    if par.dp == "auto":
        if devices is not None and devices % model_parallel:
            problems.append(
                _problem(
                    "resources.devices",
                    f"resources.devices={devices} is not divisible by tp×pp×cp={par.tp}×{par.pp}×{par.cp}",
                )
            )
        dp = max(1, devices // model_parallel) if devices is not None else 1
    else:
        dp = par.dp
        if spec.resources.devices is not None and spec.resources.devices != model_parallel * dp:
            problems.append(
                _problem(
                    "resources.devices",
                    f"resources.devices={spec.resources.devices} does not equal "
                    f"tp×pp×cp×dp={par.tp}×{par.pp}×{par.cp}×{dp}",
                )
            )
    layout = Layout(
        tp=par.tp,
        pp=par.pp,
        dp=dp,
        cp=par.cp,
        ep=par.ep,
        virtual_stages=par.virtual_stages,
        sequence_parallel=par.sequence_parallel,
        pipeline_schedule=par.pipeline_schedule,
        pipeline_layers=split_pipeline_layers(spec, par),  # (T5's pipeline_split_rank lands there)
    )
    problems += layout_problems(spec, layout)
    if problems:
        raise SpecError(problems)
    return layout


def check_layout(spec: JobSpec, layout: Layout, world_size: int | None = None) -> None:
    """SpecError when a stored (or hand-written) layout breaks a rule for this spec or world."""
    problems = layout_problems(spec, layout)
    if world_size is not None and layout.world_size != world_size:
        problems.insert(
            0,
            _problem(
                "parallelism",
                f"tp×cp×dp×pp = {layout.tp}×{layout.cp}×{layout.dp}×{layout.pp} = {layout.world_size} "
                f"but the world has {world_size} processes",
            ),
        )
    if problems:
        raise SpecError(problems)


__all__: Sequence[str] = [
    "AXES",
    "EXPERT_AXES",
    "Coords",
    "Layout",
    "LayoutError",
    "batch_problems",
    "check_layout",
    "context_problems",
    "layout_problems",
    "micro_batch_size",
    "model_problems",
    "resolve_layout",
    "with_micro_batch_size",
]
