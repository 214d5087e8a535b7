"""Node tokens: how a node's agent (its worker and runners) proves to the API which node it is.

An operator creates one per node (`megatrain nodes token create POOL [--node NAME]`): `mtn_` + 40
url-safe characters, shown once, stored only as its sha256. A token names its pool and its node; one
created without a node name is bound to the first node that registers with it. It reports for that
node's own attempts only (api/node/router.py), and a revoked one reports nothing. An executor that
starts runners on nodes it does not control (Slurm) mints an attempt token instead: it reports for
one job only, expires, and is revoked when the attempt ends.

`ReportCursor` is what makes a runner's batched reports exactly-once: each batch carries the next
sequence number of its (job, attempt, node rank), and a batch the cursor has passed (a retry after
the API applied it but the answer was lost) is acknowledged without being applied again.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import JSON, ForeignKey, Integer, String, select, update
from sqlalchemy.orm import Mapped, Session, mapped_column

from megatrain.db.models import Base, NodePool, UTCDateTime, new_id, utcnow

TOKEN_PREFIX = "mtn_"
TOKEN_PATTERN = re.compile(r"^mtn_[A-Za-z0-9_-]{40}$")


class NodeToken(Base):
    __tablename__ = "node_token"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ntok"))
    pool_id: Mapped[str] = mapped_column(ForeignKey("node_pool.id", ondelete="CASCADE"), index=True)
    node_name: Mapped[str | None] = mapped_column(String(255), nullable=True)
    """The node it speaks for; None until the first node registers with it (then bound to that one)."""
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    job_id: Mapped[str | None] = mapped_column(
        ForeignKey("job.id", ondelete="CASCADE"), nullable=True, index=True
    )
    """An attempt token's job: it reports for that job only (on whichever node runs it)."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class ReportCursor(Base):
    __tablename__ = "report_cursor"
    job_id: Mapped[str] = mapped_column(ForeignKey("job.id", ondelete="CASCADE"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, default=0)
    """The last batch applied."""
    node_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    """The node whose runner claimed (or joined) the attempt as this node rank: it may still report
    for it once the job has given its placement back (a follower's last lines)."""
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    """A gang shard's ranks as it last read them: {"node", "step" (the lowest), "ranks" (those at it)},
    so node rank 0's hang report can name the node whose ranks stopped first."""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_node_token(
    session: Session, pool_name: str, node_name: str | None = None
) -> tuple[NodeToken, str]:
    """A token for a node of `pool_name` (created if new); returns (its row, the plaintext token,
    which is not stored). The caller commits."""
    pool = session.scalar(select(NodePool).where(NodePool.name == pool_name))
    if pool is None:
        pool = NodePool(name=pool_name)
        session.add(pool)
        session.flush()
    token = TOKEN_PREFIX + secrets.token_urlsafe(30)
    row = NodeToken(pool_id=pool.id, node_name=node_name, token_hash=hash_token(token), prefix=token[:10])
    session.add(row)
    session.flush()
    return row, token


def create_attempt_token(session: Session, job_id: str, pool_id: str, ttl_s: float) -> str:
    """A token for one job's runners on nodes the control plane does not know by a token of their
    own (Slurm's), valid for `ttl_s`; revoke_attempt_tokens ends it sooner. The caller commits."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(30)
    expires = utcnow() + timedelta(seconds=ttl_s)
    row = NodeToken(
        pool_id=pool_id, job_id=job_id, token_hash=hash_token(token), prefix=token[:10], expires_at=expires
    )
    session.add(row)
    session.flush()
    return token


def revoke_attempt_tokens(session: Session, job_id: str) -> None:
    """The job's attempt ended: its runners' tokens report nothing more."""
    session.execute(
        update(NodeToken)
        .where(NodeToken.job_id == job_id, NodeToken.revoked_at.is_(None))
        .values(revoked_at=utcnow())
        .execution_options(synchronize_session=False)
    )


def authenticate_node(session: Session, token: str) -> NodeToken | None:
    """The live (not revoked, not expired) token row, or None."""
    if not TOKEN_PATTERN.match(token):
        return None
    row = session.scalar(
        select(NodeToken).where(NodeToken.token_hash == hash_token(token), NodeToken.revoked_at.is_(None))
    )
    if row is not None and row.expires_at is not None and row.expires_at <= utcnow():
        return None
    return row
