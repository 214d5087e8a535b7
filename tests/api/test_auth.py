"""API keys, 401s, and tenant isolation: another tenant's job is a 404 on every job endpoint."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import pytest
from api_handle import Api
from fastapi.testclient import TestClient
from sqlalchemy import select

from megatrain.api.app import create_app
from megatrain.api.auth import KEY_PATTERN, create_api_key, ensure_local_credentials
from megatrain.db.models import ApiKey, Checkpoint, JobLog, JobMetric, Tenant
from megatrain.db.session import session_scope, upgrade_database
from megatrain.settings import get_settings


def test_create_api_key_stores_only_the_hash(api: Api) -> None:
    assert KEY_PATTERN.match(api.key) and len(api.key) == 43
    with session_scope(api.db_url) as s:
        key = create_api_key(s, "acme", "second")
        rows = s.scalars(select(ApiKey).join(Tenant).where(Tenant.name == "acme")).all()
        assert len(rows) == 2 and len(s.scalars(select(Tenant)).all()) == 2  # tenant reused
        hashes = {r.key_hash for r in rows}
        assert hashlib.sha256(key.encode()).hexdigest() in hashes
        assert all(key not in (r.key_hash, r.prefix) for r in rows)
        with pytest.raises(ValueError):
            create_api_key(s, "../evil")


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Basic dXNlcjpwYXNz",
        "Bearer mt_not-a-key",
        "Bearer " + "mt_" + "a" * 40,
    ],
)
def test_missing_or_wrong_key_is_401(api: Api, header: str | None) -> None:
    headers = {} if header is None else {"Authorization": header}
    for method, path in (("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/v1/jobs/job-0123456789abcdef")):
        resp = api.client.request(
            method, path, headers=headers, json=api.spec() if method == "POST" else None
        )
        assert resp.status_code == 401, (header, path)
        assert resp.headers["WWW-Authenticate"] == "Bearer"
        assert isinstance(resp.json()["detail"], str)


def test_keys_create_list_revoke(api: Api) -> None:
    created = api.client.post("/v1/keys", json={"name": "ci"}, headers=api.headers)
    assert created.status_code == 201
    new = created.json()
    assert KEY_PATTERN.match(new["key"]) and new["prefix"] == new["key"][:10] and new["name"] == "ci"
    new_headers = {"Authorization": f"Bearer {new['key']}"}
    assert api.client.get("/v1/jobs", headers=new_headers).status_code == 200
    listed = api.client.get("/v1/keys", headers=api.headers).json()
    assert {k["name"] for k in listed} == {"test", "ci"} and all("key" not in k for k in listed)
    # Another tenant can neither see nor revoke it.
    assert all(k["id"] != new["id"] for k in api.client.get("/v1/keys", headers=api.other_headers).json())
    assert api.client.post(f"/v1/keys/{new['id']}/revoke", headers=api.other_headers).status_code == 404
    revoked = api.client.post(f"/v1/keys/{new['id']}/revoke", headers=api.headers)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    resp = api.client.get("/v1/jobs", headers=new_headers)
    assert resp.status_code == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
    assert api.client.get("/v1/jobs", headers=api.headers).status_code == 200
    assert (
        api.client.post("/v1/keys", json={"name": "x", "admin": True}, headers=api.headers).status_code == 422
    )


def test_tenant_isolation_on_every_job_endpoint(api: Api) -> None:
    job = api.submit()
    job_id = job["id"]
    with session_scope(api.db_url) as s:
        s.add(JobMetric(job_id=job_id, kind="train", step=1, loss=1.0, data={"step": 1, "loss": 1.0}))
        s.add(JobLog(job_id=job_id, seq=1, line="secret"))
        s.add(Checkpoint(job_id=job_id, step=1, uri="file:///x", size_bytes=1))
    sse = {"Accept": "text/event-stream"}
    endpoints = [
        ("GET", f"/v1/jobs/{job_id}", {}),
        ("POST", f"/v1/jobs/{job_id}/cancel", {}),
        ("GET", f"/v1/jobs/{job_id}/events", {}),
        ("GET", f"/v1/jobs/{job_id}/metrics", {}),
        ("GET", f"/v1/jobs/{job_id}/metrics", sse),
        ("GET", f"/v1/jobs/{job_id}/logs", {}),
        ("GET", f"/v1/jobs/{job_id}/logs", sse),
        ("GET", f"/v1/jobs/{job_id}/checkpoints", {}),
        ("GET", f"/v1/jobs/{job_id}/checkpoints/1/download", {}),
    ]
    for method, path, extra in endpoints:
        resp = api.client.request(method, path, headers={**api.other_headers, **extra})
        assert resp.status_code == 404, (method, path, resp.text)
        assert resp.json() == {"detail": f"job {job_id!r} not found"}
        # The owner still gets an answer (and nothing above cancelled the job).
        if not (method == "POST" or extra or "download" in path):
            assert api.client.request(method, path, headers=api.headers).status_code == 200, path
    assert api.client.get(f"/v1/jobs/{job_id}", headers=api.headers).json()["status"] == "queued"
    assert api.client.get("/v1/jobs", headers=api.other_headers).json()["items"] == []
    # An unknown id answers exactly like another tenant's.
    unknown = api.client.get("/v1/jobs/job-ffffffffffffffff", headers=api.headers)
    assert unknown.status_code == 404 and unknown.json() == {"detail": "job 'job-ffffffffffffffff' not found"}


def test_ensure_local_credentials(megatrain_home: Path) -> None:
    settings = get_settings()
    upgrade_database(settings.resolved_database_url)
    key = ensure_local_credentials(settings)
    path = settings.credentials_path
    assert KEY_PATTERN.match(key) and path.read_text().strip() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_local_credentials(settings) == key  # kept, not rotated
    # A key the database no longer knows (database replaced, key revoked) is replaced.
    with session_scope(settings.resolved_database_url) as s:
        for row in s.scalars(select(ApiKey)).all():
            s.delete(row)
    fresh = ensure_local_credentials(settings)
    assert fresh != key and path.read_text().strip() == fresh
    with TestClient(create_app(settings)) as client:
        resp = client.get("/v1/jobs", headers={"Authorization": f"Bearer {fresh}"})
        assert resp.status_code == 200
        with session_scope(settings.resolved_database_url) as s:
            assert s.scalar(select(Tenant.name)) == "local"


def test_a_known_key_costs_no_query_until_revoked(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """API requests take a key this process found live within AUTH_CACHE_S without asking the
    database; revoking it through the API forgets it at once; a key removed behind the API's back
    (another process, an operator's SQL) stops working once its time in the cache is over."""
    from sqlalchemy import event

    from megatrain.api import auth
    from megatrain.db.session import get_engine

    new = api.client.post("/v1/keys", json={"name": "ci"}, headers=api.headers).json()
    headers = {"Authorization": f"Bearer {new['key']}"}
    statements: list[str] = []
    engine = get_engine(api.db_url)
    event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    assert api.client.get("/v1/jobs", headers=headers).status_code == 200
    assert any("api_key" in s for s in statements)
    statements.clear()
    assert api.client.get("/v1/jobs", headers=headers).status_code == 200
    assert statements and not any("api_key" in s for s in statements)  # the job list's query only
    revoked = api.client.post(f"/v1/keys/{new['id']}/revoke", headers=api.headers)
    assert revoked.status_code == 200
    assert api.client.get("/v1/jobs", headers=headers).status_code == 401  # at once, in this process

    second = api.client.post("/v1/keys", json={"name": "ci-2"}, headers=api.headers).json()
    headers = {"Authorization": f"Bearer {second['key']}"}
    assert api.client.get("/v1/jobs", headers=headers).status_code == 200
    with session_scope(api.db_url) as s:
        s.delete(s.get(ApiKey, second["id"]))
    assert api.client.get("/v1/jobs", headers=headers).status_code == 200  # still within its 5 s
    later = auth._clock() + auth.AUTH_CACHE_S + 1
    monkeypatch.setattr(auth, "_clock", lambda: later)
    assert api.client.get("/v1/jobs", headers=headers).status_code == 401


def test_a_revocation_notified_by_another_api_process_empties_the_cache() -> None:
    """On PostgreSQL a revocation is NOTIFYed (db.notify.AUTH_CHANGED); the listener of every API
    process hands it to its stream hub, which forgets the cached keys (as after a reconnect, when a
    notification may have been missed); a job's notification leaves them."""
    from megatrain.api import auth
    from megatrain.api.streams import StreamHub
    from megatrain.db.notify import AUTH_CHANGED

    hub = StreamHub("postgresql+psycopg://x@127.0.0.1/none", 0.5, 8)
    for payload, kept in (("job-123", True), (AUTH_CHANGED, False), (None, False)):
        auth._known[(1, "digest")] = (float("inf"), Tenant(id="ten-1", name="t"), "key-1")
        hub._notified(payload)
        assert bool(auth._known) is kept, payload
