"""The zero-bubble orders as pure functions: every action once, dependencies satisfiable, the exact
simulated bubble (F = B = W) against the formula, 1F1B's peak memory, and zbv at pp=4 M=16 below
half of 1F1B's bubble."""

from __future__ import annotations

import pytest

from megatrain.engine.parallel.schedules import (
    ScheduleError,
    check_schedule,
    chunk_stage,
    schedule_actions,
    simulate,
    stage_chunk_ids,
    theoretical_bubble,
)
from megatrain.engine.parallel.zero_bubble import split_bubble


@pytest.mark.parametrize("schedule,v", [("zb-h1", 1), ("zbv", 2)])
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 4, 8, 16, 32])
def test_every_action_once_in_dependency_order(schedule: str, v: int, pp: int, m: int) -> None:
    for stage in range(pp):
        acts = schedule_actions(schedule, pp, stage, m, v)
        assert sorted(acts) == sorted((k, c, b) for k in "FBW" for c in range(v) for b in range(m))
        for c in range(v):  # per chunk: F before B before W, each in micro-batch order
            for kind in "FBW":
                assert [a.microbatch for a in acts if a.chunk == c and a.kind == kind] == list(range(m))
            for b in range(m):
                f, bw, w = (acts.index((k, c, b)) for k in "FBW")
                assert f < bw < w
    sim = simulate(schedule, pp, m, v)  # raises on a deadlock
    # 1F1B's memory: at most pp micro-batches' activations on any stage (zbv: 2pp half-size chunks).
    assert max(sim.peak_in_flight) <= pp * v


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [8, 16, 32])
def test_simulated_bubble_is_the_formula(pp: int, m: int) -> None:
    if m < 2 * pp - 1:
        pytest.skip("the V's formula holds from 2p-1 micro-batches on")
    for schedule, v in (("zb-h1", 1), ("zbv", 2)):
        sim = simulate(schedule, pp, m, v)
        assert sim.bubble_fraction == pytest.approx(split_bubble(schedule, pp, m), rel=1e-9)
        assert theoretical_bubble(pp, m, v, schedule) == pytest.approx(sim.bubble_fraction, rel=1e-9)
    one_f_one_b = simulate("1f1b", pp, m).bubble_fraction
    # zb-h1: (p-1)(F+B-W) against 1F1B's (p-1)(F+B+W), a third of the idle time.
    assert simulate("zb-h1", pp, m).bubble_fraction < one_f_one_b / 2
    assert simulate("zb-h1", pp, m).peak_in_flight == (pp,) * pp


def test_zbv_at_pp4_m16_is_below_half_of_1f1b() -> None:
    zbv = simulate("zbv", 4, 16, 2).bubble_fraction
    assert zbv == pytest.approx(1.5 / 49.5)  # (p-1)·F/2 idle against 3m of work per stage
    assert zbv < simulate("1f1b", 4, 16).bubble_fraction / 2


def test_the_v_places_both_ends_on_stage_zero() -> None:
    assert [stage_chunk_ids(s, 4, 2, "zbv") for s in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [chunk_stage(c, 4, 2, "zbv") for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [chunk_stage(c, 4, 2) for c in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_rules_name_what_is_wrong() -> None:
    with pytest.raises(ScheduleError, match="zb-h1 runs one chunk per stage"):
        check_schedule("zb-h1", 2, 4, 2)
    with pytest.raises(ScheduleError, match="zbv runs two chunks per stage"):
        check_schedule("zbv", 2, 4, 1)
    with pytest.raises(ScheduleError, match="zbv runs two chunks per stage"):
        check_schedule("zbv", 1, 4, 2)
    check_schedule("zbv", 4, 6, 2)  # the V takes any number of micro-batches
