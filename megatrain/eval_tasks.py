"""Evaluation tasks as lm-evaluation-harness task YAML whose items are JSON files (torch-free: the
API checks an eval job's tasks at submission; megatrain.engine.evaluation.tasks runs them).

No machine of ours reaches a dataset hub, so a task's `dataset_path` must be `json` and its
`dataset_kwargs.data_files` name JSON / JSON Lines files: relative to the YAML's own folder, or
absolute paths, file:// and s3:// URLs; the YAML itself is a path, file:// or s3:// URL (the caller
applies the data-access rule to the URLs `data_urls` lists). `load_task` reads a YAML and answers
lm-eval's config with every data file resolved: to a local path, or an s3:// URL that `fetch` (the
engine's node cache) turns into one; or raises TaskError naming the field and the rule.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import yaml

OUTPUT_TYPES = ("loglikelihood", "loglikelihood_rolling", "multiple_choice", "generate_until")
SPLITS = ("test_split", "validation_split")


class TaskError(ValueError):
    """A task file lm-eval cannot run here; `field` names the key at fault ("data_files.test")."""

    def __init__(self, source: str, field: str, message: str):
        super().__init__(f"{source}: {field}: {message}")
        self.source, self.field, self.message = source, field, message


def load_task(path: str | Path, fetch: Callable[[str], Path] | None = None) -> dict[str, Any]:
    """The lm-eval task config in the YAML at `path` (a local path, file:// or s3:// URL), data
    files resolved (s3:// ones kept as URLs, or made local by `fetch`). Raises TaskError for what
    lm-eval could not run here."""
    source = str(path)
    text = _read(source, "file")
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TaskError(source, "file", f"not YAML: {exc}") from None
    if not isinstance(config, dict):
        raise TaskError(source, "file", "must hold one task: a mapping with task, dataset_path, ...")
    if "include" in config or "group" in config:
        raise TaskError(
            source, "include" if "include" in config else "group", "one self-contained task per file"
        )
    name = config.get("task")
    if not isinstance(name, str) or not name.strip():
        raise TaskError(source, "task", "a task name is required")
    if config.get("dataset_path") != "json":
        raise TaskError(source, "dataset_path", "must be `json`: items come from local JSON files, not a hub")
    output = config.get("output_type", "generate_until")
    if output not in OUTPUT_TYPES:
        raise TaskError(source, "output_type", f"must be one of {', '.join(OUTPUT_TYPES)}, got {output!r}")
    if not any(config.get(s) for s in SPLITS):
        raise TaskError(source, "test_split", "a test_split or validation_split is required")
    kwargs = dict(config.get("dataset_kwargs") or {})
    files = kwargs.get("data_files")
    if not files:
        raise TaskError(source, "dataset_kwargs.data_files", "name the items' JSON files (per split)")
    base = source.rsplit("/", 1)[0] if _is_s3(source) else _local(source).parent
    if isinstance(files, dict):
        resolved = {
            split: _files(source, f"data_files.{split}", v, base, fetch) for split, v in files.items()
        }
        for key in SPLITS:
            split = config.get(key)
            if split and split not in resolved:
                raise TaskError(source, key, f"split {split!r} has no data_files entry")
    else:
        resolved = _files(source, "data_files", files, base, fetch)  # type: ignore[assignment]
    kwargs["data_files"] = resolved
    return {**config, "dataset_kwargs": kwargs}


def data_urls(config: dict[str, Any]) -> list[str]:
    """The URLs of a loaded task's data files (for the data-access rule): file:// or s3://."""
    files = config["dataset_kwargs"]["data_files"]
    groups = files.values() if isinstance(files, dict) else [files]
    return [p if _is_s3(p) else Path(p).as_uri() for group in groups for p in group]


def _files(
    source: str, field: str, value: Any, base: Path | str, fetch: Callable[[str], Path] | None
) -> list[str]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        raise TaskError(source, field, "a file name or a list of file names")
    out = []
    for v in values:
        if _is_s3(v) or (isinstance(base, str) and "://" not in v and not v.startswith("/")):
            url = v if _is_s3(v) else f"{base}/{v}"
            _suffix(source, field, v, url)
            _exists(source, field, v, url)
            out.append(str(fetch(url)) if fetch is not None else url)
            continue
        path = _local(v) if "://" in v or Path(v).is_absolute() else Path(base) / v
        _suffix(source, field, v, str(path))
        if not path.is_file():
            raise TaskError(source, field, f"{v}: no such file ({path})")
        out.append(str(path.resolve()))
    return out


def _suffix(source: str, field: str, value: str, name: str) -> None:
    if not name.endswith((".json", ".jsonl")):
        raise TaskError(source, field, f"{value}: items must be a .json or .jsonl file")


def _exists(source: str, field: str, value: str, url: str) -> None:
    from megatrain.storage import StorageError, open_store, split_url

    parent, key = split_url(url)
    try:
        open_store(parent).stat(key)
    except StorageError as exc:
        raise TaskError(source, field, f"{value}: no such object ({url}: {exc})") from None


def _read(url: str, field: str) -> str:
    """A task file's text, from a local path, file:// or s3:// URL."""
    if _is_s3(url):
        from megatrain.storage import StorageError, read_url

        try:
            with read_url(url) as f:
                return f.read().decode()
        except StorageError as exc:
            raise TaskError(url, field, f"cannot read it: {exc}") from None
    try:
        return _local(url).read_text()
    except OSError as exc:
        raise TaskError(url, field, f"cannot read it: {exc.strerror or exc}") from None


def _is_s3(url: str) -> bool:
    return url.startswith("s3://")


def _local(url: str) -> Path:
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        return Path(unquote(parsed.path) if parsed.scheme else url)
    raise TaskError(
        url, "file", f"{parsed.scheme}:// task files are not supported here: a path, file:// or s3://"
    )
