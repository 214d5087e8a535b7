"""Every error leaves the API as JSON `{"detail": ...}`; validation errors as a list of
`{"field": "a.b", "message": ...}`, whether our spec rules or FastAPI's own request parsing found them.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from megatrain.spec import SpecError

log = logging.getLogger("megatrain.api")

# FastAPI's location prefixes; the parameter's own name is what a client can act on.
_LOCATION_TAGS = {"body", "query", "path", "header", "cookie"}


class FieldError(Exception):
    """A request that breaks a rule about one named field; answered with 422 (or `status`)."""

    def __init__(self, field: str, message: str, status: int = 422):
        self.errors = [{"field": field, "message": message}]
        self.status = status
        super().__init__(f"{field}: {message}")


MAX_ERRORS = 50
MAX_MESSAGE_CHARS = 1000
"""A message names its value and the fix, which for a data path lists the roots and the command that
adds one: paths are long, so room for several."""
MAX_FIELD_CHARS = 200


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def field_errors(status: int, errors: list[dict[str, str]]) -> JSONResponse:
    """The errors, at most MAX_ERRORS of them (then one saying how many more) with fields and
    messages clipped: a hostile body cannot make the answer larger than the request."""
    shown = [
        {"field": _clip(e["field"], MAX_FIELD_CHARS), "message": _clip(e["message"], MAX_MESSAGE_CHARS)}
        for e in errors[:MAX_ERRORS]
    ]
    if len(errors) > MAX_ERRORS:
        shown.append({"field": "request", "message": f"and {len(errors) - MAX_ERRORS} more errors"})
    return JSONResponse({"detail": shown}, status_code=status)


def _request_validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = []
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ())]
        if loc and loc[0] in _LOCATION_TAGS:
            loc = loc[1:]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        errors.append({"field": ".".join(loc) or "request", "message": msg})
    return field_errors(422, errors)


def _spec_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, SpecError)
    return field_errors(422, exc.errors)


def _field_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, FieldError)
    return field_errors(exc.status, exc.errors)


def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    headers: dict[str, Any] | None = getattr(exc, "headers", None)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=headers)


def _database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    log.error("database error on %s %s: %s", request.method, request.url.path, exc)
    return JSONResponse({"detail": "the database is unavailable; try again shortly"}, status_code=503)


def _client_left(request: Request, exc: Exception) -> Response:
    # Nobody is left to answer: a line for the operator, no traceback, no 500.
    log.info("client left during %s %s (%s)", request.method, request.url.path, type(exc).__name__)
    return Response(status_code=400)


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Logged in full here, answered without internals (no traceback, no SQL, no paths).
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse({"detail": "internal server error"}, status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(SpecError, _spec_error)
    app.add_exception_handler(FieldError, _field_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(OperationalError, _database_unavailable)
    app.add_exception_handler(ClientDisconnect, _client_left)
    app.add_exception_handler(Exception, _unexpected)
