"""OpenAI's POST /openai/v1/chat/completions, /openai/v1/completions and /openai/v1/embeddings,
answered by a model server (embeddings: an encoder's, arch bert; the others: a decoder's).

The API holds no model (it never imports the engine): it authenticates the tenant, resolves the
requested model to a base and its LoRA adapters (serve_jobs.py), finds the tenant's serve job for
that base or submits one through the job service, waits for its address (at most
settings.serve_start_timeout_s; then a 503 with Retry-After, which the `openai` package retries),
and forwards the request there with httpx, streaming `stream=true` answers through as they come
(OpenAI's SSE chunks, ending with `data: [DONE]`). The adapters and chat template are set here
from what the API resolved, never taken from the client. A model whose kind cannot answer the route
(embeddings of a decoder, chat of an encoder) is a 400 before any server starts. Every error is
OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, so the SDK raises its own
exception classes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from megatrain.api.deps import bearer_key, tenant_of
from megatrain.api.openai.serve_jobs import (
    ServeError,
    Serving,
    Target,
    find_or_submit,
    resolve_model,
    serving_address,
)
from megatrain.db.models import FAILED, QUEUED, RUNNING, SCHEDULED, Tenant
from megatrain.db.session import get_sessionmaker
from megatrain.settings import Settings

router = APIRouter(prefix="/openai/v1", tags=["openai"])

SERVER_HEADERS = ("x-megatrain-server", "retry-after")
"""Headers of the model server's answer passed on: which process answered, when to retry a 429."""
JOB_HEADER = "x-megatrain-serve-job"
EMBEDDINGS = "/v1/embeddings"
POLL_S = 0.25
RETRY_AFTER_S = 10
HTTP_TIMEOUT = httpx.Timeout(600.0, connect=5.0)
"""A long read: a non-streamed answer arrives whole once the last token is drawn."""


@router.post("/chat/completions", summary="Create a chat completion (OpenAI)")
async def chat_completions(request: Request) -> Response:
    return await _answer(request, "/v1/chat/completions", chat=True)


@router.post("/completions", summary="Create a completion (OpenAI, legacy)")
async def completions(request: Request) -> Response:
    return await _answer(request, "/v1/completions", chat=False)


@router.post("/embeddings", summary="Create embeddings (OpenAI; an encoder model, arch bert)")
async def embeddings(request: Request) -> Response:
    return await _answer(request, EMBEDDINGS, chat=False)


def _error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    retry_after: int | None = None,
) -> JSONResponse:
    kind = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    headers = {"retry-after": str(retry_after)} if retry_after is not None else None
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _answer(request: Request, path: str, chat: bool) -> Response:
    settings: Settings = request.app.state.settings
    try:
        tenant = await run_in_threadpool(_db, settings, _tenant, bearer_key(request))
        body = await _body(request)
        target = await run_in_threadpool(_db, settings, resolve_model, settings, tenant, body["model"])
        problem = target.endpoint_problem(body["model"], embeddings=path == EMBEDDINGS)
        if problem is not None:
            raise problem
        # Ours, not the client's: a request never names another tenant's checkpoint folder.
        payload = {**body, "adapter": target.adapter}
        payload.pop("chat_template", None)
        if chat:
            payload["chat_template"] = target.chat_template
        for tries_left in (1, 0):
            job_id, at = await _address(settings, tenant, target)
            try:
                return await _forward(at, path, payload, bool(body.get("stream")), job_id)
            except httpx.TransportError:
                if not tries_left:  # the server went away (idle) just as we came: once more
                    raise ServeError(503, "the model server went away; retry", retry_after=1) from None
                await asyncio.sleep(POLL_S)
        raise AssertionError("unreachable")
    except HTTPException as exc:  # authentication
        code = "invalid_api_key" if exc.status_code == 401 else None
        return _error_response(exc.status_code, str(exc.detail), code=code)
    except ServeError as exc:
        return _error_response(exc.status, exc.message, exc.param, exc.code, exc.retry_after)


def _db(settings: Settings, fn: Any, *args: Any) -> Any:
    """fn(session, *args) in one short session (a worker thread's)."""
    session = get_sessionmaker(settings.resolved_database_url)()
    try:
        return fn(session, *args)
    finally:
        session.close()


def _serve_job_id(session: Any, settings: Settings, tenant: Tenant, target: Target) -> str:
    return str(find_or_submit(session, settings, tenant, target).id)


def _tenant(session: Any, key: str) -> Tenant:
    tenant = tenant_of(session, key)
    session.expunge(tenant)
    return tenant


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise ServeError(400, "We could not parse the JSON body of your request.") from None
    if not isinstance(body, dict):
        raise ServeError(400, "The request body must be a JSON object.")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise ServeError(400, "you must provide a model parameter", param="model")
    return body


async def _address(settings: Settings, tenant: Tenant, target: Target) -> tuple[str, Serving]:
    """(serve job id, where it stands) once its model server listens; ServeError 503 past the
    timeout."""
    deadline = time.monotonic() + settings.serve_start_timeout_s
    job_id = None
    while True:
        if job_id is None:
            job_id = await run_in_threadpool(_db, settings, _serve_job_id, settings, tenant, target)
        at = await run_in_threadpool(_db, settings, serving_address, job_id)
        status, reason = at.status, at.reason
        if at.url is not None:
            return job_id, at
        if status == FAILED:
            raise ServeError(500, f"the model server (job {job_id}) failed: {reason}", code="server_failed")
        if status not in (QUEUED, SCHEDULED, RUNNING):  # ended (idle, cancelled): start another
            job_id = None
        if time.monotonic() >= deadline:
            raise ServeError(
                503,
                f"the model server (job {job_id}) is still starting ({status}); retry in a moment",
                code="model_loading",
                retry_after=RETRY_AFTER_S,
            )
        await asyncio.sleep(POLL_S)


async def _forward(at: Serving, path: str, payload: dict[str, Any], stream: bool, job_id: str) -> Response:
    """POST `payload` to the model server; its answer (streamed through when it streams)."""
    client = httpx.AsyncClient(timeout=HTTP_TIMEOUT)
    auth = {"authorization": f"Bearer {at.token}"} if at.token else {}
    try:
        request = client.build_request("POST", f"{at.url}{path}", json=payload, headers=auth)
        upstream = await client.send(request, stream=True)
    except BaseException:
        await client.aclose()
        raise
    headers = {h: upstream.headers[h] for h in SERVER_HEADERS if h in upstream.headers}
    headers[JOB_HEADER] = job_id
    if stream and upstream.status_code == 200:

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:  # the client left, or the answer ended: either way the upstream closes
                await upstream.aclose()
                await client.aclose()

        headers["cache-control"] = "no-cache"
        return StreamingResponse(relay(), media_type="text/event-stream", headers=headers)
    try:
        content = await upstream.aread()
    finally:
        await upstream.aclose()
        await client.aclose()
    media = upstream.headers.get("content-type", "application/json")
    return Response(content, status_code=upstream.status_code, media_type=media, headers=headers)
