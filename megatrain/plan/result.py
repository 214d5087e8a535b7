"""What the planner answers: a choice (layout + the settings it does not hold), its predicted step
and memory, the runners-up and the rejected with their reasons (codes and numbers, rendered to a
message here, per STYLE habit 13), and the JSON that POST /v1/plan returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatrain.plan.cost import StepTime
from megatrain.plan.layout import Layout
from megatrain.plan.memory import GiB, MemoryEstimate
from megatrain.spec import JobSpec, SpecError, parse_spec

MAX_REJECTED_SHOWN = 20
TIME_PARTS = ("compute_s", "recompute_s", "tp_comm_s", "cp_comm_s", "ep_comm_s", "pp_comm_s", "bubble_s",
              "dp_comm_s", "dp_exposed_s", "optimizer_s", "overhead_s")  # fmt: skip


class PlanError(SpecError):
    """No layout can run: `errors` are field-named problems (a 422), `rejected` the best tries."""

    def __init__(self, errors: list[dict[str, str]], rejected: list[dict[str, Any]] | None = None):
        super().__init__(errors)
        self.rejected = rejected or []


@dataclass(frozen=True)
class Choice:
    """One point of the search: a layout and the settings the layout does not hold."""

    layout: Layout
    micro_batch_size: int
    recompute: str
    distributed_optimizer: bool
    moe_overlap_chunks: int = 1
    """parallelism.moe_overlap_chunks: an MoE layer's all-to-alls pipelined behind its experts."""
    moe_dispatch: str = "pairs"
    """parallelism.moe_dispatch: "nodes", each token once per node (an ep group across nodes)."""
    moe_overlap_microbatches: bool = False
    """parallelism.moe_overlap_microbatches: 1F1B's steady pairs side by side (engine.parallel.lanes)."""

    def as_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "tp": lay.tp,
            "pp": lay.pp,
            "dp": lay.dp,
            "cp": lay.cp,
            "ep": lay.ep,
            "virtual_stages": lay.virtual_stages,
            "micro_batch_size": self.micro_batch_size,
            "recompute": self.recompute,
            "sequence_parallel": lay.sequence_parallel,
            "distributed_optimizer": self.distributed_optimizer,
            "pipeline_schedule": lay.pipeline_schedule,
            "pipeline_layers": list(lay.pipeline_layers) if lay.pipeline_layers is not None else None,
            "moe_overlap_chunks": self.moe_overlap_chunks,
            "moe_dispatch": self.moe_dispatch,
            "moe_overlap_microbatches": self.moe_overlap_microbatches,
        }

    def apply(self, spec: JobSpec) -> JobSpec:
        """`spec` with this choice written in: an explicit parallelism, the micro-batch size and
        recompute chosen, resources.devices the layout's world (what to store once planned)."""
        raw = spec.model_dump(mode="json")
        lay = self.layout
        par = raw["parallelism"] if isinstance(raw["parallelism"], dict) else {}
        raw["parallelism"] = {
            **par,
            "tp": lay.tp,
            "pp": lay.pp,
            "dp": lay.dp,
            "cp": lay.cp,
            "ep": lay.ep,
            "virtual_stages": lay.virtual_stages,
            "sequence_parallel": lay.sequence_parallel,
            "distributed_optimizer": self.distributed_optimizer,
            "pipeline_schedule": lay.pipeline_schedule,
            "pipeline_layers": list(lay.pipeline_layers) if lay.pipeline_layers is not None else None,
            "moe_overlap_chunks": self.moe_overlap_chunks,
            "moe_dispatch": self.moe_dispatch,
            "moe_overlap_microbatches": self.moe_overlap_microbatches,
        }
        raw["training"].update(micro_batch_size=self.micro_batch_size, recompute=self.recompute)
        raw["resources"]["devices"] = lay.world_size
        return parse_spec(raw)


@dataclass
class Rejection:
    code: str
    """divisibility | tp_exceeds_node | ep_exceeds_node | cp_chunk | cp_unsupported | model_state | memory |
    devices."""
    message: str
    choice: dict[str, Any] | None = None
    numbers: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "reason": self.message, "layout": self.choice, **self.numbers}


@dataclass
class Plan:
    choice: Choice
    time: StepTime
    memory: MemoryEstimate
    devices: int
    pool: str
    precision: str
    runners_up: list[tuple[Choice, StepTime, MemoryEstimate]] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    rejected_counts: dict[str, int] = field(default_factory=dict)
    considered: int = 1
    explicit: bool = False
    parameters: dict[str, int] = field(default_factory=dict)
    """The model's parameter counts: total, and active per token (megatrain.plan.shapes.param_counts)."""

    def as_dict(self) -> dict[str, Any]:
        """The plan's JSON: `layout`, `predicted`, `candidates` (POST /v1/plan's answer)."""
        return {
            "layout": self.choice.as_dict(),
            "predicted": predicted_dict(self.time, self.memory),
            "candidates": {
                "considered": self.considered,
                "runners_up": [
                    {"layout": c.as_dict(), "predicted": predicted_dict(t, m, brief=True)}
                    for c, t, m in self.runners_up
                ],
                "rejected": [r.as_dict() for r in most_telling(self.rejected)],
                "rejected_counts": self.rejected_counts,
            },
            "devices": self.devices,
            "pool": self.pool,
            "precision": self.precision,
            "explicit_layout": self.explicit,
            "parameters": self.parameters,
        }


REJECTION_ORDER = (
    "memory",
    "model_state",
    "divisibility",
    "ep_exceeds_node",
    "cp_chunk",
    "cp_unsupported",
    "tp_exceeds_node",
)


def nothing_fits(
    rejected: list[Rejection], best_miss: tuple[Choice, MemoryEstimate] | None, devices: int,
    device_bytes: int, budget: float, fixed_micro_batch: bool,
) -> PlanError:  # fmt: skip
    """The error when no candidate survives: the closest miss, or every rule that ruled all out."""
    floors = [r for r in rejected if r.code == "model_state"]
    if best_miss is None and floors:
        closest = min(floors, key=lambda r: r.numbers["memory_per_gpu_bytes"])
        message = f"no layout of {devices} devices fits: the smallest, {closest.message}"
    elif best_miss is not None:
        c, est = best_miss
        message = (
            f"no layout of {devices} devices fits a {device_bytes / GiB:,.1f} "
            f"GiB device: the smallest, {c.layout.describe()} micro_batch_size={c.micro_batch_size} "
            f"recompute={c.recompute}, needs {est.total_bytes / GiB:,.2f} GiB of the "
            f"{budget / GiB:,.2f} GiB budget: use more devices or a pool with more memory"
        )
        if c.micro_batch_size > 1 and fixed_micro_batch:
            message += ", or a smaller training.micro_batch_size (auto: the planner picks one)"
    else:
        rules = list(dict.fromkeys(r.message for r in most_telling(rejected)))[:5]
        message = f"no layout of {devices} devices passes the layout rules: " + "; ".join(rules)
    field_name = "resources.devices" if best_miss is None and not floors else "model"
    return PlanError(
        [{"field": field_name, "message": message}],
        [r.as_dict() for r in rejected[:MAX_REJECTED_SHOWN]],
    )


def most_telling(rejected: list[Rejection]) -> list[Rejection]:
    """The rejections to show: the nearest misses (memory) first, capped."""
    rank = {code: i for i, code in enumerate(REJECTION_ORDER)}
    return sorted(rejected, key=lambda r: rank.get(r.code, len(rank)))[:MAX_REJECTED_SHOWN]


def memory_message(est: MemoryEstimate, budget: float, device_bytes: int, headroom: float) -> tuple[str, int]:
    """Why a layout does not fit (its step's or, where larger, its start-up's bytes against the
    budget), and the bytes it needs."""
    gib = 1 << 30
    pool = f"{headroom:.0%} of the pool's {device_bytes / gib:,.1f} GiB is {budget / gib:,.2f} GiB"
    if est.startup_bytes > est.total_bytes:
        # The start (plan.startup_memory) is what does not fit, not the step.
        return (
            f"needs {est.startup_bytes / gib:,.2f} GiB per device to start (the start-up peak, before the "
            f"first step; a step needs {est.total_bytes / gib:,.2f}) but {pool}",
            est.startup_bytes,
        )
    return (
        f"needs {est.total_bytes / gib:,.2f} GiB per device (stage {est.stage}: params "
        f"{est.params_bytes / gib:,.2f}, grads {est.grads_bytes / gib:,.2f}, optimizer "
        f"{est.optimizer_bytes / gib:,.2f}, activations {est.activations_bytes / gib:,.2f}) but {pool}",
        est.total_bytes,
    )


def predicted_dict(time: StepTime, memory: MemoryEstimate, brief: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "step_time_s": time.step_time_s,
        "tokens_per_s": time.tokens_per_s,
        "tflops_per_gpu": time.tflops_per_gpu,
        "mfu": time.mfu,
        "memory_per_gpu_bytes": memory.total_bytes,
    }
    if brief:
        return out
    out["memory_breakdown"] = {
        "params_bytes": memory.params_bytes,
        "grads_bytes": memory.grads_bytes,
        "optimizer_bytes": memory.optimizer_bytes,
        "activations_bytes": memory.activations_bytes,
        "worst_stage": memory.stage,
    }
    out["time_breakdown"] = {k: getattr(time, k) for k in TIME_PARTS}
    return out
