"""Server-Sent Events that follow a job's rows in the database.

Each tick reads the job's status, then the rows after the cursor; rows written before the job became
terminal are therefore always sent before `event: end`. Polling the database (rather than a pub/sub
channel) keeps API replicas stateless and works the same on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from megatrain.db.models import TERMINAL_STATES, Job
from megatrain.db.session import get_sessionmaker

BATCH = 1000
KEEPALIVE_S = 15.0

# fetch(session, cursor) -> (events as (id, data), new cursor). Rows come at most BATCH at a time.
Fetch = Callable[[Session, Any], tuple[list[tuple[int, dict[str, Any]]], Any]]


def wants_event_stream(accept: str | None) -> bool:
    return "text/event-stream" in (accept or "").lower()


def format_event(data: Any, *, event_id: int | None = None, event: str | None = None) -> str:
    lines = []
    if event is not None:
        lines.append(f"event: {event}")
    if event_id is not None:
        lines.append(f"id: {event_id}")
    lines.append("data: " + json.dumps(data, default=str, separators=(",", ":")))
    return "\n".join(lines) + "\n\n"


async def follow_job(
    database_url: str, job_id: str, fetch: Fetch, cursor: Any, poll_interval_s: float
) -> AsyncIterator[str]:
    sessionmaker = get_sessionmaker(database_url)

    def tick(cur: Any) -> tuple[str | None, list[tuple[int, dict[str, Any]]], Any]:
        with sessionmaker() as session:
            status = session.scalar(select(Job.status).where(Job.id == job_id))
            rows, cur = fetch(session, cur)
            return status, rows, cur

    yield "retry: 2000\n\n"
    last_sent = time.monotonic()
    while True:
        status, rows, cursor = await run_in_threadpool(tick, cursor)
        for event_id, data in rows:
            yield format_event(data, event_id=event_id)
        if rows:
            last_sent = time.monotonic()
        if len(rows) >= BATCH:
            continue  # more are waiting: no sleep
        if status is None or status in TERMINAL_STATES:
            yield format_event({"status": status}, event="end")
            return
        if time.monotonic() - last_sent > KEEPALIVE_S:
            yield ": keep-alive\n\n"  # proxies close idle connections
            last_sent = time.monotonic()
        await anyio.sleep(poll_interval_s)


def event_stream_response(stream: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        stream,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
