"""The free room of one pool's ready nodes during one `placement.place` call, indexed for speed.

Nodes are bucketed by their free device count, each bucket a heap of node indices (hostname
order): best fit is "the lowest non-empty bucket at or above the need", a gang is "the fullest
buckets downwards". Free room only shrinks inside one call, so a node that left a bucket never
comes back to it and stale heap entries can be dropped lazily. Pure: no database, no clock.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodeRoom:
    """A ready node as placement sees it: total slots, free slots, the devices in use, and when the
    jobs holding slots there are expected to end (`releases`: seconds from now, slots freed)."""

    id: str
    hostname: str
    total: int
    free: int
    busy_devices: frozenset[int] = field(default_factory=frozenset)
    releases: tuple[tuple[float, int], ...] = ()

    def free_devices(self) -> list[int]:
        return [d for d in range(self.total) if d not in self.busy_devices]


@dataclass(frozen=True)
class Placement:
    """One node's share of a job: the node and the device indices the job's ranks get there."""

    node_id: str
    hostname: str
    devices: tuple[int, ...]


def whole(n: int, group: int) -> int:
    """The most of `n` devices that hold whole groups of `group` (tp×cp ranks share a node)."""
    return n - n % group


class PoolRooms:
    def __init__(self, nodes: Sequence[NodeRoom]):
        self.nodes = sorted(nodes, key=lambda n: (n.hostname, n.id))
        self.index = {n.id: i for i, n in enumerate(self.nodes)}
        self.devices = [n.free_devices() for n in self.nodes]
        # Slots and devices are both kept by the database; rows of jobs placed before devices were
        # recorded hold slots but no devices, so the smaller count is what is really free.
        self.free = [max(0, min(n.free, len(d))) for n, d in zip(self.nodes, self.devices, strict=True)]
        self.counts: Counter[int] = Counter(self.free)
        self.top = max((n.total for n in self.nodes), default=0)
        self.buckets: list[list[int]] = [[] for _ in range(self.top + 1)]
        for i, f in enumerate(self.free):
            self.buckets[f].append(i)  # appended in index order: already a heap
        self.ends: list[list[tuple[float, int]]] = [list(n.releases) for n in self.nodes]
        """Expected releases per node: the snapshot's, plus those of jobs placed in this call."""

    # -- what can never fit -----------------------------------------------------------------------

    def capacity(self, group: int, avoid: Collection[str] = ()) -> tuple[int, int, list[int]]:
        """(all whole-group devices of the pool, the largest node's, each node's, largest first)."""
        sizes = sorted((whole(n.total, group) for n in self.nodes if n.id not in avoid), reverse=True)
        return sum(sizes), (sizes[0] if sizes else 0), sizes

    # -- what fits now ----------------------------------------------------------------------------

    def _valid(self, f: int, avoid: Collection[str]) -> list[int]:
        """Node indices with exactly `f` free now, lowest first (drops stale heap entries)."""
        heap = self.buckets[f]
        if not avoid:
            while heap and self.free[heap[0]] != f:
                heapq.heappop(heap)
            return heap[:1]
        return sorted(i for i in heap if self.free[i] == f and self.nodes[i].id not in avoid)

    def best_fit(self, n: int, avoid: Collection[str] = (), skip: Collection[int] = ()) -> int | None:
        """The node with the least free room that still holds `n` (ties: hostname order). With a
        group size dividing n, f >= n already means whole groups fit."""
        for f in range(max(n, 1), self.top + 1):
            if not self.counts[f]:
                continue
            if not skip:
                found = self._valid(f, avoid)
                if found:
                    return found[0]
                continue
            for i in self._valid(f, avoid) if avoid else sorted(self.buckets[f]):
                if self.free[i] == f and i not in skip:
                    return i
        return None

    def usable_free(self, group: int, avoid: Collection[str] = ()) -> int:
        """Free devices in whole groups over every node (the most a gang could get now)."""
        if avoid:
            return sum(whole(self.free[i], group) for i, n in enumerate(self.nodes) if n.id not in avoid)
        return sum(c * whole(f, group) for f, c in self.counts.items())

    def freest(self, avoid: Collection[str] = ()) -> int:
        if avoid:
            return max((self.free[i] for i, n in enumerate(self.nodes) if n.id not in avoid), default=0)
        return max((f for f, c in self.counts.items() if c), default=0)

    def gang(self, n: int, group: int, avoid: Collection[str] = ()) -> list[tuple[int, int]] | None:
        """[(node index, devices)] holding `n` devices in whole groups on the fewest nodes, or None.

        The fullest nodes are taken first (fewest nodes); the last share goes to the node that fits
        it best, so the big holes stay whole for the next big job."""
        if self.usable_free(group, avoid) < n:
            return None
        chosen: list[tuple[int, int]] = []
        got = 0
        for f in range(self.top, group - 1, -1):
            if not self.counts[f] or whole(f, group) == 0:
                continue
            members = sorted(
                i for i in self.buckets[f] if self.free[i] == f and self.nodes[i].id not in avoid
            )
            for i in members:
                chosen.append((i, whole(f, group)))
                got += whole(f, group)
                if got >= n:
                    break
            if got >= n:
                break
        head = chosen[:-1]
        rest = n - sum(c for _, c in head)
        last = self.best_fit(rest, avoid, skip={i for i, _ in head})
        assert last is not None  # the last chosen node holds `rest` at worst
        return [*head, (last, rest)]

    def take(self, i: int, count: int, ends_in_s: float | None) -> Placement:
        """Give `count` of node i's lowest free devices to a job expected to end in `ends_in_s`."""
        f = self.free[i]
        devices, self.devices[i] = self.devices[i][:count], self.devices[i][count:]
        self.free[i] = f - count
        self.counts[f] -= 1
        self.counts[f - count] += 1
        heapq.heappush(self.buckets[f - count], i)
        if ends_in_s is not None:
            self.ends[i].append((ends_in_s, count))
        node = self.nodes[i]
        return Placement(node.id, node.hostname, tuple(devices))

    # -- when it will fit -------------------------------------------------------------------------

    def earliest_start(
        self, n: int, group: int, multi_node: bool, avoid: Collection[str] = ()
    ) -> float | None:
        """Seconds from now until `n` devices (whole groups; on one node unless `multi_node`) are
        expected to be free, replaying the known releases in time order; None if they never are
        (some holder's end is unknown, or the pool is too small)."""
        free = list(self.free)
        events = sorted(
            (t, i, c) for i, ends in enumerate(self.ends) if self.nodes[i].id not in avoid for t, c in ends
        )
        total = self.usable_free(group, avoid)
        for t, i, c in events:
            before = whole(free[i], group)
            free[i] = min(free[i] + c, self.nodes[i].total)
            total += whole(free[i], group) - before
            if (multi_node and total >= n) or whole(free[i], group) >= n:
                return max(t, 0.0)
        return None
