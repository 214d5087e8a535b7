"""Liveness and Prometheus metrics. Neither needs an API key: /healthz says only whether the
database answers, and /metrics holds aggregate counts (requests by route, jobs by state) and no
tenant data. Expose them to the network your probes and Prometheus scrape from, not beyond."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from megatrain import __version__
from megatrain.api.deps import SessionDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
@router.get("/v1/healthz", include_in_schema=False)
def healthz(session: SessionDep) -> Any:
    """{"status": "ok", "database": "ok", "version"}; 503 with a `detail` when the database is down."""
    try:
        session.execute(text("SELECT 1"))
    except SQLAlchemyError:
        return JSONResponse(
            {"detail": "the database does not answer", "status": "unavailable", "database": "error"},
            status_code=503,
        )
    return {"status": "ok", "database": "ok", "version": __version__}


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    registry = request.app.state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
