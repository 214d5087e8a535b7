"""Changes of a job that live streams wait for (new metric rows, new log lines, a new status), told
to every API process at once instead of each polling for them.

On PostgreSQL a writer's transaction sends `NOTIFY megatrain_jobs, '<job id>'` (`notify_job`): it is
delivered when the transaction commits, never if it rolls back, and a transaction that notifies the
same job many times delivers it once. Each API process listens on one connection of its own
(api/notifications.py) and wakes the feeds of that job. SQLite has no such thing: there the feeds
poll, as they do on PostgreSQL as a fallback (a lost listening connection, a writer that did not
notify).
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.orm import Session

CHANNEL = "megatrain_jobs"
AUTH_CHANGED = "auth"
"""Not a job id: an API key was revoked, every process drops its cache of keys (api.auth)."""


def notify_job(session: Session, job_id: str) -> None:
    """Tell the API processes, once this transaction commits, that `job_id` changed."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_notify(:channel, :job)"), {"channel": CHANNEL, "job": job_id})
