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

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WaitReason:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def _slots(n: int | None, free: bool = False) -> str:
    return f"{n} {'free ' if free else ''}slot{'s' * (n != 1)}"


def render_wait(reason: WaitReason, *, owns_blocker: bool, blocker_position: int | None = None) -> str:
    """One line for a person. `owns_blocker`: whether the viewer's tenant owns `reason.job_id`; if
    not, that job is named by its place in the queue (when given), never by its id."""
    pool = repr(reason.pool)
    match reason.code:
        case "no_ready_nodes":
            return f"pool {pool} has no ready nodes"
        case "too_big_for_pool":
            return f"needs {_slots(reason.needs)} but the largest node in pool {pool} offers {reason.largest}"
        case "behind_job":
            if owns_blocker:
                who = f"job {reason.job_id}"
            elif blocker_position is not None:
                who = f"another tenant's job (#{blocker_position} in the queue)"
            else:
                who = "another tenant's job"
            return f"behind {who}, first in line for pool {pool} (no backfill)"
        case "no_free_slots":
            return (
                f"needs {_slots(reason.needs, free=True)} in pool {pool}; the freest node has {reason.freest}"
            )
        case "fits_next_tick":
            return f"fits now on {reason.hostname}: starts on the scheduler's next tick"
        case "cancel_requested":
            return "cancel requested: the scheduler removes it on its next tick"
    return reason.code  # a code this version does not know (written by a newer scheduler)
