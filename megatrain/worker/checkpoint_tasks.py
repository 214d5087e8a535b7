"""The worker side of background work on a row (a dataset, an export, a sample): claim a pending row,
keep its heartbeat fresh while the work runs, and write the outcome only while the row is still this
attempt's (the scheduler may judge a silent worker lost and hand the row to another). The control
plane's side is megatrain.attempts.tasks, reached over worker.task_link (the database, or the API
with a node token).
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from megatrain.db.models import FAILED
from megatrain.settings import Settings, get_settings
from megatrain.worker.reporter import ReportError
from megatrain.worker.task_link import TaskLink, task_link

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 2000


def checkpoint_folder(storage_url: str, job_id: str, step: int) -> str:
    """The URL of a job's checkpoint folder in the storage layout."""
    return f"{storage_url.rstrip('/')}/jobs/{job_id}/checkpoints/iter_{step:07d}"


def claim_row(link: TaskLink, kind: str, ident: str, **values: Any) -> tuple[int, Any] | None:
    """pending → running for this worker: (attempt, the row as claimed, detached), or None if it
    was not pending (another delivery has it) or is gone."""
    claimed = link.claim(kind, ident, **values)
    if claimed is None:
        log.info("%s %s is not pending: skipping this delivery", kind, ident)
    return claimed


def fail(link: TaskLink, kind: str, ident: str, attempt: int, exc: BaseException) -> bool:
    """running → failed with the exception as the reason; False if the row is no longer ours."""
    why = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
    return link.finish(kind, ident, attempt, FAILED, error=why)


@contextmanager
def heartbeating(
    settings: Settings, link: TaskLink, kind: str, ident: str, attempt: int,
    progress: Callable[[], dict[str, Any]] | None = None,
) -> Iterator[None]:  # fmt: skip
    """Refresh the row's heartbeat (and the `progress()` columns) every heartbeat interval while
    the block runs."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(settings.heartbeat_interval_s):
            try:
                link.beat(kind, ident, attempt, **(progress() if progress else {}))
            except (SQLAlchemyError, ReportError) as exc:
                log.warning("%s %s: heartbeat failed: %s", kind, ident, exc)

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


__all__ = ["checkpoint_folder", "claim_row", "fail", "heartbeating", "task_link", "task_main"]
