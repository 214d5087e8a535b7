"""Samples through the API: validation naming the field, the 409 of a job without checkpoints and the
404 listing the steps it has, the latest step by default, newest-first listing, the states a worker
leaves, tenancy, and the per-tenant cap on waiting samples."""

from __future__ import annotations

from api_handle import Api
from fixtures.live import add_checkpoint
from sqlalchemy import update

from megatrain.db.models import CheckpointSample
from megatrain.db.session import session_scope


def _samples(job_id: str) -> str:
    return f"/v1/jobs/{job_id}/samples"


def test_validation_no_checkpoints_and_missing_steps(api: Api) -> None:
    job_id = api.submit()["id"]
    url = _samples(job_id)
    resp = api.client.post(url, json={"prompt": "def"}, headers=api.headers)
    assert resp.status_code == 409 and "no checkpoints yet" in resp.json()["detail"]
    for step in (5, 10):
        add_checkpoint(api.settings, job_id, step)
    resp = api.client.post(url, json={"prompt": "def", "step": 7}, headers=api.headers)
    assert resp.status_code == 404 and resp.json()["detail"].endswith("its checkpoints: 5, 10")
    for body, field in (
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x" * 4001}, "prompt"),
        ({"prompt": "a", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "a", "max_new_tokens": 257}, "max_new_tokens"),
        ({"prompt": "a", "temperature": 0}, "temperature"),
        ({"prompt": "a", "top_k": -1}, "top_k"),
        ({"prompt": "a", "top_p": 1.5}, "top_p"),
        ({"prompt": "a", "seed": -3}, "seed"),
        ({"prompt": "a", "step": -1}, "step"),
        ({"prompt": "a", "temprature": 1.0}, "temprature"),
    ):
        resp = api.client.post(url, json=body, headers=api.headers)
        assert resp.status_code == 422, (body, resp.text)
        assert [e["field"] for e in resp.json()["detail"]] == [field], body
    # Another tenant's job does not exist for them.
    assert api.client.post(url, json={"prompt": "a"}, headers=api.other_headers).status_code == 404
    assert api.client.get(url, headers=api.other_headers).status_code == 404


def test_create_list_get_and_states(api: Api) -> None:
    job_id = api.submit()["id"]
    url = _samples(job_id)
    for step in (5, 10):
        add_checkpoint(api.settings, job_id, step)
    first = api.client.post(url, json={"prompt": "def add"}, headers=api.headers)
    assert first.status_code == 202, first.text
    body = first.json()
    assert (body["step"], body["status"], body["max_new_tokens"], body["text"]) == (10, "pending", 64, None)
    assert body["temperature"] is None and body["seed"] is None
    second = api.client.post(
        url,
        json={"prompt": "class", "step": 5, "max_new_tokens": 8, "temperature": 0.7, "top_k": 5, "seed": 1},
        headers=api.headers,
    ).json()
    assert (second["step"], second["max_new_tokens"], second["temperature"], second["top_k"]) == (
        5,
        8,
        0.7,
        5,
    )
    listed = api.client.get(url, headers=api.headers).json()
    assert [s["id"] for s in listed] == [second["id"], body["id"]]  # newest first
    with session_scope(api.db_url) as s:
        s.execute(
            update(CheckpointSample)
            .where(CheckpointSample.id == body["id"])
            .values(status="ready", text=" return a + b", new_tokens=6, prompt_tokens=2, elapsed_s=0.25)
        )
        s.execute(
            update(CheckpointSample)
            .where(CheckpointSample.id == second["id"])
            .values(status="failed", error="ValueError: the prompt is 40 tokens; this model reads at most 15")
        )
    got = api.client.get(f"{url}/{body['id']}", headers=api.headers).json()
    assert (got["status"], got["text"], got["new_tokens"], got["elapsed_s"]) == (
        "ready",
        " return a + b",
        6,
        0.25,
    )
    failed = api.client.get(f"{url}/{second['id']}", headers=api.headers).json()
    assert failed["status"] == "failed" and "reads at most 15" in failed["error"]
    assert api.client.get(f"{url}/smp-nope", headers=api.headers).status_code == 404
    assert api.client.get(f"{url}/{body['id']}", headers=api.other_headers).status_code == 404


def test_listing_keeps_the_last_20(api: Api) -> None:
    job_id = api.submit()["id"]
    add_checkpoint(api.settings, job_id, 3)
    ids = []
    for i in range(22):
        resp = api.client.post(_samples(job_id), json={"prompt": f"p{i}"}, headers=api.headers)
        assert resp.status_code == 202, resp.text
        ids.append(resp.json()["id"])
        with session_scope(api.db_url) as s:  # done, so the cap on waiting samples does not bite
            s.execute(update(CheckpointSample).where(CheckpointSample.id == ids[-1]).values(status="ready"))
    listed = api.client.get(_samples(job_id), headers=api.headers).json()
    assert [s["id"] for s in listed] == ids[::-1][:20]
    fewer = api.client.get(_samples(job_id), params={"limit": 3}, headers=api.headers).json()
    assert [s["id"] for s in fewer] == ids[::-1][:3]
    resp = api.client.get(_samples(job_id), params={"limit": 21}, headers=api.headers)
    assert resp.status_code == 422 and [e["field"] for e in resp.json()["detail"]] == ["limit"]


def test_per_tenant_cap_on_waiting_samples(api: Api) -> None:
    api.settings.max_pending_samples_per_tenant = 2
    jobs = [api.submit()["id"] for _ in range(2)]
    for job_id in jobs:
        add_checkpoint(api.settings, job_id, 1)
    a = api.client.post(_samples(jobs[0]), json={"prompt": "a"}, headers=api.headers)
    b = api.client.post(_samples(jobs[1]), json={"prompt": "b"}, headers=api.headers)
    assert (a.status_code, b.status_code) == (202, 202)
    # The cap counts the tenant's samples across its jobs, waiting or running.
    with session_scope(api.db_url) as s:
        s.execute(
            update(CheckpointSample).where(CheckpointSample.id == a.json()["id"]).values(status="running")
        )
    resp = api.client.post(_samples(jobs[0]), json={"prompt": "c"}, headers=api.headers)
    assert resp.status_code == 429 and "max_pending_samples_per_tenant=2" in resp.json()["detail"]
    with session_scope(api.db_url) as s:
        s.execute(
            update(CheckpointSample).where(CheckpointSample.id == a.json()["id"]).values(status="failed")
        )
    assert api.client.post(_samples(jobs[0]), json={"prompt": "c"}, headers=api.headers).status_code == 202
