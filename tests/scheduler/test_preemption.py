"""Victim choice for preemption (pure): strictly lower priority, preemptible, fewest, lowest
priority, most recently started; whole groups per node; a job already leaving is not counted twice."""

from __future__ import annotations

import pytest

from megatrain.scheduler.placement import NodeRoom, QueuedJob
from megatrain.scheduler.preemption import RunningJob, choose_victims, victims_by_pool


def node(name: str, total: int, busy: tuple[int, ...]) -> NodeRoom:
    return NodeRoom(name, name, total, total - len(busy), frozenset(busy))


def run(
    job_id: str, prio: int, started: float, *shares: tuple[str, tuple[int, ...]], **kw: bool | int
) -> RunningJob:
    return RunningJob(job_id, "p", prio, started, tuple(shares), **kw)


N4 = [node("a", 4, (0, 1, 2, 3))]
FOUR = [
    run("low-old", 0, 1.0, ("a", (0, 1))),
    run("low-new", 0, 2.0, ("a", (2, 3))),
]

CASES = [
    # (name, queued job, nodes, running, multi_node, expected)
    ("most recent of equals", QueuedJob("q", "p", 2, priority=5), N4, FOUR, False, ("low-new",)),
    ("both when it needs all", QueuedJob("q", "p", 4, priority=5), N4, FOUR, False, ("low-old", "low-new")),
    (
        "lowest priority first",
        QueuedJob("q", "p", 2, priority=5),
        N4,
        [run("mid", 3, 9.0, ("a", (0, 1))), run("low", 1, 1.0, ("a", (2, 3)))],
        False,
        ("low",),
    ),
    (
        "mixed priorities when it needs them all",
        QueuedJob("q", "p", 4, priority=5),
        N4,
        [
            run("l1", 0, 1.0, ("a", (0,))),
            run("l2", 0, 1.0, ("a", (1,))),
            run("l3", 0, 1.0, ("a", (2,))),
            run("m4", 1, 1.0, ("a", (3,))),
        ],
        False,
        ("l1", "l2", "l3", "m4"),
    ),
    (
        "fewest beats lowest priority",
        QueuedJob("q", "p", 2, priority=5),
        [node("a", 2, (0, 1)), node("b", 2, (0, 1))],
        [run("s1", 0, 5.0, ("a", (0,))), run("s2", 0, 5.0, ("a", (1,))), run("big", 1, 1.0, ("b", (0, 1)))],
        False,
        ("big",),
    ),
    ("equal priority is never preempted", QueuedJob("q", "p", 2, priority=0), N4, FOUR, False, None),
    (
        "non-preemptible is never chosen",
        QueuedJob("q", "p", 4, priority=5),
        N4,
        [run("keep", 0, 1.0, ("a", (0, 1)), preemptible=False), run("go", 0, 2.0, ("a", (2, 3)))],
        False,
        None,
    ),
    (
        "a spent preemption budget is never chosen",
        QueuedJob("q", "p", 2, priority=5),
        N4,
        [run("spent", 0, 9.0, ("a", (0, 1)), preemptions_left=0), run("old", 0, 1.0, ("a", (2, 3)))],
        False,
        ("old",),
    ),
    (
        "already leaving counts as freed",
        QueuedJob("q", "p", 2, priority=5),
        N4,
        [run("leaving", 0, 1.0, ("a", (0, 1)), preempting=True), run("other", 0, 2.0, ("a", (2, 3)))],
        False,
        (),
    ),
    (
        "already leaving is not chosen twice",
        QueuedJob("q", "p", 4, priority=5),
        N4,
        [run("leaving", 0, 1.0, ("a", (0, 1)), preempting=True), run("other", 0, 2.0, ("a", (2, 3)))],
        False,
        ("other",),
    ),
    (
        "whole tp groups on one node",
        QueuedJob("q", "p", 2, priority=5, group=2),
        [node("a", 2, (0, 1)), node("b", 2, (0, 1))],
        [run("x", 0, 9.0, ("a", (0,))), run("y", 0, 9.0, ("b", (1,))), run("z", 0, 1.0, ("a", (1,)))],
        False,
        ("x", "z"),
    ),
    (
        "a gang needs a multi-node executor",
        QueuedJob("q", "p", 4, priority=5),
        [node("a", 2, (0, 1)), node("b", 2, (0, 1))],
        [run("x", 0, 1.0, ("a", (0, 1))), run("y", 0, 1.0, ("b", (0, 1)))],
        False,
        None,
    ),
    (
        "a gang across nodes when multi-node",
        QueuedJob("q", "p", 4, priority=5),
        [node("a", 2, (0, 1)), node("b", 2, (0, 1))],
        [run("x", 0, 1.0, ("a", (0, 1))), run("y", 0, 1.0, ("b", (0, 1)))],
        True,
        ("x", "y"),
    ),
    (
        "a gang victim frees every node it holds",
        QueuedJob("q", "p", 2, priority=5),
        [node("a", 2, (0,)), node("b", 2, (0,))],
        [run("g", 0, 1.0, ("a", (0,)), ("b", (0,)))],
        True,
        (),
    ),
    (
        "other pools' jobs are not victims",
        QueuedJob("q", "p", 2, priority=5),
        N4,
        [RunningJob("elsewhere", "other", 0, 1.0, (("a", (0, 1)),))],
        False,
        None,
    ),
]


@pytest.mark.parametrize(
    ("name", "job", "nodes", "running", "multi", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_choose_victims(
    name: str,
    job: QueuedJob,
    nodes: list[NodeRoom],
    running: list[RunningJob],
    multi: bool,
    expected: tuple[str, ...] | None,
) -> None:
    got = choose_victims(job, nodes, running, multi_node=multi)
    assert (tuple(sorted(got)) if got else got) == (tuple(sorted(expected)) if expected else expected)


def test_one_job_per_pool_and_tick() -> None:
    queue = [QueuedJob("hi", "p", 2, priority=9), QueuedJob("mid", "p", 2, priority=5)]
    got = victims_by_pool(queue, {"hi", "mid"}, {"p": N4}, FOUR)
    assert got == {"hi": ("low-new",)}


def test_only_waiting_jobs_preempt() -> None:
    queue = [QueuedJob("hi", "p", 2, priority=9)]
    assert victims_by_pool(queue, set(), {"p": N4}, FOUR) == {}
