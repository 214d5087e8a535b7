"""megatrain/api/jobs/data_exists.py: files and S3 objects, found, missing, or unreachable in time."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatrain.api.jobs.data_exists import DataCheck, missing_data
from megatrain.storage import open_store


def test_files(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("{}\n")
    (tmp_path / "p.bin").write_bytes(b"")
    (tmp_path / "p.idx").write_bytes(b"")
    (tmp_path / "q.idx").write_bytes(b"")
    ok = [
        DataCheck("f.0", (tmp_path / "a.jsonl").as_uri()),
        DataCheck("f.1", (tmp_path / "p").as_uri(), True),
    ]
    assert missing_data(ok, None) == []
    bad = [
        DataCheck("f.0", (tmp_path / "b.jsonl").as_uri()),
        DataCheck("f.1", (tmp_path / "q").as_uri(), True),
        DataCheck("f.2", (tmp_path / "r").as_uri(), True),
    ]
    problems = missing_data(bad, None)
    assert [p["field"] for p in problems] == ["f.0", "f.1", "f.2"]
    assert problems[0]["message"].endswith("b.jsonl' does not exist")
    assert f"{(tmp_path / 'q').as_uri()}.bin does not exist" in problems[1]["message"]
    assert ".bin and " in problems[2]["message"] and "r.idx do not exist" in problems[2]["message"]


def test_s3_objects(s3_bucket_url: str, moto_s3_endpoint: str) -> None:
    store = open_store(s3_bucket_url, moto_s3_endpoint)
    store.put_bytes("shared/c.jsonl", b"{}\n")
    store.put_bytes("shared/ds.bin", b"")
    checks = [
        DataCheck("data.train.0.path", f"{s3_bucket_url}/shared/c.jsonl"),
        DataCheck("data.train.1.path", f"{s3_bucket_url}/shared/ds", indexed=True),
        DataCheck("data.train.2.path", f"{s3_bucket_url}/shared/gone.jsonl"),
    ]
    problems = missing_data(checks, moto_s3_endpoint)
    assert [p["field"] for p in problems] == ["data.train.1.path", "data.train.2.path"], problems
    assert "ds.idx does not exist" in problems[0]["message"]
    assert "gone.jsonl' does not exist" in problems[1]["message"]


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """http://127.0.0.1:PORT of a server that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:  # the abandoned HEADs now fail at once instead of waiting out botocore
        conn.close()
    server.close()


def test_an_s3_endpoint_that_does_not_answer_is_an_error_in_bounded_time(
    silent_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    checks = [DataCheck(f"data.train.{i}.path", f"s3://bucket/c{i}.jsonl") for i in range(3)]
    start = time.monotonic()
    problems = missing_data(checks, silent_endpoint, timeout_s=1.0)
    assert time.monotonic() - start < 5
    assert [p["field"] for p in problems] == [c.field for c in checks]
    assert all("could not be checked within 1 s" in p["message"] for p in problems), problems


def test_an_s3_endpoint_that_refuses_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    problems = missing_data(
        [DataCheck("data.tokenizer.path", "s3://bucket/tok.json")], f"http://127.0.0.1:{port}"
    )
    assert [p["field"] for p in problems] == ["data.tokenizer.path"]
    assert "S3 did not answer" in problems[0]["message"], problems
