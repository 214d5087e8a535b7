"""One attempt of a job: what a runner claimed (`Attempt`), and how a failed one ends.

`end_failed_attempt` decides between a retry (running → queued, resumed from the latest
checkpoint) and the end (→ failed) from the attempt's failure records, for a single-node attempt
and for every shard of a gang (megatrain.worker.gang), and names the nodes to avoid next time.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from megatrain.db.jobs import retry_allowed, transition
from megatrain.db.models import FAILED, QUEUED, RUNNING, Job
from megatrain.failures import NOT_RETRIED, attempt_reason, event_data, pick, read_records
from megatrain.secrets_box import Redactor
from megatrain.settings import CONTROL_PLANE_SETTINGS, SERVE_TOKEN_ENV
from megatrain.worker.launch import Rendezvous
from megatrain.worker.nodes import device_env

MAX_REASON_CHARS = 4000
"""A job event's reason is cut to this (the tail of an engine's traceback can be long)."""


@dataclass
class Attempt:
    """One attempt of a job, as a runner claimed it (a whole job, or one node's share of a gang)."""

    job_id: str
    attempt: int
    max_retries: int
    num_procs: int
    max_runtime_s: float
    out_dir: Path
    devices: list[int] | None = None
    """The node's device indices the scheduler placed this attempt on."""
    accelerator: str = "cpu"
    rendezvous: Rendezvous | None = None
    """Set for one node's share of a multi-node attempt (a gang)."""
    node_id: str | None = None
    queued_s: float = 0.0
    """How long the job waited in the queue before this attempt (for the goodput ledger)."""
    prev_step: int = 0
    checkpoint_interval: int = 0
    preemptions: int = 0
    """Earlier attempts of the job that ended preempted (not failures: see db.jobs.retry_allowed)."""
    max_preemptions: int = 10
    continuations: int = 0
    """Earlier attempts that ended at an allocation's time limit and continued (not failures)."""
    serve_token: str | None = None
    """A serve job's bearer token for this attempt (db.models.Job.serve_token)."""
    secret_env: dict[str, str] = field(default_factory=dict, repr=False)
    """The tenant secrets the job names (spec `secrets`), decrypted for its engine's environment."""

    @property
    def redact(self) -> Redactor:
        """Removes those secrets' values from what the attempt reports (lines, events, reasons)."""
        return Redactor(self.secret_env)

    def to_wire(self) -> dict[str, Any]:
        """The attempt as JSON (the API's claim answer), without the node's own folder."""
        wire = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "out_dir"}
        wire["rendezvous"] = asdict(self.rendezvous) if self.rendezvous is not None else None
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any], out_dir: Path) -> Attempt:
        rdzv = wire.get("rendezvous")
        names = {f.name for f in fields(cls)} - {"out_dir", "rendezvous"}
        values = {k: v for k, v in wire.items() if k in names}
        return cls(out_dir=out_dir, rendezvous=Rendezvous(**rdzv) if rdzv else None, **values)

    def engine_env(self) -> dict[str, str]:
        """The engine's environment: this process's without the control plane's credentials (nor
        this node's token: the engine reports through its runner), the tenant secrets the job
        names, the devices the attempt was placed on (and a serve job's token)."""
        hidden = {f"MEGATRAIN_{name.upper()}" for name in (*CONTROL_PLANE_SETTINGS, "node_token")}
        env = {k: v for k, v in os.environ.items() if k not in hidden}
        env |= self.secret_env | {"PYTHONUNBUFFERED": "1", "MEGATRAIN_JOB_ID": self.job_id}
        if self.serve_token is not None:
            env[SERVE_TOKEN_ENV] = self.serve_token
        return env | device_env(self.devices, self.accelerator, os.environ)


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
        from megatrain.worker.gang import shard_records

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
