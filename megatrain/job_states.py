"""Job states, shared by the database, the API and the CLI (which must not import SQLAlchemy).

Active states hold node slots; terminal states never change again."""

QUEUED, SCHEDULED, RUNNING = "queued", "scheduled", "running"
SUCCEEDED, FAILED, CANCELLED = "succeeded", "failed", "cancelled"
JOB_STATES = (QUEUED, SCHEDULED, RUNNING, SUCCEEDED, FAILED, CANCELLED)
ACTIVE_STATES = (SCHEDULED, RUNNING)
TERMINAL_STATES = (SUCCEEDED, FAILED, CANCELLED)

PAUSE_REQUEST = "user-pause"
"""Job.preempt_for of a running job its user asked to pause (not a waiting job's id): its runner
checkpoints, stops and requeues it, and the scheduler leaves it queued while Job.paused_at is set."""
