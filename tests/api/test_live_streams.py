"""Live streams at scale, against a real server: open streams hold no database connection, every
stream receives every row, a tenant's streams are capped, and a slow reader catches up."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_handle import parse_sse
from fixtures.live import LiveApi
from sqlalchemy import select

from megatrain.api import streams
from megatrain.api.streams import METRICS, StreamHub
from megatrain.db.jobs import transition
from megatrain.db.models import CANCELLED, QUEUED, Job, JobMetric
from megatrain.db.session import get_engine, session_scope

STREAMS = 50


def _add_rows(url: str, job_id: str, steps: range) -> None:
    with session_scope(url) as s:
        s.add_all(
            JobMetric(job_id=job_id, kind="train", step=i, loss=1.0 / i, data={"loss": 1.0 / i})
            for i in steps
        )


def _finish(url: str, job_id: str) -> None:
    with session_scope(url) as s:
        assert transition(s, job_id, CANCELLED, from_statuses=(QUEUED,), reason="test over")


def _submit(live: LiveApi) -> str:
    headers = {"Authorization": f"Bearer {live.key}"}
    resp = httpx.post(f"{live.url}/v1/jobs", json=live.spec(), headers=headers, timeout=30)
    assert resp.status_code == 201, resp.text
    return str(resp.json()["id"])


async def _stream(client: httpx.AsyncClient, path: str, opened: asyncio.Event, count: list[int]) -> str:
    async with client.stream("GET", path, headers={"Accept": "text/event-stream"}) as resp:
        assert resp.status_code == 200, await resp.aread()
        text = ""
        async for chunk in resp.aiter_text():
            if not text:
                count[0] += 1
                if count[0] == STREAMS:
                    opened.set()
            text += chunk
        return text


def test_open_streams_hold_no_database_connection_and_all_get_every_row(live_api: LiveApi) -> None:
    url = live_api.settings.resolved_database_url
    job_id = _submit(live_api)
    _add_rows(url, job_id, range(1, 4))
    pool = get_engine(url).pool  # the pool request handlers (and, in `megatrain up`, the scheduler) use

    async def main() -> tuple[list[str], list[int], list[float]]:
        headers = {"Authorization": f"Bearer {live_api.key}"}
        limits = httpx.Limits(max_connections=STREAMS + 10)
        async with httpx.AsyncClient(
            base_url=live_api.url, headers=headers, limits=limits, timeout=60
        ) as client:
            opened, count = asyncio.Event(), [0]
            tasks = [
                asyncio.create_task(_stream(client, f"/v1/jobs/{job_id}/metrics", opened, count))
                for _ in range(STREAMS)
            ]
            await asyncio.wait_for(opened.wait(), 60)
            await asyncio.sleep(0.5)  # every stream past its backlog, waiting on the feed
            checked_out = [pool.checkedout() for _ in range(5)]
            healthz = []
            for _ in range(5):
                start = time.perf_counter()
                assert (await client.get("/healthz")).status_code == 200
                healthz.append(time.perf_counter() - start)
            await asyncio.to_thread(_add_rows, url, job_id, range(4, 7))
            await asyncio.sleep(1.0)
            await asyncio.to_thread(_finish, url, job_id)
            return await asyncio.wait_for(asyncio.gather(*tasks), 60), checked_out, healthz

    texts, checked_out, healthz = asyncio.run(main())
    assert checked_out == [0] * 5, "open streams must not hold the request pool's connections"
    assert max(healthz) < 1.0, healthz
    for text in texts:
        events = parse_sse(text)
        assert [e["data"].get("step") for e in events[:-1]] == [1, 2, 3, 4, 5, 6]
        assert events[-1] == {"event": "end", "id": None, "data": {"status": "cancelled"}}


def test_a_tenant_s_streams_are_capped_with_a_429(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fixtures.live import start_live_api

    monkeypatch.setenv("MEGATRAIN_MAX_STREAMS_PER_TENANT", "2")
    live = start_live_api(tmp_path, monkeypatch, with_scheduler=False)
    live_api = next(live)
    try:
        job_id = _submit(live_api)
        path = f"{live_api.url}/v1/jobs/{job_id}/logs?follow=true"
        headers = {"Authorization": f"Bearer {live_api.key}"}
        with httpx.Client(headers=headers, timeout=30) as client:
            with client.stream("GET", path) as one, client.stream("GET", path) as two:
                assert one.status_code == two.status_code == 200
                third = client.get(path)
                assert third.status_code == 429
                assert "max_streams_per_tenant=2" in third.json()["detail"]
                assert third.headers["Retry-After"]
                # Plain reads are not streams: still served.
                assert client.get(f"{live_api.url}/v1/jobs/{job_id}/logs").status_code == 200
            # Closed streams give their places back (the server sees the disconnect on its next write
            # or poll; allow it a moment).
            deadline = time.monotonic() + 10
            while True:
                with client.stream("GET", path) as again:
                    if again.status_code == 200:
                        break
                assert time.monotonic() < deadline, "closed streams never gave their places back"
                time.sleep(0.2)
    finally:
        next(live, None)


def test_a_slow_reader_catches_up_from_the_database(
    db_url: str, add_job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(streams, "MAX_PENDING", 4)
    job_id = add_job()

    async def main() -> list[str]:
        hub = StreamHub(db_url, poll_interval_s=0.01, max_per_tenant=10)
        sub = await hub.subscribe("acme", job_id, METRICS)
        events = hub.events(sub, cursor=0)
        out = [await events.__anext__()]  # "retry:", then it waits for the feed's first tick
        await asyncio.to_thread(_add_rows, db_url, job_id, range(1, 21))  # 5× what may wait
        for _ in range(100):  # the feed polls while this reader reads nothing
            await asyncio.sleep(0.01)
            if sub.pending == 0 and not sub.queue.empty():
                break
        await asyncio.to_thread(_finish, db_url, job_id)
        async for text in events:
            out.append(text)
        await hub.close()
        assert hub.open == {} or hub.open == {"acme": 1}
        return out

    out = asyncio.run(main())
    steps = [e["data"].get("step") for e in parse_sse("".join(out))]
    assert steps == [*range(1, 21), None]  # every row once, in order, then the end
    with session_scope(db_url) as s:
        assert s.scalar(select(Job.status).where(Job.id == job_id)) == CANCELLED
