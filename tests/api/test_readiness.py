"""/readyz follows what the process can serve, with no restart: unready while its PostgreSQL is
unreachable (cut by a TCP proxy in front of the real server) and ready once it is back, unready
while the schema is not this code's, and unready while every request thread is taken; /healthz
(liveness) answers throughout."""

from __future__ import annotations

import time
from collections.abc import Iterator

import anyio
import pytest
from fastapi.testclient import TestClient
from fixtures.tcp_proxy import TcpProxy
from sqlalchemy.engine import make_url

from megatrain.api.app import create_app
from megatrain.api.health.router import thread_pressure
from megatrain.settings import get_settings


def _ready(client: TestClient) -> tuple[int, dict]:
    resp = client.get("/readyz")
    return resp.status_code, resp.json()


def _until(client: TestClient, status: int, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        code, body = _ready(client)
        if code == status:
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.2)


@pytest.fixture
def proxied(db_url: str) -> Iterator[tuple[TestClient, TcpProxy]]:
    """An app whose database connections go through a proxy to the test's PostgreSQL schema."""
    url = make_url(db_url)
    proxy = TcpProxy((url.host or "127.0.0.1", url.port or 5432)).start()
    through = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    settings = get_settings().model_copy(update={"database_url": through})
    try:
        with TestClient(create_app(settings)) as client:
            yield client, proxy
    finally:
        proxy.stop()


@pytest.mark.postgres
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_unready_while_the_database_is_gone_and_ready_after(proxied: tuple[TestClient, TcpProxy]) -> None:
    client, proxy = proxied
    assert _ready(client)[0] == 200
    headers = {"Authorization": "Bearer mt_" + "a" * 40}
    proxy.stop()
    body = _until(client, 503)
    assert body["checks"]["database"].startswith("does not answer") and body["status"] == "unready"
    assert client.get("/healthz").status_code == 200  # alive all along: nothing to restart
    assert client.get("/v1/jobs", headers=headers).status_code == 503
    proxy.start()
    body = _until(client, 200)
    assert body["checks"] == {"database": "ok", "migrations": "ok", "threads": "ok"}
    assert client.get("/v1/jobs", headers=headers).status_code == 401  # served again (an unknown key)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_unready_while_the_schema_is_not_this_codes(db_url: str) -> None:
    from alembic import command

    from megatrain.db.session import _alembic_config, schema_head

    with TestClient(create_app(get_settings())) as client:
        assert _ready(client)[0] == 200
        command.downgrade(_alembic_config(db_url), "-1")
        code, body = _ready(client)
        assert code == 503 and body["checks"]["database"] == "ok"
        assert body["checks"]["migrations"].startswith("the database is at ")
        assert body["checks"]["migrations"].endswith(f"this code at {schema_head()} (migrations not run)")
        command.upgrade(_alembic_config(db_url), "head")
        assert _ready(client)[0] == 200


def test_every_thread_taken_and_a_request_waiting_is_unready() -> None:
    async def main() -> list[dict]:
        limiter = anyio.CapacityLimiter(2)
        seen = [thread_pressure(limiter)]
        release = anyio.Event()

        async def hold() -> None:
            async with limiter:
                await release.wait()

        async with anyio.create_task_group() as tg:
            for _ in range(3):  # two take the threads, the third waits
                tg.start_soon(hold)
            await anyio.sleep(0.05)
            seen.append(thread_pressure(limiter))
            release.set()
        seen.append(thread_pressure(limiter))
        return seen

    idle, full, after = anyio.run(main)
    assert idle == {"ok": True, "busy": 0, "size": 2, "waiting": 0}
    assert full == {"ok": False, "busy": 2, "size": 2, "waiting": 1}
    assert after["ok"] and after["busy"] == 0
