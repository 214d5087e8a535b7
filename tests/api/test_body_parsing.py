"""Hostile request bodies: bounded in depth, size and aliases, and parsed off the event loop so that
other requests are answered meanwhile."""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest
from api_handle import Api
from fixtures.live import LiveApi

from megatrain.api.jobs.service import MAX_BODY_DEPTH, MAX_BODY_NODES

YAML = {"Content-Type": "application/yaml"}


@pytest.mark.parametrize(
    ("body", "ctype", "message"),
    [
        ("a: " + "[" * 40 + "]" * 40, "application/yaml", f"nested deeper than {MAX_BODY_DEPTH}"),
        ('{"a": ' + "[" * 40 + "]" * 40 + "}", "application/json", f"nested deeper than {MAX_BODY_DEPTH}"),
        ("a: [" + "1," * MAX_BODY_NODES + "1]", "application/yaml", "more than"),
        ("[" + "1," * MAX_BODY_NODES + "1]", "application/json", "more than"),
        ("a: &x [1, 2]\nb: *x\n", "application/yaml", "aliases"),
        ("n: " + "9" * 5000, "application/yaml", "not valid YAML"),
    ],
    ids=["yaml-deep", "json-deep", "yaml-many", "json-many", "yaml-alias", "yaml-huge-int"],
)
def test_hostile_bodies_are_422s_naming_the_bound(api: Api, body: str, ctype: str, message: str) -> None:
    resp = api.client.post("/v1/jobs", content=body, headers={**api.headers, "Content-Type": ctype})
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"][0]
    assert detail["field"] == "body" and message in detail["message"]


def test_healthz_answers_while_the_slowest_body_is_parsed(live_api: LiveApi) -> None:
    # The slowest body the bounds let through: just under MAX_BODY_NODES values (a spec has ~100).
    body = "".join(f"k{i}: v\n" for i in range(MAX_BODY_NODES - 100)).encode()
    headers = {"Authorization": f"Bearer {live_api.key}", **YAML}
    done = threading.Event()
    answers: list[int] = []

    def flood() -> None:
        with httpx.Client(base_url=live_api.url, headers=headers, timeout=60) as client:
            for _ in range(6):
                answers.append(client.post("/v1/jobs", content=body).status_code)
        done.set()

    def probe(client: httpx.Client) -> float:
        start = time.perf_counter()
        assert client.get("/healthz").status_code == 200
        return time.perf_counter() - start

    latencies = []
    with httpx.Client(base_url=live_api.url, timeout=30) as client:
        # The same probe with nothing else to do: on a busy shared machine both figures grow alike.
        idle = statistics.median(probe(client) for _ in range(20))
        thread = threading.Thread(target=flood, daemon=True)
        thread.start()
        while not done.is_set():
            latencies.append(probe(client))
            time.sleep(0.01)
    thread.join()
    assert answers == [422] * 6  # parsed, then refused by the spec's rules (unknown fields)
    assert len(latencies) >= 5
    # Parsed on the event loop, each body held every probe for its ~0.9 s (median ~0.4 s).
    assert statistics.median(latencies) < max(0.1, 3 * idle), (idle, latencies)
