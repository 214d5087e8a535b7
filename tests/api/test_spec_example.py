"""GET /v1/spec/example: the Submit page's template trains on data that exists (a ready dataset of
the tenant, else the demo corpus once built), never a placeholder path; none without data."""

from __future__ import annotations

from typing import Any

from api_handle import Api

from megatrain.api.auth import get_or_create_tenant
from megatrain.api.spec.example import DEMO_CORPUS_KEY
from megatrain.db.models import READY, Dataset
from megatrain.db.session import session_scope
from megatrain.demo import build_stdlib_corpus
from megatrain.storage import open_store


def _example(api: Api, headers: dict[str, str] | None = None) -> dict[str, Any]:
    resp = api.client.get("/v1/spec/example", headers=headers or api.headers)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_no_data_means_no_example_and_a_hint(api: Api) -> None:
    ex = _example(api)
    assert ex["spec"] is None and ex["source"] is None
    assert "megatrain demo" in ex["hint"] and "dataset" in ex["hint"]
    assert api.client.get("/v1/spec/example").status_code == 401


def test_the_demo_corpus_once_built(api: Api) -> None:
    store = open_store(api.settings.resolved_storage_url)
    build_stdlib_corpus(store.local_path(DEMO_CORPUS_KEY), max_bytes=20_000)
    ex = _example(api)
    assert ex["source"] == "demo"
    path = ex["spec"]["data"]["train"][0]["path"]
    assert path == f"{store.url}/{DEMO_CORPUS_KEY}" and store.exists(DEMO_CORPUS_KEY)
    # Ready to submit as it is.
    check = api.client.post("/v1/spec/validate", json=ex["spec"], headers=api.headers)
    assert check.status_code == 200, check.text


def test_a_ready_dataset_of_the_tenant_comes_first(api: Api) -> None:
    store = open_store(api.settings.resolved_storage_url)
    build_stdlib_corpus(store.local_path(DEMO_CORPUS_KEY), max_bytes=20_000)
    with session_scope(api.db_url) as s:
        acme = get_or_create_tenant(s, "acme")
        for name, state in (("older", READY), ("newest-pending", "pending")):
            s.add(
                Dataset(
                    tenant_id=acme.id, name=name, state=state, source_url="file:///x.jsonl",
                    prefix_url=f"{api.settings.resolved_storage_url}/tenants/acme/{name}/data",
                    tokenizer={"type": "byte"},
                )
            )  # fmt: skip
    ex = _example(api)
    assert ex["source"] == "dataset"
    assert ex["spec"]["data"]["train"] == [{"dataset": "older"}]
    assert ex["spec"]["data"]["tokenizer"] == {"type": "byte"}
    check = api.client.post("/v1/spec/validate", json=ex["spec"], headers=api.headers)
    assert check.status_code == 200, check.text
    # Another tenant does not see it: it gets the demo corpus.
    assert _example(api, api.other_headers)["source"] == "demo"
