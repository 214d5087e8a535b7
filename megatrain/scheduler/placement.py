"""Placement, pure: which queued job goes on which nodes and devices, and why every other one waits.

The rule, in order:

1. **Priority, then fair share, then FIFO.** The queue comes in (priority, highest first; FIFO)
   order. Among jobs of equal priority the next decision goes to the tenant holding the fewest
   devices for its share (devices of its running jobs plus those placed in this call, over its
   share weight, 1 by default; ties: the tenant whose next job is older); inside a tenant, FIFO.
   Devices count over all pools, as quotas do.
2. **Quotas.** A job that would take its tenant over its device quota waits (`over_quota`, with the
   quota and the use) without holding anyone up; the tenant's later, smaller jobs may still fit.
3. **Gangs, packed.** A job is placed whole or not at all: on the one node with the least room that
   holds it (best fit), or, when none does and the executor runs multi-node jobs, on the fewest
   nodes (fullest first; the last share on the node that fits it best). Every node gets whole
   tp×cp groups, so tensor and context parallel ranks never cross nodes; pipeline stages may.
   A job that needs several nodes under a single-node executor waits (`single_node_executor`).
4. **Head of line and backfill.** In each pool the first job that could run there but finds no
   room is the head: its start is estimated by replaying the running jobs' expected ends. A later
   job may start ahead of it only if it fits now and is expected to end (expected or maximum
   runtime) before that estimated start, so it never delays the head; else it waits `behind_job`.
   Without an estimate (some end unknown) nothing starts ahead of the head. A job too big for its
   pool waits without blocking anyone.

Every decision also carries the job's place in its pool's queue (1 = next, counting the jobs of that
pool still waiting ahead of it in this order). The scheduling loop reserves what this returns
(guarded UPDATEs, since several schedulers may race); `GET /v1/cluster` shows the same decisions.
No database, no clock.
"""

from __future__ import annotations

import heapq
import re
from collections import defaultdict, deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Protocol

from megatrain.scheduler.reasons import (
    BEHIND_JOB,
    CANCEL_REQUESTED,
    NO_FREE_SLOTS,
    NO_READY_NODES,
    OVER_QUOTA,
    SINGLE_NODE_EXECUTOR,
    TOO_BIG_FOR_POOL,
    WaitReason,
)
from megatrain.scheduler.rooms import NodeRoom, Placement, PoolRooms

__all__ = ["Decision", "NodeRoom", "Placement", "QueuedJob", "TenantRoom", "place"]


@dataclass(frozen=True)
class RuleItem:
    title: str
    """Its bold headline, e.g. 'Priority, then fair share, then FIFO.'"""
    text: str


def rule_items(doc: str | None = __doc__) -> list[RuleItem]:
    """The placement rule, item by item, read from this module's docstring: the Cluster page shows
    these words, so what it says and what this module does have one source."""
    items = re.findall(r"^\d+\. \*\*(.+?)\*\* (.+?)(?=^\d+\. |^\s*$)", doc or "", re.M | re.S)
    return [RuleItem(title, " ".join(text.split())) for title, text in items]


def rule_summary() -> str:
    """The rule's headlines in one line: 'priority, then fair share, then FIFO; quotas; …'."""
    return "; ".join(item.title[:1].lower() + item.title[1:].rstrip(".") for item in rule_items())


@dataclass(frozen=True)
class QueuedJob:
    id: str
    pool: str
    num_procs: int
    cancel_requested: bool = False
    tenant: str = ""
    priority: int = 0
    group: int = 1
    """tp×cp: ranks that must share a node; each node gets a whole number of groups."""
    max_runtime_s: float | None = None
    expected_runtime_s: float | None = None
    """The planner's or a measured estimate, when there is one (else max_runtime_s is used)."""
    avoid: frozenset[str] = frozenset()
    """Node ids an earlier attempt was lost on: used only when no other node has room now."""

    @property
    def runtime_s(self) -> float | None:
        return self.expected_runtime_s if self.expected_runtime_s is not None else self.max_runtime_s


@dataclass(frozen=True)
class TenantRoom:
    """A tenant as placement sees it: devices its active jobs hold, its quota, its fair-share weight."""

    used: int = 0
    quota: int | None = None
    share: float = 1.0


@dataclass(frozen=True)
class Decision:
    """Exactly one of `placements` (one entry per node: a gang) and `wait` is set."""

    job_id: str
    placements: tuple[Placement, ...] = ()
    wait: WaitReason | None = None
    position: int | None = None
    """Place in its pool's queue (1 = next); None for a job whose cancel was requested."""

    @property
    def placement(self) -> Placement | None:
        """The first (for a single-node job, the only) node's share; None while it waits."""
        return self.placements[0] if self.placements else None


@dataclass
class _Head:
    job_id: str
    starts_in_s: float | None


@dataclass
class _Pool:
    rooms: PoolRooms
    head: _Head | None = None
    waiting: int = 0
    capacity: dict[int, tuple[int, int, list[int]]] = field(default_factory=dict)

    def capacity_for(self, job: QueuedJob) -> tuple[int, int, list[int]]:
        # What could ever fit ignores `avoid`: avoiding a node is a preference, not a limit.
        if job.group not in self.capacity:
            self.capacity[job.group] = self.rooms.capacity(job.group)
        return self.capacity[job.group]


def _fair_order(
    jobs: list[tuple[int, QueuedJob]], usage: dict[str, float], shares: dict[str, float]
) -> Iterator[QueuedJob]:
    """Yield the jobs of one priority level: the tenant with the least use for its share first,
    FIFO inside a tenant. The caller adds to `usage` between yields (a placed job's devices)."""
    queues: dict[str, deque[tuple[int, QueuedJob]]] = defaultdict(deque)
    for item in jobs:
        queues[item[1].tenant].append(item)
    heap = [(usage[t] / shares[t], q[0][0], t) for t, q in queues.items()]
    heapq.heapify(heap)
    while heap:
        _, _, tenant = heapq.heappop(heap)
        q = queues[tenant]
        yield q.popleft()[1]
        if q:
            heapq.heappush(heap, (usage[tenant] / shares[tenant], q[0][0], tenant))


def place(
    queue: Sequence[QueuedJob],
    pools: Mapping[str, Sequence[NodeRoom]],
    tenants: Mapping[str, TenantRoom] | None = None,
    *,
    multi_node: bool = False,
) -> list[Decision]:
    """One decision per job of `queue` (given in (priority, FIFO) order), in scheduling order (the
    rule above). `pools` maps a pool's name to its ready nodes, `tenants` a job's tenant to its use
    and quota (absent: none, unlimited); `multi_node`: whether the executor can run a job across
    nodes. Nothing passed in is modified."""
    tenants = tenants or {}
    state = {name: _Pool(PoolRooms(nodes)) for name, nodes in pools.items()}
    for job in queue:  # a pool without ready nodes still has a queue, and positions in it
        state.setdefault(job.pool, _Pool(PoolRooms(())))
    usage: dict[str, float] = defaultdict(float)
    shares: dict[str, float] = defaultdict(lambda: 1.0)
    for name, t in tenants.items():
        usage[name] = t.used
        shares[name] = t.share if t.share > 0 else 1.0
    out: list[Decision] = []
    indexed = list(enumerate(queue))
    for _, level in groupby(indexed, key=lambda item: item[1].priority):
        for job in _fair_order(list(level), usage, shares):
            decision = _decide(job, state[job.pool], tenants.get(job.tenant), usage, multi_node)
            if decision.placements:
                usage[job.tenant] += job.num_procs
            out.append(decision)
    return out


def _decide(
    job: QueuedJob,
    pool: _Pool,
    tenant: TenantRoom | None,
    usage: Mapping[str, float],
    multi_node: bool,
) -> Decision:
    def wait(code: str, **fields: object) -> Decision:
        if code == CANCEL_REQUESTED:
            return Decision(job.id, wait=WaitReason(code, job.pool, **fields))  # type: ignore[arg-type]
        pool.waiting += 1
        return Decision(job.id, wait=WaitReason(code, job.pool, **fields), position=pool.waiting)  # type: ignore[arg-type]

    if job.cancel_requested:
        return wait(CANCEL_REQUESTED)
    if not pool.rooms.nodes:
        return wait(NO_READY_NODES)
    n, avoid = job.num_procs, job.avoid
    group = job.group if job.group >= 1 and n % job.group == 0 else 1
    total, largest, sizes = pool.capacity_for(job)
    if n > largest and (not multi_node or n > total):
        if n > total:
            extra = {"total": total} if multi_node else {}
            return wait(TOO_BIG_FOR_POOL, needs=n, largest=largest, **extra)
        nodes = next(k for k in range(1, len(sizes) + 1) if sum(sizes[:k]) >= n)
        return wait(SINGLE_NODE_EXECUTOR, needs=n, nodes=nodes)
    if tenant is not None and tenant.quota is not None and usage[job.tenant] + n > tenant.quota:
        return wait(OVER_QUOTA, needs=n, quota=tenant.quota, used=int(usage[job.tenant]))
    rooms = pool.rooms
    head = pool.head
    runtime = job.runtime_s
    if head is not None and (head.starts_in_s is None or runtime is None or runtime > head.starts_in_s):
        extra = (
            {"starts_in_s": head.starts_in_s, "runtime_s": runtime} if head.starts_in_s is not None else {}
        )
        return wait(BEHIND_JOB, job_id=head.job_id, **extra)
    shares = _find(rooms, n, group, multi_node and n > 0, avoid)
    if shares is None:
        gang = multi_node and n > largest
        starts = None
        if head is None:  # only the head's start is estimated: the replay is the costly part
            starts = rooms.earliest_start(n, group, multi_node, avoid)
            pool.head = _Head(job.id, starts)
        extra = {"free": rooms.usable_free(group, avoid)} if gang else {}
        return wait(NO_FREE_SLOTS, needs=n, freest=rooms.freest(avoid), starts_in_s=starts, **extra)
    placements = tuple(rooms.take(i, count, runtime) for i, count in shares)
    return Decision(job.id, placements=placements, position=pool.waiting + 1)


def _find(
    rooms: PoolRooms, n: int, group: int, multi_node: bool, avoid: frozenset[str]
) -> list[tuple[int, int]] | None:
    """Where `n` devices fit now: one node (best fit) if any holds them, else (multi-node) a gang."""
    i = rooms.best_fit(n, avoid)
    if i is not None:
        return [(i, n)]
    found = rooms.gang(n, group, avoid) if multi_node else None
    if found is None and avoid:  # the avoided nodes only when nothing else has room now
        return _find(rooms, n, group, multi_node, frozenset())
    return found


class _Sized(Protocol):
    @property
    def world_size(self) -> int: ...


def fit_problem(layout: _Sized, node_slots: list[int], pool: str, multi_node: bool = False) -> str | None:
    """Why a layout can never run on a pool whose nodes offer `node_slots` processes, or None.

    Under a single-node executor a job must fit one node; `multi_node` lets it span the pool.
    """
    if not node_slots:
        return f"resources.pool={pool!r} has no nodes"
    if multi_node:
        if layout.world_size > sum(node_slots):
            return (
                f"the job needs tp×pp×cp×dp={layout.world_size} processes but pool {pool!r} offers "
                f"{sum(node_slots)} over all its nodes"
            )
        return None
    biggest = max(node_slots)
    if layout.world_size > biggest:
        return (
            f"the job needs tp×pp×cp×dp={layout.world_size} processes but the largest node in "
            f"pool {pool!r} offers {biggest}"
        )
    return None


def memory_problem(
    per_device_bytes: int, layout_text: str, device_memory: list[int], pool: str
) -> str | None:
    """Why a job needing `per_device_bytes` on each device can never fit a node of a pool whose
    nodes' devices hold `device_memory` bytes (unknown sizes left out), or None."""
    if not device_memory or per_device_bytes <= max(device_memory):
        return None
    gib = 1 << 30
    return (
        f"the job needs about {per_device_bytes / gib:,.1f} GiB per device with layout {layout_text} "
        f"(the engine's memory estimate) but the largest device in pool {pool!r} has "
        f"{max(device_memory) / gib:,.1f} GiB: raise parallelism (tp, pp, dp with the distributed "
        f"optimizer), turn on recompute, or lower micro_batch_size"
    )


def startup_memory_problem(
    startup_bytes: int, layout_text: str, device_memory: list[int], pool: str
) -> str | None:
    """Why a job whose ranks hold `startup_bytes` per device while starting (before the first step:
    megatrain.plan.startup_memory) can never start on a node of the pool, or None."""
    if not device_memory or startup_bytes <= max(device_memory):
        return None
    gib = 1 << 30
    return (
        f"the job needs about {startup_bytes / gib:,.1f} GiB per device to start with layout "
        f"{layout_text} (the engine's start-up peak: the build, DataParallel's parameter and "
        f"gradient buffers and the optimizer's fp32 mains, before the first step) but the largest "
        f"device in pool {pool!r} has {max(device_memory) / gib:,.1f} GiB: raise tp or pp (while "
        f"starting, a rank holds its whole share of the weights and gradients whatever dp is)"
    )
