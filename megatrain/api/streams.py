"""Live streams of a job's rows (metrics, logs) as Server-Sent Events, shared by every client.

One `Feed` per followed (job, channel) polls the database for the rows after its high-water mark and
fans each new row out, formatted once, to every subscriber in this API process; a thousand dashboards
on one job cost one query per tick, not a thousand. A new subscriber reads its backlog once (rows up
to the feed's mark, in pages), then takes the feed's rows; rows are keyed by their insertion order, so
the two parts meet without a gap or a repeat. A subscriber that falls more than `MAX_PENDING` rows
behind is told to catch up from the database again instead of growing a queue without bound.

Streams hold no database connection between ticks and use their own small pool (`STREAM_POOL`), so
open streams never exhaust the connections request handlers and the scheduler need. Each tick reads
the job's status before its rows: rows written before the job became terminal are always sent before
`event: end`. On PostgreSQL a feed ticks when its job is notified (db.notify, api/notifications.py):
a row reaches its streams within one query of its commit, and an idle stream costs nothing but a
slow fallback poll; on SQLite (or while the listening connection is lost) feeds poll every
`poll_interval_s`. Either way API replicas stay stateless: each serves its own streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session, sessionmaker
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from megatrain.api.auth import forget_keys
from megatrain.api.jobs.schemas import LogLinePublic
from megatrain.api.jobs.service import metric_row
from megatrain.api.notifications import JobListener
from megatrain.db.models import TERMINAL_STATES, Job, JobLog, JobMetric
from megatrain.db.notify import AUTH_CHANGED
from megatrain.db.session import make_engine
from megatrain.db.stream_leases import (
    LEASE_TTL_S,
    LeaseRefused,
    drop_lease,
    drop_process_leases,
    refresh_leases,
    take_lease,
)

log = logging.getLogger("megatrain.api.streams")

BATCH = 1000
KEEPALIVE_S = 15.0
MAX_PENDING = 10 * BATCH
STREAM_POOL = 4
"""Connections (and threads) all streams of one API process share."""
LISTENING_POLL_S = 5.0
"""How often a feed polls while notifications arrive (in case one was missed)."""


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


@dataclass(frozen=True)
class Row:
    key: int
    """Insertion order within the job (metric row id, log seq): the feed's and the cursor's unit."""
    text: str
    """The SSE event, formatted once for every subscriber."""
    step: int = 0
    kind: str = ""


@dataclass(frozen=True)
class Channel:
    """What a feed follows: a job's rows after a key (optionally after a step, of one kind), and
    the newest key."""

    name: str
    rows_after: Callable[[Session, str, int, int, int | None, str | None], list[Row]]
    newest: Callable[[Session, str], int]


def _metrics_after(
    s: Session, job_id: str, after: int, limit: int, since: int | None, kind: str | None
) -> list[Row]:
    q = select(JobMetric).where(JobMetric.job_id == job_id, JobMetric.id > after)
    if since is not None:
        q = q.where(JobMetric.step > since)
    if kind is not None:
        q = q.where(JobMetric.kind == kind)
    rows = s.scalars(q.order_by(JobMetric.id).limit(limit))
    return [Row(m.id, format_event(metric_row(m), event_id=m.step), m.step, m.kind) for m in rows]


def _logs_after(
    s: Session, job_id: str, after: int, limit: int, since: int | None, kind: str | None
) -> list[Row]:
    q = select(JobLog).where(JobLog.job_id == job_id, JobLog.seq > after)
    rows = s.scalars(q.order_by(JobLog.seq).limit(limit))
    return [
        Row(r.seq, format_event(LogLinePublic.model_validate(r).model_dump(mode="json"), event_id=r.seq))
        for r in rows
    ]


METRICS = Channel(
    "metrics",
    _metrics_after,
    lambda s, job_id: s.scalar(select(func.max(JobMetric.id)).where(JobMetric.job_id == job_id)) or 0,
)
LOGS = Channel(
    "logs",
    _logs_after,
    lambda s, job_id: s.scalar(select(func.max(JobLog.seq)).where(JobLog.job_id == job_id)) or 0,
)


@dataclass(frozen=True)
class _Lagged:
    """The subscriber fell too far behind: it re-reads from the database."""


@dataclass(frozen=True)
class _Failed:
    """The feed's poller failed."""


@dataclass(frozen=True)
class _End:
    status: str | None
    """The job's terminal status (None: the job is gone)."""


class TooManyStreams(Exception):
    def __init__(self, limit: int):
        self.limit = limit
        super().__init__(f"this tenant already has {limit} live streams open (the limit); close some")


@dataclass(eq=False)
class Subscriber:
    feed: Feed
    tenant_id: str
    since: int | None = None
    """Only rows after this step (metrics)."""
    kind: str | None = None
    """Only rows of this kind (metrics)."""
    queue: asyncio.Queue[list[Row] | _Lagged | _End | _Failed] = field(default_factory=asyncio.Queue)
    pending: int = 0
    lease: str | None = None
    """Its place under the tenant's cap across API processes (db.stream_leases), if shared."""

    def keeps(self, row: Row) -> bool:
        return (self.since is None or row.step > self.since) and (self.kind is None or row.kind == self.kind)

    def offer(self, rows: list[Row]) -> None:
        if self.pending + len(rows) > MAX_PENDING:
            # Too slow a reader: drop what waits and let it re-read from the database at its own pace.
            while not self.queue.empty():
                self.queue.get_nowait()
            self.pending = 0
            self.queue.put_nowait(_Lagged())
            return
        self.pending += len(rows)
        self.queue.put_nowait(rows)

    async def next(self, timeout_s: float) -> list[Row] | _Lagged | _End | _Failed | None:
        """The next batch or marker, or None after `timeout_s`."""
        with anyio.move_on_after(timeout_s):
            item = await self.queue.get()
            if isinstance(item, list):
                self.pending -= len(item)
            return item
        return None


class Feed:
    """One poller for one (job, channel), fanning its rows out to every subscriber."""

    def __init__(self, hub: StreamHub, job_id: str, channel: Channel):
        self.hub, self.job_id, self.channel = hub, job_id, channel
        self.subscribers: set[Subscriber] = set()
        self.mark = 0
        self.primed = asyncio.Event()
        self.wakeup = asyncio.Event()
        """Set when the job is notified (new rows or status): the feed ticks at once."""
        self.task: asyncio.Task[None] | None = None

    def _tick(self, prime: bool) -> tuple[str | None, list[Row]]:
        with self.hub.sessions() as s:
            status = s.scalar(select(Job.status).where(Job.id == self.job_id))
            if prime:
                self.mark = self.channel.newest(s, self.job_id)
                return status, []
            return status, self.channel.rows_after(s, self.job_id, self.mark, BATCH, None, None)

    async def run(self) -> None:
        prime = True
        try:
            while self.subscribers:
                self.wakeup.clear()  # a notification during the tick below ticks again at once
                status, rows = await self.hub.db(self._tick, prime)
                if prime:
                    prime = False
                    self.primed.set()
                if rows:
                    self.mark = rows[-1].key
                    for sub in self.subscribers:
                        sub.offer(rows)
                if len(rows) >= BATCH:
                    continue  # more are waiting: no sleep
                if status is None or status in TERMINAL_STATES:
                    for sub in self.subscribers:
                        sub.queue.put_nowait(_End(status))
                    return
                with anyio.move_on_after(self.hub.interval_s()):
                    await self.wakeup.wait()
        except Exception:
            # The clients reconnect (SSE's retry) and resume by Last-Event-ID on a fresh feed.
            log.exception("the %s feed of job %s failed; its streams end", self.channel.name, self.job_id)
            for sub in self.subscribers:
                sub.queue.put_nowait(_Failed())
        finally:
            self.primed.set()
            self.hub.drop_feed(self)


class StreamHub:
    """The feeds of one API process, its streams' connection pool, and the per-tenant stream cap."""

    def __init__(self, database_url: str, poll_interval_s: float, max_per_tenant: int):
        self.database_url = database_url
        self.poll_interval_s = poll_interval_s
        self.max_per_tenant = max_per_tenant
        self.feeds: dict[tuple[str, str], Feed] = {}
        self.open: dict[str, int] = {}
        self._engine: Engine | None = None
        self._sessions: sessionmaker[Session] | None = None
        self._limiter = anyio.CapacityLimiter(STREAM_POOL)
        self.listener: JobListener | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.shared_cap = JobListener.supported(database_url)
        """Whether the tenant cap holds across API processes (PostgreSQL: stream leases)."""
        self.process = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._lease_task: asyncio.Task[None] | None = None

    def listen(self) -> None:
        """On PostgreSQL: wake feeds on the database's job notifications, and keep this process's
        stream leases (the tenant cap across processes); a no-op elsewhere."""
        if self.listener is None and self.shared_cap:
            self._loop = asyncio.get_running_loop()
            self.listener = JobListener(self.database_url, self._notified).start()
            self._lease_task = self._loop.create_task(self._keep_leases())

    def _notified(self, job_id: str | None) -> None:
        """From the listener's thread: wake the job's feeds (every feed for None); a revoked key
        (or, after a reconnect, maybe one) empties this process's cache of keys."""
        if job_id is None or job_id == AUTH_CHANGED:
            forget_keys()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.wake, job_id)

    def wake(self, job_id: str | None) -> None:
        for (feed_job, _), feed in list(self.feeds.items()):
            if job_id is None or feed_job == job_id:
                feed.wakeup.set()

    def interval_s(self) -> float:
        """How long a feed waits for a notification before it polls."""
        if self.listener is not None and self.listener.connected:
            return max(self.poll_interval_s, LISTENING_POLL_S)
        return self.poll_interval_s

    def sessions(self) -> Session:
        if self._sessions is None:
            self._engine = make_engine(self.database_url, pool_size=STREAM_POOL, max_overflow=0)
            self._sessions = sessionmaker(self._engine, expire_on_commit=False)
        return self._sessions()

    async def db(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking database read off the event loop, on the streams' own threads and pool."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def subscribe(
        self, tenant_id: str, job_id: str, channel: Channel, since: int | None = None, kind: str | None = None
    ) -> Subscriber:
        """A place in the feed of (job, channel); raises TooManyStreams past the tenant's cap (held
        across every API process on PostgreSQL: db.stream_leases)."""
        if self.open.get(tenant_id, 0) >= self.max_per_tenant:
            raise TooManyStreams(self.max_per_tenant)
        lease = None
        if self.shared_cap:
            try:
                lease = await self.db(self._take_lease, tenant_id)
            except LeaseRefused:
                raise TooManyStreams(self.max_per_tenant) from None
        feed = self.feeds.get((job_id, channel.name))
        if feed is None:
            feed = self.feeds[(job_id, channel.name)] = Feed(self, job_id, channel)
        sub = Subscriber(feed, tenant_id, since, kind, lease=lease)
        feed.subscribers.add(sub)
        self.open[tenant_id] = self.open.get(tenant_id, 0) + 1
        if feed.task is None:
            feed.task = asyncio.get_running_loop().create_task(feed.run())
        return sub

    async def unsubscribe(self, sub: Subscriber) -> None:
        if sub not in sub.feed.subscribers:
            return
        sub.feed.subscribers.discard(sub)
        self.open[sub.tenant_id] -= 1
        if not self.open[sub.tenant_id]:
            del self.open[sub.tenant_id]
        if sub.lease is not None:
            with anyio.CancelScope(shield=True):
                await self.db(self._leases, drop_lease, sub.lease)

    def _take_lease(self, tenant_id: str) -> str:
        with self.sessions() as s, s.begin():
            return take_lease(s, tenant_id, self.process, self.max_per_tenant)

    def _leases(self, fn: Callable[[Session, str], None], arg: str) -> None:
        with self.sessions() as s, s.begin():
            fn(s, arg)

    async def _keep_leases(self) -> None:
        """Refresh this process's leases while it lives (a dead process's lapse: LEASE_TTL_S)."""
        while True:
            await anyio.sleep(LEASE_TTL_S / 4)
            try:
                await self.db(self._leases, refresh_leases, self.process)
            except Exception as exc:  # the database is away: the leases may lapse, streams go on
                log.warning("could not refresh this process's stream leases: %s", exc)

    def drop_feed(self, feed: Feed) -> None:
        if self.feeds.get((feed.job_id, feed.channel.name)) is feed:
            del self.feeds[(feed.job_id, feed.channel.name)]

    async def close(self) -> None:
        if self._lease_task is not None:
            self._lease_task.cancel()
        if self.listener is not None:
            await anyio.to_thread.run_sync(self.listener.stop)
        if self.shared_cap and self._sessions is not None:
            with contextlib.suppress(Exception):  # they lapse anyway
                await self.db(self._leases, drop_process_leases, self.process)
        for feed in list(self.feeds.values()):
            if feed.task is not None:
                feed.task.cancel()
        if self._engine is not None:
            self._engine.dispose()

    async def events(self, sub: Subscriber, cursor: int) -> AsyncIterator[str]:
        """The subscriber's stream: its backlog after `cursor`, then the feed's rows, then `end`."""
        feed = sub.feed
        yield "retry: 2000\n\n"
        await feed.primed.wait()
        catch_up = True
        while True:
            while catch_up:  # everything up to (at least) the feed's mark, read once, in pages
                rows = await self.db(self._page, sub, cursor)
                for row in rows:
                    yield row.text
                cursor = rows[-1].key if rows else cursor
                catch_up = len(rows) == BATCH
            item = await sub.next(KEEPALIVE_S)
            if item is None:
                yield ": keep-alive\n\n"  # proxies close idle connections
            elif isinstance(item, _Lagged):
                catch_up = True
            elif isinstance(item, list):
                for row in item:
                    if row.key > cursor:
                        cursor = row.key
                        if sub.keeps(row):
                            yield row.text
            elif isinstance(item, _End):
                yield format_event({"status": item.status}, event="end")
                return
            else:  # the feed failed: the client reconnects and resumes
                return

    def _page(self, sub: Subscriber, cursor: int) -> list[Row]:
        with self.sessions() as s:
            return sub.feed.channel.rows_after(s, sub.feed.job_id, cursor, BATCH, sub.since, sub.kind)


class EventStreamResponse(StreamingResponse):
    """SSE from a subscription, which is given back however the response ends (finished, client
    gone, server stopping) — even when the body was never started."""

    def __init__(self, hub: StreamHub, sub: Subscriber, cursor: int):
        super().__init__(
            hub.events(sub, cursor),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.hub, self.sub = hub, sub

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.hub.unsubscribe(self.sub)
