"""Multi-node attempts as the control plane keeps them: node rank 0 leads (publishes the rendezvous
endpoint of its claimed attempt), the other shards join it once, a shard whose engine failed reports
its records and ends the attempt, and node rank 0 learns which shards never reported. The runners'
side is megatrain.worker.gang."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from megatrain.attempts.ending import end_failed_attempt
from megatrain.attempts.model import Attempt, Rendezvous
from megatrain.attempts.secrets import job_secrets
from megatrain.db.jobs import record_event
from megatrain.db.models import RUNNING, SCHEDULED, Job, JobAllocation, JobEvent, Node, NodePool
from megatrain.secrets_box import SecretsUnavailable
from megatrain.settings import Settings

RENDEZVOUS_EVENT = "rendezvous"
SHARD_FAILED_EVENT = "shard_failed"
SHARD_JOINED_EVENT = "shard_joined"


@dataclass(frozen=True)
class Share:
    """One node's part of a multi-node attempt, as the executor's task names it."""

    node_rank: int
    nnodes: int
    attempt: int


def run_id(job_id: str, attempt: int) -> str:
    """torchrun's --rdzv-id of an attempt."""
    return f"{job_id}.{attempt}"


def _share_row(s: Session, job_id: str, node_rank: int) -> Any:
    """(slots, devices, accelerator) of the job's share on its node_rank'th node; None if gone."""
    return s.execute(
        select(JobAllocation.slots, JobAllocation.devices, NodePool.accelerator)
        .join(Node, Node.id == JobAllocation.node_id)
        .join(NodePool, NodePool.id == Node.pool_id)
        .where(JobAllocation.job_id == job_id, JobAllocation.node_rank == node_rank)
    ).first()


def lead(s: Session, settings: Settings, att: Attempt, endpoint: str) -> None:
    """Make `att` (just claimed by node rank 0's shard, in session `s`) this node's share of the
    gang and publish `endpoint` (HOST:PORT), where the other shards meet it. A repeated claim (its
    first answer was lost) keeps the endpoint published first."""
    count = len(s.scalars(select(JobAllocation.id).where(JobAllocation.job_id == att.job_id)).all())
    share = _share_row(s, att.job_id, 0)
    if count < 2 or share is None:
        raise RuntimeError(f"job {att.job_id} has no gang allocation to run")
    published = _events(s, att.job_id, RENDEZVOUS_EVENT, att.attempt)
    if published:
        endpoint = published[-1]["endpoint"]
    rdzv = Rendezvous(0, count, endpoint, run_id(att.job_id, att.attempt), settings.rendezvous_timeout_s)
    att.num_procs, att.devices, att.rendezvous = share.slots, share.devices, rdzv
    if not published:
        data = {"attempt": att.attempt, "endpoint": endpoint, "run_id": rdzv.run_id, "nnodes": count}
        text = f"attempt {att.attempt}: shards meet at {endpoint}"
        record_event(s, att.job_id, RENDEZVOUS_EVENT, text, data)


def _events(s: Session, job_id: str, kind: str, attempt: int) -> list[dict[str, Any]]:
    rows = s.scalars(select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == kind))
    return [d for d in rows if isinstance(d, dict) and d.get("attempt") == attempt]


def shard_records(s: Session, job_id: str, attempt: int) -> list[dict[str, Any]]:
    """The failure records every shard of the attempt reported (their ranks' failure.rank{R}.json)."""
    return [r for d in _events(s, job_id, SHARD_FAILED_EVENT, attempt) for r in d.get("records") or ()]


def silent_now(s: Session, job_id: str, attempt: int) -> list[tuple[str, str]] | None:
    """(node id, hostname) of the attempt's other shards that have not reported their end; None
    once the attempt has ended (a shard ended it)."""
    job = s.execute(select(Job.status, Job.attempt).where(Job.id == job_id)).first()
    if job is None or job.status != RUNNING or job.attempt != attempt:
        return None
    reported = {d.get("node_rank") for d in _events(s, job_id, SHARD_FAILED_EVENT, attempt)}
    rows = s.execute(
        select(JobAllocation.node_rank, Node.id, Node.hostname)
        .join(Node, Node.id == JobAllocation.node_id)
        .where(JobAllocation.job_id == job_id, JobAllocation.node_rank > 0)
    ).all()
    return [(r.id, r.hostname) for r in rows if r.node_rank not in reported]


def join(
    s: Session, settings: Settings, job_id: str, share: Share, node: str, node_id: str | None = None
) -> dict[str, Any]:
    """A follower shard's turn: {"state": "wait"} until node rank 0 runs the attempt, {"state":
    "gone"} when the attempt is over (or never ran), or this share was joined already (a
    redelivery), else {"state": "go", "attempt": its Attempt.to_wire, "spec", "layout"}."""
    job = s.get(Job, job_id)
    if job is None or job.attempt != share.attempt or job.status not in (SCHEDULED, RUNNING):
        return {"state": "gone"}
    published = _events(s, job_id, RENDEZVOUS_EVENT, share.attempt)
    row = _share_row(s, job_id, share.node_rank)
    joined = _events(s, job_id, SHARD_JOINED_EVENT, share.attempt)
    if row is None or any(d.get("node_rank") == share.node_rank for d in joined):
        # A redelivery (its worker died mid-attempt): joining a rendezvous that is complete would
        # restart the others' ranks; the attempt ends without it.
        return {"state": "gone"}
    if job.status != RUNNING or not published:
        return {"state": "wait"}
    try:
        secret_env = job_secrets(s, settings, job)
    except SecretsUnavailable:
        return {"state": "gone"}  # node rank 0 fails the job, naming why
    data = {"attempt": share.attempt, "node_rank": share.node_rank, "node": node}
    text = f"node {node} joins attempt {share.attempt} as node rank {share.node_rank}"
    record_event(s, job_id, SHARD_JOINED_EVENT, text, data)
    from megatrain.attempts.reports import cursor

    cursor(s, job_id, share.attempt, share.node_rank, node_id)
    spec_runtime = (job.spec.get("resources") or {}).get("max_runtime_s") or 86400
    rdzv = Rendezvous(
        share.node_rank,
        share.nnodes,
        published[-1]["endpoint"],
        run_id(job_id, share.attempt),
        settings.rendezvous_timeout_s,
    )
    att = Attempt(
        job_id,
        share.attempt,
        job.max_retries,
        row.slots,
        float(spec_runtime),
        out_dir=None,  # type: ignore[arg-type]  # the node's folder: the shard sets it
        devices=row.devices,
        accelerator=row.accelerator or "cpu",
        rendezvous=rdzv,
        preemptions=job.preemptions,
        continuations=job.continuations,
        secret_env=secret_env,
    )
    return {"state": "go", "attempt": att.to_wire(), "spec": job.spec, "layout": job.layout}


def shard_failed(
    s: Session, att: Attempt, rc: int, node: str, node_rank: int, records: list[dict[str, Any]]
) -> None:
    """A follower's engine failed: record its ranks' failure records (a 'shard_failed' event) and end
    the attempt (guarded: if node rank 0 already did, nothing changes)."""
    job = s.scalars(select(Job).where(Job.id == att.job_id).with_for_update()).first()
    if job is None or job.status != RUNNING or job.attempt != att.attempt:
        return
    if job.preempt_for is not None:
        return  # preempted: its ranks stopped with node rank 0's, which requeues the job
    data = {"attempt": att.attempt, "node": node, "node_rank": node_rank, "rc": rc, "records": records}
    record_event(s, att.job_id, SHARD_FAILED_EVENT, f"shard on {node} exited {rc}", data)
    s.flush()
    # It reads every shard's reported records, this one's included.
    end_failed_attempt(s, att, rc, node=node, records=[])
