"""Dependencies every router shares, as `Annotated` aliases: SettingsDep, SessionDep, CurrentTenant."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from functools import cache
from typing import Annotated, Any, TypeVar

import anyio
from fastapi import Depends, HTTPException, Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from megatrain.api.auth import authenticate_key
from megatrain.db.audit import ACTOR, Actor
from megatrain.db.models import Tenant
from megatrain.db.session import get_sessionmaker
from megatrain.settings import Settings


async def get_app_settings(request: Request) -> Settings:
    # async: FastAPI runs a plain `def` dependency in a worker thread, a hop that cost every request
    # with a database session ~10% of a GET's CPU for one attribute read.
    return request.app.state.settings  # type: ignore[no-any-return]


T = TypeVar("T")

SettingsDep = Annotated[Settings, Depends(get_app_settings)]


async def get_session(settings: SettingsDep) -> AsyncIterator[Session]:
    """One session per request; services commit what they change, the rest is rolled back.

    Made on the event loop (a session touches the database only when first used); closed in a
    worker thread when it holds a connection, shielded so a client that left still gives it back."""
    session = get_sessionmaker(settings.resolved_database_url)()
    try:
        yield session
    finally:
        if session.in_transaction():
            # Closing has threads of its own: a request holding a connection never waits for a
            # thread that requests blocked on the pool hold (that wait would be a deadlock).
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(session.close, limiter=_closers())
        else:
            session.close()


@cache
def _closers() -> anyio.CapacityLimiter:
    return anyio.CapacityLimiter(4)


def release(session: Session, fn: Callable[..., T], *args: Any) -> T:
    """`fn(session, *args)`, then give the session's connection back: a dependency's work is done
    in one thread hop and the request holds no connection while it waits for the next."""
    try:
        return fn(session, *args)
    finally:
        session.close()


SessionDep = Annotated[Session, Depends(get_session)]

_UNAUTHORIZED = {"WWW-Authenticate": "Bearer"}


def bearer_key(request: Request) -> str:
    """The request's API key (401 when there is none)."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise HTTPException(401, "missing API key: send 'Authorization: Bearer KEY'", headers=_UNAUTHORIZED)
    return key.strip()


def tenant_of(session: Session, key: str) -> Tenant:
    """The key's tenant (401 for an unknown or revoked key); the session records what it changes
    in the audit log as this key's doing (db.audit)."""
    found = authenticate_key(session, key, cached=True)
    if found is None:
        raise HTTPException(401, "invalid or revoked API key", headers=_UNAUTHORIZED)
    tenant, key_id = found
    session.info[ACTOR] = Actor("key", key_id, tenant.id)
    return tenant


async def get_current_tenant(request: Request, session: SessionDep) -> Tenant:
    return await run_in_threadpool(release, session, tenant_of, bearer_key(request))


CurrentTenant = Annotated[Tenant, Depends(get_current_tenant)]
