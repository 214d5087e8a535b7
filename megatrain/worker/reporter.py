"""How a node's runner reaches the control plane: one interface, two transports.

`DbReporter` writes to the database itself (the embedded default, and any node an operator trusts
with the database URL); `HttpReporter` holds only the API's URL and a node token
(`megatrain nodes token create`) and asks the API's /v1/node routes to do the same work. Both end in
megatrain.attempts' functions, so what a claim, a batch of reports or an attempt's end does is one
piece of code whichever way it travels. `reporter_for(settings)` picks: a node token in the
settings (MEGATRAIN_NODE_TOKEN) means HTTP.

Failures: `ReportError` when the control plane could not be reached or failed (retry later: the
runner keeps its batch and resends it, with the same sequence number); `ReportRefused` when it
answered no (a revoked token, a job not this node's, a job deleted): retrying will not help.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from megatrain.db.session import session_scope
from megatrain.settings import Settings

if TYPE_CHECKING:
    from megatrain.worker.attempt import Attempt
    from megatrain.worker.gang import Share

log = logging.getLogger(__name__)
# httpx says every request at INFO: a runner's reports and heartbeats, once a second, would bury its
# log (a refused or failed one is logged here, with why).
logging.getLogger("httpx").setLevel(logging.WARNING)

T = TypeVar("T")


class ReportError(RuntimeError):
    """The control plane could not take the report now; the same call may succeed later."""


class ReportRefused(ReportError):
    """The control plane refused the report (revoked token, not this node's job, job gone)."""


class Reporter(Protocol):
    def claim(
        self,
        job_id: str,
        *,
        node: str,
        host: str,
        pid: int,
        packages: dict[str, str],
        endpoint: str | None,
        attempt: int | None = None,
    ) -> dict[str, Any]:
        """attempts.reports.claim."""
        ...

    def report(self, job_id: str, batch: dict[str, Any]) -> dict[str, Any]:
        """attempts.reports.report: {"verdict", "applied"}."""
        ...

    def heartbeat(self, job_id: str, host: str, pid: int) -> bool: ...

    def backfill(self, job_id: str, attempt: int, metrics: list[dict], events: list[dict]) -> None: ...

    def finish(self, att: Attempt, end: dict[str, Any]) -> str | None:
        """attempts.reports.finish: the status the attempt ended the job in (None: someone else did)."""
        ...

    def join(self, job_id: str, share: Share, node: str) -> dict[str, Any]:
        """attempts.gang.join."""
        ...

    def silent(self, job_id: str, attempt: int) -> list[tuple[str, str]] | None:
        """attempts.gang.silent_now."""
        ...

    def shard_failed(self, att: Attempt, rc: int, node: str, node_rank: int, records: list[dict]) -> None: ...

    def register(self, report: dict[str, Any]) -> str:
        """db.node_registry.register_node of a node_report: the node's id."""
        ...

    def storage_key(self, job_id: str, attempt: int) -> dict[str, Any]:
        """attempts.storage_keys.attempt_storage_key: a scoped object-store key for the attempt's
        ranks (ReportRefused when the attempt is over or none is handed out)."""
        ...

    def node_seen(self, node_id: str, values: dict[str, Any], pool_spec: dict[str, Any] | None) -> None:
        """db.node_registry.node_seen."""
        ...


def attempt_ref(att: Attempt) -> dict[str, Any]:
    """What names an attempt to the control plane when it ends (it rebuilds the rest from the job)."""
    rdzv = att.to_wire()["rendezvous"]
    return {"attempt": att.attempt, "rendezvous": rdzv}


class DbReporter:
    """The control plane's functions, run in this process on its own database connection."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.url = settings.resolved_database_url

    @contextmanager
    def _session(self) -> Iterator[Session]:
        try:
            with session_scope(self.url) as s:
                yield s
        except SQLAlchemyError as exc:
            raise ReportError(f"database error: {exc}") from exc

    def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        with self._session() as s:
            return fn(s, *args, **kwargs)

    def claim(
        self,
        job_id: str,
        *,
        node: str,
        host: str,
        pid: int,
        packages: dict[str, str],
        endpoint: str | None,
        attempt: int | None = None,
    ) -> dict[str, Any]:
        from megatrain.attempts import reports as control

        kw = {"node": node, "host": host, "pid": pid, "packages": packages, "endpoint": endpoint}
        return self._run(control.claim, self.settings, job_id, attempt=attempt, **kw)

    def report(self, job_id: str, batch: dict[str, Any]) -> dict[str, Any]:
        from megatrain.attempts import reports as control

        return self._run(control.report, job_id, batch, self.settings.max_log_lines)

    def heartbeat(self, job_id: str, host: str, pid: int) -> bool:
        from megatrain.attempts import reports as control

        return self._run(control.heartbeat, job_id, host, pid)

    def backfill(self, job_id: str, attempt: int, metrics: list[dict], events: list[dict]) -> None:
        from megatrain.attempts import reports as control

        self._run(control.backfill, job_id, attempt, metrics, events)

    def finish(self, att: Attempt, end: dict[str, Any]) -> str | None:
        from megatrain.attempts import reports as control

        with self._session() as s:
            found = control.attempt_of(s, att.job_id, **attempt_ref(att))
            return None if found is None else control.finish(s, self.settings, found, end)

    def join(self, job_id: str, share: Share, node: str) -> dict[str, Any]:
        from megatrain.attempts.gang import join

        return self._run(join, self.settings, job_id, share, node)

    def silent(self, job_id: str, attempt: int) -> list[tuple[str, str]] | None:
        from megatrain.attempts.gang import silent_now

        return self._run(silent_now, job_id, attempt)

    def shard_failed(self, att: Attempt, rc: int, node: str, node_rank: int, records: list[dict]) -> None:
        from megatrain.attempts import reports as control
        from megatrain.attempts.gang import shard_failed

        with self._session() as s:
            found = control.attempt_of(s, att.job_id, **attempt_ref(att))
            if found is not None:
                shard_failed(s, found, rc, node, node_rank, records)

    def register(self, report: dict[str, Any]) -> str:
        from megatrain.db.node_registry import register_node

        return self._run(lambda s: register_node(s, report).id)

    def node_seen(self, node_id: str, values: dict[str, Any], pool_spec: dict[str, Any] | None) -> None:
        from megatrain.db.node_registry import node_seen

        self._run(node_seen, node_id, values, pool_spec)

    def storage_key(self, job_id: str, attempt: int) -> dict[str, Any]:
        from botocore.exceptions import BotoCoreError, ClientError

        from megatrain.attempts.storage_keys import NoStorageKey, attempt_storage_key
        from megatrain.storage_scope import StorageScopeError

        try:
            return self._run(attempt_storage_key, self.settings, job_id, attempt)
        except (NoStorageKey, StorageScopeError) as exc:
            raise ReportRefused(str(exc)) from exc
        except (BotoCoreError, ClientError) as exc:
            raise ReportError(f"STS refused a storage key: {exc}") from exc


class HttpReporter:
    """The same calls as HTTP requests to the API's /v1/node routes, authenticated by a node token."""

    def __init__(self, api_url: str, token: str, timeout_s: float = 30.0):
        import httpx

        self.base = api_url.rstrip("/") + "/v1/node"
        self.client = httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s)

    def call(self, path: str, body: dict[str, Any] | None = None, method: str = "POST") -> Any:
        import httpx

        try:
            response = self.client.request(method, self.base + path, json=body)
        except httpx.HTTPError as exc:
            raise ReportError(f"the API at {self.base} did not answer: {exc!r}") from exc
        if response.status_code in (401, 403, 404, 409, 422):
            raise ReportRefused(f"the API refused {path}: {response.status_code} {response.text[:500]}")
        if response.status_code >= 400:
            raise ReportError(f"the API failed {path}: {response.status_code} {response.text[:500]}")
        return response.json()

    def claim(
        self,
        job_id: str,
        *,
        node: str,
        host: str,
        pid: int,
        packages: dict[str, str],
        endpoint: str | None,
        attempt: int | None = None,
    ) -> dict[str, Any]:
        body = {"host": host, "pid": pid, "packages": packages, "endpoint": endpoint, "attempt": attempt}
        body["node"] = node
        return dict(self.call(f"/jobs/{job_id}/claim", body))

    def report(self, job_id: str, batch: dict[str, Any]) -> dict[str, Any]:
        return dict(self.call(f"/jobs/{job_id}/reports", batch))

    def heartbeat(self, job_id: str, host: str, pid: int) -> bool:
        return bool(self.call(f"/jobs/{job_id}/heartbeat", {"host": host, "pid": pid})["owned"])

    def backfill(self, job_id: str, attempt: int, metrics: list[dict], events: list[dict]) -> None:
        self.call(f"/jobs/{job_id}/backfill", {"attempt": attempt, "metrics": metrics, "events": events})

    def finish(self, att: Attempt, end: dict[str, Any]) -> str | None:
        answer = self.call(f"/jobs/{att.job_id}/finish", attempt_ref(att) | {"end": end})
        return answer["status"]  # type: ignore[no-any-return]

    def join(self, job_id: str, share: Share, node: str) -> dict[str, Any]:
        body = {"node_rank": share.node_rank, "nnodes": share.nnodes, "attempt": share.attempt, "node": node}
        return dict(self.call(f"/jobs/{job_id}/join", body))

    def silent(self, job_id: str, attempt: int) -> list[tuple[str, str]] | None:
        answer = self.call(f"/jobs/{job_id}/attempts/{attempt}/silent", method="GET")["silent"]
        return None if answer is None else [(a, b) for a, b in answer]

    def shard_failed(self, att: Attempt, rc: int, node: str, node_rank: int, records: list[dict]) -> None:
        body = attempt_ref(att) | {"rc": rc, "node_rank": node_rank, "records": records, "node": node}
        self.call(f"/jobs/{att.job_id}/shard-failed", body)

    def register(self, report: dict[str, Any]) -> str:
        return str(self.call("/register", report)["node_id"])

    def node_seen(self, node_id: str, values: dict[str, Any], pool_spec: dict[str, Any] | None) -> None:
        # The token names the node: `node_id` is the database's business.
        self.call("/heartbeat", {"values": values, "pool_spec": pool_spec})

    def storage_key(self, job_id: str, attempt: int) -> dict[str, Any]:
        return dict(self.call(f"/jobs/{job_id}/storage-key", {"attempt": attempt}))


class SilencedReporter:
    """A reporter whose calls fail as if the network were down while an operator's `silence:` fault
    (megatrain.faults) holds: the runner keeps its batches and sends them once it lifts."""

    def __init__(self, inner: Reporter, windows: list[tuple[float, float]]):
        self.inner, self.windows = inner, windows

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.inner, name)

        def silenced(*args: Any, **kwargs: Any) -> Any:
            now = time.monotonic()
            if any(start <= now < end for start, end in self.windows):
                raise ReportError("injected fault silence: the control plane is out of reach")
            return call(*args, **kwargs)

        return silenced


def reporter_for(settings: Settings) -> Reporter:
    """HTTP to settings.api_url when this node holds a node token, else the database."""
    from megatrain.faults import silences
    from megatrain.worker.nodes import node_name

    reporter: Reporter = (
        HttpReporter(settings.api_url, settings.node_token) if settings.node_token else DbReporter(settings)
    )
    windows = silences(node_name(settings))
    return SilencedReporter(reporter, windows) if windows else reporter  # type: ignore[return-value]
