"""placement.place and fit_problem (pure), and the reasons' one rendering to text."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from megatrain.scheduler.placement import Decision, NodeRoom, Placement, QueuedJob, fit_problem, place
from megatrain.scheduler.reasons import WaitReason, render_wait


def _node(name: str, total: int, free: int, busy: set[int] | None = None) -> NodeRoom:
    return NodeRoom(f"id-{name}", name, total, free, frozenset(busy or ()))


def test_place_follows_the_scheduler_rule() -> None:
    pools = {"default": [_node("a", 4, 1, {0, 1, 2}), _node("b", 4, 3, {0})], "empty": []}
    queue = [
        QueuedJob("job-fits", "default", 2),  # best fit: b (3 free) -> 1 left
        QueuedJob("job-big", "default", 2),  # no node has 2 free now: blocks the pool
        QueuedJob("job-small", "default", 1),  # would fit, but no backfill
        QueuedJob("job-huge", "default", 9),  # larger than the whole pool: waits, blocks nobody
        QueuedJob("job-nopool", "gpu", 1),
        QueuedJob("job-gone", "default", 1, cancel_requested=True),
    ]
    decisions = place(queue, pools)
    assert [d.job_id for d in decisions] == [q.id for q in queue]
    assert decisions[0] == Decision("job-fits", placements=(Placement("id-b", "b", (1, 2)),), position=1)
    assert [d.wait.as_dict() if d.wait else None for d in decisions[1:]] == [
        {"code": "no_free_slots", "pool": "default", "needs": 2, "freest": 1},
        {"code": "behind_job", "pool": "default", "job_id": "job-big"},
        {"code": "too_big_for_pool", "pool": "default", "needs": 9, "largest": 4},
        {"code": "no_ready_nodes", "pool": "gpu"},
        {"code": "cancel_requested", "pool": "default"},
    ]
    assert pools["default"][1].free == 3  # the caller's snapshot is not changed


def test_place_gives_each_job_its_own_devices() -> None:
    # a fake GPU node with 4 devices: two 2-slot jobs split it, a third waits
    gpu = {"gpu": [_node("g", 4, 4)]}
    jobs = [QueuedJob(f"j{i}", "gpu", 2) for i in range(3)]
    first, second, third = place(jobs, gpu)
    assert first.placement and first.placement.devices == (0, 1)
    assert second.placement and second.placement.devices == (2, 3)
    assert third.wait and third.wait.code == "no_free_slots"
    # devices held by running jobs are skipped, and the free ones are handed out lowest first
    (d,) = place([QueuedJob("j", "gpu", 2)], {"gpu": [_node("g", 4, 2, {0, 2})]})
    assert d.placement and d.placement.devices == (1, 3)


def test_slots_held_without_devices_count_as_busy() -> None:
    # a job placed before devices were recorded holds slots but no device indices: the node's room
    # is the smaller of the two counts, never more devices than slots
    node = _node("g", 4, 1, {3})
    (d,) = place([QueuedJob("j", "gpu", 2)], {"gpu": [node]})
    assert d.wait and d.wait.as_dict() == {"code": "no_free_slots", "pool": "gpu", "needs": 2, "freest": 1}


def test_render_names_only_the_viewers_own_blocking_job() -> None:
    behind = WaitReason("behind_job", "default", job_id="job-x")
    assert render_wait(behind, owns_blocker=True) == (
        "behind job job-x, first in line for pool 'default' (no backfill)"
    )
    other = render_wait(behind, owns_blocker=False, blocker_position=2)
    assert (
        other
        == "behind another tenant's job (#2 in the queue), first in line for pool 'default' (no backfill)"
    )
    assert "job-x" not in render_wait(behind, owns_blocker=False)
    assert render_wait(WaitReason("no_free_slots", "p", needs=1, freest=0), owns_blocker=False) == (
        "needs 1 free slot in pool 'p'; the freest node has 0"
    )
    assert render_wait(WaitReason("too_big_for_pool", "p", needs=8, largest=4), owns_blocker=False) == (
        "needs 8 slots but the largest node in pool 'p' offers 4"
    )
    assert WaitReason.from_dict(behind.as_dict()) == behind


@dataclass(frozen=True)
class _Layout:
    world_size: int


@pytest.mark.parametrize(
    ("world_size", "slots", "problem"),
    [
        (4, [8], None),
        (8, [8, 2], None),
        (8, [4, 4], "needs tp×pp×cp×dp=8 processes but the largest node in pool 'gpu' offers 4"),
        (1, [], "resources.pool='gpu' has no nodes"),
    ],
)
def test_fit_problem(world_size: int, slots: list[int], problem: str | None) -> None:
    result = fit_problem(_Layout(world_size), slots, "gpu")
    if problem is None:
        assert result is None
    else:
        assert result is not None and problem in result


def test_the_rule_as_its_docstring_states_it() -> None:
    # The Cluster page shows these (GET /v1/cluster's `scheduling`): a reworded docstring must still parse.
    from megatrain.scheduler import placement

    items = placement.rule_items()
    assert [i.title for i in items] == [
        "Priority, then fair share, then FIFO.",
        "Quotas.",
        "Gangs, packed.",
        "Head of line and backfill.",
    ]
    assert all(i.text and "**" not in i.text for i in items)
    assert placement.rule_summary().startswith("priority, then fair share, then FIFO; quotas; ")
