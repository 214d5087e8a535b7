"""Live streams woken by the database (db.notify, api/notifications.py): on PostgreSQL a committed
row reaches a stream within one query, with the feed's polling set so slow that only the
notification can explain it; a status change ends the stream as fast; SQLite keeps polling."""

from __future__ import annotations

import asyncio
import time

import pytest
from fixtures.cluster import seed_job

from megatrain.api.streams import METRICS, StreamHub
from megatrain.db.jobs import transition
from megatrain.db.models import CANCELLED, QUEUED
from megatrain.db.session import session_scope
from megatrain.worker.ingest import ingest_metrics

SLOW_POLL_S = 30.0


def _commit_row(url: str, job_id: str, step: int) -> None:
    with session_scope(url) as s:
        ingest_metrics(s, job_id, [{"step": step, "loss": 1.0 / step}])


async def _follow(url: str, job_id: str, poll_s: float) -> tuple[list[float], bool, float]:
    """Delays (s) of rows 1..3 from their commit to the stream, whether it listened, and the delay of
    `event: end` after the job ended."""
    hub = StreamHub(url, poll_s, max_per_tenant=4)
    hub.listen()
    try:
        if hub.listener is not None:
            await asyncio.wait_for(_until(lambda: hub.listener.connected), 10)
        sub = await hub.subscribe("t", job_id, METRICS)
        events = hub.events(sub, 0)
        assert (await anext(events)).startswith("retry:")
        await sub.feed.primed.wait()
        delays, committed = [], {}
        for step in (1, 2, 3):
            await asyncio.sleep(0.2)
            await asyncio.to_thread(_commit_row, url, job_id, step)
            committed[step] = time.monotonic()
            text = await asyncio.wait_for(anext(events), SLOW_POLL_S * 2)
            assert f'"step":{step}' in text, text
            delays.append(time.monotonic() - committed[step])
        ended = time.monotonic()
        await asyncio.to_thread(_cancel, url, job_id)
        text = await asyncio.wait_for(anext(events), SLOW_POLL_S * 2)
        assert text.startswith("event: end"), text
        return delays, hub.listener is not None, time.monotonic() - ended
    finally:
        await hub.close()


async def _until(pred: object) -> None:
    while not pred():  # type: ignore[operator]
        await asyncio.sleep(0.02)


def _cancel(url: str, job_id: str) -> None:
    with session_scope(url) as s:
        assert transition(s, job_id, CANCELLED, from_statuses=(QUEUED,), reason="test over")


@pytest.mark.parametrize("db_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_a_notified_row_reaches_the_stream_without_waiting_for_a_poll(db_url: str) -> None:
    job_id = seed_job(db_url, 1)
    delays, listened, end_delay = asyncio.run(_follow(db_url, job_id, SLOW_POLL_S))
    assert listened
    assert max(delays) < 1.0, delays  # polls come every 30 s: the notification woke the feed
    assert end_delay < 1.0


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_sqlite_streams_keep_polling(db_url: str) -> None:
    job_id = seed_job(db_url, 1)
    delays, listened, _ = asyncio.run(_follow(db_url, job_id, 0.2))
    assert not listened and max(delays) < 2.0


@pytest.mark.parametrize("db_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_a_rolled_back_write_notifies_no_one(db_url: str) -> None:
    """NOTIFY is transactional: a batch that fails to commit wakes nothing (and a feed that wakes
    anyway finds nothing)."""
    import psycopg
    from sqlalchemy.engine import make_url

    from megatrain.db.notify import CHANNEL

    job_id = seed_job(db_url, 1)
    conninfo = make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f"LISTEN {CHANNEL}")
        with pytest.raises(RuntimeError), session_scope(db_url) as s:
            ingest_metrics(s, job_id, [{"step": 1, "loss": 1.0}])
            raise RuntimeError("the batch failed")
        assert [n.payload for n in conn.notifies(timeout=0.5) if n.payload == job_id] == []
        _commit_row(db_url, job_id, 1)
        assert job_id in [n.payload for n in conn.notifies(timeout=1.0)]


@pytest.mark.parametrize("db_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_the_tenant_cap_holds_across_api_processes(db_url: str) -> None:
    """Two hubs stand for two API processes: the tenant's streams count together, a closed stream
    gives its place back, and the places of a process that died lapse."""
    from datetime import timedelta

    from sqlalchemy import select, update

    from megatrain.api.streams import TooManyStreams
    from megatrain.db.models import Job, utcnow
    from megatrain.db.stream_leases import LEASE_TTL_S, StreamLease

    job_id = seed_job(db_url, 1)
    with session_scope(db_url) as s:
        tenant = s.scalar(select(Job.tenant_id).where(Job.id == job_id))

    async def main() -> None:
        a, b = StreamHub(db_url, 0.2, max_per_tenant=3), StreamHub(db_url, 0.2, max_per_tenant=3)
        assert a.process != b.process
        try:
            held = [await a.subscribe(tenant, job_id, METRICS) for _ in range(2)]
            held.append(await b.subscribe(tenant, job_id, METRICS))
            with pytest.raises(TooManyStreams):
                await b.subscribe(tenant, job_id, METRICS)  # B alone holds 1 of 3: the cap is shared
            with pytest.raises(TooManyStreams):
                await a.subscribe(tenant, job_id, METRICS)
            await a.unsubscribe(held[0])
            held[0] = await b.subscribe(tenant, job_id, METRICS)  # the place A gave back
            # A dies without giving its place back: once its lease lapses, the place is free.
            with session_scope(db_url) as s:
                old = utcnow() - timedelta(seconds=LEASE_TTL_S + 1)
                s.execute(update(StreamLease).where(StreamLease.process == a.process).values(seen_at=old))
            await b.subscribe(tenant, job_id, METRICS)
            with pytest.raises(TooManyStreams):
                await b.subscribe(tenant, job_id, METRICS)
        finally:
            await a.close()
            await b.close()
        with session_scope(db_url) as s:
            assert s.scalars(select(StreamLease.id)).all() == []  # closed hubs hold nothing

    asyncio.run(main())
