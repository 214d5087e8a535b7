"""/v1/jobs: submit, list, read, cancel, and follow a job's events, metrics and logs.

A job id that is malformed, unknown, or another tenant's is the same 404 on every endpoint.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from megatrain.api.deps import CurrentTenant, SessionDep, SettingsDep, bearer_key, release, tenant_of
from megatrain.api.jobs import service
from megatrain.api.jobs.downsample import MIN_POINTS
from megatrain.api.jobs.progress import job_pace
from megatrain.api.jobs.schemas import JobEventPublic, JobPage, JobPublic, LogLinePublic
from megatrain.api.streams import LOGS, METRICS, Channel, EventStreamResponse, StreamHub, wants_event_stream
from megatrain.db.goodput import job_goodput
from megatrain.db.models import Job
from megatrain.settings import Settings

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


def _json(model: JobPublic | JobPage) -> Response:
    """The model as its JSON, as FastAPI would answer it but without validating it once more
    against the route's response_model first (a fifth of a GET's work in the route)."""
    return Response(model.model_dump_json(), media_type="application/json")


def _owned_job(session: Session, key: str, job_id: str) -> Job:
    return service.get_job(session, tenant_of(session, key), job_id)


async def get_owned_job(request: Request, job_id: str, session: SessionDep) -> Job:
    """The job, if the request's key owns it: authentication and the lookup in one thread hop and
    one connection checkout (the hottest path: dashboards poll it)."""
    return await run_in_threadpool(release, session, _owned_job, bearer_key(request), job_id)


OwnedJob = Annotated[Job, Depends(get_owned_job)]

_SPEC_BODY = {"$ref": "#/components/schemas/JobSpec"}
SUBMIT_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": _SPEC_BODY}, "application/yaml": {"schema": _SPEC_BODY}},
    }
}
IdempotencyKey = Annotated[
    str | None,
    Header(
        min_length=1,
        max_length=255,
        pattern=r"^[\x21-\x7e]+$",
        description="Repeat a submission safely: the same key and spec return the first job (200).",
    ),
]


@router.post(
    "",
    status_code=201,
    response_model=JobPublic,
    openapi_extra=SUBMIT_OPENAPI,
    responses={200: {"model": JobPublic, "description": "Replay of an earlier Idempotency-Key"}},
)
async def create_job(
    request: Request,
    response: Response,
    session: SessionDep,
    settings: SettingsDep,
    idempotency_key: IdempotencyKey = None,
) -> JobPublic:
    """Submit a JobSpec (JSON, or YAML with Content-Type application/yaml); 201 with the queued job.

    The spec, its layout, its fit on the pool and its data paths are all checked first: any broken
    rule is a 422 listing `{"field", "message"}` items. With `Idempotency-Key`, a repeat with the same
    spec answers 200 with the first job; a different spec under the same key is a 409.
    """
    key, raw = bearer_key(request), await request.body()
    ctype = request.headers.get("content-type", "")
    job, created = await run_in_threadpool(
        release, session, _submit, settings, key, raw, ctype, idempotency_key
    )
    if not created:
        response.status_code = 200
        response.headers["Idempotent-Replayed"] = "true"
    return job


def _submit(
    session: Session, settings: Settings, key: str, raw: bytes, ctype: str, idempotency_key: str | None
) -> tuple[JobPublic, bool]:
    """Authenticate, parse and submit in one worker-thread hop (each hop costs the event loop about
    a fifth of a millisecond of CPU: it was three per submission)."""
    tenant = tenant_of(session, key)
    data = service.parse_body(raw, ctype)
    job, created = service.submit_job(session, settings, tenant, data, idempotency_key)
    return service.public_job(job), created


@router.get("", response_model=JobPage)
async def list_jobs(
    request: Request,
    session: SessionDep,
    status: Annotated[str | None, Query(max_length=32)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
    include: Literal["spec"] | None = None,
) -> Response:
    """The tenant's jobs, newest first, as summaries (`spec` null; `?include=spec` adds it); follow
    `next_cursor` for older pages. GET /v1/jobs/{id} always has the spec."""
    args = (bearer_key(request), status, limit, cursor, include == "spec")
    return _json(await run_in_threadpool(release, session, _list_page, *args))


def _list_page(
    session: Session, key: str, status: str | None, limit: int, cursor: str | None, with_spec: bool
) -> JobPage:
    tenant = tenant_of(session, key)
    jobs, next_cursor = service.list_jobs(session, tenant, status, limit, cursor, with_spec)
    items = [service.public_job(j, job_pace(session, j), with_spec) for j in jobs]
    return JobPage(items=items, next_cursor=next_cursor)


def _public_owned_job(session: Session, key: str, job_id: str) -> JobPublic:
    job = _owned_job(session, key, job_id)
    public = service.public_job(job, job_pace(session, job))  # a query only while it runs (its ETA)
    if job.attempt == 0:
        return public  # never claimed: no attempt has ended, the ledger has nothing
    goodput = job_goodput(session, job.id)
    return public.model_copy(update={"goodput": goodput if goodput["attempts"] else None})


@router.get("/{job_id}", response_model=JobPublic)
async def get_job(request: Request, job_id: str, session: SessionDep) -> Response:
    """The job; a queued one with its place in the queue and why it waits, a running one with its
    progress and ETA at its measured pace."""
    return _json(await run_in_threadpool(release, session, _public_owned_job, bearer_key(request), job_id))


@router.post("/{job_id}/cancel", response_model=JobPublic)
def cancel_job(job_id: str, session: SessionDep, tenant: CurrentTenant) -> JobPublic:
    """Queued jobs are cancelled at once; scheduled/running ones get `cancel_requested` and stop when
    their runner sees it. Cancelling a finished job is a 409."""
    return service.public_job(service.cancel_job(session, tenant, job_id))


@router.get("/{job_id}/events", response_model=list[JobEventPublic])
def list_events(job: OwnedJob, session: SessionDep) -> list[Any]:
    """State transitions and notable events (checkpoint_saved, resumed, cancel_requested), oldest first."""
    return service.list_events(session, job.id)


def _resume_from(query_value: int | None, last_event_id: int | None) -> int | None:
    if last_event_id is None:
        return query_value
    return last_event_id if query_value is None else max(query_value, last_event_id)


LastEventId = Annotated[int | None, Header(ge=0, le=2**62, description="SSE resume point")]


async def _follow(
    request: Request,
    session: Session,
    tenant_id: str,
    job_id: str,
    channel: Channel,
    cursor: int,
    since: int | None = None,
    kind: str | None = None,
) -> EventStreamResponse:
    """A live stream of the job's `channel`; the request's session (authentication, ownership) is
    closed first, so an open stream holds no database connection."""
    session.close()
    hub: StreamHub = request.app.state.streams
    return EventStreamResponse(hub, await hub.subscribe(tenant_id, job_id, channel, since, kind), cursor)


@router.get(
    "/{job_id}/metrics",
    response_model=list[dict[str, Any]],
    responses={200: {"content": {"text/event-stream": {}}}, 429: {"description": "Too many live streams"}},
)
async def list_metrics(
    request: Request,
    job: OwnedJob,
    session: SessionDep,
    since_step: Annotated[int | None, Query(ge=-1, le=2**62)] = None,
    kind: Literal["train", "val", "eval"] | None = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 100_000,
    max_points: Annotated[int | None, Query(ge=MIN_POINTS, le=100_000)] = None,
    last_event_id: LastEventId = None,
    response: Response = None,  # type: ignore[assignment]
) -> Any:
    """Metric rows with step > since_step: the engine's row plus `step` and `kind`, in step order.

    With `max_points=N` (JSON only): at most N rows per kind for a chart, keeping each step
    bucket's lowest and highest loss (spikes survive) and always the first and last row;
    `X-Total-Rows` says how many rows matched before downsampling.

    With `Accept: text/event-stream`: Server-Sent Events, the existing rows then new ones as they
    arrive, each with `id:` = its step (so `Last-Event-ID` resumes), then `event: end` once the job
    has finished. A tenant may hold `max_streams_per_tenant` streams open at once (429 past it).
    """
    since = _resume_from(since_step, last_event_id)
    if wants_event_stream(request.headers.get("accept")):
        return await _follow(request, session, job.tenant_id, job.id, METRICS, 0, since, kind)
    if max_points is None:
        return await run_in_threadpool(service.list_metrics, session, job.id, since, kind, limit)
    rows, total = await run_in_threadpool(
        service.list_metrics_downsampled, session, job.id, since, kind, max_points
    )
    response.headers["X-Total-Rows"] = str(total)
    return rows


@router.get("/{job_id}/results", response_model=dict[str, Any])
async def get_results(job: OwnedJob, session: SessionDep) -> Any:
    """The job's evaluation results (an eval job's, or its tasks scored during training): `tasks`
    {task: {metric: {value, stderr, n}}} at the latest step scored, `step` (null: none yet) and
    `history`, every scored step's."""
    return await run_in_threadpool(service.job_results, session, job)


@router.get(
    "/{job_id}/logs",
    response_model=list[LogLinePublic],
    responses={200: {"content": {"text/event-stream": {}}}, 429: {"description": "Too many live streams"}},
)
async def list_logs(
    request: Request,
    job: OwnedJob,
    session: SessionDep,
    after_seq: Annotated[int, Query(ge=0, le=2**62)] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    tail: Annotated[int | None, Query(ge=1, le=10_000)] = None,
    follow: bool = False,
    last_event_id: LastEventId = None,
) -> Any:
    """Log lines with seq > after_seq, oldest first; `?tail=N` gives the last N lines instead.
    With `Accept: text/event-stream` (or ?follow=true): SSE with `id:` = seq, following new lines
    until the job ends (`event: end`)."""
    after = _resume_from(after_seq, last_event_id) or 0
    if follow or wants_event_stream(request.headers.get("accept")):
        return await _follow(request, session, job.tenant_id, job.id, LOGS, after)
    if tail is not None:
        return await run_in_threadpool(service.list_log_tail, session, job.id, tail)
    return await run_in_threadpool(service.list_logs, session, job.id, after, limit)
