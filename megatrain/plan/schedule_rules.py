"""The schedules' layout rules, each naming its field: the zero-bubble pipelines'
(engine.parallel.schedules.check_schedule's twins: zb-h1 runs one chunk per stage, zbv two in a V
over pp >= 2) and two micro-batches in flight (parallelism.moe_overlap_microbatches)."""

from __future__ import annotations

from typing import Any


def zero_bubble_problems(layout: Any, par: str) -> list[dict[str, str]]:
    """The first rule `layout`'s pipeline_schedule breaks, as [{"field", "message"}] (or [])."""
    pp, v = layout.pp, layout.virtual_stages
    schedule = layout.pipeline_schedule
    if schedule == "zb-h1" and v != 1:
        return [
            _problem(
                f"{par}virtual_stages",
                f"{par}pipeline_schedule=zb-h1 runs one chunk per stage: {par}virtual_stages={v} must be 1 "
                "(zbv is the zero-bubble schedule with two)",
            )
        ]
    if schedule == "zbv" and (v != 2 or pp < 2):
        return [
            _problem(
                f"{par}virtual_stages" if v != 2 else f"{par}pp",
                f"{par}pipeline_schedule=zbv runs two chunks per stage in a V: it needs "
                f"{par}virtual_stages=2 (not {v}) and {par}pp >= 2 (not {pp})",
            )
        ]
    return []


def microbatch_lane_problems(spec: Any, layout: Any, micro_batch_size: int) -> list[dict[str, str]]:
    """parallelism.moe_overlap_microbatches (engine.parallel.lanes): an ep > 1 MoE model, 1F1B with
    one chunk per stage under a pipeline, pp + 1 micro-batches per step or more (so that a forward
    has a backward beside it on every stage), no dropout (the two micro-batches' masks would draw
    from one random stream in an order the schedule sets)."""
    if not getattr(spec.parallelism, "moe_overlap_microbatches", False):  # (auto: the planner's)
        return []
    return lane_problems(spec.model, layout, spec.training.global_batch_size, micro_batch_size)


def lane_problems(m: Any, layout: Any, global_batch_size: int, micro_batch_size: int) -> list[dict[str, str]]:
    """microbatch_lane_problems for a model spec on a layout, whether or not the spec asks for lanes
    (the planner asks before it proposes them)."""
    field = "parallelism.moe_overlap_microbatches"
    if m.moe is None or layout.ep == 1:
        why = "the model has no model.moe" if m.moe is None else "parallelism.ep is 1"
        return [_problem(field, f"{field} hides expert-parallel all-to-alls, but {why}")]
    if layout.pp > 1 and (layout.pipeline_schedule != "1f1b" or layout.virtual_stages > 1):
        why = (
            f"{field} pairs 1F1B's forwards and backwards: with parallelism.pp > 1 it needs "
            f"pipeline_schedule 1f1b (not {layout.pipeline_schedule}) and virtual_stages 1 "
            f"(not {layout.virtual_stages})"
        )
        return [_problem(field, why)]
    per_rank = global_batch_size // (micro_batch_size * layout.dp)
    if per_rank < layout.pp + 1:
        why = (
            f"{field} needs {layout.pp + 1} or more micro-batches per step on each rank (pp + 1, for a "
            f"forward beside a backward); training.global_batch_size / (micro_batch_size × dp) is {per_rank}"
        )
        return [_problem("training.global_batch_size", why)]
    for name in ("hidden_dropout", "attention_dropout"):
        if getattr(m, name) > 0:
            return [_problem(f"model.{name}", f"{field} needs model.{name} 0 (not {getattr(m, name)})")]
    return []


def _problem(field: str, message: str) -> dict[str, str]:
    return {"field": field, "message": message}
