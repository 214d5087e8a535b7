"""Why a queued job waits, as data, and its one rendering to text for people.

The scheduler stores a `WaitReason` on the job (`job.wait_reason`) and the cluster view computes
them afresh; both render text only at the edge, with `render_wait`, which is told whether the
viewer owns the blocking job: another tenant's job id is never put into text in the first place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

NO_READY_NODES = "no_ready_nodes"
TOO_BIG_FOR_POOL = "too_big_for_pool"
BEHIND_JOB = "behind_job"
NO_FREE_SLOTS = "no_free_slots"
FITS_NEXT_TICK = "fits_next_tick"
CANCEL_REQUESTED = "cancel_requested"
OVER_QUOTA = "over_quota"
SINGLE_NODE_EXECUTOR = "single_node_executor"


@dataclass(frozen=True)
class WaitReason:
    code: str
    pool: str
    job_id: str | None = None
    """behind_job: the job first in line for the pool, which this one may not overtake."""
    needs: int | None = None
    """Slots the job needs (too_big_for_pool, no_free_slots)."""
    freest: int | None = None
    """no_free_slots: the most free slots on any ready node of the pool."""
    largest: int | None = None
    """too_big_for_pool: the most slots any ready node of the pool has at all."""
    hostname: str | None = None
    """fits_next_tick: the node it fits on now."""
    total: int | None = None
    """too_big_for_pool (gangs): the pool's devices in whole tp×cp groups, over all its nodes."""
    free: int | None = None
    """no_free_slots (gangs): free devices in whole groups over all the pool's nodes."""
    starts_in_s: float | None = None
    """no_free_slots: when the job is expected to start (seconds from the decision; running jobs'
    expected ends), if known. behind_job: the same for the blocking job."""
    runtime_s: float | None = None
    """behind_job: this job's expected runtime, too long to start ahead of the blocking job."""
    quota: int | None = None
    """over_quota: the tenant's device quota."""
    used: int | None = None
    """over_quota: devices the tenant's jobs hold now."""
    nodes: int | None = None
    """single_node_executor: the fewest nodes the job would span."""

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WaitReason:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def _slots(n: int | None, free: bool = False) -> str:
    return f"{n} {'free ' if free else ''}slot{'s' * (n != 1)}"


def duration(seconds: float) -> str:
    """'45s', '12m', '3h 05m', '2d 4h': short, for queue estimates and ETAs."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 11th, 22nd."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _behind(reason: WaitReason, who: str, pool: str) -> str:
    text = f"behind {who}, first in line for pool {pool}"
    if reason.starts_in_s is None:
        return f"{text} (no backfill)"
    if reason.runtime_s is None:
        return (
            f"{text} (expected to start in {duration(reason.starts_in_s)}; this job has no runtime estimate)"
        )
    return (
        f"{text} (expected to start in {duration(reason.starts_in_s)}; this job's "
        f"{duration(reason.runtime_s)} would delay it)"
    )


def render_wait(reason: WaitReason, *, owns_blocker: bool, blocker_position: int | None = None) -> str:
    """One line for a person. `owns_blocker`: whether the viewer's tenant owns `reason.job_id`; if
    not, that job is named by its place in the queue (when given), never by its id."""
    pool = repr(reason.pool)
    match reason.code:
        case "no_ready_nodes":
            return f"pool {pool} has no ready nodes"
        case "too_big_for_pool":
            if reason.total is not None:
                in_all = f"{reason.total} in all (whole tp×cp groups)"
                return f"needs {_slots(reason.needs)} but pool {pool} has {in_all}"
            return f"needs {_slots(reason.needs)} but the largest node in pool {pool} offers {reason.largest}"
        case "behind_job":
            if owns_blocker:
                who = f"job {reason.job_id}"
            elif blocker_position is not None:
                who = f"another tenant's job (#{blocker_position} in the queue)"
            else:
                who = "another tenant's job"
            return _behind(reason, who, pool)
        case "no_free_slots":
            where = f"the freest node has {reason.freest}"
            if reason.free is not None:
                where = f"{reason.free} free across its nodes"
            eta = (
                f"; expected to start in {duration(reason.starts_in_s)}"
                if reason.starts_in_s is not None
                else ""
            )
            return f"needs {_slots(reason.needs, free=True)} in pool {pool}; {where}{eta}"
        case "over_quota":
            return (
                f"needs {reason.needs} devices but its tenant's quota is {reason.quota} and its jobs "
                f"hold {reason.used}"
            )
        case "single_node_executor":
            return (
                f"needs {reason.needs} devices across {reason.nodes} nodes of pool {pool}; this "
                "executor runs a job on one node"
            )
        case "fits_next_tick":
            return f"fits now on {reason.hostname}: starts on the scheduler's next tick"
        case "cancel_requested":
            return "cancel requested: the scheduler removes it on its next tick"
    return reason.code  # a code this version does not know (written by a newer scheduler)
