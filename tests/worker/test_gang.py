"""The shards of a multi-node attempt, without engines: node rank 0 claims the job and publishes the
rendezvous, another node's shard joins it once (a redelivery does not), and a failed attempt names
and avoids the node whose shard never reported (worker.gang)."""

from __future__ import annotations

from fixtures.cluster import seed_job, seed_node
from sqlalchemy import select
from worker_helpers import job_spec

from megatrain.db.jobs import record_event, reserve_gang
from megatrain.db.models import QUEUED, RUNNING, Job, JobEvent
from megatrain.db.session import session_scope
from megatrain.settings import Settings
from megatrain.worker.attempt import end_failed_attempt
from megatrain.worker.gang import SHARD_FAILED_EVENT, Share, _await_leader, silent_shares
from megatrain.worker.shard import _claim


def test_node_rank_0_leads_and_another_node_joins_its_attempt_once(settings: Settings) -> None:
    settings = settings.model_copy(update={"rendezvous_timeout_s": 2.0, "node_address": "head.example"})
    url = settings.resolved_database_url
    a, b = seed_node(url, 2, "default", "node-a"), seed_node(url, 2, "default", "node-b")
    job_id = seed_job(url, 4, spec=job_spec(), max_retries=2)
    with session_scope(url) as s:
        assert reserve_gang(s, job_id, [(a, [0, 1]), (b, [0, 1])], "test")
    share = Share(node_rank=1, nnodes=2, attempt=1)

    lead = _claim(settings, job_id, gang=True)
    assert lead is not None and lead.rendezvous is not None
    assert (lead.num_procs, lead.devices, lead.rendezvous.nnodes) == (2, [0, 1], 2)  # its node's share
    host, port = lead.rendezvous.endpoint.split(":")
    assert host == "head.example" and int(port) > 0
    with session_scope(url) as s:
        assert s.get(Job, job_id).status == RUNNING

    follower = _await_leader(settings, job_id, share)
    assert follower is not None and follower.rendezvous is not None
    assert follower.rendezvous.endpoint == lead.rendezvous.endpoint
    assert follower.rendezvous.run_id == lead.rendezvous.run_id == f"{job_id}.1"
    assert (follower.rendezvous.node_rank, follower.num_procs) == (1, 2)
    assert follower.out_dir != lead.out_dir and (follower.out_dir / "layout.json").is_file()
    assert _await_leader(settings, job_id, share) is None  # a redelivery of the same share
    assert _await_leader(settings, job_id, Share(1, 2, attempt=0)) is None  # an older attempt's

    # Node rank 0's engine failed and node-b's shard never said why: it is named and avoided.
    assert silent_shares(settings, lead, wait_s=0) == [(b, "node-b")]
    with session_scope(url) as s:
        assert end_failed_attempt(s, lead, 1, silent_shares(settings, lead, wait_s=0))[0]
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job.status == QUEUED and job.avoid_nodes == [b]
        assert job.status_reason.endswith("; no word from the shard on node-b (avoided next time)")


def test_a_shard_that_reported_its_failure_is_not_silent(settings: Settings) -> None:
    url = settings.resolved_database_url
    a, b = seed_node(url, 2, "default", "node-a"), seed_node(url, 2, "default", "node-b")
    job_id = seed_job(url, 4, spec=job_spec(), max_retries=2)
    with session_scope(url) as s:
        assert reserve_gang(s, job_id, [(a, [0, 1]), (b, [0, 1])], "test")
    lead = _claim(settings, job_id, gang=True)
    assert lead is not None
    record = {"rank": 2, "kind": "infrastructure", "phase": "train", "at": 1.0, "exception": "RuntimeError"}
    with session_scope(url) as s:
        data = {"attempt": 1, "node_rank": 1, "node": "node-b", "rc": 1, "records": [record]}
        record_event(s, job_id, SHARD_FAILED_EVENT, "shard on node-b exited 1", data)
    assert silent_shares(settings, lead, wait_s=0) == []
    with session_scope(url) as s:
        assert end_failed_attempt(s, lead, 1, [])[0]
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job.status == QUEUED and not job.avoid_nodes
        assert "on rank 2" in job.status_reason  # node-b's record explains the attempt
        kinds = s.scalars(select(JobEvent.kind).where(JobEvent.job_id == job_id)).all()
        assert "rendezvous" in kinds
