"""/v1/datasets: uploads checked while they stream (bad ones refused with the line, nothing left
behind), storage URLs under the data-access rule, tenant isolation on every endpoint, and dataset
names resolved in job specs at submission and validation. SQLite and PostgreSQL; one test on S3."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import boto3
import pytest
from api_handle import Api
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update

from megatrain.api.app import create_app
from megatrain.api.auth import create_api_key
from megatrain.db.models import PENDING, READY, Dataset
from megatrain.db.session import session_scope
from megatrain.settings import get_settings, reset_settings_cache
from megatrain.storage import open_store
from megatrain.worker.nodes import ensure_local_pool

NDJSON = {"Content-Type": "application/x-ndjson"}
DOCS = [{"text": f"document number {i} " * 3, "id": i} for i in range(20)]


def _jsonl(docs: list[Any]) -> bytes:
    return b"".join(json.dumps(d).encode() + b"\n" for d in docs)


@pytest.fixture(autouse=True)
def spool_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The API host's temporary directory, so a test can see that an upload never lands there."""
    d = tmp_path / "spool"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def upload(api: Api, name: str, body: Any, headers: dict[str, str] | None = None, **params: Any) -> Any:
    return api.client.post(
        "/v1/datasets",
        params={"name": name, **params},
        content=body,
        headers={**(headers or api.headers), **NDJSON},
    )


def _objects(api: Api, prefix: str = "") -> list[str]:
    return [o.key for o in open_store(api.settings.resolved_storage_url).list(prefix)]


def _rows(api: Api) -> int:
    with session_scope(api.db_url) as s:
        return s.scalar(select(func.count()).select_from(Dataset)) or 0


def _mark_ready(api: Api, name: str, **values: Any) -> None:
    with session_scope(api.db_url) as s:
        s.execute(update(Dataset).where(Dataset.name == name).values(state=READY, documents=20, **values))


def _error(resp: Any, status: int = 422) -> tuple[str, str]:
    assert resp.status_code == status, resp.text
    detail = resp.json()["detail"]
    assert isinstance(detail, list) and len(detail) == 1, detail
    return detail[0]["field"], detail[0]["message"]


def test_upload_registers_a_pending_dataset_under_the_tenants_prefix(api: Api, spool_dir: Path) -> None:
    body = _jsonl(DOCS)
    resp = upload(api, "corpus", body, tokenizer="byte", json_key="text", append_eod="false")
    assert resp.status_code == 201, resp.text
    ds = resp.json()
    assert ds["name"] == "corpus" and ds["state"] == PENDING and ds["uploaded"] is True
    assert ds["shared"] is False and ds["tokenizer"] == {"type": "byte"} and ds["append_eod"] is False
    assert ds["input_bytes"] == len(body) and ds["documents"] is None
    storage = api.settings.resolved_storage_url
    folder = f"tenants/acme/datasets/corpus/{ds['id']}"
    assert ds["path"] == f"{storage}/{folder}/data" and ds["source_url"] == f"{storage}/{folder}/source.jsonl"
    # The stored object is the upload, byte for byte; no spooled copy is left on the API's disk.
    assert open_store(storage).get_bytes(f"{folder}/source.jsonl") == body
    assert list(spool_dir.iterdir()) == []
    got = api.client.get("/v1/datasets/corpus", headers=api.headers)
    assert got.status_code == 200 and got.json() == ds
    listed = api.client.get("/v1/datasets", headers=api.headers).json()["items"]
    assert [d["name"] for d in listed] == ["corpus"]


def test_upload_streams_a_chunked_body_and_adds_a_missing_final_newline(api: Api) -> None:
    body = _jsonl(DOCS).rstrip(b"\n")
    chunks = (body[i : i + 7] for i in range(0, len(body), 7))  # lines split across chunks
    resp = upload(api, "chunked", chunks)
    assert resp.status_code == 201, resp.text
    stored = open_store(api.settings.resolved_storage_url).get_bytes(
        f"tenants/acme/datasets/chunked/{resp.json()['id']}/source.jsonl"
    )
    assert stored == body + b"\n"


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        (_jsonl(DOCS[:2]) + b"{not json}\n", "file", ["line 3", "not valid JSON"]),
        (_jsonl(DOCS[:1]) + _jsonl([{"content": "x"}]), "file", ["line 2", "no field 'text'"]),
        (_jsonl([{"text": ""}]), "file", ["line 1", "'text' is empty"]),
        (_jsonl([{"text": 7}]), "file", ["line 1", "must be a string"]),
        (_jsonl([["text"]]), "file", ["line 1", "JSON object"]),
        (_jsonl(DOCS[:1]) + b"\n" + b"[]\n", "file", ["line 3", "JSON object"]),  # blank line 2 counted
        (b'{"text": "caf\xe9"}\n', "file", ["line 1", "UTF-8"]),
        (b"", "file", ["empty"]),
    ],
    ids=[
        "not-json",
        "wrong-key",
        "empty-text",
        "not-a-string",
        "not-an-object",
        "blank-line",
        "latin1",
        "empty",
    ],
)
def test_bad_uploads_are_refused_naming_the_line_and_leave_nothing(
    api: Api, spool_dir: Path, body: bytes, field: str, words: list[str]
) -> None:
    got_field, message = _error(upload(api, "bad", body))
    assert got_field == field and all(w in message for w in words), message
    assert _rows(api) == 0 and _objects(api) == [] and list(spool_dir.iterdir()) == []


def test_an_upload_that_fails_half_way_leaves_nothing(
    api: Api, spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatrain.api.datasets import service
    from megatrain.storage import FileStore

    real_writer = FileStore.writer

    @contextmanager
    def write_then_fail(self: FileStore, key: str) -> Iterator[Any]:
        with real_writer(self, key) as f:
            yield f
            raise OSError("disk full")  # every byte is written, then the store "fails"

    # Answered as the server would (a 500), not raised into the test.
    client = TestClient(api.client.app, raise_server_exceptions=False)

    def post() -> Any:
        body, headers = _jsonl(DOCS), {**api.headers, **NDJSON}
        return client.post("/v1/datasets", params={"name": "half"}, content=body, headers=headers)

    monkeypatch.setattr(FileStore, "writer", write_then_fail)
    assert post().status_code == 500
    assert _rows(api) == 0 and _objects(api) == [] and list(spool_dir.iterdir()) == []
    monkeypatch.setattr(FileStore, "writer", real_writer)

    def insert_fails(*args: Any) -> None:
        raise RuntimeError("database went away")

    monkeypatch.setattr(service, "_insert", insert_fails)
    assert post().status_code == 500
    assert _rows(api) == 0 and _objects(api) == [] and list(spool_dir.iterdir()) == []


def test_the_upload_cap_is_a_413_naming_it_with_or_without_content_length(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spool_dir: Path
) -> None:
    monkeypatch.setenv("MEGATRAIN_MAX_DATASET_UPLOAD_BYTES", "2048")
    reset_settings_cache()
    settings = get_settings()
    with session_scope(db_url) as s:
        key = create_api_key(s, "acme")
    headers = {"Authorization": f"Bearer {key}", **NDJSON}
    body = _jsonl(DOCS * 4)
    assert len(body) > 2048
    with TestClient(create_app(settings)) as client:
        for content in (body, iter([body[:1000], body[1000:]])):  # declared, then chunked
            resp = client.post("/v1/datasets", params={"name": "big"}, content=content, headers=headers)
            assert resp.status_code == 413, resp.text
            assert "2048 bytes" in resp.json()["detail"]
        small = client.post(
            "/v1/datasets", params={"name": "small"}, content=_jsonl(DOCS[:3]), headers=headers
        )
        assert small.status_code == 201, small.text
    with session_scope(db_url) as s:
        assert s.scalars(select(Dataset.name)).all() == ["small"]
    assert list(spool_dir.iterdir()) == []
    objects = [o.key for o in open_store(settings.resolved_storage_url).list()]
    assert len(objects) == 1 and "/small/" in objects[0]


def test_upload_options_are_checked_before_the_body(api: Api) -> None:
    assert _error(upload(api, "bad/name", _jsonl(DOCS)))[0] == "name"
    assert _error(upload(api, "t", _jsonl(DOCS), tokenizer="wordpiece"))[0] == "tokenizer"
    field, message = _error(upload(api, "t", _jsonl(DOCS), tokenizer="hf:file:///etc/tokenizer.json"))
    assert field == "tokenizer.path" and "outside the data this tenant may read" in message
    no_name = api.client.post("/v1/datasets", content=_jsonl(DOCS), headers={**api.headers, **NDJSON})
    assert _error(no_name)[0] == "name"
    csv = api.client.post(
        "/v1/datasets",
        params={"name": "t"},
        content=b"a,b",
        headers={**api.headers, "Content-Type": "text/csv"},
    )
    assert csv.status_code == 415
    assert _rows(api) == 0 and _objects(api) == []


def test_a_name_is_unique_per_tenant(api: Api) -> None:
    assert upload(api, "dup", _jsonl(DOCS)).status_code == 201
    again = upload(api, "dup", _jsonl(DOCS))
    assert again.status_code == 409 and "already exists" in again.json()["detail"]
    # Another tenant may use the same name: names are per tenant.
    assert upload(api, "dup", _jsonl(DOCS), headers=api.other_headers).status_code == 201
    assert _rows(api) == 2 and len(_objects(api)) == 2


def test_register_a_storage_url_the_tenant_may_read(api: Api, tmp_path: Path) -> None:
    corpus = api.data_root / "corpus.jsonl"
    corpus.write_bytes(_jsonl(DOCS))
    body = {
        "name": "from-url",
        "source_url": corpus.as_uri(),
        "tokenizer": {"type": "byte"},
        "json_key": "text",
    }
    resp = api.client.post("/v1/datasets", json=body, headers=api.headers)
    assert resp.status_code == 201, resp.text
    ds = resp.json()
    assert ds["uploaded"] is False and ds["source_url"] == corpus.as_uri() and ds["state"] == PENDING
    # A link inside the allowed root is registered as its target, which the rule checked.
    link = api.data_root / "link.jsonl"
    link.symlink_to(corpus)
    linked = api.client.post(
        "/v1/datasets", json={**body, "name": "linked", "source_url": link.as_uri()}, headers=api.headers
    )
    assert linked.status_code == 201 and linked.json()["source_url"] == corpus.resolve().as_uri()
    outside = tmp_path / "outside.jsonl"
    outside.write_bytes(_jsonl(DOCS))
    (api.data_root / "escape.jsonl").symlink_to(outside)
    escape = {**body, "name": "escape", "source_url": (api.data_root / "escape.jsonl").as_uri()}
    assert "outside the data" in _error(api.client.post("/v1/datasets", json=escape, headers=api.headers))[1]
    assert ds["path"].startswith(f"{api.settings.resolved_storage_url}/tenants/acme/datasets/from-url/")
    bad = [
        ({"source_url": "file:///etc/passwd.jsonl"}, "source_url", "outside the data this tenant may read"),
        ({"source_url": (api.data_root / "missing.jsonl").as_uri()}, "source_url", "does not exist"),
        ({"source_url": (api.data_root / "corpus.csv").as_uri()}, "source_url", "JSONL file"),
        ({"source_url": corpus.as_uri(), "tokenizer": "tiktoken"}, "tokenizer", "tokenizer"),
        ({"source_url": corpus.as_uri(), "extra": 1}, "extra", ""),
    ]
    for change, field, words in bad:
        got_field, message = _error(
            api.client.post("/v1/datasets", json={**body, "name": "x", **change}, headers=api.headers)
        )
        assert got_field == field and words in message, message
    not_json = api.client.post(
        "/v1/datasets", content=b"{", headers={**api.headers, "Content-Type": "application/json"}
    )
    assert _error(not_json)[0] == "body"
    assert _rows(api) == 2


def test_tenants_see_only_their_own_datasets_and_shared_ones(api: Api) -> None:
    assert upload(api, "mine", _jsonl(DOCS)).status_code == 201
    assert upload(api, "theirs", _jsonl(DOCS), headers=api.other_headers).status_code == 201
    with session_scope(api.db_url) as s:
        s.add(
            Dataset(
                tenant_id=None, name="common", state=READY, source_url="file:///x.jsonl",
                prefix_url=f"{api.settings.resolved_storage_url}/datasets/common/ds-1/data",
                tokenizer={"type": "byte"},
            )
        )  # fmt: skip

    def names(headers: dict[str, str]) -> list[tuple[str, bool]]:
        items = api.client.get("/v1/datasets", headers=headers).json()["items"]
        return [(d["name"], d["shared"]) for d in items]

    assert names(api.headers) == [("common", True), ("mine", False)]
    assert names(api.other_headers) == [("common", True), ("theirs", False)]
    # Another tenant's dataset is the same 404 as one that does not exist, on every endpoint.
    for name in ("theirs", "nothing-here"):
        for method in ("GET", "DELETE"):
            resp = api.client.request(method, f"/v1/datasets/{name}", headers=api.headers)
            assert resp.status_code == 404 and resp.json() == {"detail": f"dataset {name!r} not found"}
    assert api.client.get("/v1/datasets/common", headers=api.other_headers).json()["shared"] is True
    assert api.client.delete("/v1/datasets/common", headers=api.headers).status_code == 403
    # No key, no datasets.
    assert api.client.get("/v1/datasets").status_code == 401
    assert (
        api.client.post("/v1/datasets", params={"name": "x"}, content=b"{}", headers=NDJSON).status_code
        == 401
    )
    assert _rows(api) == 3


def test_delete_removes_the_row_and_its_objects(api: Api) -> None:
    ds = upload(api, "gone", _jsonl(DOCS)).json()
    assert upload(api, "kept", _jsonl(DOCS)).status_code == 201
    assert api.client.delete("/v1/datasets/gone", headers=api.headers).status_code == 204
    assert api.client.get("/v1/datasets/gone", headers=api.headers).status_code == 404
    assert not any(ds["id"] in key for key in _objects(api)) and len(_objects(api)) == 1
    # The name is free again.
    assert upload(api, "gone", _jsonl(DOCS)).status_code == 201


def _spec_with(api: Api, name: str) -> dict[str, Any]:
    spec = api.spec("uses-dataset")
    spec["data"]["train"] = [{"dataset": name}]
    return spec


def test_a_job_naming_a_dataset_gets_its_path_when_ready(api: Api) -> None:
    ds = upload(api, "corpus", _jsonl(DOCS)).json()
    # Pending: refused, naming the field and the state.
    for route in ("/v1/jobs", "/v1/spec/validate"):
        field, message = _error(api.client.post(route, json=_spec_with(api, "corpus"), headers=api.headers))
        assert field == "data.train.0.dataset" and "pending, not ready" in message
    _mark_ready(api, "corpus")
    check = api.client.post("/v1/spec/validate", json=_spec_with(api, "corpus"), headers=api.headers)
    assert check.status_code == 200, check.text
    assert check.json()["spec"]["data"]["train"][0] == {
        "path": ds["path"],
        "dataset": "corpus",
        "weight": 1.0,
    }
    job = api.submit(_spec_with(api, "corpus"))
    stored = api.client.get(f"/v1/jobs/{job['id']}", headers=api.headers).json()["spec"]
    assert stored["data"]["train"][0]["path"] == ds["path"] and not ds["path"].endswith(".jsonl")
    # A path the user wrote beside the name is replaced by the registry's.
    spec = _spec_with(api, "corpus")
    spec["data"]["train"][0]["path"] = (api.data_root / "other.jsonl").as_uri()
    assert api.submit(spec)["spec"]["data"]["train"][0]["path"] == ds["path"]
    # While an unfinished job reads it, the dataset cannot be deleted.
    resp = api.client.delete("/v1/datasets/corpus", headers=api.headers)
    assert resp.status_code == 409 and job["id"] in resp.json()["detail"]


def test_a_job_cannot_name_an_unknown_or_another_tenants_dataset(api: Api) -> None:
    assert upload(api, "theirs", _jsonl(DOCS), headers=api.other_headers).status_code == 201
    _mark_ready(api, "theirs")
    spec = _spec_with(api, "theirs")
    spec["data"]["train"].append({"dataset": "nothing"})
    resp = api.client.post("/v1/jobs", json=spec, headers=api.headers)
    assert resp.status_code == 422
    detail = resp.json()["detail"]
    assert [d["field"] for d in detail] == ["data.train.0.dataset", "data.train.1.dataset"]
    assert all("no such dataset" in d["message"] for d in detail)
    # The owner may use it.
    other = api.client.post("/v1/jobs", json=_spec_with(api, "theirs"), headers=api.other_headers)
    assert other.status_code == 201, other.text


def test_a_job_must_use_the_datasets_tokenizer(api: Api) -> None:
    assert upload(api, "bytes", _jsonl(DOCS)).status_code == 201
    _mark_ready(api, "bytes")
    spec = _spec_with(api, "bytes")
    spec["data"]["tokenizer"] = {"type": "tiktoken", "name": "gpt2"}
    field, message = _error(api.client.post("/v1/spec/validate", json=spec, headers=api.headers))
    assert (
        field == "data.train.0.dataset" and "tokenized with {'type': 'byte'}" in message and "gpt2" in message
    )


def test_a_job_reading_records_gets_the_uploaded_jsonl(api: Api) -> None:
    """The index holds the json_key text alone: a dpo job, and a fine-tune of prompt/response records,
    read the uploaded file's records; pretraining and a fine-tune of plain text read the index."""
    transformers = pytest.importorskip("transformers")
    folder = api.data_root / "llama"
    transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=128, vocab_size=300).save_pretrained(folder)  # fmt: skip
    pairs = [{"prompt": f"q{i}?", "chosen": "yes", "rejected": "no", "response": "ok"} for i in range(4)]
    records = upload(api, "pairs", _jsonl(pairs), json_key="prompt").json()
    plain = upload(api, "plain", _jsonl(DOCS)).json()
    _mark_ready(api, "pairs")
    _mark_ready(api, "plain")

    def path(kind: str, name: str) -> str:
        spec = _spec_with(api, name)
        spec["kind"], spec["model"] = kind, {"init_from": f"hf:{folder.as_uri()}", "seq_length": 32}
        resp = api.client.post("/v1/spec/validate", json=spec, headers=api.headers)
        assert resp.status_code == 200, resp.text
        return resp.json()["spec"]["data"]["train"][0]["path"]

    assert path("dpo", "pairs") == path("finetune", "pairs") == records["source_url"]
    assert records["source_url"].endswith(".jsonl")
    assert path("pretrain", "pairs") == records["path"]
    assert path("finetune", "plain") == plain["path"] and path("dpo", "plain") == plain["source_url"]


def test_a_failed_dataset_is_refused_with_its_reason(api: Api) -> None:
    assert upload(api, "broken", _jsonl(DOCS)).status_code == 201
    with session_scope(api.db_url) as s:
        s.execute(update(Dataset).values(state="failed", state_reason="line 3: no field 'text'"))
    field, message = _error(api.client.post("/v1/jobs", json=_spec_with(api, "broken"), headers=api.headers))
    assert field == "data.train.0.dataset" and "failed" in message and "line 3" in message


@pytest.fixture
def s3_api(db_url: str, s3_bucket_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Api]:
    # db_url first: its MEGATRAIN_HOME fixture clears MEGATRAIN_* (the S3 endpoint included).
    monkeypatch.setenv("MEGATRAIN_STORAGE_URL", f"{s3_bucket_url}/prefix")
    monkeypatch.setenv("MEGATRAIN_ALLOWED_DATA_ROOTS", s3_bucket_url + "/shared")
    reset_settings_cache()
    settings = get_settings()
    with session_scope(db_url) as s:
        ensure_local_pool(s, settings)
        key, other = create_api_key(s, "acme"), create_api_key(s, "globex")
    with TestClient(create_app(settings)) as client:
        yield Api(client, settings, db_url, key, other, tmp_path)


def test_uploads_and_urls_on_s3(s3_api: Api, s3_bucket_url: str) -> None:
    api = s3_api
    ds = upload(api, "on-s3", _jsonl(DOCS)).json()
    assert ds["source_url"].startswith(f"{s3_bucket_url}/prefix/tenants/acme/datasets/on-s3/")
    assert open_store(s3_bucket_url).get_bytes(ds["source_url"].removeprefix(s3_bucket_url + "/")) == _jsonl(
        DOCS
    )
    assert _error(upload(api, "bad", _jsonl(DOCS) + b"nope\n"))[1].startswith("line 21")
    assert [o.key for o in open_store(s3_bucket_url).list()] == [
        ds["source_url"].removeprefix(s3_bucket_url + "/")
    ]
    open_store(s3_bucket_url).put_bytes("shared/c.jsonl", _jsonl(DOCS))
    body = {"name": "by-url", "source_url": f"{s3_bucket_url}/shared/c.jsonl"}
    assert api.client.post("/v1/datasets", json=body, headers=api.headers).status_code == 201
    missing = {"name": "nope", "source_url": f"{s3_bucket_url}/shared/none.jsonl"}
    assert "does not exist" in _error(api.client.post("/v1/datasets", json=missing, headers=api.headers))[1]


def _big_jsonl(size: int) -> bytes:
    """About `size` bytes of JSONL, random enough that no layer could compress it away."""
    lines, n = [], 0
    while n < size:
        line = json.dumps({"text": os.urandom(3000).hex()}).encode() + b"\n"
        lines.append(line)
        n += len(line)
    return b"".join(lines)


def _post_asgi(api: Api, name: str, chunks: list[bytes], between: Any, disconnect: bool = False) -> int:
    """POST an upload straight to the ASGI app, one body message per chunk, calling `between(i)`
    after chunk i is taken (TestClient reads a body whole before the app sees it); `disconnect`:
    the client goes away after the chunks. The response's status (0 when none was sent)."""
    query = f"name={name}".encode()
    headers = [(k.lower().encode(), v.encode()) for k, v in {**api.headers, **NDJSON}.items()]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/datasets", "raw_path": b"/v1/datasets", "query_string": query,
        "headers": [(b"host", b"testserver"), *headers],
        "client": ("127.0.0.1", 1), "server": ("testserver", 80),
    }  # fmt: skip
    sent: list[dict[str, Any]] = []
    at = 0

    async def receive() -> dict[str, Any]:
        nonlocal at
        if at > 0:
            between(at - 1)
        if at < len(chunks):
            at += 1
            return {"type": "http.request", "body": chunks[at - 1], "more_body": True}
        if disconnect:
            return {"type": "http.disconnect"}
        at += 1
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def main() -> None:
        # A disconnect ends the request with an error, as it does under a server.
        with contextlib.suppress(Exception):
            await api.client.app(scope, receive, send)

    anyio.run(main)
    return next((m["status"] for m in sent if m["type"] == "http.response.start"), 0)


def _s3(api: Api) -> tuple[Any, str]:
    store = open_store(api.settings.resolved_storage_url)
    return boto3.client("s3", endpoint_url=store.endpoint_url), store.bucket  # type: ignore[attr-defined]


def test_a_large_upload_streams_to_s3_in_parts_with_its_crc32_and_no_local_spool(
    s3_api: Api, spool_dir: Path
) -> None:
    """Past one part (8 MiB) the upload is a multipart upload whose parts go up while the body is
    still arriving; the API's temporary directory stays empty all along; the object is the body,
    byte for byte, with the whole object's CRC32."""
    api = s3_api
    client, bucket = _s3(api)
    body = _big_jsonl(20 << 20)
    chunks = [body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20)]
    seen_parts = []

    def between(i: int) -> None:
        assert list(spool_dir.iterdir()) == []  # nothing of it on the API's disk, at any point
        uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        if uploads:
            parts = client.list_parts(Bucket=bucket, Key=uploads[0]["Key"], UploadId=uploads[0]["UploadId"])
            seen_parts.append((i, len(parts.get("Parts", []))))

    assert _post_asgi(api, "big", chunks, between) == 201
    # Parts were in S3 while most of the body had not arrived yet.
    assert any(n >= 1 and i < len(chunks) - 4 for i, n in seen_parts), seen_parts
    assert list(spool_dir.iterdir()) == []
    with session_scope(api.db_url) as s:
        ds = s.scalars(select(Dataset)).one()
    assert ds.input_bytes == len(body)
    key = ds.source_url.removeprefix(f"s3://{bucket}/")
    head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    crc = base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()
    assert head["ETag"].endswith('-3"') and head["ContentLength"] == len(body)
    assert (head.get("ChecksumType"), head.get("ChecksumCRC32")) == ("FULL_OBJECT", crc)
    assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == body
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


@pytest.mark.parametrize("how", ["bad line", "client gone"])
def test_an_upload_refused_or_abandoned_half_way_aborts_its_multipart_upload(
    s3_api: Api, spool_dir: Path, how: str
) -> None:
    """A bad line past the first parts, or a client that disconnects, aborts the multipart upload:
    no upload in progress, no object, no row, nothing on the API's disk."""
    api = s3_api
    client, bucket = _s3(api)
    body = _big_jsonl(12 << 20)
    chunks = [body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20)]
    if how == "bad line":
        chunks += [b'{"text": "fine"}\nnot json\n', _big_jsonl(1 << 20)]
    started = []

    def between(i: int) -> None:
        started.extend(client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))

    status = _post_asgi(api, "half", chunks, between, disconnect=how == "client gone")
    if how == "bad line":  # (a client gone sees no answer, whatever the app sends)
        assert status == 422
    assert started, "the upload never reached S3 as a multipart upload"
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert client.list_objects_v2(Bucket=bucket).get("Contents", []) == []
    assert _rows(api) == 0 and list(spool_dir.iterdir()) == []
