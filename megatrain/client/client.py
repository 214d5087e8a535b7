"""The Python SDK: one httpx client per `Client`, plain dataclasses and dicts back.

Every long call returns at once (submit gives a job id); `wait`, `follow_logs` and `stream_metrics`
are the only calls that block, and they block by polling or by reading an SSE stream.
This module must stay importable without torch, fastapi or sqlalchemy (a laptop needs only httpx).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urljoin

import httpx
import yaml

from megatrain.client.datasets import DatasetsMixin
from megatrain.client.download import extract_checkpoint_files, extract_checkpoint_tar
from megatrain.client.errors import ApiError, ApiUnreachable, SpecFileError
from megatrain.client.exports import ExportsMixin
from megatrain.client.models import Checkpoint, Job, LogLine
from megatrain.client.models_registry import ModelsMixin
from megatrain.client.samples import SamplesMixin
from megatrain.client.spec_paths import resolve_spec_paths
from megatrain.client.tensorboard import TensorBoardMixin

if TYPE_CHECKING:
    from megatrain.spec import JobSpec

DEFAULT_TIMEOUT_S = 30.0


def read_credentials(path: Path) -> str | None:
    """The API key stored by the embedded default; None if the file is absent or empty.

    Accepts a bare key, `api_key = KEY` / `MEGATRAIN_API_KEY=KEY` lines, or a JSON object.
    """
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text:
        return None
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError:
            return None
        key = data.get("api_key") or data.get("key") if isinstance(data, dict) else None
        return str(key) if key else None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "=" in line:
            name, _, value = line.partition("=")
            if name.strip().lower() in ("api_key", "megatrain_api_key", "key"):
                return value.strip().strip("'\"") or None
            continue
        return line
    return None


def load_spec_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON spec file into a dict (the server validates its contents); data paths
    written without a scheme are resolved against the file's folder (see spec_paths)."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise SpecFileError(f"spec file {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecFileError(f"cannot read spec file {p}: {exc}") from None
    try:
        data = yaml.safe_load(text)  # YAML is a superset of JSON: one parser reads both
    except yaml.YAMLError as exc:
        raise SpecFileError(f"spec file {p} is not valid YAML or JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SpecFileError(
            f"spec file {p} must hold a mapping (a YAML/JSON object), not {type(data).__name__}"
        )
    return resolve_spec_paths(data, p.resolve().parent)


def _items(data: Any) -> list[Any]:
    """A list response, whether the server sends a bare list or wraps it as {"items": [...]}."""
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        for key in ("items", "metrics", "events", "logs", "checkpoints", "lines"):
            if isinstance(data.get(key), list):
                return data[key]
    raise ApiError(200, f"unexpected response shape: {str(data)[:200]}")


class Client(DatasetsMixin, ModelsMixin, ExportsMixin, SamplesMixin, TensorBoardMixin):
    """A client of the megatrain API.

    Arguments default to the settings (MEGATRAIN_API_URL, MEGATRAIN_API_KEY), and the key to the
    credentials file the embedded default writes under MEGATRAIN_HOME.
    """

    def __init__(
        self,
        api_url: str | None = None,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ):
        source = "the api_key argument"
        if api_url is None or api_key is None:
            from megatrain.settings import get_settings

            settings = get_settings()
            api_url = api_url or settings.api_url
            if api_key is None:
                source = "MEGATRAIN_API_KEY" if settings.api_key else str(settings.credentials_path)
                api_key = settings.api_key or read_credentials(settings.credentials_path)
        self.api_url = api_url.rstrip("/")
        self.api_key = api_key
        self.key_source = source if api_key else None
        """Where the key came from: MEGATRAIN_API_KEY, the credentials file's path, or the argument."""
        headers = {"Accept": "application/json", "User-Agent": "megatrain-sdk"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.Client(
            base_url=self.api_url, headers=headers, timeout=timeout, transport=transport
        )

    # -- plumbing ------------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def sent_key(self) -> str:
        """Which key this client sends and from where, for a 401: a prefix only, never the secret
        (at most the 10 characters the server lists as the key's prefix, and a third of the key)."""
        if not self.api_key:
            return "no API key was sent: MEGATRAIN_API_KEY is unset and no credentials file holds one"
        shown = self.api_key[: min(10, len(self.api_key) // 3)]
        return f"sent the key {shown}… from {self.key_source}"

    def _raise_for(self, resp: httpx.Response) -> None:
        if resp.status_code < 400:
            return
        try:
            body = resp.json()
            detail = body.get("detail", body) if isinstance(body, dict) else body
        except ValueError:
            detail = resp.text.strip()[:500] or resp.reason_phrase
        raise ApiError(resp.status_code, detail, self.sent_key if resp.status_code == 401 else None)

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ApiUnreachable(self.api_url, str(exc) or type(exc).__name__) from None
        self._raise_for(resp)
        return resp

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        resp = self._request(method, path, **kwargs)
        try:
            return resp.json()
        except ValueError:
            raise ApiError(resp.status_code, f"expected JSON from {path}, got: {resp.text[:200]}") from None

    # -- service -------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """The API's /healthz answer; raises ApiUnreachable when nothing listens."""
        try:
            return self._json("GET", "/healthz")
        except ApiError as exc:
            if exc.status != 404:
                raise
            return self._json("GET", "/v1/healthz")

    def spec_schema(self) -> dict[str, Any]:
        return self._json("GET", "/v1/spec/schema")

    def spec_example(self) -> dict[str, Any]:
        """{"spec", "source", "hint"}: a ready-to-submit spec on data that exists, or spec None."""
        return dict(self._json("GET", "/v1/spec/example"))

    def cluster(self) -> dict[str, Any]:
        """{"pools": [{name, accelerator, slot_kind, slots_total/used/free, nodes}], "queue": [...]}:
        each pool's slots (GPUs, or CPU slots on a pool without GPUs) and the queue in order."""
        return dict(self._json("GET", "/v1/cluster"))

    # -- jobs ----------------------------------------------------------------------------------

    def submit(self, spec: dict[str, Any] | JobSpec | str | Path, idempotency_key: str | None = None) -> Job:
        """Submit a job (a dict, a JobSpec, or a YAML/JSON file path); returns it as queued.

        With an idempotency key, submitting again returns the first job instead of a second one.
        """
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return Job.from_dict(self._json("POST", "/v1/jobs", json=_spec_body(spec), headers=headers))

    def validate(self, spec: dict[str, Any] | JobSpec | str | Path) -> dict[str, Any]:
        """Every check a submission runs (spec, layout, pool fit, data access), creating no job:
        {"valid", "spec" (as stored), "layout", "num_procs"}; an invalid spec raises the 422."""
        return dict(self._json("POST", "/v1/spec/validate", json=_spec_body(spec)))

    def plan(
        self,
        spec: dict[str, Any] | JobSpec | str | Path,
        pool: dict[str, Any] | None = None,
        devices: int | None = None,
    ) -> dict[str, Any]:
        """The planner's fastest layout for a spec, submitting nothing (POST /v1/plan): {"layout",
        "predicted", "candidates", ...}. `pool`: a pool description (default: the spec's
        resources.pool as the server knows it). A spec that fits no layout raises the 422."""
        body: dict[str, Any] = {"spec": _spec_body(spec)}
        if pool is not None:
            body["pool"] = pool
        if devices is not None:
            body["devices"] = devices
        return dict(self._json("POST", "/v1/plan", json=body))

    def get_job(self, job_id: str) -> Job:
        return Job.from_dict(self._json("GET", f"/v1/jobs/{job_id}"))

    def list_jobs(
        self,
        status: str | None = None,
        limit: int | None = None,
        page_size: int = 100,
        include_spec: bool = False,
    ) -> Iterator[Job]:
        """Jobs newest first, following the API's cursor across pages; at most `limit` of them.
        Their `spec` is None unless `include_spec` (get_job always has it)."""
        cursor: str | None = None
        seen = 0
        while True:
            want = page_size if limit is None else min(page_size, limit - seen)
            if want <= 0:
                return
            params: dict[str, Any] = {"limit": want}
            if status:
                params["status"] = status
            if cursor:
                params["cursor"] = cursor
            if include_spec:
                params["include"] = "spec"
            page = self._json("GET", "/v1/jobs", params=params)
            for item in _items(page):
                yield Job.from_dict(item)
                seen += 1
                if limit is not None and seen >= limit:
                    return
            cursor = page.get("next_cursor") if isinstance(page, dict) else None
            if not cursor:
                return

    def cancel(self, job_id: str) -> Job:
        """Ask for cancellation; a queued job is cancelled at once, a running one when its runner stops."""
        return Job.from_dict(self._json("POST", f"/v1/jobs/{job_id}/cancel"))

    def events(self, job_id: str) -> list[dict[str, Any]]:
        """State transitions and notable events, oldest first."""
        return list(_items(self._json("GET", f"/v1/jobs/{job_id}/events")))

    def metrics(
        self, job_id: str, since_step: int | None = None, kind: str | None = None
    ) -> list[dict[str, Any]]:
        """Metric rows (kind 'train', 'val' or 'eval', or only `kind`) with step > since_step, in step
        order."""
        params = _metric_params(since_step, kind)
        return list(_items(self._json("GET", f"/v1/jobs/{job_id}/metrics", params=params)))

    def results(self, job_id: str) -> dict[str, Any]:
        """The job's evaluation results: `tasks` {task: {metric: {value, stderr, n}}} at the latest
        step scored (`step`; null: none yet), and `history`, every scored step's."""
        return dict(self._json("GET", f"/v1/jobs/{job_id}/results"))

    def stream_metrics(
        self, job_id: str, since_step: int | None = None, kind: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """Metric rows as the server pushes them (SSE), until the job ends or the stream closes."""
        params = _metric_params(since_step, kind)
        headers = {"Accept": "text/event-stream"}
        try:
            with self._http.stream(
                "GET",
                f"/v1/jobs/{job_id}/metrics",
                params=params,
                headers=headers,
                timeout=httpx.Timeout(self._http.timeout.connect, read=None),
            ) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    self._raise_for(resp)
                if not resp.headers.get("content-type", "").startswith("text/event-stream"):
                    # A server without SSE answers with the plain list; hand those rows over once.
                    resp.read()
                    yield from _items(resp.json())
                    return
                for event, data in _parse_sse(resp.iter_lines()):
                    if event in ("end", "done", "close"):
                        return
                    if isinstance(data, dict) and "step" in data:
                        yield data
                    elif isinstance(data, list):
                        yield from (row for row in data if isinstance(row, dict))
        except httpx.TransportError as exc:
            raise ApiUnreachable(self.api_url, str(exc) or type(exc).__name__) from None

    def logs(self, job_id: str, after_seq: int = 0, limit: int | None = None) -> list[LogLine]:
        """Log lines with seq > after_seq, oldest first."""
        params: dict[str, Any] = {"after_seq": after_seq}
        if limit is not None:
            params["limit"] = limit
        rows = _items(self._json("GET", f"/v1/jobs/{job_id}/logs", params=params))
        return [LogLine.from_dict(r) for r in rows]

    def follow_logs(self, job_id: str, after_seq: int = 0, poll_interval_s: float = 1.0) -> Iterator[LogLine]:
        """Every log line as it arrives, until the job has ended and its last lines are read."""
        while True:
            # Read the status first: lines written before the job ended are then surely visible.
            done = self.get_job(job_id).done
            while True:
                batch = self.logs(job_id, after_seq=after_seq)
                if not batch:
                    break
                yield from batch
                after_seq = batch[-1].seq
            if done:
                return
            time.sleep(poll_interval_s)

    def wait(self, job_id: str, timeout_s: float | None = None, poll_interval_s: float = 1.0) -> Job:
        """Block until the job reaches succeeded, failed or cancelled; returns its final state."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            job = self.get_job(job_id)
            if job.done:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} still {job.status} after {timeout_s:g} s")
            time.sleep(poll_interval_s)

    # -- checkpoints ---------------------------------------------------------------------------

    def checkpoints(self, job_id: str) -> list[Checkpoint]:
        rows = _items(self._json("GET", f"/v1/jobs/{job_id}/checkpoints"))
        return sorted((Checkpoint.from_dict(r) for r in rows), key=lambda c: c.step)

    def download(
        self,
        job_id: str,
        step: int | None = None,
        dest: str | Path | None = None,
        weights_only: bool = False,
    ) -> Path:
        """Fetch a checkpoint (the latest when step is None) into the folder `dest`; returns it.

        The folder ends up holding the checkpoint's files (model_*.bin, manifest.json, …); with
        weights_only, not the optimizer state (state_*.bin): `load_checkpoint` loads it, a resume
        cannot.
        """
        if step is None:
            cps = self.checkpoints(job_id)
            if not cps:
                raise ApiError(404, self.get_job(job_id).no_checkpoints)
            step = cps[-1].step
        dest = Path(dest) if dest is not None else Path(f"{job_id}-iter_{step:07d}")
        path = f"/v1/jobs/{job_id}/checkpoints/{step}/download"
        if weights_only:
            return self._download_folder(path, dest, params={"weights_only": "true"}, weights_only=True)
        return self._download_folder(path, dest)

    def _download_folder(
        self,
        path: str,
        dest: Path,
        marker: str = "manifest.json",
        params: dict[str, str] | None = None,
        weights_only: bool = False,
    ) -> Path:
        """A download endpoint's folder (a tar stream or a JSON listing of file URLs) into `dest`,
        which may be replaced only if it is empty or holds `marker` (an earlier download of its kind).
        With weights_only the manifest is checked only for the files a weights-only copy holds."""
        try:
            with self._http.stream(
                "GET",
                path,
                params=params,
                follow_redirects=True,
                timeout=httpx.Timeout(self._http.timeout.connect, read=300.0),
            ) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    self._raise_for(resp)
                if resp.headers.get("content-type", "").startswith("application/json"):
                    listing = json.loads(resp.read())
                    return extract_checkpoint_files(
                        listing,
                        dest,
                        self._fetch_to_file,
                        base=str(resp.url),
                        marker=marker,
                        weights_only=weights_only,
                    )
                return extract_checkpoint_tar(
                    resp.iter_bytes(), dest, marker=marker, weights_only=weights_only
                )
        except httpx.TransportError as exc:
            raise ApiUnreachable(self.api_url, str(exc) or type(exc).__name__) from None

    def _fetch_to_file(self, url: str, target: Path, base: str) -> None:
        """Download one file of a listing: presigned URLs go out without our key, API paths with it."""
        full, api = httpx.URL(urljoin(base, url)), httpx.URL(self.api_url)
        # Only the API's own origin gets our key: S3 refuses a presigned URL sent with a second auth.
        same_origin = (full.scheme, full.host, full.port) == (api.scheme, api.host, api.port)
        stream = (
            self._http.stream("GET", full, follow_redirects=True)
            if same_origin
            else httpx.stream("GET", full, follow_redirects=True, timeout=300.0)
        )
        with stream as resp:
            if resp.status_code >= 400:
                resp.read()
                self._raise_for(resp)
            with open(target, "wb") as f:
                for chunk in resp.iter_bytes(1 << 20):
                    f.write(chunk)


def _spec_body(spec: dict[str, Any] | JobSpec | str | Path) -> dict[str, Any]:
    if isinstance(spec, str | Path):
        return load_spec_file(spec)
    if isinstance(spec, dict):
        return spec
    if hasattr(spec, "model_dump"):
        return dict(spec.model_dump(mode="json"))
    raise SpecFileError(f"a job spec must be a dict, a JobSpec or a file path, not {type(spec).__name__}")


def _metric_params(since_step: int | None, kind: str | None) -> dict[str, Any]:
    params: dict[str, Any] = {} if since_step is None else {"since_step": since_step}
    if kind is not None:
        params["kind"] = kind
    return params


def _parse_sse(lines: Iterator[str]) -> Iterator[tuple[str, Any]]:
    """(event name, decoded data) for each server-sent event; comments and keep-alives are skipped."""
    event, data_lines = "message", []
    for line in lines:
        if line == "":
            if data_lines:
                text = "\n".join(data_lines)
                try:
                    payload: Any = json.loads(text)
                except ValueError:
                    payload = text
                yield event, payload
            event, data_lines = "message", []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                event = value
            elif name == "data":
                data_lines.append(value)
    if data_lines:
        yield event, "\n".join(data_lines)
