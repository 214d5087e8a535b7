"""The SDK against a scripted transport: request shapes, paging, errors, SSE, credentials.

The same calls run against the real API in test_client_live.py; these pin the edge cases a live
server rarely produces (odd pages, redirects to presigned listings, keep-alive comments).
"""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from megatrain.client import ApiError, ApiUnreachable, Client, SpecFileError, read_credentials


def _job(i: int, status: str = "queued", **kw: Any) -> dict[str, Any]:
    return {"id": f"job-{i}", "name": f"n{i}", "kind": "pretrain", "status": status, "status_reason": "",
            "created_at": "2026-11-22T00:00:00Z", "current_step": 0, "total_steps": 10, "latest_loss": None,
            "latest_tokens_per_s": None, "latest_mfu": None, "layout": {"tp": 1}, "num_procs": 1,
            "attempt": 0, "future_field": 1, **kw}  # fmt: skip


def _client(handler: Callable[[httpx.Request], httpx.Response], key: str = "k") -> Client:
    return Client("http://api.test", api_key=key, transport=httpx.MockTransport(handler))


def test_submit_sends_spec_key_and_idempotency_key(tmp_path: Path) -> None:
    seen: list[httpx.Request] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        return httpx.Response(201, json=_job(1, name=json.loads(req.content)["name"]))

    spec_yaml = tmp_path / "spec.yaml"
    spec_yaml.write_text("name: from-yaml\ndata:\n  train: [{path: 'file:///x.jsonl'}]\n")
    spec_json = tmp_path / "spec.json"
    spec_json.write_text(json.dumps({"name": "from-json", "data": {"train": [{"path": "file:///x"}]}}))
    with _client(handler, key="secret") as c:
        job = c.submit(spec_yaml, idempotency_key="abc")
        assert job.name == "from-yaml" and job.id == "job-1" and job.raw["future_field"] == 1
        assert c.submit(str(spec_json)).name == "from-json"
        assert c.submit({"name": "from-dict", "data": {}}).name == "from-dict"
    assert seen[0].method == "POST" and seen[0].url.path == "/v1/jobs"
    assert seen[0].headers["Authorization"] == "Bearer secret"
    assert seen[0].headers["Idempotency-Key"] == "abc"
    assert "Idempotency-Key" not in seen[1].headers


def test_submit_a_jobspec_object() -> None:
    from megatrain.spec import parse_spec

    spec = parse_spec({"name": "typed", "data": {"train": [{"path": "file:///x.jsonl"}]}})
    bodies: list[dict[str, Any]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(req.content))
        return httpx.Response(201, json=_job(1))

    with _client(handler) as c:
        c.submit(spec)
    assert bodies[0]["name"] == "typed" and bodies[0]["model"]["arch"] == "llama"


@pytest.mark.parametrize(
    ("content", "match"),
    [(None, "does not exist"), ("name: [unclosed", "not valid YAML"), ("- a list", "must hold a mapping")],
)
def test_bad_spec_files(tmp_path: Path, content: str | None, match: str) -> None:
    path = tmp_path / "spec.yaml"
    if content is not None:
        path.write_text(content)
    with _client(lambda r: httpx.Response(500)) as c, pytest.raises(SpecFileError, match=match):
        c.submit(path)


def test_422_names_each_field() -> None:
    detail = [
        {"field": "model.hidden_size", "message": "model.hidden_size=250 is not divisible by ..."},
        {"field": "training.lr", "message": "Input should be greater than 0"},
    ]
    with _client(lambda r: httpx.Response(422, json={"detail": detail})) as c, pytest.raises(ApiError) as ei:
        c.submit({"name": "x"})
    assert ei.value.status == 422
    assert ei.value.fields == ["model.hidden_size", "training.lr"]
    assert "model.hidden_size" in str(ei.value) and "training.lr" in str(ei.value)


def test_fastapi_style_422() -> None:
    body = {"detail": [{"loc": ["body", "name"], "msg": "Field required", "type": "missing"}]}
    with _client(lambda r: httpx.Response(422, json=body)) as c, pytest.raises(ApiError) as ei:
        c.submit({})
    assert ei.value.fields == ["name"]


@pytest.mark.parametrize(
    ("response", "match"),
    [
        (httpx.Response(404, json={"detail": "job job-x not found"}), "404.*job job-x not found"),
        (httpx.Response(502, text="Bad gateway"), "502.*Bad gateway"),
        (httpx.Response(401, json={"detail": "invalid API key"}), "not authenticated.*invalid API key"),
    ],
)
def test_plain_errors(response: httpx.Response, match: str) -> None:
    with _client(lambda r: response) as c, pytest.raises(ApiError, match=match):
        c.get_job("job-x")


def test_unreachable_api() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with Client(f"http://127.0.0.1:{port}", api_key="k", timeout=2) as c, pytest.raises(ApiUnreachable) as ei:
        c.get_job("job-1")
    assert ei.value.status == 0 and f"127.0.0.1:{port}" in str(ei.value)


def test_list_jobs_follows_cursor_and_honours_limit() -> None:
    calls: list[dict[str, str]] = []
    jobs = [_job(i, status="running") for i in range(7)]

    def handler(req: httpx.Request) -> httpx.Response:
        params = dict(req.url.params)
        calls.append(params)
        start = int(params.get("cursor", 0))
        size = int(params["limit"])
        nxt = start + size
        return httpx.Response(
            200, json={"items": jobs[start:nxt], "next_cursor": str(nxt) if nxt < len(jobs) else None}
        )

    with _client(handler) as c:
        assert [j.id for j in c.list_jobs(status="running", page_size=3)] == [f"job-{i}" for i in range(7)]
        assert calls[0] == {"limit": "3", "status": "running"} and calls[2]["cursor"] == "6"
        calls.clear()
        assert len(list(c.list_jobs(limit=4, page_size=3))) == 4
        assert [p["limit"] for p in calls] == ["3", "1"]


def test_metrics_events_logs_checkpoints_accept_lists_or_wrapped() -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        path = req.url.path
        if path.endswith("/metrics"):
            assert req.url.params["since_step"] == "5"
            return httpx.Response(200, json=[{"step": 10, "kind": "train", "loss": 3.0}])
        if path.endswith("/events"):
            return httpx.Response(200, json={"items": [{"kind": "queued"}]})
        if path.endswith("/logs"):
            assert req.url.params["after_seq"] == "2"
            return httpx.Response(200, json={"items": [{"seq": 3, "line": "hello"}], "next_seq": 3})
        return httpx.Response(200, json=[{"step": 20, "uri": "u2"}, {"step": 10, "uri": "u1"}])

    with _client(handler) as c:
        assert c.metrics("j", since_step=5)[0]["loss"] == 3.0
        assert c.events("j") == [{"kind": "queued"}]
        assert [(ln.seq, ln.line) for ln in c.logs("j", after_seq=2)] == [(3, "hello")]
        assert [cp.step for cp in c.checkpoints("j")] == [10, 20]


def test_follow_logs_and_wait() -> None:
    state = {"polls": 0}
    lines = [{"seq": i, "line": f"line {i}"} for i in range(1, 6)]

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path.endswith("/logs"):
            after = int(req.url.params["after_seq"])
            # Lines appear two per poll, so following must keep asking until the job ends.
            visible = lines[: 2 * state["polls"]]
            return httpx.Response(200, json=[ln for ln in visible if ln["seq"] > after])
        state["polls"] += 1
        return httpx.Response(200, json=_job(1, status="succeeded" if state["polls"] >= 3 else "running"))

    with _client(handler) as c:
        got = [ln.line for ln in c.follow_logs("job-1", poll_interval_s=0.01)]
        assert got == [f"line {i}" for i in range(1, 6)]
        assert c.wait("job-1", poll_interval_s=0.01).status == "succeeded"
    state["polls"] = -100
    with _client(handler) as c, pytest.raises(TimeoutError, match="still running"):
        c.wait("job-1", timeout_s=0.05, poll_interval_s=0.01)


def test_stream_metrics_parses_sse() -> None:
    body = (
        ": keep-alive\n\n"
        'event: metric\ndata: {"step": 10, "kind": "train", "loss": 4.0}\n\n'
        'data: {"step": 20, "kind": "train",\ndata:  "loss": 3.5}\n\n'
        'event: status\ndata: {"status": "running"}\n\n'
        "event: end\ndata: {}\n\n"
        'data: {"step": 99}\n\n'
    )

    def handler(req: httpx.Request) -> httpx.Response:
        assert req.headers["Accept"] == "text/event-stream"
        return httpx.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})

    with _client(handler) as c:
        assert [(m["step"], m["loss"]) for m in c.stream_metrics("j")] == [(10, 4.0), (20, 3.5)]


def _tar_bytes(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_download_latest_via_tar_and_via_presigned_listing(tmp_path: Path) -> None:
    seen: list[httpx.Request] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        path = req.url.path
        if path.endswith("/checkpoints"):
            return httpx.Response(200, json=[{"step": 10}, {"step": 30}, {"step": 20}])
        if path == "/v1/jobs/j1/checkpoints/30/download":
            return httpx.Response(200, content=_tar_bytes({"iter_0000030/model.safetensors": b"w30"}))
        if path == "/v1/jobs/j2/checkpoints/20/download":
            return httpx.Response(307, headers={"location": "/v1/listing/j2"})
        if path == "/v1/listing/j2":
            files = [{"path": "model.safetensors", "url": "http://s3.test/b/m?X-Amz-Signature=1", "size": 3}]
            return httpx.Response(200, json={"files": files})
        if req.url.host == "s3.test":
            return httpx.Response(200, content=b"w20")
        return httpx.Response(404, json={"detail": "no"})

    with _client(handler) as c:
        dest = c.download("j1", dest=tmp_path / "a")
        assert (dest / "model.safetensors").read_bytes() == b"w30"
        # The presigned-URL path: the real transport is bypassed for other hosts, so patch it in.
        c._fetch_to_file = _fetch_with(handler)  # type: ignore[method-assign]
        dest = c.download("j2", step=20, dest=tmp_path / "b")
        assert (dest / "model.safetensors").read_bytes() == b"w20"
    assert all(r.headers.get("Authorization") == "Bearer k" for r in seen if r.url.host == "api.test")


def _fetch_with(handler: Callable[[httpx.Request], httpx.Response]) -> Callable[[str, Path, str], None]:
    def fetch(url: str, target: Path, base: str) -> None:
        resp = handler(httpx.Request("GET", httpx.URL(base).join(url)))
        target.write_bytes(resp.content)

    return fetch


@pytest.mark.parametrize(
    ("status", "says"),
    [("running", "has no checkpoints yet"), ("failed", "failed without saving a checkpoint")],
)
def test_download_without_checkpoints_is_a_clear_error(tmp_path: Path, status: str, says: str) -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path.endswith("/checkpoints"):
            return httpx.Response(200, json=[])
        return httpx.Response(200, json=_job(1, status=status))

    with _client(handler) as c, pytest.raises(ApiError, match=says):
        c.download("job-1", dest=tmp_path / "x")


def test_credentials_file_formats(tmp_path: Path) -> None:
    p = tmp_path / "credentials"
    assert read_credentials(p) is None
    for text in (
        "mt_abc\n",
        "# local key\napi_key = mt_abc\n",
        "MEGATRAIN_API_KEY='mt_abc'",
        '{"api_key": "mt_abc"}',
    ):
        p.write_text(text)
        assert read_credentials(p) == "mt_abc", text


def test_key_defaults_to_settings_then_credentials_file(
    megatrain_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatrain.settings import reset_settings_cache

    megatrain_home.mkdir(parents=True)
    (megatrain_home / "credentials").write_text("from-file\n")
    with Client() as c:
        assert c.api_key == "from-file" and c.api_url == "http://127.0.0.1:8000"
    monkeypatch.setenv("MEGATRAIN_API_KEY", "from-env")
    monkeypatch.setenv("MEGATRAIN_API_URL", "http://example.test:9000/")
    reset_settings_cache()
    with Client() as c:
        assert c.api_key == "from-env" and c.api_url == "http://example.test:9000"


def test_import_is_torch_free() -> None:
    code = (
        "import sys, megatrain.client, megatrain.cli\n"
        "heavy = [m for m in ('torch', 'fastapi', 'sqlalchemy', 'uvicorn') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_sdk_spec_defaults_are_the_apis() -> None:
    # A JobSpec built in Python is sent with the API's defaults: precision auto, not a bf16 that
    # every CPU run would downgrade.
    from megatrain.client.client import _spec_body
    from megatrain.spec import JobSpec

    body = _spec_body(
        JobSpec.model_validate({"name": "s", "data": {"train": [{"path": "file:///d/c.jsonl"}]}})
    )
    assert body["training"]["precision"] == "auto"
    assert body["resources"]["devices"] is None and "gpus" not in body["resources"]


KEY = "mt_" + "a1B2c3D4e5" + "x" * 30  # a key's shape (megatrain.api.auth.new_key)


@pytest.mark.parametrize("source", ["env", "file", "none"])
def test_a_401_names_the_key_sent_by_its_prefix_and_where_it_came_from(
    source: str, megatrain_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatrain.settings import get_settings, reset_settings_cache

    if source == "env":
        monkeypatch.setenv("MEGATRAIN_API_KEY", KEY)
    elif source == "file":
        megatrain_home.mkdir(parents=True, exist_ok=True)
        (megatrain_home / "credentials").write_text(KEY + "\n")
    reset_settings_cache()
    refuse = httpx.MockTransport(lambda r: httpx.Response(401, json={"detail": "invalid API key"}))
    with Client("http://api.test", transport=refuse) as c, pytest.raises(ApiError) as ei:
        c.get_job("job-x")
    message = str(ei.value)
    assert KEY not in message and KEY[10:] not in message  # never the secret, only its prefix
    expected = {
        "env": "sent the key mt_a1B2c3D… from MEGATRAIN_API_KEY",
        "file": f"sent the key mt_a1B2c3D… from {get_settings().credentials_path}",
        "none": "no API key was sent",
    }[source]
    assert expected in message, message


def test_a_short_key_shows_at_most_a_third_of_itself() -> None:
    refuse = httpx.MockTransport(lambda r: httpx.Response(401, json={"detail": "invalid API key"}))
    with Client("http://api.test", api_key="mt_wrong", transport=refuse) as c, pytest.raises(ApiError) as ei:
        c.get_job("job-x")
    assert "sent the key mt… from the api_key argument" in str(ei.value)
