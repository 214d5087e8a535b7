"""/v1/node/tasks: a node's background work (dataset preprocessing, checkpoint exports, samples)
through the API, so that a pool whose workers hold only a node token needs no worker with the
database URL. Each route is one of megatrain.attempts.tasks' functions on the API's connection.

A node's own token may take any pending task of its pool's kinds (the scheduler hands them to the
pool's shared queue); an attempt token (one Slurm job's) takes none. A claimed row is recorded as the
token's node's, and only that node may beat or finish it: another node's token gets `mine: false`,
as a worker whose row was handed to a newer attempt does.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException
from pydantic import Field

from megatrain.api.deps import SessionDep
from megatrain.api.node.router import Body, CurrentNode, NodeCaller
from megatrain.attempts import tasks as control

router = APIRouter(prefix="/v1/node/tasks", tags=["nodes"])


class ClaimBody(Body):
    pid: int = Field(..., ge=1)
    values: dict[str, Any] = Field(default_factory=dict)


class BeatBody(Body):
    attempt: int = Field(..., ge=1)
    values: dict[str, Any] = Field(default_factory=dict)


class FinishBody(BeatBody):
    outcome: str


def _node(caller: NodeCaller) -> str:
    if caller.job_id is not None:
        raise HTTPException(403, "an attempt token runs its job only, not a pool's background tasks")
    if caller.node is None:
        raise HTTPException(403, "this node token is bound to no node yet: register the node first")
    return caller.node


def _kind(kind: str) -> str:
    if kind not in control.KINDS:
        raise HTTPException(404, f"unknown task kind {kind!r} (one of {', '.join(control.KINDS)})")
    return kind


def _refused(exc: control.TaskValueError) -> HTTPException:
    return HTTPException(422, str(exc))


@router.post("/{kind}/{ident}/claim")
def claim(kind: str, ident: str, body: ClaimBody, session: SessionDep, caller: CurrentNode) -> dict[str, Any]:
    """pending → running for the calling node: {attempt, row}, or {attempt: null} when the row is not
    pending (another delivery has it) or is gone."""
    node = _node(caller)
    try:
        got = control.claim(session, _kind(kind), ident, node, body.pid, **body.values)
    except control.TaskValueError as exc:
        raise _refused(exc) from None
    session.commit()
    return {"attempt": None, "row": None} if got is None else {"attempt": got[0], "row": got[1]}


@router.post("/{kind}/{ident}/beat")
def beat(kind: str, ident: str, body: BeatBody, session: SessionDep, caller: CurrentNode) -> dict[str, bool]:
    """A fresh heartbeat (and progress columns); mine: false once the row is no longer this node's
    attempt."""
    node = _node(caller)
    try:
        mine = control.beat(session, _kind(kind), ident, body.attempt, host=node, **body.values)
    except control.TaskValueError as exc:
        raise _refused(exc) from None
    session.commit()
    return {"mine": mine}


@router.post("/{kind}/{ident}/finish")
def finish(
    kind: str, ident: str, body: FinishBody, session: SessionDep, caller: CurrentNode
) -> dict[str, bool]:
    node = _node(caller)
    try:
        mine = control.finish(
            session, _kind(kind), ident, body.attempt, body.outcome, host=node, **body.values
        )
    except control.TaskValueError as exc:
        raise _refused(exc) from None
    session.commit()
    return {"mine": mine}


@router.get("/{kind}/{ident}")
def exists(kind: str, ident: str, session: SessionDep, caller: CurrentNode) -> dict[str, bool]:
    _node(caller)
    return {"exists": control.exists(session, _kind(kind), ident)}
