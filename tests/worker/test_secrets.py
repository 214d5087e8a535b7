"""Tenant secrets end to end on a live embedded stack (the fake engine): stored through /v1/secrets
(names checked, values never shown again), named by a job's spec (a name the tenant has not stored
is a 422), injected into the engine's environment only, and redacted from everything stored about
the job: a log line that prints the value, the failure's reason and events quoting it. A test reads
every answer and the whole database file for the value. Then the operator's key: required on a
server database, and rotated with old rows still readable."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest
from cryptography.fernet import Fernet
from fixtures.live import LiveApi
from worker_helpers import wait_for

from megatrain.secrets_box import SecretBox, SecretsUnavailable

VALUE = "wandb-4f1d9c2e7b8a-super-secret"


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_secret_reaches_the_engine_and_nothing_stored(
    live_stack: LiveApi, fake_engine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_ENGINE_PRINT_ENV", "WANDB_API_KEY")
    monkeypatch.setenv("FAKE_ENGINE_FAIL_AT", "3")
    monkeypatch.setenv("FAKE_ENGINE_RAISE", "ValueError")
    monkeypatch.setenv("FAKE_ENGINE_MESSAGE", f"W&B refused the key {VALUE}")
    answers: list[str] = []
    with httpx.Client(base_url=live_stack.url, headers={"Authorization": f"Bearer {live_stack.key}"}) as api:

        def call(method: str, path: str, **kw: object) -> httpx.Response:
            resp = api.request(method, path, **kw)
            answers.append(resp.text)
            return resp

        assert call("PUT", "/v1/secrets/WANDB_API_KEY", json={"value": "first"}).status_code == 201
        again = call("PUT", "/v1/secrets/WANDB_API_KEY", json={"value": VALUE})
        assert again.status_code == 200 and set(again.json()) == {"name", "created_at", "updated_at"}
        assert [s["name"] for s in call("GET", "/v1/secrets").json()] == ["WANDB_API_KEY"]
        bad = call("PUT", "/v1/secrets/wandb", json={"value": "x"})
        assert bad.status_code == 422 and bad.json()["detail"][0]["field"] == "name"
        reserved = call("PUT", "/v1/secrets/LD_PRELOAD", json={"value": "x"})
        assert reserved.status_code == 422 and "set by megatrain or the runtime" in reserved.text

        unknown = call("POST", "/v1/jobs", json=live_stack.spec() | {"secrets": ["HF_TOKEN"]})
        assert unknown.status_code == 422
        assert (
            unknown.json()["detail"][0]["field"] == "secrets[0]"
            and "PUT /v1/secrets/HF_TOKEN" in unknown.text
        )

        job = call("POST", "/v1/jobs", json=live_stack.spec() | {"secrets": ["WANDB_API_KEY"]}).json()
        assert job["spec"]["secrets"] == ["WANDB_API_KEY"]
        done = wait_for(
            lambda: (
                (j := call("GET", f"/v1/jobs/{job['id']}").json())["status"] in ("failed", "succeeded") and j
            ),
            60,
        )
        assert done["status"] == "failed" and "[secret:WANDB_API_KEY]" in done["status_reason"]
        logs = call("GET", f"/v1/jobs/{job['id']}/logs").text
        assert "fake engine: WANDB_API_KEY=[secret:WANDB_API_KEY]" in logs
        call("GET", f"/v1/jobs/{job['id']}/events")
        call("GET", "/v1/jobs")
    # The engine had it: its sha256 is the value's.
    shas = list(live_stack.settings.runs_dir.glob(f"{job['id']}/attempt-*/pids/rank0.env.sha256"))
    assert shas and shas[0].read_text() == hashlib.sha256(VALUE.encode()).hexdigest()
    # Nowhere else: not in any answer, not in the database (its file and write-ahead log) or storage;
    # on the node, only in the engine's own failure records (which the runner redacts as it reads).
    assert not [a for a in answers if VALUE in a]
    home = live_stack.settings.home
    stored = [p for p in home.rglob("*") if p.is_file() and VALUE.encode() in p.read_bytes()]
    assert stored and all(p.name == "failure.rank0.json" for p in stored), stored
    with httpx.Client(base_url=live_stack.url, headers={"Authorization": f"Bearer {live_stack.key}"}) as api:
        assert api.delete("/v1/secrets/WANDB_API_KEY").status_code == 204
        assert api.get("/v1/secrets").json() == []
        assert (
            api.post("/v1/jobs", json=live_stack.spec() | {"secrets": ["WANDB_API_KEY"]}).status_code == 422
        )


def test_the_operators_key(megatrain_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatrain.settings import get_settings

    server = get_settings().model_copy(update={"database_url": "postgresql+psycopg://u@127.0.0.1:1/db"})
    with pytest.raises(SecretsUnavailable, match="MEGATRAIN_SECRETS_KEY"):
        SecretBox.from_settings(server)  # a server database needs the operator's key
    embedded = SecretBox.from_settings(get_settings())  # made once under MEGATRAIN_HOME, mode 0600
    key_file = megatrain_home / "secrets.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert SecretBox.from_settings(get_settings()).decrypt(embedded.encrypt("v")) == "v"
    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    token = SecretBox([old]).encrypt("value")
    rotated = SecretBox([new, old])  # a new key first: it encrypts, the old one still decrypts
    assert rotated.decrypt(token) == "value" and SecretBox([new]).decrypt(rotated.encrypt("x")) == "x"
    with pytest.raises(SecretsUnavailable, match="does not decrypt"):
        SecretBox([new]).decrypt(token)
    with pytest.raises(SecretsUnavailable, match="not a Fernet key"):
        SecretBox(["not-a-key"])
