"""The OpenAI-compatible API at /openai/v1 (files, fine_tuning.jobs, models): the same keys,
tenants, database and jobs as /v1, so `openai.OpenAI(base_url=".../openai/v1", api_key=KEY)` works.

One more surface is one more entry in SUB_ROUTERS (an APIRouter whose paths are relative to PREFIX).
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from megatrain.api.openai import files, fine_tuning, models

PREFIX = "/openai/v1"
SUB_ROUTERS = (files.router, fine_tuning.router, models.router)

router = APIRouter(prefix=PREFIX)
for sub in SUB_ROUTERS:
    router.include_router(sub)


@router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
def unknown(path: str) -> None:
    """Anything else under the prefix: OpenAI's 404 (not the dashboard's static files)."""
    raise HTTPException(404, f"Unknown request URL: {PREFIX}/{path[:200]}")
