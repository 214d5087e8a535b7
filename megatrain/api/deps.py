"""Dependencies every router shares, as `Annotated` aliases: SettingsDep, SessionDep, CurrentTenant."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from sqlalchemy.orm import Session

from megatrain.api.auth import authenticate
from megatrain.db.models import Tenant
from megatrain.db.session import get_sessionmaker
from megatrain.settings import Settings


def get_app_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


SettingsDep = Annotated[Settings, Depends(get_app_settings)]


def get_session(settings: SettingsDep) -> Iterator[Session]:
    """One session per request; services commit what they change, the rest is rolled back."""
    session = get_sessionmaker(settings.resolved_database_url)()
    try:
        yield session
    finally:
        session.close()


SessionDep = Annotated[Session, Depends(get_session)]

_UNAUTHORIZED = {"WWW-Authenticate": "Bearer"}


def get_current_tenant(request: Request, session: SessionDep) -> Tenant:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise HTTPException(401, "missing API key: send 'Authorization: Bearer KEY'", headers=_UNAUTHORIZED)
    tenant = authenticate(session, key.strip())
    if tenant is None:
        raise HTTPException(401, "invalid or revoked API key", headers=_UNAUTHORIZED)
    return tenant


CurrentTenant = Annotated[Tenant, Depends(get_current_tenant)]
