"""POST/GET /v1/jobs: submission, validation (spec rules, pools, data paths), idempotency,
listing, cancellation. Every test runs on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pytest
import yaml
from api_handle import Api, write_corpus
from sqlalchemy import func, select

from megatrain.db.jobs import reserve_and_schedule, transition
from megatrain.db.models import RUNNING, SCHEDULED, SUCCEEDED, Job, JobEvent, Node
from megatrain.db.session import session_scope


def _fields(resp: Any) -> list[str]:
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert isinstance(detail, list) and all(set(d) == {"field", "message"} for d in detail), detail
    return [d["field"] for d in detail]


def test_create_and_get(api: Api) -> None:
    job = api.submit(api.spec("first", training={"train_iters": 30}, resources={"devices": 2, "priority": 5}))
    assert job["id"].startswith("job-") and job["status"] == "queued" and job["name"] == "first"
    assert job["num_procs"] == 2 and job["layout"]["dp"] == 2 and job["layout"]["tp"] == 1
    assert job["total_steps"] == 30 and job["priority"] == 5 and job["pool"] == "default"
    assert job["max_retries"] == 2 and job["cancel_requested"] is False
    assert (job["preemptions"], job["max_preemptions"], job["continuations"]) == (0, 10, 0)
    # The stored spec is the normalised one: defaults filled in.
    assert job["spec"]["training"]["lr"] == 3e-4 and job["spec"]["model"]["num_layers"] == 2
    got = api.client.get(f"/v1/jobs/{job['id']}", headers=api.headers)
    assert got.status_code == 200 and got.json() == job
    events = api.client.get(f"/v1/jobs/{job['id']}/events", headers=api.headers).json()
    assert [(e["kind"], e["to_status"]) for e in events] == [("queued", "queued")]
    assert events[0]["data"]["layout"]["dp"] == 2


def test_the_preemption_budget_is_the_users_and_shown_apart_from_retries(api: Api) -> None:
    job = api.submit(api.spec("budget", resources={"max_retries": 1, "max_preemptions": 3}))
    got = api.client.get(f"/v1/jobs/{job['id']}", headers=api.headers).json()
    assert (got["max_retries"], got["preemptions"], got["max_preemptions"]) == (1, 0, 3)


def test_yaml_body(api: Api) -> None:
    body = yaml.safe_dump(api.spec("from-yaml"))
    for ctype in ("application/yaml", "text/yaml; charset=utf-8"):
        resp = api.client.post("/v1/jobs", content=body, headers={**api.headers, "Content-Type": ctype})
        assert resp.status_code == 201, resp.text
        assert resp.json()["name"] == "from-yaml"
    bad = api.client.post(
        "/v1/jobs", content="name: [unclosed", headers={**api.headers, "Content-Type": "application/yaml"}
    )
    assert _fields(bad) == ["body"]
    # Aliases could expand a small document into a huge one.
    bomb = "a: &a [x, x]\nb: &b [*a, *a]\nname: t\n"
    resp = api.client.post("/v1/jobs", content=bomb, headers={**api.headers, "Content-Type": "text/yaml"})
    assert _fields(resp) == ["body"] and "alias" in resp.json()["detail"][0]["message"]


def test_list_filter_and_paginate(api: Api) -> None:
    ids = [api.submit(api.spec(f"j{i}"))["id"] for i in range(5)]
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params: dict[str, Any] = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = api.client.get("/v1/jobs", params=params, headers=api.headers).json()
        assert set(page) == {"items", "next_cursor"}
        seen += [j["id"] for j in page["items"]]
        pages += 1
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert pages == 3 and seen == ids[::-1]  # newest first, each exactly once
    # Items are summaries (the spec is most of a job's bytes) unless it is asked for; the
    # estimates made from it stay, and one job's answer always has it.
    one = api.client.get(f"/v1/jobs/{ids[0]}", headers=api.headers).json()
    summary = api.client.get("/v1/jobs", params={"limit": 1}, headers=api.headers).json()["items"][0]
    assert summary["spec"] is None and summary["params_estimate"] == one["params_estimate"] > 0
    full = api.client.get("/v1/jobs", params={"limit": 1, "include": "spec"}, headers=api.headers).json()
    assert full["items"][0]["spec"]["name"] == "j4" and one["spec"]["name"] == "j0"
    assert _fields(api.client.get("/v1/jobs", params={"include": "all"}, headers=api.headers)) == ["include"]
    api.client.post(f"/v1/jobs/{ids[1]}/cancel", headers=api.headers)
    cancelled = api.client.get("/v1/jobs", params={"status": "cancelled"}, headers=api.headers).json()
    assert [j["id"] for j in cancelled["items"]] == [ids[1]] and cancelled["next_cursor"] is None
    queued = api.client.get("/v1/jobs", params={"status": "queued"}, headers=api.headers).json()
    assert [j["id"] for j in queued["items"]] == [ids[4], ids[3], ids[2], ids[0]]
    assert _fields(api.client.get("/v1/jobs", params={"status": "done"}, headers=api.headers)) == ["status"]
    assert _fields(api.client.get("/v1/jobs", params={"cursor": "garbage!"}, headers=api.headers)) == [
        "cursor"
    ]
    assert _fields(api.client.get("/v1/jobs", params={"limit": 501}, headers=api.headers)) == ["limit"]


def test_idempotency_key(api: Api) -> None:
    headers = {**api.headers, "Idempotency-Key": "run-42"}
    first = api.client.post("/v1/jobs", json=api.spec("idem"), headers=headers)
    assert first.status_code == 201
    # Same spec, written differently (a default spelled out): the canonical spec is what counts.
    same = api.spec("idem")
    same["training"]["lr"] = 3e-4
    again = api.client.post("/v1/jobs", json=same, headers=headers)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    other = api.client.post("/v1/jobs", json=api.spec("idem", training={"lr": 1e-3}), headers=headers)
    assert other.status_code == 409 and "run-42" in other.json()["detail"]
    # Keys are per tenant: another tenant may use the same key for its own job.
    theirs = api.client.post(
        "/v1/jobs", json=api.spec("idem"), headers={**api.other_headers, "Idempotency-Key": "run-42"}
    )
    assert theirs.status_code == 201 and theirs.json()["id"] != first.json()["id"]
    # Without a key, every submission is a new job.
    assert api.submit(api.spec("idem"))["id"] != api.submit(api.spec("idem"))["id"]
    bad_key = api.client.post(
        "/v1/jobs", json=api.spec(), headers={**api.headers, "Idempotency-Key": "x" * 300}
    )
    assert _fields(bad_key) == ["idempotency-key"]


BAD_SPECS: list[tuple[str, dict[str, Any], str]] = [
    ("unknown top-level field", {"bogus": 1}, "bogus"),
    ("unknown nested field", {"model": {"flash": True}}, "model.flash"),
    ("heads not divisible by tp", {"parallelism": {"tp": 3}, "resources": {"devices": 3}},
     "model.num_attention_heads"),
    ("hidden not divisible by heads", {"model": {"hidden_size": 66}}, "model.hidden_size"),
    ("micro batch does not divide global", {"training": {"global_batch_size": 9}},
     "training.global_batch_size"),
    # An explicit layout: `parallelism: auto` is planned, and the planner picks a micro-batch that fits.
    ("micro·dp does not divide global", {"training": {"global_batch_size": 6}, "parallelism": {"dp": 2}},
     "training.global_batch_size"),
    ("seq_length zero", {"model": {"seq_length": 0}}, "model.seq_length"),
    ("seq_length negative", {"model": {"seq_length": -5}}, "model.seq_length"),
    ("lr zero", {"training": {"lr": 0}}, "training.lr"),
    ("lr negative", {"training": {"lr": -1e-4}}, "training.lr"),
    ("unknown arch", {"model": {"arch": "mamba"}}, "model.arch"),
    ("unknown tokenizer", {"data": {"tokenizer": {"type": "wordpiece"}}}, "data.tokenizer.type"),
    ("huge layer count", {"model": {"num_layers": 10**30}}, "model.num_layers"),
    ("huge batch", {"training": {"global_batch_size": 2**62}}, "training.global_batch_size"),
    ("string for an int", {"model": {"num_layers": "four"}}, "model.num_layers"),
    ("float for an int", {"training": {"train_iters": 1.5}}, "training.train_iters"),
    ("list for a section", {"training": [1, 2]}, "training"),
    ("string for a float", {"training": {"lr": "fast"}}, "training.lr"),
    ("null for a required section", {"data": None}, "data"),
    ("bad name", {"name": "../etc"}, "name"),
    ("empty data", {"data": {"train": []}}, "data.train"),
    ("bad dp", {"parallelism": {"dp": "many"}}, "parallelism.dp"),
    ("finetune without init_from", {"kind": "finetune"}, "model.init_from"),
    ("unknown pool", {"resources": {"pool": "tpu-v9", "devices": 2}}, "resources.pool"),
    ("more processes than any node",
     {"resources": {"devices": 8}, "training": {"global_batch_size": 16, "micro_batch_size": 2}},
     "resources.devices"),
    ("init_from an unknown job",
     {"kind": "finetune", "model": {"init_from": "checkpoint:job-0123456789abcdef"}}, "model.init_from"),
]  # fmt: skip


@pytest.mark.parametrize("case, change, field", BAD_SPECS, ids=[c[0] for c in BAD_SPECS])
def test_bad_spec_names_the_field(api: Api, case: str, change: dict[str, Any], field: str) -> None:
    spec = api.spec()
    for section, values in change.items():
        if isinstance(values, dict) and isinstance(spec.get(section), dict):
            spec[section] = {**spec[section], **values}
        else:
            spec[section] = values
    resp = api.client.post("/v1/jobs", json=spec, headers=api.headers)
    assert field in _fields(resp), resp.json()
    with session_scope(api.db_url) as s:
        assert s.scalar(select(func.count()).select_from(Job)) == 0


def test_init_from_other_tenants_job_is_refused(api: Api) -> None:
    theirs = api.client.post("/v1/jobs", json=api.spec("theirs"), headers=api.other_headers).json()
    mine = api.submit(api.spec("mine"))
    for job_id, ok in ((theirs["id"], False), (mine["id"], True)):
        spec = api.spec("ft", kind="finetune", model={"init_from": f"checkpoint:{job_id}@10"})
        resp = api.client.post("/v1/jobs", json=spec, headers=api.headers)
        assert resp.status_code == (201 if ok else 422), resp.text
        if not ok:
            assert _fields(resp) == ["model.init_from"]
    # A LoRA fine-tune continued from another tenant's adapters is refused the same way.
    lora = {"method": "lora", "lora": {"rank": 4}}
    for job_id, ok in ((theirs["id"], False), (mine["id"], True)):
        model = {"init_from": f"checkpoint:{mine['id']}", "adapter_from": f"checkpoint:{job_id}"}
        spec = api.spec("cont", kind="finetune", training={**api.spec()["training"], **lora}, model=model)
        resp = api.client.post("/v1/jobs", json=spec, headers=api.headers)
        assert resp.status_code == (201 if ok else 422), resp.text
        if not ok:
            assert _fields(resp) == ["model.adapter_from"]


def test_number_edge_cases_in_raw_json(api: Api) -> None:
    spec = json.dumps(api.spec())
    cases = {
        "infinity": spec.replace('"global_batch_size": 8', '"global_batch_size": 1e400'),
        "NaN": spec.replace('"train_iters": 20', '"train_iters": NaN'),
        "5000-digit integer": spec.replace('"train_iters": 20', '"train_iters": ' + "9" * 5000),
    }
    for name, body in cases.items():
        assert body != spec, name
        resp = api.client.post(
            "/v1/jobs", content=body, headers={**api.headers, "Content-Type": "application/json"}
        )
        assert resp.status_code == 422, (name, resp.text)


def _data_spec(api: Api, path: str, tokenizer: str | None = None) -> dict[str, Any]:
    spec = api.spec()
    spec["data"]["train"][0]["path"] = path
    if tokenizer is not None:
        spec["data"]["tokenizer"] = {"type": "hf", "path": tokenizer}
    return spec


def test_data_paths_outside_the_allowed_prefixes(api: Api, tmp_path: Any) -> None:
    root = api.data_root.as_uri()
    storage = api.settings.resolved_storage_url
    sibling = tmp_path / (api.data_root.name + "-evil")
    sibling.mkdir()
    link = api.data_root / "escape"
    os.symlink("/etc", link)
    bad = [
        "file:///etc/passwd",
        f"{root}/../secret.jsonl",
        f"{root}/sub/../../secret.jsonl",
        f"{root}/%2e%2e/secret.jsonl",
        f"{root}/%2E%2E%2Fsecret.jsonl",
        f"{root}/a%252e%252e/x.jsonl",
        f"{root}//x.jsonl",
        f"{root}/./x.jsonl",
        f"{root}/x.jsonl?version=2",
        f"{root}/x%00.jsonl",
        f"{sibling.as_uri()}/x.jsonl",
        f"{link.as_uri()}/passwd",
        f"{storage}/tenants/globex/x.jsonl",
        f"{storage}/tenants/acme-evil/x.jsonl",
        f"{storage}/jobs/job-0123456789abcdef/checkpoints/latest",
        "corpus.jsonl",
        str(api.data_root / "corpus.jsonl"),
        "file://localhost" + str(api.data_root / "corpus.jsonl"),
        "file:" + str(api.data_root / "corpus.jsonl"),
        "http://example.com/corpus.jsonl",
        "s3://other-bucket/corpus.jsonl",
        "FILE:///etc/passwd",
    ]
    for path in bad:
        resp = api.client.post("/v1/jobs", json=_data_spec(api, path), headers=api.headers)
        assert _fields(resp) == ["data.train.0.path"], path
    resp = api.client.post(
        "/v1/jobs",
        json=_data_spec(api, f"{root}/corpus.jsonl", tokenizer="file:///etc/tok.json"),
        headers=api.headers,
    )
    assert _fields(resp) == ["data.tokenizer.path"]
    message = resp.json()["detail"][0]["message"]
    assert "/tenants/acme/" in message and "/datasets/" in message


def test_data_paths_inside_the_allowed_prefixes(api: Api) -> None:
    storage = api.settings.resolved_storage_url
    good = [
        f"{storage}/tenants/acme/corpus.jsonl",
        f"{storage}/tenants/acme/sub/dir/corpus.jsonl.gz",
        f"{storage}/datasets/stdlib/corpus.jsonl",
        f"{api.data_root.as_uri()}/corpus.jsonl",
        f"{api.data_root.as_uri()}/with%20space.jsonl",
    ]
    tokenizer = f"{storage}/datasets/tok.json"
    for url in [*good, tokenizer]:  # submission checks that each exists
        write_corpus(Path(unquote(urlparse(url).path)))
    for path in good:
        resp = api.client.post(
            "/v1/jobs",
            json=_data_spec(api, path, tokenizer=tokenizer),
            headers=api.headers,
        )
        assert resp.status_code == 201, (path, resp.text)


def test_concurrent_idempotent_submissions_create_one_job(api: Api) -> None:
    """20 parallel POSTs with one Idempotency-Key: one 201, nineteen 200s, one row (real races on
    PostgreSQL; SQLite serialises writers, which must give the same answer)."""
    headers = {**api.headers, "Idempotency-Key": "parallel-1"}
    spec = api.spec("parallel")

    def post(_: int) -> tuple[int, str]:
        resp = api.client.post("/v1/jobs", json=spec, headers=headers)
        return resp.status_code, resp.json().get("id", resp.text)

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(post, range(20)))
    codes = sorted(code for code, _ in results)
    assert codes == [200] * 19 + [201], results
    assert len({job_id for _, job_id in results}) == 1
    with session_scope(api.db_url) as s:
        assert s.scalar(select(func.count()).select_from(Job)) == 1
        assert s.scalar(select(func.count()).select_from(JobEvent)) == 1


def _start(api: Api, job_id: str, to_running: bool) -> None:
    with session_scope(api.db_url) as s:
        node_id = s.scalar(select(Node.id))
        assert reserve_and_schedule(s, job_id, node_id, "test")
        if to_running:
            assert transition(s, job_id, RUNNING, from_statuses=(SCHEDULED,), reason="test")


def test_cancel_transitions(api: Api) -> None:
    queued = api.submit(api.spec("q"))
    resp = api.client.post(f"/v1/jobs/{queued['id']}/cancel", headers=api.headers)
    assert resp.status_code == 200 and resp.json()["status"] == "cancelled"
    assert resp.json()["finished_at"] is not None
    again = api.client.post(f"/v1/jobs/{queued['id']}/cancel", headers=api.headers)
    assert again.status_code == 409 and f"job {queued['id']} was already cancelled;" in again.json()["detail"]

    for to_running, state in ((False, "scheduled"), (True, "running")):
        job = api.submit(api.spec(state, resources={"devices": 1}))
        _start(api, job["id"], to_running)
        resp = api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.headers)
        body = resp.json()
        assert resp.status_code == 200 and body["status"] == state and body["cancel_requested"] is True
        # Asking twice is fine and records one event.
        assert api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.headers).status_code == 200
        kinds = [
            e["kind"] for e in api.client.get(f"/v1/jobs/{job['id']}/events", headers=api.headers).json()
        ]
        assert kinds.count("cancel_requested") == 1 and kinds[-1] == "cancel_requested"

    done = api.submit(api.spec("done", resources={"devices": 1}))
    _start(api, done["id"], True)
    with session_scope(api.db_url) as s:
        assert transition(s, done["id"], SUCCEEDED, from_statuses=(RUNNING,), reason="test")
    resp = api.client.post(f"/v1/jobs/{done['id']}/cancel", headers=api.headers)
    assert resp.status_code == 409 and "succeeded" in resp.json()["detail"]
