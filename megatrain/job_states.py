"""Job states, shared by the database, the API and the CLI (which must not import SQLAlchemy).

Active states hold node slots; terminal states never change again."""

QUEUED, SCHEDULED, RUNNING = "queued", "scheduled", "running"
SUCCEEDED, FAILED, CANCELLED = "succeeded", "failed", "cancelled"
JOB_STATES = (QUEUED, SCHEDULED, RUNNING, SUCCEEDED, FAILED, CANCELLED)
ACTIVE_STATES = (SCHEDULED, RUNNING)
TERMINAL_STATES = (SUCCEEDED, FAILED, CANCELLED)
