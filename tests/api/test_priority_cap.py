"""A tenant's priority is capped by the maximum its operator set (default 0: no boost)."""

from __future__ import annotations

from api_handle import Api
from sqlalchemy import select

from megatrain.api.auth import create_api_key
from megatrain.db.models import Tenant
from megatrain.db.session import session_scope


def _set_cap(api: Api, tenant: str, cap: int) -> None:
    with session_scope(api.db_url) as s:
        s.scalar(select(Tenant).where(Tenant.name == tenant)).max_priority = cap


def _submit(api: Api, priority: int) -> tuple[int, dict]:
    resp = api.client.post(
        "/v1/jobs", json=api.spec("p", resources={"devices": 1, "priority": priority}), headers=api.headers
    )
    return resp.status_code, resp.json()


def test_default_tenant_cannot_boost_its_jobs(api: Api) -> None:
    _set_cap(api, "acme", 0)  # what a tenant created by `megatrain keys create` gets
    code, body = _submit(api, 1000)
    assert code == 422
    assert body["detail"] == [
        {
            "field": "resources.priority",
            "message": "resources.priority=1000 exceeds this tenant's maximum priority 0",
        }
    ]
    assert _submit(api, 0)[0] == 201
    assert _submit(api, -5)[0] == 201  # lowering one's own jobs is always allowed


def test_operator_cap_is_per_tenant(api: Api) -> None:
    _set_cap(api, "acme", 3)
    assert _submit(api, 3)[0] == 201
    code, body = _submit(api, 4)
    assert code == 422 and "maximum priority 3" in body["detail"][0]["message"]
    with session_scope(api.db_url) as s:  # a new tenant starts without a boost
        create_api_key(s, "newco")
    with session_scope(api.db_url) as s:
        assert s.scalar(select(Tenant.max_priority).where(Tenant.name == "newco")) == 0
