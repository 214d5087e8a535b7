"""Many concurrent requests on few threads: no request holds a database connection while it waits
for a thread, so a full pool never deadlocks the API."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fixtures.live import LiveApi, start_live_api

CLIENTS = 48  # more than the pool's 10 + 20 connections


@pytest.fixture
def few_threads_api(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveApi]:
    monkeypatch.setenv("MEGATRAIN_API_THREADS", "2")
    yield from start_live_api(tmp_path, monkeypatch, with_scheduler=False)


def test_more_clients_than_connections_on_two_threads_all_answered(few_threads_api: LiveApi) -> None:
    live = few_threads_api
    headers = {"Authorization": f"Bearer {live.key}"}

    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=live.url, headers=headers, limits=limits, timeout=20) as client:
            job_id = (await client.post("/v1/jobs", json=live.spec())).json()["id"]

            async def one(i: int) -> int:
                if i % 8 == 0:
                    return (await client.post("/v1/jobs", json=live.spec(f"j{i}"))).status_code
                path = f"/v1/jobs/{job_id}" if i % 2 else f"/v1/jobs/{job_id}/events"
                return (await client.get(path)).status_code

            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(4 * CLIENTS))), 60)

    codes = asyncio.run(main())
    assert sorted(set(codes)) == [200, 201], codes
