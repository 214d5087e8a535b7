"""Named registrations a tenant sees (datasets, models): its own, and the ones an operator shared
(tenant_id NULL). One lookup rule for all of them: the tenant's own wins over a shared one."""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import HTTPException
from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from megatrain.db.models import Tenant

Row = TypeVar("Row")


def visible(model: Any, tenant: Tenant) -> Any:
    """The WHERE clause for the rows of `model` the tenant may see."""
    return or_(model.tenant_id == tenant.id, model.tenant_id.is_(None))


def find_named(session: Session, model: type[Row], tenant: Tenant, name: str) -> Row | None:
    """The tenant's own row called `name`, else the shared one, else None."""
    m: Any = model
    rows = session.scalars(select(m).where(visible(m, tenant), m.name == name)).all()
    own = [r for r in rows if r.tenant_id == tenant.id]
    return (own or list(rows) or [None])[0]


def get_named(session: Session, model: type[Row], tenant: Tenant, name: str, noun: str) -> Row:
    """find_named, or a 404 naming the `noun`."""
    found = find_named(session, model, tenant, name)
    if found is None:
        raise HTTPException(404, f"{noun} {name!r} not found")
    return found


def list_named(session: Session, model: type[Row], tenant: Tenant) -> list[Row]:
    """The tenant's rows and the shared ones, by name (own before shared for equal names)."""
    m: Any = model
    rows = session.scalars(select(m).where(visible(m, tenant))).all()
    return sorted(rows, key=lambda r: (r.name, r.tenant_id is None, r.created_at))
