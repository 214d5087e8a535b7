"""The worker side of background work on one checkpoint (exports, samples): claim a pending row,
keep its heartbeat fresh while the work runs, and write the outcome only while the row is still this
attempt's (scheduler.checkpoint_tasks may judge a silent worker lost and hand the row to another).

The rows have the columns `status`, `attempt`, `runner_host`, `runner_pid`, `heartbeat_at`,
`updated_at`, `error` and `finished_at`; running is the status "running".
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import SQLAlchemyError

from megatrain.db.models import FAILED, PENDING, RUNNING_EXPORT, utcnow
from megatrain.db.session import session_scope
from megatrain.settings import Settings, get_settings

log = logging.getLogger(__name__)

RUNNING = RUNNING_EXPORT
MAX_ERROR_CHARS = 2000


def checkpoint_folder(storage_url: str, job_id: str, step: int) -> str:
    """The URL of a job's checkpoint folder in the storage layout."""
    return f"{storage_url.rstrip('/')}/jobs/{job_id}/checkpoints/iter_{step:07d}"


def claim(settings: Settings, row: Any, ident: str) -> int | None:
    """pending → running for this process; the attempt number, or None if it was not pending."""
    with session_scope(settings.resolved_database_url) as s:
        attempt = s.scalar(select(row.attempt).where(row.id == ident, row.status == PENDING))
        if attempt is None:
            return None
        done = s.execute(
            update(row)
            .where(row.id == ident, row.status == PENDING, row.attempt == attempt)
            .values(
                status=RUNNING,
                attempt=attempt + 1,
                runner_host=socket.gethostname(),
                runner_pid=os.getpid(),
                heartbeat_at=utcnow(),
                updated_at=utcnow(),
            )
            .execution_options(synchronize_session=False)
        )
        return attempt + 1 if done.rowcount == 1 else None


def claim_row(settings: Settings, row: Any, ident: str, what: str) -> tuple[int, Any] | None:
    """claim() then the row as claimed (detached from its session): (attempt, row), or None if it
    was not pending (another delivery has it) or is gone."""
    attempt = claim(settings, row, ident)
    if attempt is None:
        log.info("%s %s is not pending: skipping this delivery", what, ident)
        return None
    with session_scope(settings.resolved_database_url) as s:
        claimed = s.get(row, ident)
        if claimed is None:
            return None
        s.expunge(claimed)
        return attempt, claimed


def update_mine(settings: Settings, row: Any, ident: str, attempt: int, **values: Any) -> bool:
    """Write `values` if the row is still this attempt's; False if it is gone or taken over."""
    with session_scope(settings.resolved_database_url) as s:
        done = s.execute(
            update(row)
            .where(row.id == ident, row.status == RUNNING, row.attempt == attempt)
            .values(updated_at=utcnow(), **values)
            .execution_options(synchronize_session=False)
        )
        return done.rowcount == 1


def finish(settings: Settings, row: Any, ident: str, attempt: int, status: str, **values: Any) -> bool:
    """The attempt's last write (running → `status`), if the row is still this attempt's."""
    return update_mine(
        settings, row, ident, attempt, status=status, runner_pid=None, heartbeat_at=None,
        finished_at=utcnow(), **values,
    )  # fmt: skip


def fail(settings: Settings, row: Any, ident: str, attempt: int, exc: BaseException) -> bool:
    """running → failed with the exception as the reason; False if the row is no longer ours."""
    why = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
    return finish(settings, row, ident, attempt, FAILED, error=why)


@contextmanager
def heartbeating(settings: Settings, row: Any, ident: str, attempt: int) -> Iterator[None]:
    """Refresh the row's heartbeat_at every heartbeat interval while the block runs."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(settings.heartbeat_interval_s):
            try:
                update_mine(settings, row, ident, attempt, heartbeat_at=utcnow())
            except SQLAlchemyError as exc:
                log.warning("%s: heartbeat failed: %s", ident, exc)

    thread = threading.Thread(target=beat, daemon=True, name=f"heartbeat-{ident}")
    thread.start()
    try:
        yield
    finally:
        stop.set()


def task_main(
    module: str, doc: str | None, id_flag: str, run: Callable[[str, Settings], Any], argv: list[str] | None
) -> None:
    """`python -m {module} --{id_flag} ID`: the task `run(id, settings)` from the environment's
    settings, as the local executor spawns it."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc)
    parser.add_argument(f"--{id_flag}", required=True, dest="ident", metavar="ID")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(args.ident, get_settings())
