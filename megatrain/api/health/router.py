"""Liveness and Prometheus metrics. Neither needs an API key: /healthz says only whether the
database answers, and /metrics holds aggregate counts (requests by route, jobs by state) and no
tenant data. Expose them to the network your probes and Prometheus scrape from, not beyond."""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from megatrain import __version__
from megatrain.db.session import make_engine

router = APIRouter(tags=["health"])


class Probe:
    """The database ping behind /healthz, on its own connection and thread: a liveness probe must
    not queue behind the requests it is meant to vouch for."""

    def __init__(self, database_url: str):
        self.engine = make_engine(database_url, pool_size=1, max_overflow=1)
        self.limiter = anyio.CapacityLimiter(1)

    def ping(self) -> bool:
        try:
            with self.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            return True
        except SQLAlchemyError:
            return False


@router.get("/healthz")
@router.get("/v1/healthz", include_in_schema=False)
async def healthz(request: Request) -> Any:
    """{"status": "ok", "database": "ok", "version"}; 503 with a `detail` when the database is down."""
    probe: Probe = request.app.state.probe
    if not await anyio.to_thread.run_sync(probe.ping, limiter=probe.limiter):
        return JSONResponse(
            {"detail": "the database does not answer", "status": "unavailable", "database": "error"},
            status_code=503,
        )
    return {"status": "ok", "database": "ok", "version": __version__}


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    registry = request.app.state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
