"""Placement, pure: which queued job goes on which node and devices, and why every other one waits.

Rule (strict priority, no backfill): the queue comes in scheduling order (priority, highest first,
then FIFO by creation). Within a pool, once a job that *could* fit a node (its size is at most the
largest node's total slots) finds no node with room, no later job of that pool is placed: small
low-priority jobs never keep a big high-priority one waiting forever. A job too big for every node
of its pool waits without blocking the others. Among the nodes with room the fullest wins (best
fit keeps big holes for big jobs), and the job gets that node's lowest free device indices.

The scheduling loop places what this returns (through guarded UPDATEs, since several schedulers
may race); `GET /v1/cluster` shows the same decisions as "why it waits". No database, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from megatrain.scheduler.reasons import (
    BEHIND_JOB,
    CANCEL_REQUESTED,
    NO_FREE_SLOTS,
    NO_READY_NODES,
    TOO_BIG_FOR_POOL,
    WaitReason,
)


@dataclass(frozen=True)
class QueuedJob:
    id: str
    pool: str
    num_procs: int
    cancel_requested: bool = False
    avoid: frozenset[str] = frozenset()
    """Ids of nodes an earlier attempt was lost on: used only when no other node has room."""


@dataclass(frozen=True)
class NodeRoom:
    """A ready node as placement sees it: total slots, free slots, and the devices in use."""

    id: str
    hostname: str
    total: int
    free: int
    busy_devices: frozenset[int] = field(default_factory=frozenset)

    def free_devices(self) -> list[int]:
        return [d for d in range(self.total) if d not in self.busy_devices]


@dataclass(frozen=True)
class Placement:
    node_id: str
    hostname: str
    devices: tuple[int, ...]


@dataclass(frozen=True)
class Decision:
    """Exactly one of `placement` and `wait` is set."""

    job_id: str
    placement: Placement | None = None
    wait: WaitReason | None = None


@dataclass
class _Room:
    node: NodeRoom
    devices: list[int]  # free device indices, lowest first; len() is the node's usable room

    @property
    def free(self) -> int:
        # Slots and devices are both kept by the database; rows of jobs placed before devices were
        # recorded hold slots but no devices, so the smaller count is what is really free.
        return min(self.node.free, len(self.devices))


def place(queue: Sequence[QueuedJob], pools: Mapping[str, Sequence[NodeRoom]]) -> list[Decision]:
    """One decision per job of `queue` (in scheduling order), in that order. `pools` maps a pool's
    name to its ready nodes; it is not modified."""
    rooms = {name: [_Room(n, n.free_devices()) for n in nodes] for name, nodes in pools.items()}
    first_blocked: dict[str, str] = {}
    out: list[Decision] = []
    for job in queue:
        nodes = rooms.get(job.pool, [])
        if job.cancel_requested:
            out.append(Decision(job.id, wait=WaitReason(CANCEL_REQUESTED, job.pool)))
            continue
        if not nodes:
            out.append(Decision(job.id, wait=WaitReason(NO_READY_NODES, job.pool)))
            continue
        largest = max(r.node.total for r in nodes)
        if job.num_procs > largest:
            reason = WaitReason(TOO_BIG_FOR_POOL, job.pool, needs=job.num_procs, largest=largest)
            out.append(Decision(job.id, wait=reason))
            continue
        if job.pool in first_blocked:
            reason = WaitReason(BEHIND_JOB, job.pool, job_id=first_blocked[job.pool])
            out.append(Decision(job.id, wait=reason))
            continue
        fits = sorted((r for r in nodes if r.free >= job.num_procs), key=lambda r: (r.free, r.node.hostname))
        if not fits:
            first_blocked[job.pool] = job.id
            freest = max(r.free for r in nodes)
            reason = WaitReason(NO_FREE_SLOTS, job.pool, needs=job.num_procs, freest=freest)
            out.append(Decision(job.id, wait=reason))
            continue
        room = next((r for r in fits if r.node.id not in job.avoid), fits[0])
        devices, room.devices = room.devices[: job.num_procs], room.devices[job.num_procs :]
        room.node = NodeRoom(
            room.node.id,
            room.node.hostname,
            room.node.total,
            room.node.free - job.num_procs,
            room.node.busy_devices | set(devices),
        )
        out.append(Decision(job.id, placement=Placement(room.node.id, room.node.hostname, tuple(devices))))
    return out


class _Sized(Protocol):
    @property
    def world_size(self) -> int: ...


def fit_problem(layout: _Sized, node_slots: list[int], pool: str) -> str | None:
    """Why a layout can never run on a pool whose nodes offer `node_slots` processes, or None.

    Jobs run on one node for now (gang placement across nodes comes with multi-node torchrun).
    """
    if not node_slots:
        return f"resources.pool={pool!r} has no nodes"
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
