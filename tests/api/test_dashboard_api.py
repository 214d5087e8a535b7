"""What the dashboard asks of the API: downsampled metrics, log tails, the cluster view, parameter
estimates, and no other tenant's job ids in anything a tenant reads."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from api_handle import Api

from megatrain.api.jobs.downsample import minmax_indices
from megatrain.db.jobs import reserve_and_schedule
from megatrain.db.models import JobLog, JobMetric, Node
from megatrain.db.session import session_scope
from megatrain.plan.shapes import spec_param_counts
from megatrain.spec import parse_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_minmax_indices_keeps_spikes_and_ends() -> None:
    values = [math.sin(i / 50) for i in range(10_000)]
    values[4321] = 99.0  # a spike
    values[7777] = -99.0  # a dip
    kept = minmax_indices(values, 200)
    assert len(kept) <= 200
    assert kept == sorted(set(kept))
    assert {0, 9_999, 4321, 7777} <= set(kept)
    assert minmax_indices(values[:50], 200) == list(range(50))
    none_bucket = [None] * 1000
    assert minmax_indices(none_bucket, 100)[:2] == [0, 1]
    with pytest.raises(ValueError, match="max_points"):
        minmax_indices(values, 5)


def _add_rows(api: Api, job_id: str, n: int, spike_at: int) -> None:
    with session_scope(api.db_url) as s:
        rows = []
        for step in range(1, n + 1):
            loss = 50.0 if step == spike_at else 5.0 - step / n
            rows.append({"job_id": job_id, "kind": "train", "step": step, "loss": loss,
                         "data": {"step": step, "loss": loss, "lr": 1e-3}})  # fmt: skip
        for step in range(100, n + 1, 100):
            rows.append({"job_id": job_id, "kind": "val", "step": step, "loss": 4.0,
                         "data": {"step": step, "val_loss": 4.0}})  # fmt: skip
        s.execute(JobMetric.__table__.insert(), rows)


def test_metrics_max_points(api: Api) -> None:
    job_id = api.submit()["id"]
    _add_rows(api, job_id, 5000, spike_at=2345)
    resp = api.client.get(f"/v1/jobs/{job_id}/metrics?max_points=100", headers=api.headers)
    assert resp.status_code == 200
    assert resp.headers["X-Total-Rows"] == str(5000 + 50)
    rows = resp.json()
    train = [r for r in rows if r["kind"] == "train"]
    val = [r for r in rows if r["kind"] == "val"]
    assert 50 <= len(train) <= 100 and len(val) == 50
    steps = [r["step"] for r in train]
    assert steps == sorted(steps) and steps[0] == 1 and steps[-1] == 5000
    assert 2345 in steps and max(r["loss"] for r in train) == 50.0
    assert train[0] == {"step": 1, "loss": 5.0 - 1 / 5000, "lr": 1e-3, "kind": "train"}
    # Combined with since_step and kind; nothing to thin: all rows.
    tail = api.client.get(
        f"/v1/jobs/{job_id}/metrics?max_points=100&since_step=4950&kind=train", headers=api.headers
    ).json()
    assert [r["step"] for r in tail] == list(range(4951, 5001))
    bad = api.client.get(f"/v1/jobs/{job_id}/metrics?max_points=3", headers=api.headers)
    assert bad.status_code == 422 and bad.json()["detail"][0]["field"] == "max_points"
    other = api.client.get(f"/v1/jobs/{job_id}/metrics?max_points=100", headers=api.other_headers)
    assert other.status_code == 404


def test_log_tail(api: Api) -> None:
    job_id = api.submit()["id"]
    with session_scope(api.db_url) as s:
        s.add_all(JobLog(job_id=job_id, seq=i, line=f"line {i}") for i in range(1, 31))
    tail = api.client.get(f"/v1/jobs/{job_id}/logs?tail=5", headers=api.headers).json()
    assert [r["seq"] for r in tail] == [26, 27, 28, 29, 30]
    assert tail[-1]["line"] == "line 30"


def test_params_estimate_in_job(api: Api) -> None:
    job = api.submit()
    # 2 layers, hidden 64, 4 heads, llama (SwiGLU ffn 192), byte vocab padded to 384, untied head.
    h, ffn, vocab = 64, 192, 384
    expected = 2 * (4 * h * h + 3 * h * ffn + 2 * h) + 2 * vocab * h + h
    assert job["params_estimate"] == job["params_active_estimate"] == expected
    hf = api.spec("hf")
    hf["data"]["tokenizer"] = {"type": "hf", "path": "file:///t/tokenizer.json"}
    assert spec_param_counts(parse_spec(hf)) is None  # the vocabulary is the tokenizer file's


def test_a_lora_jobs_estimate_says_what_it_trains(api: Api) -> None:
    spec = api.spec("lora")
    spec["training"] = {**spec.get("training", {}), "method": "lora", "lora": {"rank": 8, "targets": ["qkv"]}}
    job = api.submit(spec)
    # qkv of 2 layers: 3 parts (q, k, v) of A (8 × 64) and B (64·3 rows × 8) on each.
    assert job["params_trainable_estimate"] == 2 * 8 * (3 * 64 + 3 * 64)
    assert api.submit(api.spec("full"))["params_trainable_estimate"] is None


def test_an_moe_jobs_estimate_counts_its_experts(api: Api) -> None:
    # issue 28: a second formula here ignored the experts (836,736 of examples/moe.yaml's 1,784,960).
    example = yaml.safe_load((EXAMPLES / "moe.yaml").read_text())
    spec = api.spec("moe", model=example["model"])
    job = api.submit(spec)
    counts = spec_param_counts(parse_spec(spec))
    assert counts == {"total": 1_784_960, "active": 973_952}
    assert (job["params_estimate"], job["params_active_estimate"]) == (1_784_960, 973_952)
    plan = api.client.post("/v1/plan", json={"spec": spec}, headers=api.headers)
    assert plan.status_code == 200, plan.text
    assert plan.json()["parameters"] == counts  # the planner's count is the same formula's


def test_params_estimate_matches_the_engine() -> None:
    pytest.importorskip("torch")
    from megatrain.engine.config import transformer_config
    from megatrain.engine.models.gpt import GPTModel

    for model in (
        {"arch": "llama", "num_query_groups": 2},
        {"arch": "gpt2"},
        {"arch": "llama", "tie_embeddings": True, "vocab_size": 1000},
        {
            "arch": "llama",
            "moe": {
                "num_experts": 4,
                "router_topk": 2,
                "ffn_hidden_size": 96,
                "shared_expert_ffn_hidden_size": 64,
                "layer_freq": 2,
            },
        },
    ):
        spec = parse_spec({"name": "x", "data": {"train": [{"path": "file:///d.jsonl"}]},
                           "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                     "seq_length": 32, **model}})  # fmt: skip
        exact = sum(p.numel() for p in GPTModel(transformer_config(spec, 257)).parameters())
        counts = spec_param_counts(spec)
        assert counts is not None and counts["total"] == exact, model


def test_cluster_view(api: Api) -> None:
    mine_running = api.submit(api.spec("mine-running", resources={"devices": 2}))["id"]
    theirs_running = api.client.post(
        "/v1/jobs", json=api.spec("theirs-running", resources={"devices": 2}), headers=api.other_headers
    ).json()["id"]
    with session_scope(api.db_url) as s:
        node_id = s.query(Node.id).scalar()
        assert reserve_and_schedule(s, mine_running, node_id)
        assert reserve_and_schedule(s, theirs_running, node_id)
    theirs_queued = api.client.post(
        "/v1/jobs",
        json=api.spec("theirs-q", resources={"devices": 2, "priority": 5}),
        headers=api.other_headers,
    ).json()["id"]
    mine_queued = api.submit(api.spec("mine-q", resources={"devices": 1}))["id"]

    resp = api.client.get("/v1/cluster", headers=api.headers)
    assert resp.status_code == 200
    body = resp.json()
    (pool,) = body["pools"]
    assert (pool["slots_total"], pool["slots_used"], pool["slots_free"]) == (4, 4, 0)
    assert pool["slot_kind"] == "CPU slots"
    jobs_on_node = pool["nodes"][0]["jobs"]
    assert {"own": True, "status": "scheduled", "slots": 2, "id": mine_running, "name": "mine-running"} in (
        jobs_on_node
    )
    assert {"own": False, "status": "scheduled", "slots": 2} in jobs_on_node
    first, second = body["queue"]
    assert first == {k: first[k] for k in first} and first["own"] is False and "id" not in first
    assert first["priority"] == 5 and first["reason"].startswith("needs 2 free slots")
    assert second["id"] == mine_queued and second["position"] == 2
    assert second["reason"].startswith("behind another tenant's job (#1 in the queue)")
    # the reason as data too, with the blocking job named by its place in the queue only
    # running jobs end by their max_runtime_s (a day by default): the head's start is estimated
    assert 86000 < first["wait"].pop("starts_in_s") <= 86400
    assert first["wait"] == {"code": "no_free_slots", "pool": "default", "needs": 2, "freest": 0}
    assert second["wait"].pop("runtime_s") == 86400  # it would end after the head's estimated start
    assert 86000 < second["wait"].pop("starts_in_s") <= 86400
    assert second["wait"] == {"code": "behind_job", "pool": "default", "blocker_position": 1}
    # its owner sees the same decision with the id
    theirs_view = api.client.get("/v1/cluster", headers=api.other_headers).json()["queue"]
    assert {k: v for k, v in theirs_view[1]["wait"].items() if k not in ("runtime_s", "starts_in_s")} == {
        "code": "behind_job", "pool": "default", "job_id": theirs_queued,
    }  # fmt: skip
    assert mine_queued not in str(theirs_view)
    text = resp.text
    assert theirs_queued not in text and theirs_running not in text and "theirs" not in text
    assert api.client.get("/v1/cluster").status_code == 401
