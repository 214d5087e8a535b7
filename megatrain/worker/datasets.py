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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatrain.db.models import FAILED, READY
from megatrain.settings import Settings, get_settings
from megatrain.spec import TokenizerSpec
from megatrain.storage import StorageError, open_store, split_url
from megatrain.worker.checkpoint_tasks import claim_row, heartbeating
from megatrain.worker.task_link import TaskLink, task_link

log = logging.getLogger(__name__)

KIND = "dataset"
MAX_REASON_CHARS = 2000
OUTPUT_NAMES = ("data.bin", "data.idx")
"""Uploaded in this order: the index last."""


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
    link = task_link(settings)
    host = socket.gethostname()
    claimed = claim_row(link, KIND, dataset_id, state_reason=f"preprocessing on {host}")
    if claimed is None:
        return None
    attempt, ds = claimed
    tokenizer = TokenizerSpec.model_validate(ds.tokenizer)
    folder_url = split_url(ds.prefix_url)[0]  # {storage}/…/datasets/{name}/{id}: this dataset's alone
    store = open_store(folder_url, settings.s3_endpoint_url)
    progress = _Progress()

    def state_reason() -> dict[str, str]:
        return {"state_reason": f"preprocessing on {host}: {progress.text}"} if progress.text else {}

    with heartbeating(settings, link, KIND, dataset_id, attempt, state_reason):
        return _preprocess(settings, link, ds, attempt, tokenizer, store, progress, preprocess_fn)


def _preprocess(
    settings: Settings, link: TaskLink, ds: Any, attempt: int, tokenizer: TokenizerSpec, store: Any,
    progress: _Progress, preprocess_fn: PreprocessFn | None,
) -> str | None:  # fmt: skip
    dataset_id, folder_url = ds.id, split_url(ds.prefix_url)[0]
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix=f"megatrain-{dataset_id}-") as tmp:
            work = Path(tmp)
            run = preprocess_fn or _run_preprocess
            stats = run(ds.source_url, work / "data", tokenizer, ds.json_key, ds.append_eod, progress)
            output_bytes = 0
            for name in OUTPUT_NAMES:
                path = work / name
                output_bytes += path.stat().st_size
                store.put_file(name, path)
        stats["output_bytes"] = output_bytes
        took = time.monotonic() - started
        reason = f"{stats['documents']} documents, {stats['tokens']} tokens in {took:.1f}s"
        if link.finish(KIND, dataset_id, attempt, READY, state_reason=reason, **stats):
            log.info("dataset %s ready: %s", dataset_id, reason)
            return READY
        if not link.exists(KIND, dataset_id):
            log.info("dataset %s was deleted while preprocessing: removing its objects", dataset_id)
            _remove_folder(folder_url, settings)
        return None  # still there: a newer attempt owns it (this one was judged lost)
    except Exception as exc:  # every failure is the dataset's reason, never a lost worker
        log.warning("dataset %s failed: %s", dataset_id, exc)
        _remove_folder(folder_url, settings)
        why = (str(exc) or type(exc).__name__)[:MAX_REASON_CHARS]
        return FAILED if link.finish(KIND, dataset_id, attempt, FAILED, state_reason=why) else None


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
