"""Request hardening and the service endpoints: body limits, malformed bodies, path tricks, JSON
errors everywhere, /healthz and /readyz, /metrics, the schema, and the placeholder page at /."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from api_handle import Api
from fastapi.testclient import TestClient
from sqlalchemy import inspect

from megatrain.api import jobs as jobs_pkg
from megatrain.api.app import create_app
from megatrain.db.session import get_engine
from megatrain.settings import get_settings


def test_oversized_bodies_are_413(api: Api) -> None:
    limit = api.settings.max_request_bytes
    spec = api.spec()
    spec["name"] = "big"
    big = b'{"name": "big", "pad": "' + b"x" * limit + b'"}'
    resp = api.client.post(
        "/v1/jobs", content=big, headers={**api.headers, "Content-Type": "application/json"}
    )
    assert resp.status_code == 413 and "exceeds" in resp.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        for _ in range(limit // 1024 + 2):
            yield b" " * 1024

    resp = api.client.post(
        "/v1/jobs", content=chunks(), headers={**api.headers, "Content-Type": "application/json"}
    )
    assert resp.status_code == 413 and "exceeds" in resp.json()["detail"]
    # Size is checked before authentication: an unauthenticated flood costs nothing either.
    assert api.client.post("/v1/jobs", content=big).status_code == 413
    assert api.client.post("/v1/jobs", json=spec, headers=api.headers).status_code == 201


@pytest.mark.parametrize(
    "body, ctype, status",
    [
        (b"{not json", "application/json", 422),
        (b"", "application/json", 422),
        (b"\xff\xfe{}", "application/json", 422),
        (b"[1, 2]", "application/json", 422),
        (b'"a string"', "application/json", 422),
        (b"null", "application/json", 422),
        (b"[" * 30_000 + b"]" * 30_000, "application/json", 422),
        (b"name: x", "text/plain", 415),
        (b"<spec/>", "application/xml", 415),
    ],
)
def test_malformed_bodies(api: Api, body: bytes, ctype: str, status: int) -> None:
    resp = api.client.post("/v1/jobs", content=body, headers={**api.headers, "Content-Type": ctype})
    assert resp.status_code == status, resp.text
    detail = resp.json()["detail"]
    if status == 422:
        assert detail[0]["field"] in ("body", "spec") and detail[0]["message"]


@pytest.mark.parametrize(
    "path",
    [
        "/v1/jobs/..%2F..%2Fetc%2Fpasswd",
        "/v1/jobs/%2e%2e",
        "/v1/jobs/job-1;drop",
        "/v1/jobs/" + "a" * 300,
        "/v1/jobs/%00",
        "/v1/jobs/job-%27or%271",
    ],
)
def test_job_id_path_tricks_are_404(api: Api, path: str) -> None:
    resp = api.client.get(path, headers=api.headers)
    assert resp.status_code == 404 and isinstance(resp.json()["detail"], str)


def test_unexpected_errors_are_json_500_without_internals(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: object) -> None:
        raise RuntimeError("secret internal detail /srv/db password=hunter2")

    job_id = api.submit()["id"]
    monkeypatch.setattr(jobs_pkg.service, "list_events", boom)
    with TestClient(api.client.app, raise_server_exceptions=False) as client:
        resp = client.get(f"/v1/jobs/{job_id}/events", headers=api.headers)
    assert resp.status_code == 500 and resp.json() == {"detail": "internal server error"}


def test_request_validation_errors_use_the_field_shape(api: Api) -> None:
    job_id = api.submit()["id"]
    resp = api.client.get(f"/v1/jobs/{job_id}/logs?after_seq=-1&limit=abc", headers=api.headers)
    assert resp.status_code == 422
    assert {d["field"] for d in resp.json()["detail"]} == {"after_seq", "limit"}
    # Someone else's (or no) job is a 404 before any parameter is looked at: nothing leaks.
    resp = api.client.get(f"/v1/jobs/{job_id}/logs?after_seq=-1", headers=api.other_headers)
    assert resp.status_code == 404
    assert api.client.get("/v1/nothing-here").json() == {"detail": "Not Found"}
    resp = api.client.delete("/v1/jobs", headers=api.headers)
    assert resp.status_code == 405 and isinstance(resp.json()["detail"], str)


def test_healthz_and_readyz(api: Api) -> None:
    for path in ("/healthz", "/v1/healthz"):
        resp = api.client.get(path)  # no key needed
        assert resp.status_code == 200 and resp.json()["status"] == "ok"
    for path in ("/readyz", "/v1/readyz"):
        resp = api.client.get(path)
        assert resp.status_code == 200 and resp.json()["status"] == "ready", resp.json()
        assert resp.json()["checks"] == {"database": "ok", "migrations": "ok", "threads": "ok"}


def test_database_down_is_503_not_500(megatrain_home: object) -> None:
    settings = get_settings().model_copy(
        update={"database_url": "postgresql+psycopg://postgres@127.0.0.1:1/none?connect_timeout=2"}
    )
    with TestClient(create_app(settings)) as client:  # starts anyway
        assert client.get("/healthz").status_code == 200  # alive: a restart cannot fix the database
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["status"] == "unready"
        assert ready.json()["checks"]["database"].startswith("does not answer")
        assert ready.json()["detail"].startswith("database: does not answer")
        jobs = client.get("/v1/jobs", headers={"Authorization": "Bearer mt_" + "a" * 40})
        assert jobs.status_code == 503 and "database" in jobs.json()["detail"]
        assert "megatrain_database_up 0.0" in client.get("/metrics").text


def test_prometheus_metrics(api: Api) -> None:
    job_id = api.submit()["id"]
    api.client.post(f"/v1/jobs/{job_id}/cancel", headers=api.headers)
    api.submit()
    api.client.get("/v1/jobs", headers={"Authorization": "Bearer nope"})
    resp = api.client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    assert 'megatrain_http_requests_total{method="POST",route="/v1/jobs",status="201"} 2.0' in text
    assert 'megatrain_http_requests_total{method="GET",route="/v1/jobs",status="401"} 1.0' in text
    assert 'route="/v1/jobs/{job_id}/cancel",status="200"} 1.0' in text
    assert 'megatrain_http_request_duration_seconds_count{method="POST",route="/v1/jobs"} 2.0' in text
    assert 'megatrain_jobs{status="queued"} 1.0' in text and 'megatrain_jobs{status="cancelled"} 1.0' in text
    assert "megatrain_database_up 1.0" in text
    # The queue by pool and tenant, the nodes by pool and state, the live streams (none now).
    assert 'megatrain_queued_jobs{pool="default",tenant="acme"} 1.0' in text
    assert 'megatrain_nodes{pool="default",status="ready"} 1.0' in text
    assert "megatrain_open_streams 0.0" in text
    assert job_id not in text  # route templates, never raw paths


def test_spec_schema_and_validate(api: Api) -> None:
    schema = api.client.get("/v1/spec/schema").json()
    assert schema["title"] == "JobSpec" and "training" in schema["properties"]
    ok = api.client.post("/v1/spec/validate", json=api.spec(), headers=api.headers)
    assert ok.status_code == 200 and ok.json()["num_procs"] == 2 and ok.json()["layout"]["dp"] == 2
    bad = api.client.post("/v1/spec/validate", json=api.spec(model={"hidden_size": 66}), headers=api.headers)
    assert bad.status_code == 422 and bad.json()["detail"][0]["field"] == "model.hidden_size"
    assert api.client.get("/v1/jobs", headers=api.headers).json()["items"] == []  # nothing was created
    openapi = api.client.get("/openapi.json").json()
    assert "JobSpec" in openapi["components"]["schemas"] and "/v1/jobs/{job_id}/metrics" in openapi["paths"]


def test_root_serves_the_placeholder_page(api: Api) -> None:
    resp = api.client.get("/")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    assert "<title>megatrain</title>" in resp.text and "/docs" in resp.text


def test_startup_migrates_sqlite_and_leaves_nodes_to_the_worker(megatrain_home: object) -> None:
    settings = get_settings()
    url = settings.resolved_database_url
    assert url.startswith("sqlite")
    with TestClient(create_app(settings)) as client:
        assert "job" in inspect(get_engine(url)).get_table_names()
        assert client.get("/healthz").status_code == 200
        from sqlalchemy import select

        from megatrain.db.models import Node, NodePool
        from megatrain.db.session import session_scope

        with session_scope(url) as s:  # `megatrain up` registers them through the executor
            assert s.scalar(select(NodePool.name)) is None
            assert s.scalar(select(Node.slots_total)) is None


def test_api_imports_neither_engine_nor_worker_nor_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, megatrain.api.app; "
        "bad = [m for m in sys.modules if m.split('.')[0] == 'torch' "
        "or m.startswith(('megatrain.engine', 'megatrain.worker'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
