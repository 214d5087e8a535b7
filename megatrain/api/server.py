"""The API's HTTP server: uvicorn with the bounds a service facing untrusted clients needs.

uvicorn alone answers a request of 64 MB of headers (httptools has no size limit), waits forever for
headers or a body that trickle in, and has no header-count limit. Here:
  - `BoundedHttpToolsProtocol` refuses a request head over `max_header_bytes` (431) or with more than
    `max_headers` fields (431), and one whose head has not fully arrived `header_timeout_s` after its
    first byte (or after the connection opened) with 408, closing the connection;
  - `BodyTimeoutMiddleware` answers 408 when a request body chunk does not arrive within
    `body_timeout_s` (responses are not timed: a live stream may run for hours);
  - a new connection that sends nothing within `first_byte_timeout_s` is closed;
  - one client address holding more than `max_per_client` connections gets a 429 for each request
    past them (not for the probes; a trusted proxy's connections are not counted), so a flood of
    sockets from one client leaves room for everyone else;
  - uvicorn's own `limit_concurrency` answers 503 past `max_concurrency` connections + tasks, except
    to the probes (/healthz, /readyz: an orchestrator must not restart a healthy API that a flood of
    idle sockets fills), `timeout_keep_alive` closes idle keep-alive connections, and a stopping
    server cancels what is still running (live streams) after `shutdown_timeout_s`.
`megatrain api` (the production entry point, several worker processes) and `megatrain up` (the
embedded stack) both serve through `api_config`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import resource
from collections import Counter
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

import anyio
import httptools
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from megatrain.settings import Settings

log = logging.getLogger("megatrain.api.server")

LINGER_S = 2.0


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = 16 * 1024
    max_headers: int = 100
    header_timeout_s: float = 10.0
    first_byte_timeout_s: float = 3.0
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 5.0
    max_concurrency: int = 2048
    shutdown_timeout_s: float = 10.0
    max_per_client: int = 512
    trusted_proxies: tuple[str, ...] = ()
    """Addresses or networks whose connections are not capped per client."""

    def capped(self, host: str) -> bool:
        """Whether connections from `host` count against max_per_client (not a trusted proxy's)."""
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return True
        return not any(address in ipaddress.ip_network(net, strict=False) for net in self.trusted_proxies)

    @classmethod
    def from_settings(cls, settings: Settings) -> HttpLimits:
        return cls(
            max_header_bytes=settings.http_max_header_bytes,
            max_headers=settings.http_max_headers,
            header_timeout_s=settings.http_header_timeout_s,
            first_byte_timeout_s=settings.http_first_byte_timeout_s,
            body_timeout_s=settings.http_body_timeout_s,
            keepalive_timeout_s=settings.http_keepalive_timeout_s,
            max_concurrency=settings.http_max_concurrency,
            shutdown_timeout_s=settings.http_shutdown_timeout_s,
            max_per_client=settings.http_max_connections_per_client,
            trusted_proxies=tuple(p.strip() for p in settings.http_trusted_proxies.split(",") if p.strip()),
        )


class ApiServerConfig(uvicorn.Config):
    """uvicorn's Config carrying the limits to the protocol (picklable, for worker processes)."""

    def __init__(self, app: Any, limits: HttpLimits, **kwargs: Any):
        super().__init__(
            app,
            http=BoundedHttpToolsProtocol,
            limit_concurrency=limits.max_concurrency,
            timeout_keep_alive=max(1, round(limits.keepalive_timeout_s)),
            h11_max_incomplete_event_size=limits.max_header_bytes,
            # Live streams would hold a stopping server open for as long as their jobs run; past
            # this their tasks are cancelled and clients reconnect (SSE retry, Last-Event-ID).
            timeout_graceful_shutdown=max(1, round(limits.shutdown_timeout_s)),
            **kwargs,
        )
        self.http_limits = limits


PROBES = frozenset({b"/healthz", b"/readyz", b"/v1/healthz", b"/v1/readyz"})
"""Answered past the concurrency limit: they are how an orchestrator tells a full API from a dead one."""


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        self.status, self.message = status, message


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bounded request head (size, field count, time) and a cap
    on one client's connections."""

    open_by_client: ClassVar[Counter[str]] = Counter()
    """This process's open connections per client address (the event loop's thread only)."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any):
        super().__init__(config, *args, **kwargs)
        self.limits: HttpLimits = getattr(config, "http_limits", HttpLimits())
        self._in_head = False
        self._head_bytes = 0  # raw bytes received while the head is incomplete
        self._field_bytes = 0  # the parsed head: URL plus header names and values
        self._fields = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_deadline: asyncio.TimerHandle | None = None
        self._first_byte: asyncio.TimerHandle | None = None
        self._refused = False
        self._counted: str | None = None
        """The client address this connection counts against (None: a trusted proxy's)."""
        self._over_cap = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        host = self.client[0] if self.client else None
        if host is not None and self.limits.capped(host):
            self._counted = host
            self.open_by_client[host] += 1
            self._over_cap = self.open_by_client[host] > self.limits.max_per_client
        self._begin_head()  # a connection that sends nothing is a slow head too
        self._first_byte = self.loop.call_later(self.limits.first_byte_timeout_s, self._silent)

    def _silent(self) -> None:
        self._first_byte = None
        if not self.transport.is_closing():
            log.info("closed %s: nothing sent within %g s", self.client, self.limits.first_byte_timeout_s)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._counted is not None:
            self.open_by_client[self._counted] -= 1
            if self.open_by_client[self._counted] <= 0:
                del self.open_by_client[self._counted]
            self._counted = None
        if self._first_byte is not None:
            self._first_byte.cancel()
            self._first_byte = None
        self._end_head()
        self._cancel_body_deadline()
        super().connection_lost(exc)

    def _begin_head(self) -> None:
        self._end_head()
        self._in_head, self._head_bytes, self._field_bytes, self._fields = True, 0, 0, 0
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_too_slow)

    def _end_head(self) -> None:
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            self._refuse(408, f"request headers not received within {self.limits.header_timeout_s:g} s")

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` and close; input still arriving is read and dropped for LINGER_S first (a
        close with unread input resets the connection, and the client would never see the answer)."""
        self._end_head()
        self._cancel_body_deadline()
        log.info("refused %s: %s", self.client, message)
        body = message.encode()
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self._refused = True
        self.loop.call_later(LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        # uvicorn's, with the head's size counted and our refusals told apart from parse errors.
        if self.transport.is_closing() or self._refused:
            return  # a refused connection's input is dropped until it closes
        if self._first_byte is not None:
            self._first_byte.cancel()
            self._first_byte = None
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _Refused):  # raised by on_header below
                self._refuse(exc.__context__.status, exc.__context__.message)
            else:
                self.send_400_response("Invalid HTTP request received.")
            return
        except httptools.HttpParserError:
            self.send_400_response("Invalid HTTP request received.")
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        # Still inside the head after all of `data`: all of it was head (a chunk that completed the
        # head may carry the body too, and the parsed fields are counted in on_header instead).
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse(431, f"request headers exceed {self.limits.max_header_bytes} bytes")

    def on_message_begin(self) -> None:
        # A keep-alive connection's next request: its head gets the full time again.
        if not self._in_head:
            self._begin_head()
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._field_bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += 1
        self._field_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if self._fields > self.limits.max_headers:
            raise _Refused(431, f"more than {self.limits.max_headers} request header fields")
        if self._field_bytes > self.limits.max_header_bytes:
            raise _Refused(431, f"request headers exceed {self.limits.max_header_bytes} bytes")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._end_head()
        limit = self.limit_concurrency
        probe = self.url.split(b"?", 1)[0] in PROBES
        if self._over_cap and not probe and self.open_by_client[self._counted] > self.limits.max_per_client:
            raise _Refused(
                429,
                f"more than {self.limits.max_per_client} open connections from {self._counted}; close some",
            )
        if probe:
            self.limit_concurrency = None  # a probe is answered however full the server is
        try:
            super().on_headers_complete()
        finally:
            self.limit_concurrency = limit
        # A body must arrive whole within body_timeout_s of the head: also after the app answered
        # without reading it (a 401, a 413), when each trickled byte would otherwise keep the
        # connection from its keep-alive timeout forever.
        if self.parser.get_method() not in (b"GET", b"HEAD") and self._expects_body():
            self._body_deadline = self.loop.call_later(self.limits.body_timeout_s, self._body_too_slow)

    def _expects_body(self) -> bool:
        for name, value in self.headers:
            if name == b"content-length":
                return value.strip() not in (b"0", b"")
            if name == b"transfer-encoding":
                return True
        return False

    def on_message_complete(self) -> None:
        self._cancel_body_deadline()
        super().on_message_complete()

    def _cancel_body_deadline(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _body_too_slow(self) -> None:
        self._body_deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and self.cycle.response_started:
            log.info("closed %s: request body still arriving after the answer", self.client)
            self.transport.close()
        else:
            self._refuse(408, f"request body not received within {self.limits.body_timeout_s:g} s")


class BodyTimeoutMiddleware:
    """408 when the next chunk of a request body does not arrive within `timeout_s`; once the body
    is complete, receive() (a streaming response waiting for the client to leave) is not timed."""

    def __init__(self, app: ASGIApp, timeout_s: float):
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = False
        started = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            with anyio.fail_after(self.timeout_s):
                message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, timed_receive, tracking_send)
        except TimeoutError:
            log.info(
                "request body of %s %s stalled for %g s",
                scope.get("method"),
                scope.get("path"),
                self.timeout_s,
            )
            if not started:
                body = f"request body not received within {self.timeout_s:g} s".encode()
                headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]
                await send({"type": "http.response.start", "status": 408, "headers": headers})
                await send({"type": "http.response.body", "body": body})


def api_config(app: Any, settings: Settings, host: str, port: int, **kwargs: Any) -> ApiServerConfig:
    """The uvicorn config of the API: `app` (an ASGI app, or "module:factory" with factory=True for
    several workers) with the limits of `settings`."""
    return ApiServerConfig(app, HttpLimits.from_settings(settings), host=host, port=port, **kwargs)


def raise_open_file_limit() -> int:
    """Lift this process's soft limit on open files to its hard limit (each live stream holds a
    socket; a 1,024 soft limit caps a process well below the streams it can serve); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            log.warning("could not raise the open-file limit from %d", soft)
    return soft
