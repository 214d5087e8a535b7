"""Entry points that read as their phases: a function that grows past a screen hides the order of
what it does (the engine's run has regrown twice)."""

from __future__ import annotations

import inspect

import pytest

from megatrain.engine import train

LONGEST = 80


@pytest.mark.parametrize("fn", [train.run], ids=lambda f: f"{f.__module__}.{f.__qualname__}")
def test_entry_points_stay_short(fn: object) -> None:
    lines, _ = inspect.getsourcelines(fn)
    assert len(lines) <= LONGEST, f"{len(lines)} lines: split it into named phases"
