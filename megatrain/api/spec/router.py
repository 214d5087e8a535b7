"""/v1/spec: the JobSpec's JSON Schema, a dry run of a submission's checks, and an example spec."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from megatrain.api.deps import CurrentTenant, SessionDep, SettingsDep
from megatrain.api.jobs import service
from megatrain.api.jobs.router import SUBMIT_OPENAPI
from megatrain.api.jobs.schemas import SpecCheck
from megatrain.api.spec.example import example_spec
from megatrain.spec import spec_json_schema

router = APIRouter(prefix="/v1/spec", tags=["spec"])


@router.get("/schema")
def get_schema() -> dict[str, Any]:
    """JSON Schema of a job spec (no authentication: it holds no tenant data)."""
    return spec_json_schema()


@router.get("/example")
def get_example(session: SessionDep, settings: SettingsDep, tenant: CurrentTenant) -> dict[str, Any]:
    """A ready-to-submit spec whose data exists (the Submit page's template): `{"spec", "source",
    "hint"}`, training on the tenant's newest ready dataset, else the demo corpus if `megatrain
    demo` built it; `spec` is null, with a hint on how to get data, when there is none."""
    return example_spec(session, settings, tenant)


@router.post("/validate", response_model=SpecCheck, openapi_extra=SUBMIT_OPENAPI)
async def validate_spec(
    request: Request, session: SessionDep, settings: SettingsDep, tenant: CurrentTenant
) -> dict[str, Any]:
    """Run every check POST /v1/jobs runs (spec, layout, pool fit, data access) without creating a
    job; 200 with the normalised spec and its layout, or the same 422 a submission would get."""
    raw = await request.body()
    data = await run_in_threadpool(service.parse_body, raw, request.headers.get("content-type", ""))
    spec, layout = await run_in_threadpool(service.validate_submission, session, settings, tenant, data)
    return {
        "valid": True,
        "spec": spec.model_dump(mode="json"),
        "layout": layout.as_dict(),
        "num_procs": layout.world_size,
    }
