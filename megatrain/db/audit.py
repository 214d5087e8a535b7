"""The audit log: who (a tenant's API key, an operator, a node) created, cancelled, paused, deleted,
shared or exported what, and when, kept in the database (`megatrain audit` reads it).

Rows are written by the unit of work itself: a session that knows its actor (session.info["actor"],
set by the API's authentication, the operator CLI, or a node) gets an AuditEvent for each audited
change it flushes (RULES: a new job, a job's cancel request, a dataset deleted, a secret replaced…),
in the same transaction as the change, so a change is never kept without its record nor recorded
without having happened. A session without an actor (the scheduler's, the runner's bookkeeping)
records nothing: those are the system's own moves, in each job's events.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Index, String, event, inspect
from sqlalchemy.orm import Mapped, Session, mapped_column

from megatrain.db.models import (
    ApiKey,
    Base,
    Dataset,
    Job,
    RegisteredModel,
    Tenant,
    UTCDateTime,
    new_id,
    utcnow,
)

ACTOR = "actor"
"""session.info key: the Actor whose changes the session records."""


@dataclass(frozen=True)
class Actor:
    kind: str
    """key (a tenant's API key), operator (the CLI on the control plane's database), or node."""
    id: str
    """The key's id, the operator's login, or the node's name."""
    tenant_id: str | None = None
    """The tenant acting (a key's), or None (an operator, a node)."""


class AuditEvent(Base):
    __tablename__ = "audit_event"
    __table_args__ = (
        Index("ix_audit_event_at", "at"),
        Index("ix_audit_event_tenant_at", "tenant_id", "at"),
    )
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("aud"))
    at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    actor_kind: Mapped[str] = mapped_column(String(16))
    actor_id: Mapped[str] = mapped_column(String(255))
    tenant_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    """The tenant the change belongs to (kept as text: the audit outlives a deleted tenant)."""
    action: Mapped[str] = mapped_column(String(64))
    """kind.verb: job.create, job.cancel, dataset.share, secret.put, export.create…"""
    target: Mapped[str] = mapped_column(String(255))
    """The id (a secret's name) of what changed."""
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


Change = Callable[[Any], dict[str, Any] | None]


def _set(field: str) -> Callable[[Any], bool]:
    """Whether `field` went from empty (None, False) to set in this flush."""

    def changed(obj: Any) -> bool:
        history = inspect(obj).attrs[field].history
        return bool(history.added) and bool(history.added[0]) and not any(history.deleted or [None])

    return changed


def _changed(field: str) -> Callable[[Any], bool]:
    return lambda obj: bool(inspect(obj).attrs[field].history.has_changes())


def _shared(obj: Any) -> bool:
    return obj.tenant_id is None


def _own(obj: Any) -> bool:
    return obj.tenant_id is not None


def _event_kind(*kinds: str) -> Callable[[Any], bool]:
    return lambda obj: obj.kind in kinds


def _job(obj: Job) -> dict[str, Any]:
    return {"name": obj.name, "kind": obj.kind}


def _named(obj: Any) -> dict[str, Any]:
    return {"name": obj.name}


def _event(obj: Any) -> dict[str, Any]:
    return {"while": obj.from_status} if obj.from_status else {}


@dataclass(frozen=True)
class Rule:
    cls: type
    on: str
    """new, deleted or dirty; `when` says which of them (a dirty one: which change)."""
    action: str
    detail: Change = lambda _obj: {}
    when: Callable[[Any], bool] = lambda _obj: True


def _rules() -> list[Rule]:
    from megatrain.db.fine_tuning import FineTuningJob
    from megatrain.db.models import CheckpointExport, JobEvent
    from megatrain.db.node_tokens import NodeToken
    from megatrain.db.secrets import TenantSecret

    # A job's cancel, pause and resume are guarded UPDATEs (no lost race), not attribute changes:
    # each writes its job event in the same transaction, which is what is audited.
    return [
        Rule(Job, "new", "job.create", _job),
        Rule(JobEvent, "new", "job.cancel", _event, _event_kind("cancel_requested", "cancelled")),
        Rule(JobEvent, "new", "job.pause", _event, _event_kind("pause_requested", "paused")),
        Rule(JobEvent, "new", "job.resume", _event, _event_kind("resumed_by_user")),
        Rule(Job, "deleted", "job.delete", _job),
        Rule(Dataset, "new", "dataset.create", _named, _own),
        Rule(Dataset, "new", "dataset.share", _named, _shared),
        Rule(Dataset, "deleted", "dataset.delete", _named),
        Rule(RegisteredModel, "new", "model.register", _named, _own),
        Rule(RegisteredModel, "new", "model.share", _named, _shared),
        Rule(RegisteredModel, "deleted", "model.delete", _named),
        Rule(FineTuningJob, "dirty", "model.delete", lambda o: {"fine_tuned": True},
             _set("model_deleted_at")),
        Rule(CheckpointExport, "new", "export.create", lambda o: {"job_id": o.job_id, "step": o.step}),
        Rule(ApiKey, "new", "key.create", _named),
        Rule(ApiKey, "dirty", "key.revoke", _named, _set("revoked_at")),
        Rule(NodeToken, "new", "node_token.create", lambda o: {"node": o.node_name, "prefix": o.prefix}),
        Rule(NodeToken, "dirty", "node_token.revoke", lambda o: {"node": o.node_name}, _set("revoked_at")),
        Rule(TenantSecret, "new", "secret.put"),
        Rule(TenantSecret, "dirty", "secret.put", when=_changed("ciphertext")),
        Rule(TenantSecret, "deleted", "secret.delete"),
        Rule(Tenant, "new", "tenant.create", _named),
        Rule(Tenant, "dirty", "tenant.set_quota", lambda o: {"max_devices": o.max_devices},
             _changed("max_devices")),
        Rule(Tenant, "dirty", "tenant.set_max_priority", lambda o: {"max_priority": o.max_priority},
             _changed("max_priority")),
    ]  # fmt: skip


_RULES: list[Rule] | None = None


def _target(obj: Any) -> str:
    from megatrain.db.fine_tuning import FineTuningJob
    from megatrain.db.models import JobEvent
    from megatrain.db.secrets import TenantSecret

    if isinstance(obj, TenantSecret):
        return obj.name
    if isinstance(obj, (FineTuningJob, JobEvent)):
        return obj.job_id
    return str(obj.id)


def _tenant(obj: Any, actor: Actor) -> str | None:
    if isinstance(obj, Tenant):
        return obj.id
    if isinstance(obj, (Dataset, RegisteredModel)) and obj.tenant_id is None:
        return None  # shared with every tenant
    return getattr(obj, "tenant_id", None) or actor.tenant_id


@event.listens_for(Session, "before_flush")
def _record(session: Session, _context: Any, _instances: Any) -> None:
    actor = session.info.get(ACTOR)
    if not isinstance(actor, Actor):
        return
    global _RULES
    rules = _RULES = _RULES or _rules()
    groups = {"new": list(session.new), "dirty": list(session.dirty), "deleted": list(session.deleted)}
    for rule in rules:
        for obj in groups[rule.on]:
            if isinstance(obj, rule.cls) and rule.when(obj):
                default = inspect(type(obj)).columns["id"].default if hasattr(obj, "id") else None
                if rule.on == "new" and obj.id is None and default is not None:
                    # The id its insert would draw, drawn now: the record names what it created.
                    obj.id = default.arg(None)
                session.add(
                    AuditEvent(
                        actor_kind=actor.kind, actor_id=actor.id, tenant_id=_tenant(obj, actor),
                        action=rule.action, target=_target(obj)[:255], detail=rule.detail(obj),
                    )
                )  # fmt: skip


def as_operator(session: Session) -> Session:
    """`session`, recording what it changes as the operator's doing (their login on this machine)."""
    import getpass

    try:
        login = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's arbitrary uid)
        login = f"uid-{__import__('os').getuid()}"
    session.info[ACTOR] = Actor("operator", login)
    return session
