"""Which data a tenant's job may read: the rule the API applies before a spec is accepted.

A data URL (a data source, the tokenizer file, a chat template's tokenizer_config.json: `data_urls`)
must be `file:///abs/path` or `s3://bucket/key` and, once normalised, lie under
  - the tenant's own prefix `{storage}/tenants/{tenant_name}/`,
  - the shared `{storage}/datasets/`, or
  - one of `settings.data_roots` (MEGATRAIN_ALLOWED_DATA_ROOTS).
Normalising refuses rather than repairs: relative paths, hosts in file URLs, `.`/`..`/empty
segments (also when percent-encoded), double encoding, queries, fragments, control characters and
other schemes are all errors. file:// paths are compared after resolving symlinks, so a link inside
an allowed root cannot point the job at /etc.
"""

from __future__ import annotations

import os
import re
import time
from urllib.parse import unquote

from megatrain.settings import Settings
from megatrain.spec import JobSpec

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class DataUrlError(ValueError):
    pass


def _decoded_segments(raw: str) -> list[str]:
    """The path's segments after one round of percent-decoding (what every reader of it does)."""
    if "?" in raw or "#" in raw:
        raise DataUrlError("must not carry a query or fragment")
    try:
        decoded = unquote(raw, errors="strict")
    except UnicodeDecodeError:
        raise DataUrlError("has percent-encoding that is not valid UTF-8") from None
    if "%" in decoded:
        raise DataUrlError("is percent-encoded twice")
    if any(ord(c) < 32 or ord(c) == 127 for c in decoded) or "\\" in decoded:
        raise DataUrlError("contains control characters or backslashes")
    segments = decoded.split("/")
    if any(s in ("", ".", "..") for s in segments):
        raise DataUrlError("must be a normalised path: no '.', '..' or empty ('//') segments")
    return segments


def normalise_data_url(url: str, *, root: bool = False) -> str:
    """`url` as `file:///resolved/path` or `s3://bucket/key`; raises DataUrlError saying why not.

    With `root=True` a trailing slash is allowed and an S3 URL may name just a bucket.
    """
    if root:
        url = url.rstrip("/")
    if url.startswith("file://"):
        rest = url[len("file://") :]
        if not rest.startswith("/"):
            raise DataUrlError("a file URL needs an absolute path and no host: file:///abs/path")
        segments = _decoded_segments(rest[1:]) if rest != "/" else []
        path = os.path.realpath("/" + "/".join(segments))
        return "file://" + path
    if url.startswith("s3://"):
        bucket, _, key = url[len("s3://") :].partition("/")
        if not _BUCKET.match(bucket):
            raise DataUrlError(f"names an invalid S3 bucket {bucket!r}")
        if not key:
            if root:
                return f"s3://{bucket}"
            raise DataUrlError("needs an object key: s3://bucket/key")
        # S3 keys are used as written (nobody decodes them), so no percent signs at all.
        if "%" in key:
            raise DataUrlError("must not percent-encode an S3 key")
        return f"s3://{bucket}/" + "/".join(_decoded_segments(key))
    raise DataUrlError("must be file:///abs/path or s3://bucket/key")


ROOTS_TTL_S = 10.0
"""How long the resolved roots of one tenant stand (resolving each root's symlinks costs more than
the rest of the check); a symlink an operator re-points takes effect within this."""
_roots: dict[tuple[str, ...], tuple[float, list[str]]] = {}


def allowed_roots(settings: Settings, tenant_name: str) -> list[str]:
    storage = settings.resolved_storage_url
    raw = [f"{storage}/tenants/{tenant_name}", f"{storage}/datasets", *settings.data_roots]
    key, now = tuple(raw), time.monotonic()
    cached = _roots.get(key)
    if cached is not None and now - cached[0] < ROOTS_TTL_S:
        return list(cached[1])
    if len(_roots) > 4096:  # (tenants come and go: keep the map bounded)
        _roots.clear()
    _roots[key] = now, _resolved(raw)
    return list(_roots[key][1])


def _resolved(raw: list[str]) -> list[str]:
    roots = []
    for r in raw:
        try:
            roots.append(normalise_data_url(r, root=True))
        except DataUrlError:
            continue  # a malformed configured root grants nothing
    return roots


def _under(url: str, roots: list[str]) -> bool:
    return any(url == r or url.startswith(r + "/") for r in roots)


def data_url_problem(field: str, url: str, settings: Settings, tenant_name: str) -> str | None:
    """Why the tenant may not read `url` (a message naming `field`), or None when it may."""
    try:
        normalised = normalise_data_url(url)
    except DataUrlError as exc:
        return f"{field}={url!r} {exc}"
    if _under(normalised, allowed_roots(settings, tenant_name)):
        return None
    storage = settings.resolved_storage_url
    roots = ", ".join(settings.data_roots) or "none"
    # The fix is an operator's: the variable is read where the API runs, so say where to set it.
    configured = [r.strip() for r in settings.allowed_data_roots.split(",") if r.strip()]
    value = ",".join([*configured, normalised.rsplit("/", 1)[0]])
    # The command first: a long list of roots may be clipped (errors.MAX_MESSAGE_CHARS), the fix not.
    return (
        f"{field}={url!r} is outside the data this tenant may read. To allow it, set where the API "
        f"runs (the variable adds to the defaults): `megatrain down && "
        f"MEGATRAIN_ALLOWED_DATA_ROOTS={value} megatrain up`. Readable now: its own prefix "
        f"{storage}/tenants/{tenant_name}/, the shared {storage}/datasets/, {roots}"
    )


def is_url(text: str) -> bool:
    """Whether data.chat_template names a file (a tokenizer_config.json), not a built-in template:
    the engine's own test (a built-in name has neither '/' nor ':')."""
    return "/" in text or ":" in text


def data_urls(spec: JobSpec) -> list[tuple[str, str]]:
    """(field, URL) of everything a job reads besides its init_from: data sources, tokenizer file,
    chat template file, the lm-eval task files it scores."""
    urls = [(f"{field}.path", src.path) for field, src in spec.data.sources() if src.path]
    if spec.data.tokenizer.path:
        urls.append(("data.tokenizer.path", spec.data.tokenizer.path))
    if spec.data.chat_template and is_url(spec.data.chat_template):
        urls.append(("data.chat_template", spec.data.chat_template))
    if spec.model.adapter_from and spec.model.adapter_from.startswith("hf:"):  # checkpoint: is a job's
        urls.append(("model.adapter_from", spec.model.adapter_from.removeprefix("hf:")))
    # (the items each task names: megatrain.api.jobs.validation)
    urls += [(field, task) for field, task in task_fields(spec)]
    return urls


def task_fields(spec: JobSpec) -> list[tuple[str, str]]:
    """(field, URL) of every lm-eval task file the job scores: an eval job's eval.tasks, a training
    job's training.eval_tasks."""
    if spec.eval is not None:
        return [(f"eval.tasks[{i}]", task) for i, task in enumerate(spec.eval.tasks)]
    return [(f"training.eval_tasks[{i}]", task) for i, task in enumerate(spec.training.eval_tasks)]
