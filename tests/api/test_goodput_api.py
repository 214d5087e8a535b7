"""The goodput ledger and quarantine through the API: GET /v1/jobs/{id} answers `goodput` (its
ended attempts' productive seconds and each loss), GET /v1/cluster each node's goodput and a
quarantined node as such, its slots not offered."""

from __future__ import annotations

from api_handle import Api
from sqlalchemy import select, update

from megatrain.db.goodput import record_attempt
from megatrain.db.models import QUARANTINED, Job, Node
from megatrain.db.session import session_scope


def test_job_and_node_goodput_and_a_quarantined_node(api: Api) -> None:
    job_id = api.submit()["id"]
    with session_scope(api.db_url) as s:
        node = s.scalars(select(Node)).first()
        assert node is not None
        node_id, hostname = node.id, node.hostname
        fresh = api.client.get(f"/v1/jobs/{job_id}", headers=api.headers).json()
        assert fresh["goodput"] is None  # until an attempt ends
        loss = {"queued_s": 5, "restart_s": 0, "checkpoint_stall_s": 1, "hang_s": 30}
        record_attempt(s, job_id, node_id, 1, "queued", "hung", loss | {"productive_s": 60})
        second = {"productive_s": 100, "restart_s": 4, "eval_s": 7}
        record_attempt(s, job_id, node_id, 2, "succeeded", None, second)
        s.execute(update(Job).where(Job.id == job_id).values(attempt=2))  # as its runners claimed them
        s.execute(
            update(Node).where(Node.id == node_id).values(status=QUARANTINED, quarantine_reason="3 failures")
        )

    got = api.client.get(f"/v1/jobs/{job_id}", headers=api.headers).json()["goodput"]
    assert got == {
        "productive_s": 160.0,
        "queued_s": 5.0,
        "restart_s": 4.0,
        "checkpoint_stall_s": 1.0,
        "hang_s": 30.0,
        "preempt_s": 0.0,
        "eval_s": 7.0,
        "attempts": 2,
        "goodput": round(160 / 207, 4),
    }
    view = api.client.get("/v1/cluster", headers=api.other_headers).json()
    (pool,) = [p for p in view["pools"] if any(n["hostname"] == hostname for n in p["nodes"])]
    (row,) = [n for n in pool["nodes"] if n["hostname"] == hostname]
    assert row["status"] == QUARANTINED and row["quarantine_reason"] == "3 failures"
    assert row["goodput"] == got  # only this job ran there
    assert pool["nodes_quarantined"] == 1 and pool["nodes_lost"] == 0 and pool["slots_total"] == 0
