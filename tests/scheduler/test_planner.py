"""plan_layout and fit_problem: pure functions from a JobSpec to a layout and a placement verdict."""

from __future__ import annotations

from typing import Any

import pytest

from megatrain.scheduler.planner import Layout, fit_problem, plan_layout
from megatrain.spec import SpecError, parse_spec


def spec_with(
    parallelism: Any = "auto", gpus: int | None = None, gbs: int = 16, mbs: int = 4, **model: Any
) -> Any:
    return parse_spec(
        {
            "name": "p",
            "data": {"train": [{"path": "file:///d.jsonl"}]},
            "model": {"num_layers": 8, "hidden_size": 256, "num_attention_heads": 8, **model},
            "training": {"global_batch_size": gbs, "micro_batch_size": mbs},
            "parallelism": parallelism,
            "resources": {"gpus": gpus},
        }
    )


@pytest.mark.parametrize(
    ("parallelism", "gpus", "gbs", "mbs", "expected"),
    [
        ("auto", None, 16, 4, Layout()),
        ("auto", 4, 16, 4, Layout(dp=4)),
        ("auto", 2, 16, 8, Layout(dp=2)),
        ({"tp": 2}, None, 16, 4, Layout(tp=2)),
        ({"tp": 2}, 8, 16, 4, Layout(tp=2, dp=4)),
        ({"tp": 2, "pp": 2, "dp": "auto"}, 8, 16, 4, Layout(tp=2, pp=2, dp=2)),
        ({"tp": 2, "pp": 2, "dp": 2}, 8, 16, 4, Layout(tp=2, pp=2, dp=2)),
        ({"tp": 2, "pp": 2, "dp": 2}, None, 16, 4, Layout(tp=2, pp=2, dp=2)),
        ({"tp": 4, "sequence_parallel": True}, 4, 4, 4, Layout(tp=4, sequence_parallel=True)),
        ({"pp": 8, "dp": 1}, 8, 8, 1, Layout(pp=8)),
    ],
)
def test_plan_layout(parallelism: Any, gpus: int | None, gbs: int, mbs: int, expected: Layout) -> None:
    layout = plan_layout(spec_with(parallelism, gpus, gbs, mbs))
    assert layout == expected
    assert layout.world_size == expected.tp * expected.pp * expected.dp
    if gpus is not None:
        assert layout.world_size == gpus


def test_layout_as_dict() -> None:
    assert Layout(tp=2, dp=3).as_dict() == {
        "tp": 2,
        "pp": 1,
        "dp": 3,
        "cp": 1,
        "ep": 1,
        "virtual_stages": 1,
        "sequence_parallel": False,
        "pipeline_schedule": "1f1b",
        "pipeline_layers": None,
    }


@pytest.mark.parametrize(
    ("parallelism", "gpus", "gbs", "mbs", "field", "text"),
    [
        (
            {"tp": 2, "pp": 2},
            6,
            16,
            4,
            "resources.gpus",
            "resources.gpus=6 is not divisible by tp×pp×cp=2×2×1",
        ),
        ({"tp": 4}, 2, 16, 4, "resources.gpus", "not divisible"),
        ({"tp": 2, "dp": 2}, 8, 16, 4, "resources.gpus", "resources.gpus=8 does not equal tp×pp×cp×dp"),
        ({"dp": 4}, 2, 16, 4, "resources.gpus", "does not equal"),
        ("auto", 3, 16, 4, "training.global_batch_size", "micro_batch_size×dp=4×3"),
        ("auto", 8, 16, 4, "training.global_batch_size", "training.global_batch_size=16 is not divisible"),
        ({"tp": 2, "dp": 3}, None, 10, 2, "training.global_batch_size", "micro_batch_size×dp=2×3"),
        # 24 / (4×1) = 6 micro-batches cannot enter a 4-stage interleaved pipeline in groups of 4.
        ({"pp": 4, "virtual_stages": 2, "dp": 1}, None, 24, 4, "parallelism.virtual_stages", "= 6, divisib"),
    ],
)
def test_plan_layout_errors_name_the_field(
    parallelism: Any, gpus: int | None, gbs: int, mbs: int, field: str, text: str
) -> None:
    with pytest.raises(SpecError) as info:
        plan_layout(spec_with(parallelism, gpus, gbs, mbs))
    assert [e["field"] for e in info.value.errors] == [field]
    assert text in info.value.errors[0]["message"]


@pytest.mark.parametrize(
    ("layout", "slots", "problem"),
    [
        (Layout(dp=4), [8], None),
        (Layout(dp=8), [8, 2], None),
        (
            Layout(tp=2, dp=4),
            [4, 4],
            "needs tp×pp×cp×dp=8 processes but the largest node in pool 'gpu' offers 4",
        ),
        (Layout(), [], "resources.pool='gpu' has no nodes"),
    ],
)
def test_fit_problem(layout: Layout, slots: list[int], problem: str | None) -> None:
    result = fit_problem(layout, slots, "gpu")
    if problem is None:
        assert result is None
    else:
        assert result is not None and problem in result
