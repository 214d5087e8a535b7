"""/v1/node: where a node's worker and runners report, holding a node token instead of a database URL.

Each route is one of megatrain.attempts' functions (or db.node_registry's), run here on the API's database
connection: a runner speaking HTTP (worker.reporter.HttpReporter) gets the same answers as one
writing to the database. A token reports only for its own node's attempts: a job placed elsewhere
is 404 to it, as a job of another tenant is to an API key; a revoked token is 401.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import or_, select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from megatrain.api.deps import SessionDep, SettingsDep, bearer_key, release
from megatrain.attempts import reports as control
from megatrain.attempts.gang import Share, join, shard_failed, silent_now
from megatrain.db.audit import ACTOR, Actor
from megatrain.db.models import Job, JobAllocation, Node, NodePool, utcnow
from megatrain.db.node_registry import node_seen, register_node
from megatrain.db.node_tokens import NodeToken, ReportCursor, authenticate_node

router = APIRouter(prefix="/v1/node", tags=["nodes"])

MAX_BODY_BYTES = 64 << 20
"""A batch of reports (lines, metrics, events) may be larger than an API request."""


LAST_USED_EVERY_S = 60.0
"""A token's last use is recorded at most this often (a runner reports several times a second)."""


@dataclass(frozen=True)
class NodeCaller:
    """Who a node token speaks for."""

    token_id: str
    pool_id: str
    node: str | None
    """Its node's name (None: the token was never bound to one, or is an attempt token)."""
    job_id: str | None = None
    """An attempt token's job (db.node_tokens.create_attempt_token): the only one it reports for."""


def node_of(session: Session, token: str) -> NodeCaller:
    row = authenticate_node(session, token)
    if row is None:
        raise HTTPException(401, "invalid or revoked node token", headers={"WWW-Authenticate": "Bearer"})
    caller = NodeCaller(row.id, row.pool_id, row.node_name, row.job_id)
    now = utcnow()
    if row.last_used_at is None or (now - row.last_used_at).total_seconds() > LAST_USED_EVERY_S:
        row.last_used_at = now
        session.commit()
    session.info[ACTOR] = Actor("node", row.node_name or row.id)
    return caller


async def get_node(request: Request, session: SessionDep) -> NodeCaller:
    return await run_in_threadpool(release, session, node_of, bearer_key(request))


CurrentNode = Annotated[NodeCaller, Depends(get_node)]


def _own_job(session: Session, caller: NodeCaller, job_id: str) -> str | None:
    """404 unless the job runs (or is placed) on the caller's node, or the node ran an attempt of it
    (a follower's last lines arrive after the job gave its placement back), or it is the attempt
    token's job. The caller's node id (None for an attempt token)."""
    if caller.job_id is not None:
        if caller.job_id != job_id:
            raise HTTPException(404, f"job {job_id} is not this token's job")
        return None
    node_id = session.scalar(
        select(Node.id).where(Node.pool_id == caller.pool_id, Node.hostname == caller.node)
    )
    placed = session.scalar(
        select(Job.id)
        .outerjoin(JobAllocation, JobAllocation.job_id == Job.id)
        .where(Job.id == job_id, or_(Job.node_id == node_id, JobAllocation.node_id == node_id))
    )
    ran = session.scalar(
        select(ReportCursor.job_id).where(ReportCursor.job_id == job_id, ReportCursor.node_id == node_id)
    )
    if node_id is None or (placed is None and ran is None):
        raise HTTPException(404, f"job {job_id} is not placed on this node")
    return node_id


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ClaimBody(Body):
    host: str = Field(..., min_length=1, max_length=255)
    pid: int = Field(..., ge=1)
    packages: dict[str, str] = Field(default_factory=dict)
    endpoint: str | None = Field(default=None, max_length=300)
    attempt: int | None = Field(default=None, ge=1)
    node: str | None = Field(default=None, max_length=255)
    """The node's name (read only with an attempt token: a node's own token names it)."""


class ReportBody(Body):
    attempt: int = Field(..., ge=1)
    node_rank: int = Field(default=0, ge=0)
    seq: int = Field(..., ge=1)
    host: str = Field(..., min_length=1, max_length=255)
    pid: int = Field(..., ge=1)
    follower: bool = False
    heartbeat: bool = False
    lines: list[str] = Field(default_factory=list)
    metrics: list[dict[str, Any]] = Field(default_factory=list)
    events: list[dict[str, Any]] = Field(default_factory=list)
    progress: dict[str, Any] | None = None
    gang: bool = False


class HeartbeatBody(Body):
    host: str = Field(..., min_length=1, max_length=255)
    pid: int = Field(..., ge=1)


class BackfillBody(Body):
    attempt: int = Field(..., ge=1)
    metrics: list[dict[str, Any]] = Field(default_factory=list)
    events: list[dict[str, Any]] = Field(default_factory=list)


class AttemptRef(Body):
    attempt: int = Field(..., ge=1)
    rendezvous: dict[str, Any] | None = None


class FinishBody(AttemptRef):
    end: dict[str, Any]


class JoinBody(Body):
    node_rank: int = Field(..., ge=1)
    nnodes: int = Field(..., ge=2)
    attempt: int = Field(..., ge=1)
    node: str | None = Field(default=None, max_length=255)


class ShardFailedBody(AttemptRef):
    rc: int
    node_rank: int = Field(..., ge=1)
    records: list[dict[str, Any]] = Field(default_factory=list)
    node: str | None = Field(default=None, max_length=255)


class RegisterBody(Body):
    """worker.nodes.node_report."""

    pool: str = Field(..., min_length=1, max_length=100)
    node: str = Field(..., min_length=1, max_length=255)
    accelerator: str = Field(..., min_length=1, max_length=32)
    slots: int = Field(..., ge=1, le=1024)
    device_memory_bytes: int | None = Field(default=None, ge=0)
    packages: dict[str, str] = Field(default_factory=dict)
    heartbeat: dict[str, Any] = Field(default_factory=dict)
    pool_spec: dict[str, Any] | None = None


class NodeHeartbeatBody(Body):
    values: dict[str, Any] = Field(default_factory=dict)
    pool_spec: dict[str, Any] | None = None


@router.post("/register")
def register(body: RegisterBody, session: SessionDep, caller: CurrentNode) -> dict[str, str]:
    """Register (or refresh) the token's node in its pool; a token bound to no node yet is bound to
    this one. 403 for another node's name or another pool's."""
    token = session.get(NodeToken, caller.token_id)
    pool = session.get(NodePool, caller.pool_id)
    if token is None or pool is None:
        raise HTTPException(401, "invalid or revoked node token")
    if body.pool != pool.name:
        raise HTTPException(403, f"this token is for pool '{pool.name}', not '{body.pool}'")
    if token.node_name is None:
        token.node_name = body.node
    elif token.node_name != body.node:
        raise HTTPException(403, f"this token speaks for node '{token.node_name}', not '{body.node}'")
    node = register_node(session, body.model_dump())
    node_id = node.id
    session.commit()
    return {"node_id": node_id}


@router.post("/heartbeat")
def node_heartbeat(body: NodeHeartbeatBody, session: SessionDep, caller: CurrentNode) -> dict[str, bool]:
    node_id = session.scalar(
        select(Node.id).where(Node.pool_id == caller.pool_id, Node.hostname == caller.node)
    )
    if node_id is None:
        raise HTTPException(404, "this token's node is not registered: register it first")
    node_seen(session, node_id, body.values, body.pool_spec)
    session.commit()
    return {"ok": True}


def _node_name(caller: NodeCaller, named: str | None = None) -> str:
    """The calling node's name: its token's; an attempt token's caller names itself."""
    if caller.node is not None:
        return caller.node
    if caller.job_id is not None and named:
        return named
    raise HTTPException(403, "this node token is bound to no node yet: register the node first")


@router.post("/jobs/{job_id}/claim")
def claim_job(
    job_id: str, body: ClaimBody, session: SessionDep, settings: SettingsDep, caller: CurrentNode
) -> dict[str, Any]:
    """scheduled → running, owned by the calling runner: the attempt to run, with the job's spec,
    layout and the tenant secrets its engine gets; {"skip": why} when there is nothing to run."""
    node_id = _own_job(session, caller, job_id)
    answer = control.claim(
        session,
        settings,
        job_id,
        node=_node_name(caller, body.node),
        host=body.host,
        pid=body.pid,
        packages=body.packages,
        endpoint=body.endpoint,
        attempt=body.attempt,
        node_id=node_id,
    )
    session.commit()
    return answer


@router.post("/jobs/{job_id}/reports")
def report(
    job_id: str, body: ReportBody, session: SessionDep, settings: SettingsDep, caller: CurrentNode
) -> dict[str, Any]:
    """One numbered batch of the runner's lines, metrics and events, applied once; the verdict."""
    _own_job(session, caller, job_id)
    answer = control.report(session, job_id, body.model_dump(), settings.max_log_lines)
    session.commit()
    return answer


@router.post("/jobs/{job_id}/heartbeat")
def heartbeat(job_id: str, body: HeartbeatBody, session: SessionDep, caller: CurrentNode) -> dict[str, bool]:
    _own_job(session, caller, job_id)
    owned = control.heartbeat(session, job_id, body.host, body.pid)
    session.commit()
    return {"owned": owned}


@router.post("/jobs/{job_id}/backfill")
def backfill(job_id: str, body: BackfillBody, session: SessionDep, caller: CurrentNode) -> dict[str, bool]:
    _own_job(session, caller, job_id)
    control.backfill(session, job_id, body.attempt, body.metrics, body.events)
    session.commit()
    return {"ok": True}


@router.post("/jobs/{job_id}/finish")
def finish(
    job_id: str, body: FinishBody, session: SessionDep, settings: SettingsDep, caller: CurrentNode
) -> dict[str, Any]:
    """How the attempt ended: the status the job moved to (null when someone else moved it first)."""
    _own_job(session, caller, job_id)
    att = control.attempt_of(session, job_id, body.attempt, body.rendezvous)
    status = None if att is None else control.finish(session, settings, att, body.end)
    session.commit()
    return {"status": status}


@router.post("/jobs/{job_id}/join")
def join_attempt(
    job_id: str, body: JoinBody, session: SessionDep, settings: SettingsDep, caller: CurrentNode
) -> dict[str, Any]:
    """A follower shard's turn in a multi-node attempt (attempts.gang.join)."""
    node_id = _own_job(session, caller, job_id)
    share = Share(body.node_rank, body.nnodes, body.attempt)
    answer = join(session, settings, job_id, share, _node_name(caller, body.node), node_id)
    session.commit()
    return answer


@router.get("/jobs/{job_id}/attempts/{attempt}/silent")
def silent(job_id: str, attempt: int, session: SessionDep, caller: CurrentNode) -> dict[str, Any]:
    _own_job(session, caller, job_id)
    return {"silent": silent_now(session, job_id, attempt)}


@router.post("/jobs/{job_id}/shard-failed")
def shard_failed_route(
    job_id: str, body: ShardFailedBody, session: SessionDep, caller: CurrentNode
) -> dict[str, bool]:
    _own_job(session, caller, job_id)
    att = control.attempt_of(session, job_id, body.attempt, body.rendezvous)
    if att is not None:
        shard_failed(session, att, body.rc, _node_name(caller, body.node), body.node_rank, body.records)
    session.commit()
    return {"ok": True}


class StorageKeyBody(Body):
    attempt: int = Field(..., ge=1)


@router.post("/jobs/{job_id}/storage-key")
def storage_key(
    job_id: str, body: StorageKeyBody, session: SessionDep, caller: CurrentNode, settings: SettingsDep
) -> dict[str, Any]:
    """A key for the attempt's ranks that reaches only the job's own storage prefix and what its
    tenant may read (megatrain.storage_scope), in the shape of AWS's credential_process output.
    409 once the attempt is over or where no role is configured; 422 when the job's prefixes do
    not fit a session policy; 502 when STS refuses."""
    from botocore.exceptions import BotoCoreError, ClientError

    from megatrain.attempts.storage_keys import NoStorageKey, attempt_storage_key
    from megatrain.storage_scope import StorageScopeError

    _own_job(session, caller, job_id)
    try:
        return attempt_storage_key(session, settings, job_id, body.attempt)
    except NoStorageKey as exc:
        raise HTTPException(409, str(exc)) from None
    except StorageScopeError as exc:
        raise HTTPException(422, str(exc)) from None
    except (BotoCoreError, ClientError) as exc:
        raise HTTPException(502, f"STS refused a storage key: {exc}") from None
