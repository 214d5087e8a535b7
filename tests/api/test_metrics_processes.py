"""/metrics under `megatrain api --workers 2`: each process counts its own requests in files of the
run's PROMETHEUS_MULTIPROC_DIR, and a scrape answered by either process sums them all."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

REQUESTS = 40
HEALTHZ = (("method", "GET"), ("route", "/healthz"), ("status", "200"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthz_total(text: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "megatrain_http_requests_total" and tuple(sorted(s.labels.items())) == HEALTHZ:
                return s.value
    return 0.0


def _per_process(folder: Path) -> dict[str, float]:
    """Each process's own count of /healthz answers, read from its file alone."""
    counts = {}
    for path in folder.glob("counter_*.db"):
        counts[path.name] = sum(
            s.value
            for m in MultiProcessCollector.merge([str(path)])
            for s in m.samples
            if s.name == "megatrain_http_requests_total" and tuple(sorted(s.labels.items())) == HEALTHZ
        )
    return counts


@pytest.mark.slow
def test_counters_sum_over_every_api_process(tmp_path: Path) -> None:
    port, home = _free_port(), tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRAIN_")}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env["MEGATRAIN_HOME"] = str(home)
    env["TMPDIR"] = str(tmp_path)  # where the run's metrics folder is made
    cmd = [sys.executable, "-m", "megatrain.cli", "api", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "--workers", "2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/readyz", timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout and proc.stdout.read()
                time.sleep(0.2)
        (folder,) = tmp_path.glob("megatrain-api-metrics-*")
        # Requests on fresh connections from several threads, until both processes have served some
        # (the second may start listening a while after the first answers).
        sent, deadline = 0, time.monotonic() + 60

        def healthz(_: int) -> int:
            return httpx.get(f"{url}/healthz", timeout=10).status_code

        with ThreadPoolExecutor(8) as pool:
            while sent < REQUESTS or sum(1 for n in _per_process(folder).values() if n) < 2:
                assert time.monotonic() < deadline, f"one process served all {sent} requests"
                assert list(pool.map(healthz, range(8))) == [200] * 8
                sent += 8
        time.sleep(0.3)  # each is counted just after its answer is sent
        per_process = _per_process(folder)
        assert len(per_process) == 2 and all(per_process.values()), per_process  # both processes served
        assert sum(per_process.values()) == sent
        # Whichever process answers the scrape (fresh connections), it reports every process's count.
        for _ in range(6):
            scrape = httpx.get(f"{url}/metrics", timeout=10)
            assert scrape.status_code == 200
            assert _healthz_total(scrape.text) == sent
            assert "megatrain_database_up 1.0" in scrape.text  # the database's counts, once
            assert scrape.text.count("# TYPE megatrain_open_streams gauge") == 1
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert b"Started server process" in out
    assert not folder.exists()  # the run's folder goes with it
