"""How an attempt ends, decided by the control plane: a failed one is retried (running → queued,
resumed from the latest checkpoint) or ends the job (→ failed) by its failure records, for a
single-node attempt and for every shard of a gang, naming the nodes to avoid next time; a preempted
one, or one stopped at its allocation's time limit, is queued again without counting as a failure.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from megatrain.attempts.model import Attempt
from megatrain.db.jobs import retry_allowed, transition
from megatrain.db.models import FAILED, QUEUED, RUNNING, Job
from megatrain.failures import NOT_RETRIED, attempt_reason, event_data, pick, read_records
from megatrain.job_states import PAUSE_REQUEST

MAX_REASON_CHARS = 4000
"""A job event's reason is cut to this (the tail of an engine's traceback can be long)."""


def end_failed_attempt(
    s: Session,
    att: Attempt,
    rc: int,
    silent: list[tuple[str, str]] | None = None,
    node: str | None = None,
    records: list[dict[str, Any]] | None = None,
) -> tuple[bool, bool]:
    """running → queued (retried) or failed, explained by the attempt's failure records: this
    node's, and for a gang every shard's that reported its own (worker.gang.shard_records).
    `silent` (node id, hostname): a gang's nodes whose shard never reported its end (gone with
    its worker): named in the reason and avoided by the retry, as is this node after an
    infrastructure failure. `node`: this node's name, for its records. Returns (transitioned, an
    infrastructure failure). `records`: this node's, as its runner read them (default: read here)."""
    records = list(records) if records is not None else read_records(att.out_dir, node)
    if att.rendezvous is not None:
        from megatrain.attempts.gang import shard_records

        records += shard_records(s, att.job_id, att.attempt)
    record = pick(records)
    infra = record is None or record.get("kind") not in NOT_RETRIED
    retrying = infra and retry_allowed(att)
    reason, suffix = attempt_reason(record, rc, att.attempt, retrying), ""
    data = event_data(record, rc, att.attempt)
    clear: dict[str, object] = {"runner_pid": None, "runner_host": None, "heartbeat_at": None}
    to, fields = (QUEUED, clear) if retrying else (FAILED, {})
    avoid = set(s.scalar(select(Job.avoid_nodes).where(Job.id == att.job_id)) or [])
    if infra and att.node_id and att.rendezvous is None:
        # A preference: placement still uses it if nothing else has room. A gang's culprit is the
        # node whose shard went silent (below), not necessarily this one.
        avoid.add(att.node_id)
    if silent:
        names = ", ".join(name for _, name in silent)
        suffix = f"; no word from the shard on {names}" + (" (avoided next time)" if retrying else "")
        avoid.update(node_id for node_id, _ in silent)
        data = data | {"silent_nodes": [name for _, name in silent]}
    if retrying and avoid:
        fields = fields | {"avoid_nodes": sorted(avoid)}
    redact = att.redact  # an error message may quote a secret the job was given
    reason = redact.text(reason)[: MAX_REASON_CHARS - len(suffix)] + suffix
    data = redact.value(data)
    ok = transition(s, att.job_id, to, from_statuses=(RUNNING,), reason=reason, data=data, **fields)
    return ok, infra


def requeue_preempted(s: Session, att: Attempt, step: int | None, clear: dict[str, object]) -> bool:
    """running → queued after a preemption (not a retry), to resume from `step`; counted in the
    job's `preemptions` (once they reach max_preemptions it is no longer preempted). A pause its
    user asked for (preempt_for PAUSE_REQUEST) stops the same way and stays queued, held, until
    its resume."""
    count = att.preemptions + 1
    last = "; it will not be preempted again" if count >= att.max_preemptions else ""
    reason = (
        f"preempted by a higher-priority job ({count} of at most {att.max_preemptions}); "
        f"resumes from {_where(step)}{last}"
    )
    if s.scalar(select(Job.preempt_for).where(Job.id == att.job_id)) == PAUSE_REQUEST:
        reason = f"paused by its user at {_where(step)}; it resumes from there when resumed"
    data = {
        "attempt": att.attempt,
        "step": step,
        "preemptions": count,
        "max_preemptions": att.max_preemptions,
    }
    return _queue_again(s, att, reason, data, clear | {"preemptions": count})


def end_at_time_limit(
    s: Session, att: Attempt, step: int | None, limit_s: float, clear: dict[str, object]
) -> bool:
    """The attempt checkpointed (at `step`) and stopped before its allocation's time limit. Shorter
    than the job's max_runtime_s, the limit splits a long job into a chain: queued again, resuming
    there, and not a retry (as a preemption). Otherwise it is the job's own max_runtime_s: failed, as
    the local executor fails a job that exceeds it (with its progress saved)."""
    data = {"attempt": att.attempt, "step": step, "time_limit_s": limit_s}
    if limit_s < att.max_runtime_s:
        reason = f"reached the allocation's time limit ({limit_s:g}s); resumes from {_where(step)}"
        return _queue_again(s, att, reason, data, clear | {"continuations": att.continuations + 1})
    saved = f"; checkpointed at step {step}" if step is not None else ""
    reason = f"exceeded max_runtime_s={att.max_runtime_s:g}{saved}"
    return transition(s, att.job_id, FAILED, from_statuses=(RUNNING,), reason=reason, data=data)


def _queue_again(
    s: Session, att: Attempt, reason: str, data: dict[str, object], fields: dict[str, object]
) -> bool:
    """running → queued, not as a retry: `fields` count the attempt as a preemption or a
    continuation, which db.jobs.retry_allowed leaves out of the failed attempts (the user's
    max_retries is never changed)."""
    return transition(s, att.job_id, QUEUED, from_statuses=(RUNNING,), reason=reason, data=data, **fields)


def _where(step: int | None) -> str:
    return f"step {step}" if step is not None else "its latest checkpoint"
