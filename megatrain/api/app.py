"""The FastAPI application: `create_app(settings)` wires routers, auth, error shapes and middleware.

The API enqueues work by database state only (a queued job row); it never imports the engine or the
worker. Replicas are stateless: every request reads what it needs from the database.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from megatrain import __version__, resource_dir
from megatrain.api.checkpoints.router import router as checkpoints_router
from megatrain.api.cluster.router import router as cluster_router
from megatrain.api.datasets.router import router as datasets_router
from megatrain.api.datasets.schemas import DatasetCreate
from megatrain.api.docs import install_docs
from megatrain.api.errors import install_error_handlers
from megatrain.api.exports.router import router as exports_router
from megatrain.api.health.router import Probe
from megatrain.api.health.router import router as health_router
from megatrain.api.jobs.router import router as jobs_router
from megatrain.api.keys.router import router as keys_router
from megatrain.api.middleware import ApiMetrics, BodyLimitMiddleware, MetricsMiddleware, RequestTooLarge
from megatrain.api.models.router import router as models_router
from megatrain.api.node.router import MAX_BODY_BYTES as NODE_BODY_BYTES
from megatrain.api.node.router import router as node_router
from megatrain.api.node.tasks import router as node_tasks_router
from megatrain.api.openai import PREFIX as OPENAI_PREFIX
from megatrain.api.openai import router as openai_router
from megatrain.api.openai.chat import router as openai_chat_router
from megatrain.api.openai.errors import OpenAIErrorMiddleware
from megatrain.api.plan.router import router as plan_router
from megatrain.api.pools.router import router as pools_router
from megatrain.api.profile.router import router as profile_router
from megatrain.api.samples.router import router as samples_router
from megatrain.api.secrets.router import router as secrets_router
from megatrain.api.server import BodyTimeoutMiddleware
from megatrain.api.spec.router import router as spec_router
from megatrain.api.streams import StreamHub, TooManyStreams
from megatrain.api.tensorboard.router import router as tensorboard_router
from megatrain.db.session import upgrade_database
from megatrain.settings import Settings, get_settings
from megatrain.spec import JobSpec

log = logging.getLogger("megatrain.api")
WEB_DIR = resource_dir("web")


def prepare_backends(settings: Settings) -> None:
    """Startup work: migrate the embedded SQLite database (server databases are migrated by their
    own deploy step). Nodes are registered by the worker side (the local executor's scheduler, a
    Celery worker), never by the API."""
    url = settings.resolved_database_url
    if url.startswith("sqlite"):
        upgrade_database(url)


def _too_large(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestTooLarge)
    return JSONResponse({"detail": f"request body exceeds the limit of {exc.limit} bytes"}, status_code=413)


def _too_many_streams(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, TooManyStreams)
    detail = f"{exc} (max_streams_per_tenant={exc.limit})"
    return JSONResponse({"detail": detail}, status_code=429, headers={"Retry-After": "5"})


# Bodies parsed by hand (so that YAML or an upload is accepted too), which the routes' openapi_extra
# reference by name: their schemas must be in the document, or ReDoc refuses the whole of it.
HAND_PARSED_BODIES = (JobSpec, DatasetCreate)


def _openapi_with_spec(app: FastAPI) -> dict[str, Any]:
    """OpenAPI plus the schemas of HAND_PARSED_BODIES (the JobSpec's parts among them)."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in HAND_PARSED_BODIES:
            model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(model_schema.pop("$defs", {}))
            components[model.__name__] = model_schema
        app.openapi_schema = schema
    return app.openapi_schema


def create_app(settings: Settings | None = None, *, sse_poll_interval_s: float = 0.5) -> FastAPI:
    """The megatrain API for `settings` (default: get_settings()).

    `sse_poll_interval_s` is how often live streams look for new rows in the database.
    """
    settings = settings or get_settings()
    streams = StreamHub(settings.resolved_database_url, sse_poll_interval_s, settings.max_streams_per_tenant)
    probe = Probe(settings.resolved_database_url)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(prepare_backends, settings)
        # Few threads: request work is short and holds the GIL; dozens of threads contending for it
        # cost more CPU per request than they hide database latency (measured: BENCHMARKS.md).
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.api_threads
        streams.listen()
        try:
            yield
        finally:
            await streams.close()
            probe.engine.dispose()
            app.state.metrics.close()

    app = FastAPI(
        title="megatrain",
        version=__version__,
        description=(
            "Training as a service: submit JobSpecs, follow them, download checkpoints.\n\n"
            "Every JobSpec field (type, default, bounds) and the rules between fields: "
            "[the spec reference](/v1/spec/reference) (`GET /v1/spec/reference`, HTML in a browser, "
            "Markdown otherwise); the JSON Schema: `GET /v1/spec/schema`; a dry run of a submission: "
            "`POST /v1/spec/validate`."
        ),
        lifespan=lifespan,
        docs_url=None,  # install_docs serves both from our own assets, not a CDN
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.streams = streams
    app.state.probe = probe
    app.state.metrics = ApiMetrics(settings.resolved_database_url, lambda: sum(streams.open.values()))

    install_error_handlers(app)
    app.add_exception_handler(RequestTooLarge, _too_large)
    app.add_exception_handler(TooManyStreams, _too_many_streams)
    routers = (health_router, spec_router, jobs_router, checkpoints_router, keys_router, cluster_router)
    extra = (
        pools_router,
        datasets_router,
        models_router,
        exports_router,
        tensorboard_router,
        profile_router,
        samples_router,
        plan_router,
        secrets_router,
        node_router,
        node_tasks_router,
    )
    # The chat routes before openai_router, whose catch-all answers any other /openai/v1 path.
    for router in (*routers, *extra, openai_chat_router, openai_router):
        app.include_router(router)
    app.openapi = lambda: _openapi_with_spec(app)  # type: ignore[method-assign]
    install_docs(app)

    # Added last = outermost: metrics see every answer, including 413s and 500s.
    # Dataset uploads stream to storage under a cap of their own (JSON bodies there keep the usual one).
    upload_paths = (datasets_router.prefix, f"{OPENAI_PREFIX}/files")
    uploads = dict.fromkeys(upload_paths, settings.max_dataset_upload_bytes)
    uploads[node_router.prefix] = max(NODE_BODY_BYTES, settings.max_request_bytes)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes, overrides=uploads)
    app.add_middleware(BodyTimeoutMiddleware, timeout_s=settings.http_body_timeout_s)
    # Every error under /openai/v1 in OpenAI's shape, whichever layer inside answered it.
    app.add_middleware(OpenAIErrorMiddleware, prefix=OPENAI_PREFIX)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)

    # The dashboard's static files, served at / (index.html for "/"); mounted after every API route.
    if WEB_DIR.is_dir():
        app.mount("/", StaticFiles(directory=WEB_DIR, html=True), name="web")
    else:
        log.warning("no dashboard files at %s; serving the API only", WEB_DIR)
    return app
