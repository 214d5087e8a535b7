"""How a worker's background tasks (datasets, exports, samples) reach the control plane: the database
(`DbTasks`, the embedded default and trusted workers) or the API's /v1/node/tasks routes with a node
token (`HttpTasks`), as a runner's reports do (worker.reporter). Both end in megatrain.attempts.tasks.

A claimed row comes back as a detached instance of its model, built from its columns, so the task
code reads `row.job_id` or `row.folder_key` the same way over either.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Protocol

from megatrain.attempts import tasks as control
from megatrain.db.session import session_scope
from megatrain.settings import Settings
from megatrain.worker.reporter import HttpReporter


class TaskLink(Protocol):
    def claim(self, kind: str, ident: str, **values: Any) -> tuple[int, Any] | None: ...

    def beat(self, kind: str, ident: str, attempt: int, **values: Any) -> bool: ...

    def finish(self, kind: str, ident: str, attempt: int, outcome: str, **values: Any) -> bool: ...

    def exists(self, kind: str, ident: str) -> bool: ...


def _row(kind: str, cols: dict[str, Any]) -> Any:
    return control.kind_of(kind).model(**cols)


class DbTasks:
    def __init__(self, settings: Settings):
        self.url = settings.resolved_database_url
        self.host = socket.gethostname()

    def claim(self, kind: str, ident: str, **values: Any) -> tuple[int, Any] | None:
        with session_scope(self.url) as s:
            got = control.claim(s, kind, ident, self.host, os.getpid(), **values)
        return None if got is None else (got[0], _row(kind, got[1]))

    def beat(self, kind: str, ident: str, attempt: int, **values: Any) -> bool:
        with session_scope(self.url) as s:
            return control.beat(s, kind, ident, attempt, **values)

    def finish(self, kind: str, ident: str, attempt: int, outcome: str, **values: Any) -> bool:
        with session_scope(self.url) as s:
            return control.finish(s, kind, ident, attempt, outcome, **values)

    def exists(self, kind: str, ident: str) -> bool:
        with session_scope(self.url) as s:
            return control.exists(s, kind, ident)


class HttpTasks:
    """The same calls to the API with a node token: the row is recorded as the token's node's."""

    def __init__(self, api_url: str, token: str):
        self.http = HttpReporter(api_url, token)

    def _post(self, path: str, body: dict[str, Any] | None = None, method: str = "POST") -> Any:
        return self.http.call(f"/tasks{path}", body, method)

    def claim(self, kind: str, ident: str, **values: Any) -> tuple[int, Any] | None:
        answer = self._post(f"/{kind}/{ident}/claim", {"pid": os.getpid(), "values": values})
        return None if answer["attempt"] is None else (answer["attempt"], _row(kind, answer["row"]))

    def beat(self, kind: str, ident: str, attempt: int, **values: Any) -> bool:
        return bool(self._post(f"/{kind}/{ident}/beat", {"attempt": attempt, "values": values})["mine"])

    def finish(self, kind: str, ident: str, attempt: int, outcome: str, **values: Any) -> bool:
        body = {"attempt": attempt, "outcome": outcome, "values": values}
        return bool(self._post(f"/{kind}/{ident}/finish", body)["mine"])

    def exists(self, kind: str, ident: str) -> bool:
        return bool(self._post(f"/{kind}/{ident}", method="GET")["exists"])


def task_link(settings: Settings) -> TaskLink:
    """HTTP to settings.api_url when this node holds a node token, else the database."""
    if settings.node_token:
        return HttpTasks(settings.api_url, settings.node_token)
    return DbTasks(settings)
