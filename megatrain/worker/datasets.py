"""The preprocessing task: turn a registered dataset's JSONL into an indexed dataset in storage.

`preprocess_dataset(dataset_id, settings)` is thin and idempotent: it claims a `pending` dataset
(→ processing; a delivery that finds it in any other state does nothing), tokenizes its source
(streamed from file:// or s3://) with the engine's preprocessing into a local temporary folder
(progress in `state_reason`, written with each heartbeat), uploads PREFIX.bin then PREFIX.idx
(the index last: a reader that finds it finds the data), and marks it `ready` with its statistics,
or `failed` with the reason after removing what it wrote. A heartbeat keeps `heartbeat_at` fresh so
the scheduler can tell a lost worker (its dataset goes back to pending) from a slow one.

CLI: `python -m megatrain.worker.datasets --dataset-id ID` (what the local executor spawns).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import SQLAlchemyError

from megatrain.db.models import FAILED, PENDING, PROCESSING, READY, Dataset, utcnow
from megatrain.db.session import session_scope
from megatrain.settings import Settings, get_settings
from megatrain.spec import TokenizerSpec
from megatrain.storage import StorageError, open_store, split_url

log = logging.getLogger(__name__)

MAX_REASON_CHARS = 2000
OUTPUT_NAMES = ("data.bin", "data.idx")
"""Uploaded in this order: the index last."""


def claim(settings: Settings, dataset_id: str) -> int | None:
    """pending → processing for this process; the attempt number, or None if it was not pending."""
    with session_scope(settings.resolved_database_url) as s:
        attempt = s.scalar(select(Dataset.attempt).where(Dataset.id == dataset_id, Dataset.state == PENDING))
        if attempt is None:
            return None
        done = s.execute(
            update(Dataset)
            .where(Dataset.id == dataset_id, Dataset.state == PENDING, Dataset.attempt == attempt)
            .values(
                state=PROCESSING,
                state_reason=f"preprocessing on {socket.gethostname()}",
                attempt=attempt + 1,
                runner_host=socket.gethostname(),
                runner_pid=os.getpid(),
                heartbeat_at=utcnow(),
                updated_at=utcnow(),
            )
            .execution_options(synchronize_session=False)
        )
        return attempt + 1 if done.rowcount == 1 else None


def _mine(dataset_id: str, attempt: int) -> Any:
    return (Dataset.id == dataset_id, Dataset.state == PROCESSING, Dataset.attempt == attempt)


def _finish(settings: Settings, dataset_id: str, attempt: int, **values: Any) -> bool:
    """Set the outcome if the dataset is still this attempt's; False if it is gone or taken over."""
    with session_scope(settings.resolved_database_url) as s:
        done = s.execute(
            update(Dataset)
            .where(*_mine(dataset_id, attempt))
            .values(runner_pid=None, heartbeat_at=None, finished_at=utcnow(), updated_at=utcnow(), **values)
            .execution_options(synchronize_session=False)
        )
        return done.rowcount == 1


def _heartbeat(
    settings: Settings, dataset_id: str, attempt: int, stop: threading.Event, progress: _Progress
) -> None:
    host = socket.gethostname()
    while not stop.wait(settings.heartbeat_interval_s):
        values: dict[str, Any] = {"heartbeat_at": utcnow()}
        if progress.text:
            values["state_reason"] = f"preprocessing on {host}: {progress.text}"
        try:
            with session_scope(settings.resolved_database_url) as s:
                s.execute(
                    update(Dataset)
                    .where(*_mine(dataset_id, attempt))
                    .values(**values)
                    .execution_options(synchronize_session=False)
                )
        except SQLAlchemyError as exc:
            log.warning("dataset %s: heartbeat failed: %s", dataset_id, exc)


PREPROCESS_WORKERS = max(1, min(4, (os.cpu_count() or 2) // 2))
"""Tokenizer processes per dataset: half the cores, at most 4 (a worker node also trains)."""


def _run_preprocess(
    source: str,
    prefix: Path,
    tokenizer: TokenizerSpec,
    json_key: str,
    append_eod: bool,
    progress: Callable[[Any], None],
) -> dict[str, Any]:
    """The engine's preprocessing, streaming `source` (file:// or s3://) into `prefix`.bin/.idx
    (imported here: only a worker needs the engine)."""
    from megatrain.engine.data.preprocess import preprocess

    stats = preprocess(
        source, prefix, tokenizer, json_key=json_key, append_eod=append_eod, workers=PREPROCESS_WORKERS,
        on_error="fail", progress=progress,
    )  # fmt: skip
    return {
        "documents": stats.documents,
        "tokens": stats.tokens,
        "vocab_size": stats.vocab_size,
        "input_bytes": stats.input_bytes,
    }


PreprocessFn = Callable[[str, Path, TokenizerSpec, str, bool, Callable[[Any], None]], dict[str, Any]]


class _Progress:
    """The latest progress report of the preprocessing, as the heartbeat writes it (text)."""

    def __init__(self) -> None:
        self.text: str | None = None

    def __call__(self, info: Any) -> None:
        mib = info.bytes_read / (1 << 20)
        rate = mib / info.seconds if info.seconds > 0 else 0.0
        self.text = (
            f"{info.documents:,} documents, {info.tokens:,} tokens, {mib:,.0f} MiB read ({rate:,.1f} MiB/s)"
        )


def preprocess_dataset(
    dataset_id: str, settings: Settings, preprocess_fn: PreprocessFn | None = None
) -> str | None:
    """Preprocess a pending dataset; its final state (ready/failed), or None if it was not pending
    (another delivery ran it) or was deleted meanwhile."""
    attempt = claim(settings, dataset_id)
    if attempt is None:
        log.info("dataset %s is not pending: skipping this delivery", dataset_id)
        return None
    with session_scope(settings.resolved_database_url) as s:
        ds = s.get(Dataset, dataset_id)
        if ds is None:
            return None
        source, prefix_url = ds.source_url, ds.prefix_url
        tokenizer = TokenizerSpec.model_validate(ds.tokenizer)
        json_key, append_eod = ds.json_key, ds.append_eod
    folder_url = split_url(prefix_url)[0]  # {storage}/…/datasets/{name}/{id}: this dataset's alone
    store = open_store(folder_url, settings.s3_endpoint_url)
    stop, progress = threading.Event(), _Progress()
    beat = threading.Thread(
        target=_heartbeat, args=(settings, dataset_id, attempt, stop, progress), daemon=True
    )
    beat.start()
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix=f"megatrain-{dataset_id}-") as tmp:
            work = Path(tmp)
            run = preprocess_fn or _run_preprocess
            stats = run(source, work / "data", tokenizer, json_key, append_eod, progress)
            output_bytes = 0
            for name in OUTPUT_NAMES:
                path = work / name
                output_bytes += path.stat().st_size
                store.put_file(name, path)
        stats["output_bytes"] = output_bytes
        took = time.monotonic() - started
        reason = f"{stats['documents']} documents, {stats['tokens']} tokens in {took:.1f}s"
        if _finish(settings, dataset_id, attempt, state=READY, state_reason=reason, **stats):
            log.info("dataset %s ready: %s", dataset_id, reason)
            return READY
        if not _exists(settings, dataset_id):
            log.info("dataset %s was deleted while preprocessing: removing its objects", dataset_id)
            _remove_folder(folder_url, settings)
        return None  # still there: a newer attempt owns it (this one was judged lost)
    except Exception as exc:  # every failure is the dataset's reason, never a lost worker
        log.warning("dataset %s failed: %s", dataset_id, exc)
        _remove_folder(folder_url, settings)
        why = (str(exc) or type(exc).__name__)[:MAX_REASON_CHARS]
        return FAILED if _finish(settings, dataset_id, attempt, state=FAILED, state_reason=why) else None
    finally:
        stop.set()


def _exists(settings: Settings, dataset_id: str) -> bool:
    with session_scope(settings.resolved_database_url) as s:
        return s.scalar(select(Dataset.id).where(Dataset.id == dataset_id)) is not None


def _remove_folder(folder_url: str, settings: Settings) -> None:
    """Delete everything of the dataset (its upload, its output): a failed dataset keeps no objects."""
    parent, name = split_url(folder_url)
    try:
        open_store(parent, settings.s3_endpoint_url).delete_prefix(name)
    except StorageError as exc:
        log.warning("could not delete %s: %s", folder_url, exc)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megatrain.worker.datasets", description=__doc__)
    parser.add_argument("--dataset-id", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    preprocess_dataset(args.dataset_id, get_settings())


if __name__ == "__main__":
    main()
