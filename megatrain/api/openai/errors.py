"""Errors under /openai/v1 in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with
OpenAI's status codes (a validation error is a 400), so the `openai` SDK raises its own classes.

One middleware rewrites every error answer under the prefix, whoever produced it (a route, our
exception handlers, the body limit, the static mount's 404), so /v1 keeps its `{"detail": ...}`
shape untouched and no handler needs to know which surface it serves. A route that has an OpenAI
code or param to give raises `openai_error`, whose detail carries them.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("megatrain.api")
MAX_ERROR_BODY = 1 << 20
"""An error answer larger than this is passed on as it is (ours are a few hundred bytes)."""
_TYPES = {429: "requests", 401: "invalid_request_error"}
_CODES = {
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    409: "conflict",
    413: "request_too_large",
    429: "rate_limit_exceeded",
}


def openai_error(
    status: int, message: str, param: str | None = None, code: str | None = None, **headers: str
) -> HTTPException:
    """An HTTPException the middleware renders with this param and code (`headers` as given)."""
    detail = {"message": message, "param": param, "code": code or _CODES.get(status)}
    return HTTPException(status, detail, headers={k.replace("_", "-"): v for k, v in headers.items()} or None)


def _error_type(status: int) -> str:
    if status >= 500:
        return "server_error"
    return _TYPES.get(status, "invalid_request_error")


def openai_body(status: int, body: bytes) -> tuple[int, dict[str, Any]]:
    """(status, OpenAI error object) for one of our error answers (its JSON `detail`, or its text)."""
    try:
        data: Any = json.loads(body)
        detail: Any = data.get("detail")
    except (ValueError, AttributeError):
        data, detail = None, body.decode("utf-8", "replace").strip() or None
    shaped = data.get("error") if isinstance(data, dict) else None
    if isinstance(shaped, dict) and isinstance(shaped.get("message"), str):
        # Already OpenAI's (the chat routes', a model server's answer passed on): kept as it is.
        keys = ("message", "type", "param", "code")
        return status, {
            "error": {"type": _error_type(status), "param": None, "code": None}
            | {k: shaped[k] for k in keys if k in shaped}
        }
    param = code = None
    if isinstance(detail, dict):
        message, param, code = str(detail.get("message", "")), detail.get("param"), detail.get("code")
    elif isinstance(detail, list) and detail and all(isinstance(d, dict) for d in detail):
        # Our field errors: the first names the parameter; every message is kept.
        messages = [str(d.get("message", "")) for d in detail]
        message = messages[0] if len(messages) == 1 else "; ".join(messages)
        field = str(detail[0].get("field", ""))
        param = field if field not in ("", "body", "request") else None
    else:
        message = str(detail) if detail is not None else f"HTTP {status}"
    if status == 422:
        status, code = 400, code or "invalid_value"
    error = {
        "message": message,
        "type": _error_type(status),
        "param": param,
        "code": code or _CODES.get(status),
    }
    return status, {"error": error}


class OpenAIErrorMiddleware:
    """Rewrites the error answers (status >= 400) of requests under `prefix` into OpenAI's shape,
    keeping their headers (Retry-After, WWW-Authenticate); every other answer passes untouched."""

    def __init__(self, app: ASGIApp, prefix: str):
        self.app, self.prefix = app, prefix.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not (path == self.prefix or path.startswith(self.prefix + "/")):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        sent_body = False  # anything of a (non-error) answer went out
        body = bytearray()

        async def rewrite(message: Message) -> None:
            nonlocal start, sent_body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the body is known
                return
            if start is None or message["type"] != "http.response.body":
                sent_body = True
                await send(message)
                return
            body.extend(message.get("body", b""))
            if len(body) > MAX_ERROR_BODY:
                await send(start)
                await send(
                    {
                        "type": "http.response.body",
                        "body": bytes(body),
                        "more_body": message.get("more_body", False),
                    }
                )
                start = None
                return
            if not message.get("more_body", False):
                await self._send_error(send, start, bytes(body))

        try:
            await self.app(scope, receive, rewrite)
        except Exception:
            # Unhandled errors are answered outside this middleware (Starlette's outermost layer):
            # answered here instead, in OpenAI's shape, when nothing was sent yet.
            if start is not None or sent_body:
                raise
            log.exception("unhandled error on %s %s", scope.get("method"), path)
            await self._send_error(
                send, {"status": 500, "headers": []}, b'{"detail": "internal server error"}'
            )

    @staticmethod
    async def _send_error(send: Send, start: Message, body: bytes) -> None:
        status, error = openai_body(start["status"], body)
        data = json.dumps(error).encode()
        headers = [
            (k, v)
            for k, v in start.get("headers", [])
            if k.lower() not in (b"content-length", b"content-type")
        ]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})
