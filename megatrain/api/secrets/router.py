"""/v1/secrets: a tenant stores secrets (a W&B key, an S3 key for its data, a Hugging Face token)
that its jobs receive as environment variables. Values go in and never come out: the API lists names
and dates only; a job names the secrets it needs (spec `secrets`), and only its engine processes
see the values (megatrain.secrets_box)."""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter, HTTPException, Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select

from megatrain.api.deps import CurrentTenant, SessionDep, SettingsDep
from megatrain.api.errors import FieldError
from megatrain.db.models import utcnow
from megatrain.db.secrets import TenantSecret
from megatrain.secrets_box import SecretBox, SecretsUnavailable, name_problem

router = APIRouter(prefix="/v1/secrets", tags=["secrets"])
MAX_VALUE_CHARS = 16384


class SecretPut(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: str = Field(..., min_length=1, max_length=MAX_VALUE_CHARS)


class SecretPublic(BaseModel):
    """A secret as the API shows it: never its value."""

    model_config = ConfigDict(from_attributes=True)
    name: str
    created_at: datetime
    updated_at: datetime


def _name(name: str) -> str:
    problem = name_problem(name)
    if problem:
        raise FieldError("name", problem)
    return name


@router.get("", response_model=list[SecretPublic])
def list_secrets(session: SessionDep, tenant: CurrentTenant) -> list[TenantSecret]:
    rows = session.scalars(select(TenantSecret).where(TenantSecret.tenant_id == tenant.id))
    return sorted(rows, key=lambda r: r.name)


@router.put("/{name}", response_model=SecretPublic)
def put_secret(
    name: str,
    body: SecretPut,
    response: Response,
    session: SessionDep,
    settings: SettingsDep,
    tenant: CurrentTenant,
) -> TenantSecret:
    """Store (201) or replace (200) the secret `name`; jobs started from now on get the new value."""
    _name(name)
    try:
        ciphertext = SecretBox.from_settings(settings).encrypt(body.value)
    except SecretsUnavailable as exc:
        raise HTTPException(503, str(exc)) from None
    row = session.scalar(
        select(TenantSecret).where(TenantSecret.tenant_id == tenant.id, TenantSecret.name == name)
    )
    if row is None:
        row = TenantSecret(tenant_id=tenant.id, name=name, ciphertext=ciphertext)
        session.add(row)
        response.status_code = 201
    else:
        row.ciphertext, row.updated_at = ciphertext, utcnow()
    session.commit()
    return row


@router.delete("/{name}", status_code=204)
def delete_secret(name: str, session: SessionDep, tenant: CurrentTenant) -> Response:
    """Forget the secret; a job that names it can no longer start an attempt (it fails, naming it)."""
    row = session.scalar(
        select(TenantSecret).where(TenantSecret.tenant_id == tenant.id, TenantSecret.name == name[:64])
    )
    if row is None:
        raise HTTPException(404, f"secret {name[:64]!r} not found")
    session.delete(row)
    session.commit()
    return Response(status_code=204)
