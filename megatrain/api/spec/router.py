"""/v1/spec: the JobSpec's JSON Schema and reference, an example spec, and a dry run of a
submission's checks."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from megatrain.api.deps import CurrentTenant, SessionDep, SettingsDep
from megatrain.api.jobs import service
from megatrain.api.jobs.router import SUBMIT_OPENAPI
from megatrain.api.jobs.schemas import SpecCheck
from megatrain.api.spec.example import example_spec
from megatrain.spec import spec_json_schema
from megatrain.spec_reference import render_html, render_markdown

router = APIRouter(prefix="/v1/spec", tags=["spec"])


@router.get("/schema")
def get_schema() -> dict[str, Any]:
    """JSON Schema of a job spec (no authentication: it holds no tenant data)."""
    return spec_json_schema()


@router.get(
    "/reference",
    response_class=Response,
    responses={200: {"content": {"text/markdown": {}, "text/html": {}}}},
)
def get_reference(
    request: Request,
    format: Annotated[Literal["markdown", "html"] | None, Query(description="Default: by Accept.")] = None,
) -> Response:
    """Every JobSpec field (type, default, bounds, meaning) and the rules between fields, generated
    from the models (docs/spec-reference.md is the committed copy). HTML for a browser (or
    ?format=html), Markdown otherwise; no authentication: it holds no tenant data."""
    wants_html = format == "html" or (format is None and "text/html" in request.headers.get("accept", ""))
    if wants_html:
        return HTMLResponse(render_html())
    return PlainTextResponse(render_markdown(), media_type="text/markdown; charset=utf-8")


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
    """Run every check POST /v1/jobs runs (spec, layout, pool fit, data access and existence)
    without creating a job; 200 with the normalised (planned) spec, its layout, the planner's
    prediction (`plan`, null when its pool cannot be planned on) and what each "auto" of the spec
    became (`auto`), or the same 422 a submission would get, listing every error at once."""
    raw = await request.body()
    data = await run_in_threadpool(service.parse_body, raw, request.headers.get("content-type", ""))
    checked = await run_in_threadpool(service.check_submission, session, settings, tenant, data)
    return {
        "valid": True,
        "spec": checked.spec.model_dump(mode="json"),
        "layout": checked.layout.as_dict(),
        "num_procs": checked.layout.world_size,
        "plan": checked.plan,
        "auto": checked.auto,
    }
