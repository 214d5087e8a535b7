"""Liveness, readiness and Prometheus metrics. None needs an API key and none holds tenant data:
/healthz says the process answers (its event loop runs), /readyz whether it can serve requests now
(the database answers, its schema is this code's, request threads are not all taken), and /metrics
holds aggregate counts (requests by route, jobs by state). Expose them to the network your probes and
Prometheus scrape from, not beyond.

An orchestrator restarts a process whose liveness fails and stops sending traffic to one that is not
ready, so the two differ on purpose: a database outage makes every API process unready (drained, not
restarted: restarting cannot fix the database) and ready again, without a restart, once it is back."""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from megatrain import __version__
from megatrain.db.session import make_engine, schema_head

router = APIRouter(tags=["health"])


class Probe:
    """The database checks behind /readyz, on their own connection and thread: a probe must not
    queue behind the requests it is meant to vouch for."""

    def __init__(self, database_url: str):
        self.engine = make_engine(database_url, pool_size=1, max_overflow=1)
        self.limiter = anyio.CapacityLimiter(1)

    def database(self) -> dict[str, str]:
        """{"database": "ok" or why not, "migrations": "ok" or how the schema differs from this code's}."""
        try:
            with self.engine.connect() as conn:
                revision = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        except SQLAlchemyError as exc:
            missing = ("no such table", "does not exist")
            if "alembic_version" in str(exc) and any(m in str(exc).lower() for m in missing):
                return {"database": "ok", "migrations": "the database has no schema yet (migrations not run)"}
            cause = getattr(exc, "orig", None) or exc
            return {"database": f"does not answer ({type(cause).__name__})", "migrations": "unknown"}
        head = schema_head()
        if revision != head:
            why = f"the database is at {revision}, this code at {head} (migrations not run)"
            return {"database": "ok", "migrations": why}
        return {"database": "ok", "migrations": "ok"}


def thread_pressure(limiter: anyio.CapacityLimiter) -> dict[str, Any]:
    """The request thread pool's load: busy threads, its size, requests waiting for one; `ok` False
    when requests wait (every thread taken: a new request would queue)."""
    stats = limiter.statistics()
    busy, waiting = stats.borrowed_tokens, stats.tasks_waiting
    return {"ok": waiting == 0, "busy": busy, "size": int(limiter.total_tokens), "waiting": waiting}


@router.get("/healthz")
@router.get("/v1/healthz", include_in_schema=False)
async def healthz() -> Any:
    """Liveness: {"status": "ok", "version"} whenever the event loop answers (nothing else is asked:
    see /readyz)."""
    return {"status": "ok", "version": __version__}


@router.get("/readyz")
@router.get("/v1/readyz", include_in_schema=False)
async def readyz(request: Request) -> Any:
    """Readiness: {"status": "ready", "checks": {database, migrations, threads}, "threads", "version"};
    503 with status "unready" and a `detail` naming each failed check."""
    probe: Probe = request.app.state.probe
    checks = await anyio.to_thread.run_sync(probe.database, limiter=probe.limiter)
    threads = thread_pressure(anyio.to_thread.current_default_thread_limiter())
    checks["threads"] = "ok" if threads["ok"] else f"{threads['waiting']} requests wait for a thread"
    body = {"checks": checks, "threads": threads, "version": __version__}
    failed = [f"{name}: {value}" for name, value in checks.items() if value != "ok"]
    if failed:
        return JSONResponse({"status": "unready", "detail": "; ".join(failed), **body}, status_code=503)
    return {"status": "ready", **body}


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    registry = request.app.state.metrics.served
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
