"""/v1/plan: the fastest layout of a spec on a pool, with its predicted step time and memory."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from megatrain.api.deps import CurrentTenant, SessionDep, SettingsDep
from megatrain.api.jobs import service as jobs_service
from megatrain.api.plan.service import plan_request

router = APIRouter(prefix="/v1/plan", tags=["plan"])

PLAN_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["spec"],
                    "properties": {
                        "spec": {"$ref": "#/components/schemas/JobSpec"},
                        "pool": {"type": "object", "description": "A pool description (PoolSpec)."},
                        "devices": {"type": "integer", "minimum": 1},
                    },
                }
            },
            "application/yaml": {"schema": {"type": "string"}},
        },
    }
}


@router.post("", openapi_extra=PLAN_OPENAPI)
async def post_plan(
    request: Request, session: SessionDep, settings: SettingsDep, tenant: CurrentTenant
) -> dict[str, Any]:
    """Plan a spec without submitting it: body `{spec, pool?, devices?}` (JSON or YAML). `pool` is a
    pool description (default: the spec's resources.pool as stored); `devices` defaults to
    resources.devices, else the whole pool. 200: `{layout, predicted, candidates, devices, pool,
    pool_description, precision, explicit_layout}`; 422 naming the field of a bad spec or pool,
    or why no layout fits."""
    raw = await request.body()
    body = await run_in_threadpool(jobs_service.parse_body, raw, request.headers.get("content-type", ""))
    return await run_in_threadpool(plan_request, session, settings, body)
