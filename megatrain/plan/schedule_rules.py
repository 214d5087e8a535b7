"""The zero-bubble pipeline schedules' layout rules (engine.parallel.schedules.check_schedule's
twins, each naming its field): zb-h1 runs one chunk per stage, zbv two in a V over pp >= 2."""

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


def _problem(field: str, message: str) -> dict[str, str]:
    return {"field": field, "message": message}
