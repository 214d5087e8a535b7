"""The queue's rules, pure and table-driven: priority, quotas, fair share, gangs, packing, backfill,
positions (megatrain.scheduler.placement.place)."""

from __future__ import annotations

from typing import Any

import pytest

from megatrain.scheduler.placement import NodeRoom, QueuedJob, TenantRoom, place
from megatrain.scheduler.reasons import WaitReason, render_wait


def _node(name: str, total: int, busy: int = 0, releases: tuple[tuple[float, int], ...] = ()) -> NodeRoom:
    return NodeRoom(f"id-{name}", name, total, total - busy, frozenset(range(busy)), releases)


def _where(decision: Any) -> list[tuple[str, int]]:
    return [(p.hostname, len(p.devices)) for p in decision.placements]


def _job(job_id: str, n: int, **fields: Any) -> QueuedJob:
    return QueuedJob(job_id, "p", n, **fields)


# -- priority and FIFO, quotas, fair share ---------------------------------------------------------


def test_priority_then_fifo_and_positions() -> None:
    # the queue arrives in (priority, FIFO) order; one 2-device node: the first places, the rest wait
    queue = [_job("high", 2, priority=5), _job("mid", 2, priority=1), _job("low", 2), _job("low2", 1)]
    decisions = place(queue, {"p": [_node("a", 2)]})
    assert [d.job_id for d in decisions] == ["high", "mid", "low", "low2"]
    assert _where(decisions[0]) == [("a", 2)]
    assert [d.position for d in decisions] == [1, 1, 2, 3]  # places among the jobs still waiting
    assert decisions[1].wait and decisions[1].wait.code == "no_free_slots"
    assert [d.wait.as_dict() for d in decisions[2:] if d.wait] == [
        {"code": "behind_job", "pool": "p", "job_id": "mid"},
        {"code": "behind_job", "pool": "p", "job_id": "mid"},
    ]


@pytest.mark.parametrize(
    ("used", "quota", "needs", "placed"),
    [(0, None, 4, True), (0, 4, 4, True), (2, 4, 4, False), (3, 4, 1, True), (0, 0, 1, False)],
)
def test_quota(used: int, quota: int | None, needs: int, placed: bool) -> None:
    tenants = {"acme": TenantRoom(used=used, quota=quota)}
    (d,) = place([_job("j", needs, tenant="acme")], {"p": [_node("a", 8)]}, tenants)
    assert bool(d.placements) == placed
    if not placed:
        assert d.wait is not None
        assert d.wait.as_dict() == {
            "code": "over_quota",
            "pool": "p",
            "needs": needs,
            "quota": quota,
            "used": used,
        }
        assert render_wait(d.wait, owns_blocker=True) == (
            f"needs {needs} devices but its tenant's quota is {quota} and its jobs hold {used}"
        )


def test_quota_counts_jobs_placed_in_the_same_pass_and_blocks_nobody() -> None:
    queue = [_job("a1", 2, tenant="a"), _job("a2", 2, tenant="a"), _job("b1", 2, tenant="b")]
    decisions = place(queue, {"p": [_node("n", 8)]}, {"a": TenantRoom(quota=3)})
    by_id = {d.job_id: d for d in decisions}
    assert by_id["a1"].placements and by_id["b1"].placements
    assert by_id["a2"].wait and by_id["a2"].wait.as_dict()["used"] == 2


def test_fair_share_between_two_tenants() -> None:
    # acme submitted first and already holds 2 devices, globex none: among equal priorities globex
    # goes first until its use catches up, then they alternate (a tie goes to the older job); FIFO
    # inside a tenant
    queue = [_job(f"acme{i}", 1, tenant="acme") for i in range(4)]
    queue += [_job(f"globex{i}", 1, tenant="globex") for i in range(4)]
    tenants = {"acme": TenantRoom(used=2), "globex": TenantRoom(used=0)}
    decisions = place(queue, {"p": [_node("n", 16)]}, tenants)
    order = [d.job_id for d in decisions]
    assert order == ["globex0", "globex1", "acme0", "globex2", "acme1", "globex3", "acme2", "acme3"]
    assert all(d.placements for d in decisions)
    # waiting jobs keep their fair-share order as queue positions: 2 free devices, 8 jobs
    decisions = place(queue, {"p": [_node("n", 2)]}, tenants)
    assert [(d.job_id, d.position) for d in decisions][:4] == [
        ("globex0", 1), ("globex1", 1), ("acme0", 1), ("acme1", 2)
    ]  # fmt: skip
    # a higher priority still beats fair share
    queue = [_job("acme-urgent", 1, tenant="acme", priority=3), *queue]
    assert place(queue, {"p": [_node("n", 16)]}, tenants)[0].job_id == "acme-urgent"


def test_fair_share_weights() -> None:
    # globex's share is twice acme's: at equal use acme's job (use/share 2/1) waits for globex's (2/2)
    queue = [_job("acme0", 1, tenant="acme"), _job("globex0", 1, tenant="globex")]
    tenants = {"acme": TenantRoom(used=2), "globex": TenantRoom(used=2, share=2.0)}
    assert [d.job_id for d in place(queue, {"p": [_node("n", 8)]}, tenants)] == ["globex0", "acme0"]


# -- gangs and packing -----------------------------------------------------------------------------


def test_gang_across_two_nodes_with_whole_tp_groups() -> None:
    # 8 devices, tp×cp=2: no node holds 8; a (4 free of 4) and b (5 free of 8) give whole pairs, b 4 of its 5
    pools = {"p": [_node("a", 4), _node("b", 8, busy=3), _node("c", 2)]}
    (d,) = place([_job("gang", 8, group=2)], pools, multi_node=True)
    assert sorted(_where(d)) == [("a", 4), ("b", 4)]
    # tp×cp=4: b's 5 free hold one group of 4, a's 4 one more: still two nodes, whole groups each
    (d,) = place([_job("gang", 8, group=4)], pools, multi_node=True)
    assert sorted(_where(d)) == [("a", 4), ("b", 4)]
    assert all(len(p.devices) % 4 == 0 for p in d.placements)
    # groups of 4 cannot reach 12 (a 4 + b 4 + c 0): it waits, holding nothing
    (d,) = place([_job("gang", 12, group=4)], pools, multi_node=True)
    assert not d.placements and d.wait and d.wait.code == "no_free_slots" and d.wait.free == 8


def test_packing_uses_the_fewest_nodes_and_best_fit() -> None:
    pools = {"p": [_node("a", 8, busy=6), _node("b", 8, busy=2), _node("c", 8), _node("d", 8, busy=4)]}
    # 2 devices: the node with the least room that holds them (a, 2 free)
    (d,) = place([_job("small", 2)], pools, multi_node=True)
    assert _where(d) == [("a", 2)]
    # 10: c (8) + the best fit for the other 2 (a), two nodes rather than b + d + ...
    (d,) = place([_job("big", 10)], pools, multi_node=True)
    assert _where(d) == [("c", 8), ("a", 2)]
    # 14: c (8) + b (6): two nodes
    (d,) = place([_job("big", 14)], pools, multi_node=True)
    assert _where(d) == [("c", 8), ("b", 6)]


def test_gang_is_never_partial_and_two_big_jobs_do_not_deadlock() -> None:
    # two 12-device jobs on 2×8 free: the first takes 8+4 whole; the second holds nothing and heads
    # the queue (no half-held gangs waiting on each other)
    pools = {"p": [_node("a", 8), _node("b", 8)]}
    first, second = place([_job("big1", 12), _job("big2", 12)], pools, multi_node=True)
    assert sorted(_where(first)) == [("a", 8), ("b", 4)]
    assert second.placements == () and second.wait and second.wait.code == "no_free_slots"
    # every device handed out once
    devices = [(p.hostname, dev) for p in first.placements for dev in p.devices]
    assert len(devices) == len(set(devices)) == 12


def test_single_node_executor_gate() -> None:
    pools = {"p": [_node("a", 4), _node("b", 4)]}
    (d,) = place([_job("gang", 8)], pools)  # multi_node=False: this executor runs a job on one node
    assert d.wait and d.wait.as_dict() == {
        "code": "single_node_executor",
        "pool": "p",
        "needs": 8,
        "nodes": 2,
    }
    assert render_wait(d.wait, owns_blocker=True) == (
        "needs 8 devices across 2 nodes of pool 'p'; this executor runs a job on one node"
    )
    # it blocks nobody: a small job behind it still starts
    _, small = place([_job("gang", 8), _job("small", 2)], pools)
    assert small.placements
    # and a job larger than the whole pool is too big either way
    (d,) = place([_job("huge", 9)], pools, multi_node=True)
    assert d.wait and d.wait.as_dict() == {
        "code": "too_big_for_pool",
        "pool": "p",
        "needs": 9,
        "largest": 4,
        "total": 8,
    }


def test_avoid_prefers_other_nodes_and_falls_back_when_none_has_room() -> None:
    pools = {"p": [_node("a", 4), _node("b", 8)]}
    (d,) = place([_job("j", 2, avoid=frozenset({"id-a"}))], pools)
    assert _where(d) == [("b", 2)]  # best fit would be a
    # Only the avoided node has room for 8: a job is never stranded by the node it was lost on
    # (the embedded default has one node).
    (d,) = place([_job("j", 8, avoid=frozenset({"id-b"}))], pools, multi_node=True)
    assert _where(d) == [("b", 8)]
    (d,) = place([_job("j", 2, avoid=frozenset({"id-a", "id-b"}))], {"p": [_node("a", 4)]})
    assert _where(d) == [("a", 2)]


# -- backfill --------------------------------------------------------------------------------------


def _backfill_pool() -> dict[str, list[NodeRoom]]:
    # one 8-device node; 6 held by a job expected to end in 100 s: 2 free now
    return {"p": [_node("n", 8, busy=6, releases=((100.0, 6),))]}


@pytest.mark.parametrize(
    ("runtime", "expected", "starts"),
    [
        (50.0, None, True),  # ends before the head's estimated start (100 s): backfilled
        (100.0, None, True),  # ends exactly then: still no delay
        (3600.0, None, False),  # would still hold 2 devices at 100 s: refused
        (3600.0, 60.0, True),  # a planner/measured estimate wins over max_runtime_s
        (None, None, False),  # no estimate at all: never ahead of the head
    ],
)
def test_backfill_never_delays_the_head_job(
    runtime: float | None, expected: float | None, starts: bool
) -> None:
    queue = [_job("head", 8), _job("small", 2, max_runtime_s=runtime, expected_runtime_s=expected)]
    head, small = place(queue, _backfill_pool())
    assert head.wait and head.wait.as_dict() == {
        "code": "no_free_slots", "pool": "p", "needs": 8, "freest": 2, "starts_in_s": 100.0,
    }  # fmt: skip
    assert bool(small.placements) == starts
    if not starts:
        assert small.wait and small.wait.code == "behind_job" and small.wait.job_id == "head"
        assert small.position == 2


def test_backfill_refusal_reason_names_the_times() -> None:
    head, small = place([_job("head", 8), _job("small", 2, max_runtime_s=7200.0)], _backfill_pool())
    assert small.wait is not None
    assert render_wait(small.wait, owns_blocker=True) == (
        "behind job head, first in line for pool 'p' "
        "(expected to start in 1m; this job's 2h 00m would delay it)"
    )
    assert render_wait(head.wait, owns_blocker=True) == (  # type: ignore[arg-type]
        "needs 8 free slots in pool 'p'; the freest node has 2; expected to start in 1m"
    )


def test_head_start_counts_jobs_placed_earlier_in_the_same_pass() -> None:
    # 'first' takes 4 of 8 free for up to 500 s; 'head' (8) must wait for it: 500 s, not "now"
    queue = [_job("first", 4, max_runtime_s=500.0), _job("head", 8), _job("short", 4, max_runtime_s=400.0)]
    first, head, short = place(queue, {"p": [_node("n", 8)]})
    assert first.placements and head.wait and head.wait.starts_in_s == 500.0
    assert short.placements  # ends at 400 s < 500 s


def test_wait_reason_round_trip() -> None:
    r = WaitReason("behind_job", "p", job_id="x", starts_in_s=12.5, runtime_s=99.0)
    assert WaitReason.from_dict(r.as_dict() | {"position": 3}) == r


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("multi_node", [False, True])
def test_invariants_on_random_queues(seed: int, multi_node: bool) -> None:
    """Whatever the queue: no device given twice or beyond a node, quotas kept, whole tp×cp groups
    per node, one node per job under a single-node executor, and nothing placed after the head job
    unless it ends by the head's estimated start."""
    import random

    rng = random.Random(seed)
    nodes = []
    for i in range(30):
        busy = rng.choice([0, 0, 2, 4, 8])
        nodes.append(_node(f"n{i:02d}", 8, busy, ((rng.uniform(10, 1000), busy),) if busy else ()))
    quotas = {f"t{t}": TenantRoom(used=rng.randrange(8), quota=rng.choice([None, 16, 40])) for t in range(4)}
    queue = []
    for i in range(300):
        n = rng.choice([1, 2, 4, 8, 16, 24])
        queue.append(
            _job(f"j{i}", n, tenant=f"t{rng.randrange(4)}", priority=rng.choice([0, 0, 1]),
                 group=rng.choice([g for g in (1, 2, 4) if n % g == 0]),
                 max_runtime_s=rng.choice([None, 50.0, 500.0, 5000.0]))
        )  # fmt: skip
    queue.sort(key=lambda q: -q.priority)
    decisions = place(queue, {"p": nodes}, quotas, multi_node=multi_node)
    assert sorted(d.job_id for d in decisions) == sorted(q.id for q in queue)
    job_of = {q.id: q for q in queue}
    free = {n.id: set(n.free_devices()) for n in nodes}
    use = {t: r.used for t, r in quotas.items()}
    head_start: float | None = None
    head_seen = False
    for d in decisions:
        job = job_of[d.job_id]
        if d.placements:
            assert multi_node or len(d.placements) == 1
            assert sum(len(p.devices) for p in d.placements) == job.num_procs
            for p in d.placements:
                assert len(p.devices) % job.group == 0 and set(p.devices) <= free[p.node_id]
                free[p.node_id] -= set(p.devices)
            use[job.tenant] += job.num_procs
            quota = quotas[job.tenant].quota
            assert quota is None or use[job.tenant] <= quota
            if head_seen:  # a backfill: must end by the head's estimated start
                assert head_start is not None and job.runtime_s is not None and job.runtime_s <= head_start
        elif d.wait and d.wait.code == "no_free_slots" and not head_seen:
            head_seen, head_start = True, d.wait.starts_in_s
