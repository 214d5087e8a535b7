"""The audit log: what a tenant's key changes through the API (a job created and cancelled, a key
made and revoked, a secret stored, replaced and deleted) is recorded with the key's id, in the same
transaction as the change; refused requests and the system's own moves record nothing; operator
commands are recorded as the operator's; `megatrain audit` reads it back, filtered, newest first."""

from __future__ import annotations

import json
from typing import Any

from api_handle import Api
from cryptography.fernet import Fernet
from sqlalchemy import select
from typer.testing import CliRunner

from megatrain.cli.common import app
from megatrain.db.audit import AuditEvent
from megatrain.db.models import ApiKey, Tenant
from megatrain.db.session import session_scope


def _audit(*args: str) -> list[dict[str, Any]]:
    result = CliRunner().invoke(app, ["audit", "--json", *args])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.output.splitlines() if line.strip()]


def test_who_did_what_and_when(api: Api) -> None:
    with session_scope(api.settings.resolved_database_url) as s:
        acme_key = s.scalar(select(ApiKey.id).join(Tenant).where(Tenant.name == "acme"))
    job = api.submit()
    assert api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.headers).status_code == 200
    # Refused: another tenant's cancel (404), an invalid spec (422): nothing recorded.
    assert api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.other_headers).status_code == 404
    bad = api.spec()
    bad["training"]["train_iters"] = -1
    assert api.client.post("/v1/jobs", json=bad, headers=api.headers).status_code == 422
    made = api.client.post("/v1/keys", json={"name": "ci"}, headers=api.headers).json()
    api.settings.secrets_key = Fernet.generate_key().decode()  # (PostgreSQL: no key file is made)
    assert api.client.post(f"/v1/keys/{made['id']}/revoke", headers=api.headers).status_code == 200
    for value in ("one", "two"):
        assert api.client.put("/v1/secrets/HF_TOKEN", json={"value": value}, headers=api.headers).is_success
    assert api.client.delete("/v1/secrets/HF_TOKEN", headers=api.headers).status_code == 204
    assert CliRunner().invoke(app, ["tenants", "set-quota", "acme", "4"]).exit_code == 0

    rows = _audit("--tenant", "acme")
    assert [r["action"] for r in rows] == [
        "tenant.set_quota", "secret.delete", "secret.put", "secret.put", "key.revoke", "key.create",
        "job.cancel", "job.create",
    ]  # fmt: skip
    by_action = {r["action"]: r for r in reversed(rows)}
    assert (
        by_action["job.create"]["target"] == job["id"]
        and by_action["job.create"]["actor"] == f"key:{acme_key}"
    )
    assert by_action["job.cancel"]["detail"] == {"while": "queued"}
    assert by_action["key.revoke"]["target"] == made["id"] and by_action["secret.put"]["target"] == "HF_TOKEN"
    assert by_action["tenant.set_quota"]["actor"].startswith("operator:")
    assert by_action["tenant.set_quota"]["detail"] == {"max_devices": 4}
    assert all(r["tenant"] == "acme" for r in rows)
    assert "one" not in json.dumps(rows) and "two" not in json.dumps(rows)  # a secret's name, never its value
    # Filters: an action prefix, a time window; another tenant has none of these.
    assert [r["action"] for r in _audit("--tenant", "acme", "--action", "job")] == [
        "job.cancel",
        "job.create",
    ]
    assert len(_audit("--since", "1h")) == len(rows) and _audit("--since", "2099-01-01") == []
    assert _audit("--tenant", "globex") == []
    bad_since = CliRunner().invoke(app, ["audit", "--since", "yesterday"])
    assert bad_since.exit_code != 0 and "neither a duration" in bad_since.output
    # Scheduler-like work (a session without an actor) records nothing.
    with session_scope(api.settings.resolved_database_url) as s:
        s.get(Tenant, s.scalar(select(Tenant.id).where(Tenant.name == "globex"))).max_devices = 1
        count = s.query(AuditEvent).count()
    assert count == len(rows)
