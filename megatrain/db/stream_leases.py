"""The per-tenant cap on live streams, held across every API process (`megatrain api --workers N`,
several replicas): each open stream holds a lease row, taken under a lock on its tenant's row, so
two processes can never both take the last place. A process refreshes its leases while it lives; the
leases of one that died without giving them back lapse after LEASE_TTL_S.

PostgreSQL only: the embedded default (SQLite) serves from one API process, which counts its own.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import String, delete, func, select, update
from sqlalchemy.orm import Mapped, Session, mapped_column

from megatrain.db.models import Base, Tenant, UTCDateTime, new_id, utcnow

LEASE_TTL_S = 60.0
"""A lease its process has not refreshed for this long is free again (the process is gone)."""


class StreamLease(Base):
    __tablename__ = "stream_lease"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("lease"))
    tenant_id: Mapped[str] = mapped_column(String(40), index=True)
    process: Mapped[str] = mapped_column(String(255), index=True)
    """hostname:pid:nonce of the API process serving the stream."""
    seen_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class LeaseRefused(Exception):
    """The tenant holds `limit` streams already."""


def take_lease(session: Session, tenant_id: str, process: str, limit: int) -> str:
    """A lease for one more stream of `tenant_id` (its id), or LeaseRefused at the limit. The
    caller commits; the tenant's row stays locked until then."""
    session.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update())
    stale = utcnow() - timedelta(seconds=LEASE_TTL_S)
    session.execute(
        delete(StreamLease).where(StreamLease.tenant_id == tenant_id, StreamLease.seen_at < stale)
    )
    held = session.scalar(
        select(func.count()).select_from(StreamLease).where(StreamLease.tenant_id == tenant_id)
    )
    if (held or 0) >= limit:
        raise LeaseRefused
    lease = StreamLease(tenant_id=tenant_id, process=process)
    session.add(lease)
    session.flush()
    return lease.id


def drop_lease(session: Session, lease_id: str) -> None:
    session.execute(delete(StreamLease).where(StreamLease.id == lease_id))


def refresh_leases(session: Session, process: str) -> None:
    """This process lives: its leases stay held."""
    session.execute(
        update(StreamLease)
        .where(StreamLease.process == process)
        .values(seen_at=utcnow())
        .execution_options(synchronize_session=False)
    )


def drop_process_leases(session: Session, process: str) -> None:
    session.execute(delete(StreamLease).where(StreamLease.process == process))
