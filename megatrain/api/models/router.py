"""/v1/models: register a Hugging Face model folder under a name (for `model.init_from: hf:NAME`),
list, read, delete. Registering checks the folder and records it; nothing is copied."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from starlette.concurrency import run_in_threadpool

from megatrain.api.deps import CurrentTenant, SessionDep, SettingsDep
from megatrain.api.models import service
from megatrain.api.models.schemas import ModelCreate, ModelList, ModelPublic

router = APIRouter(prefix="/v1/models", tags=["models"])


@router.post(
    "", status_code=201, response_model=ModelPublic, responses={409: {"description": "The name is taken"}}
)
async def register_model(
    body: ModelCreate, session: SessionDep, settings: SettingsDep, tenant: CurrentTenant
) -> ModelPublic:
    """Register the folder at `url` as `name`: 422 naming `url` when the tenant may not read it, its
    config.json is missing or maps to no model we build, or it holds no safetensors weights."""
    m = await run_in_threadpool(service.register_model, session, settings, tenant, body)
    return service.public_model(m)


@router.get("", response_model=ModelList)
def list_models(session: SessionDep, tenant: CurrentTenant) -> dict[str, Any]:
    """The tenant's models and the shared ones, by name."""
    return {"items": [service.public_model(m) for m in service.list_models(session, tenant)]}


@router.get("/{name}", response_model=ModelPublic)
def get_model(name: str, session: SessionDep, tenant: CurrentTenant) -> ModelPublic:
    return service.public_model(service.get_model(session, tenant, name))


@router.delete("/{name}", status_code=204, response_class=Response)
def delete_model(name: str, session: SessionDep, tenant: CurrentTenant) -> Response:
    """Forget one of the tenant's models; jobs already submitted keep the URL they resolved."""
    service.delete_model(session, tenant, name)
    return Response(status_code=204)
