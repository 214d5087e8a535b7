"""Slurm's job states mapped onto a job's lifecycle: pure, so the executor's reconcile path and the
tests share one table. Reasons stay data: a code for what happened plus Slurm's own reason string."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from megatrain.failures import OUT_OF_MEMORY

Phase = Literal["pending", "running", "succeeded", "failed", "cancelled"]

# Slurm state → (phase, the product's cause code for an ended attempt, whether a retry may follow).
_TABLE: dict[str, tuple[Phase, str | None, bool]] = {
    "PENDING": ("pending", None, False),
    "CONFIGURING": ("pending", None, False),
    "REQUEUED": ("pending", None, False),
    "REQUEUE_FED": ("pending", None, False),
    "REQUEUE_HOLD": ("pending", None, False),
    "RESV_DEL_HOLD": ("pending", None, False),
    "RESIZING": ("running", None, False),
    "RUNNING": ("running", None, False),
    # COMPLETING: the batch script ended but nodes are still cleaning up; the outcome comes next.
    "COMPLETING": ("running", None, False),
    "STAGE_OUT": ("running", None, False),
    "SIGNALING": ("running", None, False),
    "SUSPENDED": ("running", None, False),
    "STOPPED": ("running", None, False),
    "COMPLETED": ("succeeded", None, False),
    "FAILED": ("failed", "slurm_failed", True),
    # Not retried: the same layout on the same nodes runs out of memory again (failure_record).
    "OUT_OF_MEMORY": ("failed", "slurm_out_of_memory", False),
    "TIMEOUT": ("failed", "slurm_timeout", True),
    "NODE_FAIL": ("failed", "slurm_node_fail", True),
    "BOOT_FAIL": ("failed", "slurm_boot_fail", True),
    "PREEMPTED": ("failed", "slurm_preempted", True),
    "DEADLINE": ("failed", "slurm_deadline", False),
    "REVOKED": ("cancelled", "slurm_revoked", False),
    "SPECIAL_EXIT": ("failed", "slurm_special_exit", False),
    "CANCELLED": ("cancelled", "slurm_cancelled", False),
}


@dataclass(frozen=True)
class SlurmState:
    """One Slurm job's state as squeue/sacct/slurmrestd reported it, and what it means here."""

    slurm_id: str
    state: str
    """Slurm's base state, upper case (flags such as '+' or 'by UID' stripped)."""
    reason: str | None = None
    """Slurm's reason (a PENDING job's 'Resources', 'Priority', 'QOSMaxJobsPerUserLimit', ...)."""
    exit_code: str | None = None
    """sacct's 'rc:signal' when known."""

    @property
    def phase(self) -> Phase:
        return _TABLE.get(self.state, ("failed", "slurm_unknown_state", False))[0]

    @property
    def cause(self) -> str | None:
        """The cause code recorded on an attempt that ended otherwise than COMPLETED."""
        return _TABLE.get(self.state, ("failed", "slurm_unknown_state", False))[1]

    @property
    def retryable(self) -> bool:
        """Whether the product's retry (resume from checkpoint) may follow: node failures,
        preemptions and time limits are the cluster's doing, not the job's fault alone."""
        return _TABLE.get(self.state, ("failed", None, False))[2]

    @property
    def terminal(self) -> bool:
        return self.phase in ("succeeded", "failed", "cancelled")

    def event_data(self) -> dict[str, str | None]:
        """What the job's event records about this state (rendered to text at the edge)."""
        return {"slurm_id": self.slurm_id, "state": self.state, "reason": self.reason, "cause": self.cause}


def normalise_state(raw: str) -> str:
    """Slurm's base state from what a command printed: sacct writes 'CANCELLED by 1000', squeue's
    compact codes aside, flags can follow a '+' (e.g. 'RUNNING+REQUEUED' in JSON lists)."""
    word = raw.strip().split(" ", 1)[0].split("+", 1)[0].upper()
    return word


def parse_reason(raw: str | None) -> str | None:
    """Slurm prints 'None' or '(null)' for no reason; either becomes None."""
    if raw is None:
        return None
    text = raw.strip().strip("()")
    return None if text in ("", "None", "null") else text


def failure_record(state: SlurmState, node: str | None) -> dict[str, Any] | None:
    """The failure record (megatrain.failures) of an attempt Slurm ended for a reason a retry cannot
    help, for the scheduler to fail the job with at once: OUT_OF_MEMORY (the job's memory, cgroup or
    node, ran out; its runner could not say so, or it would have ended the attempt itself). `node`:
    the attempt's node(s). None for every other state (those are retried as before)."""
    if state.state != "OUT_OF_MEMORY":
        return None
    return {
        "kind": OUT_OF_MEMORY,
        "rank": None,
        "node": node,
        "phase": None,
        "step": None,
        "exception": state.state,
        "message": f"Slurm job {state.slurm_id} ended out of memory"
        + (f" ({state.reason})" if state.reason else ""),
        "cause": state.cause,
        "evidence": {"slurm_id": state.slurm_id, "state": state.state, "exit_code": state.exit_code},
    }
