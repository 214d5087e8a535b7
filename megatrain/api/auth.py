"""API keys: `mt_` + 40 url-safe characters, shown once, stored only as their sha256.

A request authenticates with `Authorization: Bearer KEY`; the key's tenant owns everything the
request can see. The embedded default keeps one key for tenant "local" in `settings.credentials_path`.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import secrets
import time
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from megatrain.db.models import ApiKey, Tenant
from megatrain.db.session import session_scope
from megatrain.settings import Settings

KEY_PREFIX = "mt_"
KEY_PATTERN = re.compile(r"^mt_[A-Za-z0-9_-]{40}$")
# Tenant names become storage path segments ({storage}/tenants/{name}/), so they must be path-safe.
TENANT_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
LOCAL_TENANT = "local"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(30)  # 30 random bytes -> 40 url-safe characters


def get_or_create_tenant(session: Session, tenant_name: str) -> Tenant:
    """The tenant called `tenant_name`, created if new (a lost insert race becomes a lookup)."""
    if not TENANT_NAME_PATTERN.match(tenant_name):
        raise ValueError(f"tenant name {tenant_name!r} must match {TENANT_NAME_PATTERN.pattern}")
    for _ in range(3):
        tenant = session.scalar(select(Tenant).where(Tenant.name == tenant_name))
        if tenant is not None:
            return tenant
        try:
            with session.begin_nested():
                tenant = Tenant(name=tenant_name)
                session.add(tenant)
            return tenant
        except IntegrityError:
            continue
    raise RuntimeError(f"could not create tenant {tenant_name!r}")


def create_api_key(session: Session, tenant_name: str, key_name: str = "") -> str:
    """Create a key for `tenant_name` (and the tenant if needed); returns the plaintext key.

    Only the key's sha256 and its first characters are stored. The caller commits.
    """
    tenant = get_or_create_tenant(session, tenant_name)
    key = new_key()
    session.add(ApiKey(tenant_id=tenant.id, key_hash=hash_key(key), prefix=key[:10], name=key_name[:100]))
    session.flush()
    return key


def authenticate(session: Session, key: str) -> Tenant | None:
    """The tenant of a live (not revoked) key, or None."""
    found = authenticate_key(session, key)
    return found[0] if found is not None else None


AUTH_CACHE_S = 5.0
"""How long this process trusts a key it authenticated without asking the database again (the
query was a third of a GET's CPU). Revoking a key forgets it here at once, and on PostgreSQL in
every API process (db.notify's AUTH_CHANGED); elsewhere another process may take it this long more."""
AUTH_CACHE_KEYS = 10_000
_clock = time.monotonic
_known: dict[tuple[int, str], tuple[float, Tenant, str]] = {}
"""(the database's engine, key hash) -> (until, the tenant as loaded then, detached, the key's id)."""


def forget_keys() -> None:
    """Drop every cached key: one was revoked (or a notification may have been missed)."""
    _known.clear()


def authenticate_key(session: Session, key: str, cached: bool = False) -> tuple[Tenant, str] | None:
    """(the tenant, the key's id) of a live (not revoked) key, or None. `cached`: a key this
    process found live within AUTH_CACHE_S is taken without a query (API requests)."""
    if not KEY_PATTERN.match(key):
        return None  # no database round trip for keys that cannot exist
    digest, now = hash_key(key), _clock()
    slot = (id(session.get_bind()), digest)
    hit = _known.get(slot) if cached else None
    if hit is not None and hit[0] > now:
        return session.merge(hit[1], load=False), hit[2]  # no query: the cached row, in this session
    row = session.execute(
        select(Tenant, ApiKey.id)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == digest, ApiKey.revoked_at.is_(None))
    ).first()
    if row is None:
        _known.pop(slot, None)
        return None
    tenant, key_id = row[0], row[1]
    if cached:
        if len(_known) >= AUTH_CACHE_KEYS:
            forget_keys()
        _known[slot] = (now + AUTH_CACHE_S, _detached_copy(tenant), key_id)
    return tenant, key_id


def _detached_copy(tenant: Tenant) -> Tenant:
    """A copy of `tenant`'s columns that belongs to no session (what merge(load=False) takes). Its
    max_priority may be a few seconds old: the one check that needs it reads it again."""
    from sqlalchemy.orm import make_transient_to_detached

    copy = Tenant(**{c.key: getattr(tenant, c.key) for c in Tenant.__mapper__.column_attrs})
    make_transient_to_detached(copy)
    return copy


def _read_key(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return text if KEY_PATTERN.match(text) else None


def _write_private(path: Path, text: str) -> None:
    """Write atomically with mode 0600 from the start (never briefly world-readable)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def ensure_local_credentials(settings: Settings) -> str:
    """The embedded default's key for tenant "local", created and stored in
    `settings.credentials_path` (mode 0600) when missing or no longer valid; returns it.

    The database must already be migrated. Processes starting at once agree on one key (file lock).
    """
    path = settings.credentials_path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        key = _read_key(path)
        with session_scope(settings.resolved_database_url) as session:
            if key is not None:
                tenant = authenticate(session, key)
                if tenant is not None and tenant.name == LOCAL_TENANT:
                    return key
            # Missing, unreadable, or from a database that was since replaced: issue a fresh key.
            key = create_api_key(session, LOCAL_TENANT, "local credentials")
        _write_private(path, key + "\n")
        return key
