"""The HTTP server's bounds, against a real server over raw sockets: oversized and over-many headers,
slow heads and bodies are refused without delaying anyone else; long responses (live streams) are
not cut; past the concurrency limit, a 503. Plus capped validation errors and quiet disconnects."""

from __future__ import annotations

import logging
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from api_handle import Api
from fixtures.live import LiveApi, start_live_api

from megatrain.api.errors import MAX_ERRORS

TIMEOUT_S = 1.0


@pytest.fixture
def server(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveApi]:
    monkeypatch.setenv("MEGATRAIN_HTTP_HEADER_TIMEOUT_S", str(TIMEOUT_S))
    monkeypatch.setenv("MEGATRAIN_HTTP_BODY_TIMEOUT_S", str(TIMEOUT_S))
    yield from start_live_api(tmp_path, monkeypatch, with_scheduler=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _connect(live: LiveApi) -> socket.socket:
    host, port = live.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def _healthz_during(live: LiveApi, busy: threading.Event) -> list[float]:
    latencies: list[float] = []
    with httpx.Client(base_url=live.url, timeout=10) as client:
        while busy.is_set() or len(latencies) < 10:
            start = time.perf_counter()
            assert client.get("/healthz").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)
    return latencies


def _resident() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_64_mb_header_is_refused_with_431_without_delaying_others(server: LiveApi) -> None:
    before = _resident()
    sock = _connect(server)
    sent = 0
    busy = threading.Event()
    busy.set()
    probes: list[float] = []
    prober = threading.Thread(target=lambda: probes.extend(_healthz_during(server, busy)))
    prober.start()
    try:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
        chunk = b"a" * 65536
        for _ in range(1024):  # 64 MiB, unless the server shuts the door first
            sock.sendall(chunk)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass
    answer = _answer(sock)
    busy.clear()
    prober.join()
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"request headers exceed 16384 bytes" in answer
    # The server (in this process) dropped what it read past the limit instead of buffering it.
    assert _resident() - before < 32 << 20, (_resident() - before) >> 20
    assert probes and statistics.median(probes) < 0.1, probes


def test_too_many_header_fields_are_a_431(server: LiveApi) -> None:
    sock = _connect(server)
    fields = b"".join(b"X-H%d: v\r\n" % i for i in range(150))
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
    answer = _answer(sock)
    assert answer.startswith(b"HTTP/1.1 431 ") and b"more than 100 request header fields" in answer


def test_slow_heads_and_silent_connections_are_closed_with_408(server: LiveApi) -> None:
    slow, silent = _connect(server), _connect(server)
    start = time.monotonic()
    slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # ... and the rest never comes
    answers = [_answer(slow), _answer(silent)]
    waited = time.monotonic() - start
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 408 ") and b"not received within 1 s" in answer
    assert TIMEOUT_S <= waited < TIMEOUT_S + 3
    # Prompt requests on the same server are untouched, keep-alive included.
    with httpx.Client(base_url=server.url) as client:
        assert [client.get("/healthz").status_code for _ in range(3)] == [200] * 3


def test_a_stalled_body_is_a_408(server: LiveApi) -> None:
    sock = _connect(server)
    head = (
        f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.key}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    sock.sendall(head.encode() + b'{"name": "slo')  # 13 of 1000 bytes, then nothing
    start = time.monotonic()
    answer = _answer(sock)
    assert answer.startswith(b"HTTP/1.1 408 ") and b"request body not received within 1 s" in answer
    assert time.monotonic() - start < TIMEOUT_S + 3


def test_a_body_trickling_after_the_answer_is_cut_off(server: LiveApi) -> None:
    sock = _connect(server)
    # No key: the answer (401) comes before the body is read; the client keeps trickling it.
    head = "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
    sock.sendall(head.encode())
    start, answer = time.monotonic(), b""
    sock.settimeout(0.2)
    while time.monotonic() - start < 10:
        try:
            sock.sendall(b" ")
            chunk = sock.recv(65536)
        except (TimeoutError, BlockingIOError):
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
        if not chunk:
            break
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 401 ")
    assert time.monotonic() - start < TIMEOUT_S + 3  # closed at the body deadline, not kept alive


def test_the_open_file_limit_is_raised() -> None:
    import resource

    from megatrain.api.server import raise_open_file_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        if hard != resource.RLIM_INFINITY and hard > 256:
            resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        assert raise_open_file_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= min(soft, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_live_stream_outlives_every_timeout(server: LiveApi) -> None:
    headers = {"Authorization": f"Bearer {server.key}"}
    job_id = httpx.post(f"{server.url}/v1/jobs", json=server.spec(), headers=headers).json()["id"]
    with (
        httpx.Client(base_url=server.url, headers=headers, timeout=30) as client,
        client.stream("GET", f"/v1/jobs/{job_id}/logs?follow=true") as stream,
    ):
        assert stream.status_code == 200
        time.sleep(3 * TIMEOUT_S)  # longer than the head, body and keep-alive timeouts
        assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
        text = stream.read().decode()
    assert text.rstrip().endswith('data: {"status":"cancelled"}'), text


def test_past_the_concurrency_limit_a_503_but_probes_answer(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEGATRAIN_HTTP_MAX_CONCURRENCY", "3")
    monkeypatch.setenv("MEGATRAIN_HTTP_FIRST_BYTE_TIMEOUT_S", "1")
    live_gen = start_live_api(tmp_path, monkeypatch, with_scheduler=False)
    live = next(live_gen)
    try:
        held = [_connect(live) for _ in range(3)]  # three open connections that send nothing
        with httpx.Client(base_url=live.url, timeout=10) as client:
            assert client.get("/v1/jobs").status_code == 503
            # The probes still answer: a full API is not a dead one (nothing to restart).
            assert client.get("/healthz").status_code == 200
            assert client.get("/readyz").status_code == 200
        # The silent ones are closed after the first-byte timeout, without an answer: room again.
        started = time.monotonic()
        assert [_answer(sock) for sock in held] == [b""] * 3
        assert time.monotonic() - started < 5
        deadline = time.monotonic() + 10
        while True:
            with httpx.Client(base_url=live.url, timeout=10) as client:
                if client.get("/v1/jobs").status_code == 401:  # served (no key): not 503
                    break
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        next(live_gen, None)


def test_validation_errors_are_capped_in_count_and_size(api: Api) -> None:
    spec = api.spec()
    spec["training"].update({f"unknown_{i}": "x" * 250 for i in range(200)})
    resp = api.client.post("/v1/jobs", json=spec, headers=api.headers)
    assert resp.status_code == 422
    detail = resp.json()["detail"]
    assert len(detail) == MAX_ERRORS + 1
    assert detail[-1] == {"field": "request", "message": f"and {200 - MAX_ERRORS} more errors"}
    assert len(resp.content) < 20 * 1024  # not an echo of the 52 KB body
    assert all(len(e["message"]) <= 500 for e in detail)


def test_a_client_that_leaves_mid_body_is_an_info_line(
    server: LiveApi, caplog: pytest.LogCaptureFixture
) -> None:
    sock = _connect(server)
    head = (
        f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.key}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    with caplog.at_level(logging.INFO):
        sock.sendall(head.encode() + b'{"name": ')
        time.sleep(0.2)
        sock.close()
        time.sleep(0.5)
    assert any("client left during POST /v1/jobs" in r.getMessage() for r in caplog.records), caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_megatrain_api_serves_from_several_processes_with_the_limits(tmp_path: Path) -> None:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRAIN_")}
    env["MEGATRAIN_HOME"] = str(tmp_path / "home")
    cmd = [
        sys.executable,
        "-m",
        "megatrain.cli",
        "api",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "2",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout and proc.stdout.read()
                time.sleep(0.2)
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000 + b"\r\n\r\n")
        assert _answer(sock).startswith(b"HTTP/1.1 431 ")
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert out.count("Started server process") == 2, out  # two API processes behind one socket


def test_a_stopping_server_does_not_wait_for_live_streams(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatrain.cli.server import EmbeddedStack
    from megatrain.settings import get_settings, reset_settings_cache

    monkeypatch.setenv("MEGATRAIN_HTTP_SHUTDOWN_TIMEOUT_S", "1")
    monkeypatch.setenv("MEGATRAIN_CPU_SLOTS", "2")
    monkeypatch.setenv("MEGATRAIN_ALLOWED_DATA_ROOTS", tmp_path.as_uri())
    reset_settings_cache()
    settings = get_settings()
    key = EmbeddedStack.prepare(settings)
    stack = EmbeddedStack(settings, "127.0.0.1", _free_port(), log_level="warning")
    stack.start_in_background(scheduler=False)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "x"}\n')
    spec = {"name": "s", "data": {"train": [{"path": corpus.as_uri()}]}, "resources": {"devices": 1}}
    headers = {"Authorization": f"Bearer {key}"}
    job_id = httpx.post(f"{stack.url}/v1/jobs", json=spec, headers=headers, timeout=30).json()["id"]
    streamed = threading.Event()

    ended: list[str] = []

    def follow() -> None:
        url = f"{stack.url}/v1/jobs/{job_id}/logs?follow=true"
        try:
            with httpx.stream("GET", url, headers=headers, timeout=60) as r:
                for _ in r.iter_bytes():
                    streamed.set()
        except httpx.HTTPError as exc:  # the server cut the stream: a client reconnects elsewhere
            ended.append(type(exc).__name__)

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    assert streamed.wait(10)
    start = time.monotonic()
    stack.stop(timeout_s=30)
    assert not stack._threads[-1].is_alive(), "the server still waits for the stream"
    assert time.monotonic() - start < 5
    reader.join(5)
    assert not reader.is_alive() and ended == ["RemoteProtocolError"]  # the client saw it end


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("trusted", [False, True])
def test_one_clients_connections_are_capped_but_probes_and_trusted_proxies_pass(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trusted: bool
) -> None:
    monkeypatch.setenv("MEGATRAIN_HTTP_MAX_CONNECTIONS_PER_CLIENT", "3")
    monkeypatch.setenv("MEGATRAIN_HTTP_FIRST_BYTE_TIMEOUT_S", "2")
    if trusted:  # a load balancer on loopback: its connections carry many clients
        monkeypatch.setenv("MEGATRAIN_HTTP_TRUSTED_PROXIES", "10.0.0.0/8, 127.0.0.1")
    live_gen = start_live_api(tmp_path, monkeypatch, with_scheduler=False)
    live = next(live_gen)
    try:
        held = [_connect(live) for _ in range(3)]  # the client's three places, silent
        with httpx.Client(base_url=live.url, timeout=10) as client:
            over = client.get("/v1/jobs")
            assert over.status_code == (401 if trusted else 429), over.text
            if not trusted:
                assert "more than 3 open connections from 127.0.0.1" in over.text
        with httpx.Client(base_url=live.url, timeout=10) as client:
            assert client.get("/healthz").status_code == 200  # a probe answers past the cap
            assert client.get("/readyz").status_code == 200
        assert [_answer(sock) for sock in held] == [b""] * 3  # closed at the first-byte timeout
        with httpx.Client(base_url=live.url, timeout=10) as client:
            assert client.get("/v1/jobs").status_code == 401  # its places are back
    finally:
        next(live_gen, None)
