"""Plain ASGI middleware (no BaseHTTPMiddleware, so streaming responses pass straight through):
a request-body size limit and Prometheus request metrics; and stream_body, the size-capped reading
of an upload that its routes share."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from megatrain.api.scrape import ControlPlaneCollector


class RequestTooLarge(Exception):
    def __init__(self, limit: int):
        self.limit = limit
        super().__init__(f"request body exceeds {limit} bytes")


BODY_CHUNK = 1 << 20
"""An upload is handed on in pieces of about this size (a thread call each, not one per packet)."""


async def stream_body(request: Request, cap: int, feed: Callable[[bytes], object]) -> None:
    """Hand a request's body to `feed` (run in a worker thread) in BODY_CHUNK pieces, refusing it
    (RequestTooLarge) once past `cap` bytes, announced or not; then `feed(b"")`'s last piece."""
    pending, received = bytearray(), 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > cap:
            raise RequestTooLarge(cap)
        pending += chunk
        if len(pending) >= BODY_CHUNK:
            await run_in_threadpool(feed, bytes(pending))
            pending.clear()
    await run_in_threadpool(feed, bytes(pending))


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class BodyLimitMiddleware:
    """Refuse bodies over `max_bytes`: up front by Content-Length, and while reading for chunked
    bodies or a Content-Length that lies. `overrides` maps a path to its own limit (uploads)."""

    def __init__(self, app: ASGIApp, max_bytes: int, overrides: dict[str, int] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.overrides = overrides or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.overrides.get(scope.get("path", "").rstrip("/"), self.max_bytes)
        too_large = {"detail": f"request body exceeds the limit of {limit} bytes"}
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    await _send_json(send, 400, {"detail": "invalid Content-Length header"})
                    return
                if length > limit:
                    await _send_json(send, 413, too_large)
                    return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise RequestTooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except RequestTooLarge:
            # Normally answered by the exception handler inside; this covers reads outside it.
            if not started:
                await _send_json(send, 413, too_large)


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""Set by `megatrain api --workers N` before its processes start: prometheus_client then keeps each
process's counters in files there, and a scrape answered by any process sums them all."""


class ApiMetrics:
    """One registry per app (tests build many apps in one process; the global one would clash).

    `registry` holds this process's own series; `served` is what /metrics answers with: the same
    registry, or under several API processes the sum of all their files. The control plane's counts
    (scrape.py) come from the database once per scrape, whichever process answers."""

    def __init__(self, database_url: str, open_streams: Callable[[], int] | None = None):
        self.multiprocess = bool(os.environ.get(MULTIPROC_ENV))
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "megatrain_http_requests",
            "HTTP requests by method, route template and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "megatrain_http_request_duration_seconds",
            "Time to the end of the response (whole stream for SSE)",
            ["method", "route"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.served = self.registry
        self.open_streams = open_streams
        self.streams_gauge: Gauge | None = None
        if self.multiprocess:
            self.served = CollectorRegistry()
            MultiProcessCollector(self.served)
            if database_url.startswith("sqlite"):
                # No stream leases in SQLite: each process says its own count, the files sum them.
                self.streams_gauge = Gauge(
                    "megatrain_open_streams",
                    "Live SSE streams (every API process's)",
                    registry=self.registry,
                    multiprocess_mode="livesum",
                )
                open_streams = None
        self.served.register(ControlPlaneCollector(database_url, open_streams))

    def sync_streams(self) -> None:
        """Bring this process's stream count up to date in its files (several processes on SQLite)."""
        if self.streams_gauge is not None and self.open_streams is not None:
            self.streams_gauge.set(self.open_streams())

    def close(self) -> None:
        """At the process's end: its live gauges leave the sum (its counters stay in it)."""
        if self.multiprocess:
            mark_process_dead(os.getpid())


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: ApiMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def status_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                self.metrics.sync_streams()  # a stream counts once its answer starts
            await send(message)

        try:
            await self.app(scope, receive, status_send)
        finally:
            # The route template, never the raw path: job ids would make the label set unbounded.
            route = getattr(scope.get("route"), "path", None)
            label = "unmatched" if route is None else (route or "/{static}")
            method = scope.get("method", "")
            method = method if method in _METHODS else "other"
            self.metrics.requests.labels(method, label, str(status)).inc()
            self.metrics.latency.labels(method, label).observe(time.perf_counter() - start)
            self.metrics.sync_streams()
