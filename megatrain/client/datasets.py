"""The SDK's dataset calls (mixed into `Client`): upload a JSONL file or register a storage URL,
list, read, delete, and wait until the workers have preprocessed one."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from megatrain.client.errors import MegatrainError
from megatrain.client.models import Dataset

UPLOAD_TIMEOUT_S = 3600.0
"""Read timeout of an upload: the API answers only once the whole file is checked and stored."""


class DatasetFailed(MegatrainError):
    """The workers could not preprocess the dataset; `dataset.state_reason` says why."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        super().__init__(f"dataset {dataset.name!r} failed: {dataset.state_reason}")


def tokenizer_arg(tokenizer: str | dict[str, Any]) -> str:
    """The shorthand the upload's query takes: 'byte', 'hf:URL', 'tiktoken:NAME', 'sentencepiece:URL'."""
    if isinstance(tokenizer, str):
        return tokenizer
    kind = tokenizer.get("type", "byte")
    if kind == "byte":
        return "byte"
    return f"{kind}:{tokenizer.get('name') if kind == 'tiktoken' else tokenizer.get('path')}"


class DatasetsMixin:
    if TYPE_CHECKING:  # provided by Client
        _http: httpx.Client

        def _json(self, method: str, path: str, **kwargs: Any) -> Any: ...
        def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response: ...

    def upload_dataset(
        self,
        path: str | Path,
        name: str,
        tokenizer: str | dict[str, Any] = "byte",
        json_key: str = "text",
        append_eod: bool = True,
        wait: bool = False,
        timeout_s: float | None = None,
        record_format: str = "text",
    ) -> Dataset:
        """Upload a JSONL file (streamed from disk, never read whole) as the dataset `name`; returns
        it `pending`, or with `wait=True` once the workers have made it ready (DatasetFailed if not).
        `record_format` chat, prompt_completion or preference: OpenAI's fine-tuning records, checked
        line by line and ready at once."""
        p = Path(path)
        if not p.is_file():
            raise MegatrainError(f"dataset file {p} does not exist")
        params = {"name": name, "tokenizer": tokenizer_arg(tokenizer), "json_key": json_key}
        params["append_eod"] = "true" if append_eod else "false"
        params["record_format"] = record_format
        headers = {"Content-Type": "application/x-ndjson", "Content-Length": str(p.stat().st_size)}
        with open(p, "rb") as f:
            data = self._json(
                "POST",
                "/v1/datasets",
                params=params,
                content=_chunks(f),
                headers=headers,
                timeout=httpx.Timeout(
                    self._http.timeout.connect, read=UPLOAD_TIMEOUT_S, write=UPLOAD_TIMEOUT_S
                ),
            )
        ds = Dataset.from_dict(data)
        return self.wait_dataset(ds.name, timeout_s) if wait else ds

    def register_dataset(
        self,
        source_url: str,
        name: str,
        tokenizer: str | dict[str, Any] = "byte",
        json_key: str = "text",
        append_eod: bool = True,
    ) -> Dataset:
        """Register a JSONL file already in storage (file:///… or s3://…) the tenant may read."""
        body = {
            "name": name,
            "source_url": source_url,
            "tokenizer": tokenizer,
            "json_key": json_key,
            "append_eod": append_eod,
        }
        return Dataset.from_dict(self._json("POST", "/v1/datasets", json=body))

    def list_datasets(self) -> list[Dataset]:
        """The tenant's datasets and the shared ones, by name."""
        return [Dataset.from_dict(d) for d in self._json("GET", "/v1/datasets")["items"]]

    def get_dataset(self, name: str) -> Dataset:
        return Dataset.from_dict(self._json("GET", f"/v1/datasets/{name}"))

    def delete_dataset(self, name: str) -> None:
        self._request("DELETE", f"/v1/datasets/{name}")

    def wait_dataset(
        self,
        name: str,
        timeout_s: float | None = None,
        poll_interval_s: float = 1.0,
        on_update: Callable[[Dataset], None] | None = None,
    ) -> Dataset:
        """Block until the dataset is ready (returned) or failed (DatasetFailed); `on_update` sees
        each state read meanwhile (its state_reason carries the workers' progress)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            ds = self.get_dataset(name)
            if on_update is not None:
                on_update(ds)
            if ds.state == "ready":
                return ds
            if ds.state == "failed":
                raise DatasetFailed(ds)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"dataset {name!r} still {ds.state} after {timeout_s:g} s")
            time.sleep(poll_interval_s)


def _chunks(f: Any, size: int = 1 << 20) -> Any:
    while chunk := f.read(size):
        yield chunk
