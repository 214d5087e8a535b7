"""Preemption, pure: which running jobs to stop so a higher-priority queued job fits in its pool.

A queued job that finds no room may take it from running jobs of the same pool whose priority is
strictly lower and which are preemptible (`resources.preemptible`, true by default) with preemptions
left (`resources.max_preemptions`: a job preempted that many times is no longer a candidate and runs
to its end; preemptions never spend its max_retries). The victims are
the fewest that free enough room, preferring the lowest priority and, among equals, the most
recently started (it has the least work to lose). Room counts the way placement counts it: whole
nodes' devices, whole tp×cp groups per node, a gang only where the executor runs multi-node jobs,
since the fit is checked by `placement.place` itself. A job already being preempted is never chosen
again: its devices count as freed already. No database, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import combinations

from megatrain.scheduler.placement import NodeRoom, QueuedJob, place

__all__ = ["MAX_TRIES", "RunningJob", "choose_victims", "victims_by_pool"]

MAX_TRIES = 4096
"""Victim sets tried for the fewest before falling back to taking them greedily in order."""


@dataclass(frozen=True)
class RunningJob:
    """An active job as preemption sees it: its devices on each node it holds."""

    id: str
    pool: str
    priority: int
    started_s: float
    """When it started (any monotonic scale): larger is more recent."""
    shares: tuple[tuple[str, tuple[int, ...]], ...]
    """(node id, devices) of each node it holds."""
    preemptible: bool = True
    preempting: bool = False
    """Already told to checkpoint and stop: its room is as good as free."""
    preemptions_left: int = 1
    """resources.max_preemptions less the times it was preempted: at 0 it is no longer a candidate."""


def _freed(nodes: Sequence[NodeRoom], victims: Sequence[RunningJob]) -> list[NodeRoom]:
    """The pool's nodes as they will be once `victims` have released their devices."""
    gone: dict[str, set[int]] = {}
    for v in victims:
        for node_id, devices in v.shares:
            gone.setdefault(node_id, set()).update(devices)
    out = []
    for n in nodes:
        freed = gone.get(n.id, set()) & n.busy_devices
        if freed:
            n = replace(n, free=min(n.total, n.free + len(freed)), busy_devices=n.busy_devices - freed)
        out.append(n)
    return out


def _fits(job: QueuedJob, nodes: Sequence[NodeRoom], multi_node: bool) -> bool:
    (decision,) = place([replace(job, avoid=frozenset())], {job.pool: nodes}, multi_node=multi_node)
    return bool(decision.placements)


def choose_victims(
    job: QueuedJob,
    nodes: Sequence[NodeRoom],
    running: Sequence[RunningJob],
    *,
    multi_node: bool = False,
) -> tuple[str, ...] | None:
    """The ids of the running jobs to preempt so `job` fits on `nodes` (its pool's ready nodes);
    () when the jobs already being preempted free enough; None when preemption cannot make it fit."""
    mine = [r for r in running if r.pool == job.pool]
    leaving = [r for r in mine if r.preempting]
    base = _freed(nodes, leaving)
    if _fits(job, base, multi_node):
        return ()
    # Lowest priority first; among equals the most recently started, then by id for stable output.
    candidates = sorted(
        (
            r
            for r in mine
            if not r.preempting and r.preemptible and r.preemptions_left > 0 and r.priority < job.priority
        ),
        key=lambda r: (r.priority, -r.started_s, r.id),
    )
    if not candidates or not _fits(job, _freed(base, candidates), multi_node):
        return None
    tries = 0
    for k in range(1, len(candidates) + 1):
        # combinations() keeps the candidates' order: the first set that fits is the preferred one.
        for victims in combinations(candidates, k):
            tries += 1
            if tries > MAX_TRIES:
                return _greedy(job, base, candidates, multi_node)
            if _fits(job, _freed(base, victims), multi_node):
                return tuple(v.id for v in victims)
    return None  # unreachable: all candidates together fit


def _greedy(
    job: QueuedJob, base: Sequence[NodeRoom], candidates: Sequence[RunningJob], multi_node: bool
) -> tuple[str, ...]:
    """Take candidates in order until the job fits, then drop any the job does not need."""
    chosen: list[RunningJob] = []
    for c in candidates:
        chosen.append(c)
        if _fits(job, _freed(base, chosen), multi_node):
            break
    for c in reversed(list(chosen)):
        rest = [v for v in chosen if v is not c]
        if _fits(job, _freed(base, rest), multi_node):
            chosen = rest
    return tuple(v.id for v in chosen)


def victims_by_pool(
    queue: Sequence[QueuedJob],
    waiting: set[str],
    pools: Mapping[str, Sequence[NodeRoom]],
    running: Sequence[RunningJob],
    *,
    multi_node: bool = False,
) -> dict[str, tuple[str, ...]]:
    """For each pool, the first job of `queue` (priority order) among `waiting` (those that found
    no room) that preemption can make fit: {that job's id: its new victims}. One job per pool and
    tick, so a pool's room is never promised twice."""
    out: dict[str, tuple[str, ...]] = {}
    done: set[str] = set()
    for q in queue:
        if q.id not in waiting or q.pool in done or q.pool not in pools or q.cancel_requested:
            continue
        victims = choose_victims(q, pools[q.pool], running, multi_node=multi_node)
        if victims is None:
            continue
        done.add(q.pool)
        if victims:
            out[q.id] = victims
    return out
