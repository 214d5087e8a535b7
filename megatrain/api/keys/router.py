"""/v1/keys: a tenant lists, creates and revokes its own API keys."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException
from sqlalchemy import select

from megatrain.api.auth import create_api_key, forget_keys, hash_key
from megatrain.api.deps import CurrentTenant, SessionDep
from megatrain.api.keys.schemas import KeyCreate, KeyCreated, KeyPublic
from megatrain.db.models import ApiKey, utcnow
from megatrain.db.notify import AUTH_CHANGED, notify_job

router = APIRouter(prefix="/v1/keys", tags=["keys"])


@router.get("", response_model=list[KeyPublic])
def list_keys(session: SessionDep, tenant: CurrentTenant) -> list[Any]:
    q = select(ApiKey).where(ApiKey.tenant_id == tenant.id).order_by(ApiKey.created_at, ApiKey.id)
    return list(session.scalars(q).all())


@router.post("", response_model=KeyCreated, status_code=201)
def create_key(body: KeyCreate, session: SessionDep, tenant: CurrentTenant) -> dict[str, Any]:
    """A new key for the caller's tenant; the answer's `key` is the only time it is shown."""
    key = create_api_key(session, tenant.name, body.name)
    row = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key)))
    session.commit()
    return {**KeyPublic.model_validate(row).model_dump(), "key": key}


@router.post("/{key_id}/revoke", response_model=KeyPublic)
def revoke_key(key_id: str, session: SessionDep, tenant: CurrentTenant) -> ApiKey:
    """Revoke one of the tenant's keys (idempotent); requests with it get 401 from then on (from
    other API processes too on PostgreSQL; on SQLite with `--workers N`, within 5 seconds)."""
    row = session.scalar(select(ApiKey).where(ApiKey.id == key_id[:64], ApiKey.tenant_id == tenant.id))
    if row is None:
        raise HTTPException(404, f"key {key_id[:64]!r} not found")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        notify_job(session, AUTH_CHANGED)  # the other API processes forget their cached keys
        session.commit()
        forget_keys()
    return row
