"""Why each queued job waits: a pure replay of the scheduler's placement rule on a snapshot.

It follows megatrain/scheduler/loop.py (strict priority, FIFO within a priority, no backfill, best
fit on the fullest node with room): jobs are taken in queue order against each pool's free slots;
a job that fits is what the next tick will place; the first job of a pool that could fit a node
but finds no room blocks every later job of that pool. Jobs of other tenants are named only by
their place in the queue, never by id or name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QueuedJob:
    id: str
    pool: str
    num_procs: int
    own: bool
    """Whether the viewer's tenant owns it (only then may its id be shown)."""
    cancel_requested: bool = False


@dataclass
class NodeRoom:
    hostname: str
    total: int
    free: int


def _ref(job: QueuedJob, position: int) -> str:
    return f"job {job.id}" if job.own else f"another tenant's job (#{position} in the queue)"


def explain_queue(queue: list[QueuedJob], pools: dict[str, list[NodeRoom]]) -> list[str]:
    """One reason per job of `queue` (already in scheduling order). `pools` maps a pool's name to
    its ready nodes' free slots; it is not modified."""
    free = {name: [NodeRoom(n.hostname, n.total, n.free) for n in nodes] for name, nodes in pools.items()}
    blocked_by: dict[str, tuple[QueuedJob, int]] = {}
    reasons = []
    for position, job in enumerate(queue, start=1):
        nodes = free.get(job.pool, [])
        s = "s" * (job.num_procs != 1)
        if job.cancel_requested:
            reasons.append("cancel requested: the scheduler removes it on its next tick")
            continue
        if not nodes:
            reasons.append(f"pool {job.pool!r} has no ready nodes")
            continue
        biggest = max(n.total for n in nodes)
        if job.num_procs > biggest:
            reasons.append(
                f"needs {job.num_procs} slot{s} but the largest node in pool {job.pool!r} offers {biggest}"
            )
            continue
        if job.pool in blocked_by:
            first, at = blocked_by[job.pool]
            reasons.append(f"behind {_ref(first, at)}, first in line for pool {job.pool!r} (no backfill)")
            continue
        fits = sorted((n for n in nodes if n.free >= job.num_procs), key=lambda n: (n.free, n.hostname))
        if not fits:
            blocked_by[job.pool] = (job, position)
            most = max(n.free for n in nodes)
            reasons.append(
                f"needs {job.num_procs} free slot{s} in pool {job.pool!r}; the freest node has {most}"
            )
            continue
        fits[0].free -= job.num_procs
        reasons.append(f"fits now on {fits[0].hostname}: starts on the scheduler's next tick")
    return reasons
