"""An API under TestClient on the parametrized database (SQLite and PostgreSQL), seeded with two
tenants' keys and the local pool."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from api_handle import Api, write_corpus
from fastapi.testclient import TestClient
from sqlalchemy import select

from megatrain.api.app import create_app
from megatrain.api.auth import create_api_key
from megatrain.db.models import Tenant
from megatrain.db.session import session_scope
from megatrain.settings import get_settings, reset_settings_cache
from megatrain.worker.nodes import ensure_local_pool


@pytest.fixture
def api(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Api]:
    data_root = tmp_path / "shared-data"
    data_root.mkdir()
    write_corpus(data_root / "corpus.jsonl")  # what Api.spec() reads: submission checks it exists
    monkeypatch.setenv("MEGATRAIN_ALLOWED_DATA_ROOTS", data_root.as_uri())
    monkeypatch.setenv("MEGATRAIN_CPU_SLOTS", "4")
    monkeypatch.setenv("MEGATRAIN_MAX_REQUEST_BYTES", str(64 * 1024))
    reset_settings_cache()
    settings = get_settings()
    with session_scope(db_url) as session:
        ensure_local_pool(session, settings)
        key = create_api_key(session, "acme", "test")
        other_key = create_api_key(session, "globex", "test")
        for tenant in session.scalars(select(Tenant)):
            tenant.max_priority = 10  # the tests may boost their jobs (the cap's own tests lower it)
    app = create_app(settings, sse_poll_interval_s=0.02)
    with TestClient(app) as client:
        yield Api(client, settings, db_url, key, other_key, data_root)
