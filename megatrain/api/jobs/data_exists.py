"""Whether the data a job reads exists, checked at submission (after the access check): a missing
file would otherwise pass the API and fail every attempt of the job the same way.

A JSONL source is one object; an indexed-dataset prefix needs PREFIX.bin and PREFIX.idx; the
tokenizer and a chat template's tokenizer_config.json are single files. file:// is checked with
os.access (the embedded default and shared filesystems: the API sees what the workers see); s3://
with a HEAD through megatrain.storage, with the API's credentials (the usual AWS variables,
MEGATRAIN_S3_ENDPOINT_URL). Every check runs in a small shared thread pool and the whole lot is
bounded in time: an S3 endpoint that does not answer is an error naming the field, not a hang.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from megatrain.api.jobs.data_access import is_url
from megatrain.spec import JSONL_SUFFIXES, JobSpec
from megatrain.spec_errors import Problem
from megatrain.storage import open_store, split_url

TIMEOUT_S = 10.0
"""The most a submission waits for its existence checks, all of them together."""
CHECK_ATTEMPTS = 2
"""Tries per HEAD, with no patience beyond them: one retry for a blip; a node's writes retry for up
to a minute (storage.s3.S3_PATIENCE_S), which here would outlast TIMEOUT_S and turn "refused" into
"did not answer"."""
_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="data-exists")
# Shared and small on purpose: while an S3 endpoint hangs, its stuck HEADs hold at most 8 threads
# and later submissions time out in turn, instead of piling up threads.


@dataclass(frozen=True)
class DataCheck:
    field: str
    url: str
    indexed: bool = False
    """An indexed dataset's prefix: PREFIX.bin and PREFIX.idx must both exist."""


def data_checks(spec: JobSpec) -> list[DataCheck]:
    """What must exist for `spec` to run. Sources that name a registered dataset are left out: the
    API wrote those prefixes itself and lists the dataset only once it is ready."""
    checks = [
        DataCheck(f"{field}.path", src.path, indexed=not src.is_jsonl)
        for field, src in spec.data.sources()
        if src.path and src.dataset is None
    ]
    if spec.data.tokenizer.path:
        checks.append(DataCheck("data.tokenizer.path", spec.data.tokenizer.path))
    if spec.data.chat_template and is_url(spec.data.chat_template):
        checks.append(DataCheck("data.chat_template", spec.data.chat_template))
    if spec.model.adapter_from:  # a PEFT folder: its config names it one
        folder = spec.model.adapter_from.removeprefix("hf:").rstrip("/")
        checks.append(DataCheck("model.adapter_from", f"{folder}/adapter_config.json"))
    return checks


def _file_missing(url: str) -> str | None:
    """Why the file at a file:// URL cannot be read (None: it can)."""
    path = unquote(urlparse(url).path)
    if os.path.isdir(path):
        return "is a directory, not a file"
    if not os.path.isfile(path):
        return "does not exist"
    if not os.access(path, os.R_OK):
        return "is not readable by the service (file permissions)"
    return None


def _s3_missing(url: str, endpoint_url: str | None) -> str | None:
    parent, key = split_url(url)
    try:
        if open_store(parent, endpoint_url, attempts=CHECK_ATTEMPTS, patience_s=0).exists(key):
            return None
    except Exception as exc:  # noqa: BLE001 - botocore's connection and credential errors
        return f"could not be checked: S3 did not answer ({type(exc).__name__}: {exc})"
    return "does not exist (or the service's S3 credentials may not read it)"


def _missing(url: str, endpoint_url: str | None) -> str | None:
    return _file_missing(url) if url.startswith("file://") else _s3_missing(url, endpoint_url)


def _check(check: DataCheck, endpoint_url: str | None) -> str | None:
    """Why `check` fails, as the end of a message naming its field; None when the data is there."""
    if not check.indexed:
        why = _missing(check.url, endpoint_url)
        return f"{check.field}={check.url!r} {why}" if why else None
    gone = [f"{check.url}{ext}" for ext in (".bin", ".idx") if _missing(check.url + ext, endpoint_url)]
    if not gone:
        return None
    names = " and ".join(gone)
    return (
        f"{check.field}={check.url!r}: {names} {'do' if len(gone) > 1 else 'does'} not exist or cannot "
        f"be read (an indexed dataset is PREFIX.bin + PREFIX.idx; a JSONL file's name ends in "
        f"{', '.join(JSONL_SUFFIXES)})"
    )


def missing_data(
    checks: list[DataCheck], endpoint_url: str | None, timeout_s: float | None = None
) -> list[Problem]:
    """A problem naming the field of every check that fails, in the order given; a check still
    unanswered after `timeout_s` (default TIMEOUT_S) is a problem too."""
    timeout = TIMEOUT_S if timeout_s is None else timeout_s
    futures: list[Future[str | None]] = [_POOL.submit(_check, c, endpoint_url) for c in checks]
    wait(futures, timeout=timeout)
    problems = []
    for check, future in zip(checks, futures, strict=True):
        if not future.done():
            future.cancel()  # not started yet: never start it
            message = (
                f"{check.field}={check.url!r} could not be checked within {timeout:g} s "
                "(its storage did not answer); try again, or ask the operator whether it is reachable"
            )
        else:
            error = future.exception()
            message = (
                f"{check.field}={check.url!r} could not be checked: {error}" if error else future.result()
            )
        if message:
            problems.append({"field": check.field, "message": message})
    return problems
