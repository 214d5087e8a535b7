"""The dataset preprocessing task and its dispatch: pending → processing → ready with statistics
read back from the indexed dataset, or failed with the reason and no objects left; idempotent
deliveries; a dataset deleted mid-way; the scheduler's hand-out (once, through the executor) and its
recovery of lost workers; the local executor end to end."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import delete, update
from worker_helpers import wait_for

from megatrain.api.auth import get_or_create_tenant
from megatrain.db.models import FAILED, PENDING, PROCESSING, READY, Dataset, new_id, utcnow
from megatrain.db.session import session_scope
from megatrain.scheduler.datasets import MAX_DATASET_ATTEMPTS, dispatch_datasets, reconcile_datasets
from megatrain.scheduler.loop import Scheduler
from megatrain.settings import Settings
from megatrain.spec import TokenizerSpec
from megatrain.storage import open_store
from megatrain.worker.datasets import preprocess_dataset
from megatrain.worker.executors import LocalExecutor
from megatrain.worker.task_link import DbTasks

TEXTS = [f"document {i}: " + "lorem ipsum " * (i % 5 + 1) for i in range(30)]


def _jsonl(texts: list[str], key: str = "text") -> bytes:
    return b"".join(json.dumps({key: t}).encode() + b"\n" for t in texts)


@pytest.fixture
def register(settings: Settings) -> Callable[..., str]:
    """A dataset as POST /v1/datasets leaves it: source.jsonl stored in its folder, row pending."""

    def make(name: str = "corpus", body: bytes | None = None, storage: str | None = None, **row: Any) -> str:
        storage = storage or settings.resolved_storage_url
        dataset_id = new_id("ds")
        folder = f"tenants/acme/datasets/{name}/{dataset_id}"
        open_store(storage).put_bytes(f"{folder}/source.jsonl", _jsonl(TEXTS) if body is None else body)
        with session_scope(settings.resolved_database_url) as s:
            tenant = get_or_create_tenant(s, "acme")
            s.add(
                Dataset(
                    id=dataset_id, tenant_id=tenant.id, name=name, state=PENDING,
                    source_url=f"{storage}/{folder}/source.jsonl", uploaded=True,
                    prefix_url=f"{storage}/{folder}/data", tokenizer={"type": "byte"}, **row,
                )
            )  # fmt: skip
        return dataset_id

    return make


def _row(settings: Settings, dataset_id: str) -> Dataset | None:
    with session_scope(settings.resolved_database_url) as s:
        return s.get(Dataset, dataset_id)


def _folder_keys(settings: Settings, dataset_id: str) -> list[str]:
    return [o.key for o in open_store(settings.resolved_storage_url).list() if dataset_id in o.key]


def _fake_preprocess(calls: list[str], fail: Exception | None = None) -> Callable[..., dict[str, Any]]:
    """Writes a real (tiny) indexed dataset with the engine's writer, or raises `fail`."""

    def run(
        source: str, prefix: Path, tokenizer: TokenizerSpec, json_key: str, append_eod: bool, progress: Any
    ) -> dict[str, Any]:
        from megatrain.engine.data.indexed import IndexedDatasetWriter

        calls.append(source)
        if fail is not None:
            raise fail
        with IndexedDatasetWriter(prefix) as w:
            w.add_document([1, 2, 3])
        size = Path(source.removeprefix("file://")).stat().st_size
        return {"documents": 1, "tokens": 3, "vocab_size": 257, "input_bytes": size}

    return run


def test_a_pending_dataset_becomes_ready_once(settings: Settings, register: Callable[..., str]) -> None:
    dataset_id = register()
    calls: list[str] = []
    assert preprocess_dataset(dataset_id, settings, _fake_preprocess(calls)) == READY
    ds = _row(settings, dataset_id)
    assert ds is not None and ds.state == READY and ds.attempt == 1
    assert (ds.documents, ds.tokens, ds.vocab_size) == (1, 3, 257) and ds.input_bytes == len(_jsonl(TEXTS))
    keys = _folder_keys(settings, dataset_id)
    assert sorted(k.rsplit("/", 1)[1] for k in keys) == ["data.bin", "data.idx", "source.jsonl"]
    assert ds.output_bytes == sum(
        o.size for o in open_store(settings.resolved_storage_url).list() if "/data." in o.key
    )
    assert ds.heartbeat_at is None and ds.runner_pid is None and ds.finished_at is not None
    # Another delivery of the same task does nothing.
    assert preprocess_dataset(dataset_id, settings, _fake_preprocess(calls)) is None
    assert len(calls) == 1 and _row(settings, dataset_id).attempt == 1  # type: ignore[union-attr]


def test_progress_is_written_with_the_heartbeat(settings: Settings, register: Callable[..., str]) -> None:
    dataset_id = register()
    inner = _fake_preprocess([])
    seen: list[str] = []

    def slow(*args: Any) -> dict[str, Any]:
        progress = args[-1]
        progress(SimpleNamespace(documents=1200, tokens=34000, bytes_read=3 << 20, seconds=2.0))
        # The heartbeat (every 0.2 s here) writes it while the work goes on.
        wait_for(lambda: "1,200 documents" in (_row(settings, dataset_id).state_reason or ""), 10)  # type: ignore[union-attr]
        seen.append(_row(settings, dataset_id).state_reason)  # type: ignore[union-attr]
        return inner(*args)

    assert preprocess_dataset(dataset_id, settings, slow) == READY
    assert seen[0].endswith("1,200 documents, 34,000 tokens, 3 MiB read (1.5 MiB/s)")
    assert seen[0].startswith(f"preprocessing on {socket.gethostname()}")


def test_a_failure_is_the_datasets_reason_and_removes_its_objects(
    settings: Settings, register: Callable[..., str]
) -> None:
    dataset_id = register()
    calls: list[str] = []
    boom = ValueError("source.jsonl:7: field 'text' is missing")
    assert preprocess_dataset(dataset_id, settings, _fake_preprocess(calls, boom)) == FAILED
    ds = _row(settings, dataset_id)
    assert ds is not None and ds.state == FAILED and ds.state_reason == str(boom)
    assert _folder_keys(settings, dataset_id) == []


def test_a_dataset_deleted_while_preprocessing_leaves_no_objects(
    settings: Settings, register: Callable[..., str]
) -> None:
    dataset_id = register()
    inner = _fake_preprocess([])

    def delete_midway(*args: Any) -> dict[str, Any]:
        with session_scope(settings.resolved_database_url) as s:
            s.execute(delete(Dataset).where(Dataset.id == dataset_id))
        return inner(*args)

    assert preprocess_dataset(dataset_id, settings, delete_midway) is None
    assert _folder_keys(settings, dataset_id) == []


def claim(settings: Settings, dataset_id: str) -> int | None:
    """A worker's claim of the dataset on the database: its attempt, or None."""
    got = DbTasks(settings).claim("dataset", dataset_id)
    return None if got is None else got[0]


def test_only_one_claim_wins(settings: Settings, register: Callable[..., str]) -> None:
    dataset_id = register()
    assert claim(settings, dataset_id) == 1
    assert claim(settings, dataset_id) is None
    assert _row(settings, dataset_id).state == PROCESSING  # type: ignore[union-attr]


class RecordingExecutor:
    def __init__(self, fail: bool = False):
        self.submitted: list[str] = []
        self.fail = fail

    def submit_dataset(self, dataset_id: str) -> None:
        if self.fail:
            raise RuntimeError("broker down")
        self.submitted.append(dataset_id)


def test_the_scheduler_hands_each_pending_dataset_out_once(
    settings: Settings, register: Callable[..., str]
) -> None:
    first, second = register("a"), register("b")
    broken = RecordingExecutor(fail=True)
    assert dispatch_datasets(settings, broken) == []  # type: ignore[arg-type]
    ds = _row(settings, first)
    assert ds is not None and ds.submitted_at is None and "broker down" in ds.state_reason
    executor = RecordingExecutor()
    assert dispatch_datasets(settings, executor) == [first, second]  # type: ignore[arg-type]
    assert dispatch_datasets(settings, executor) == []  # type: ignore[arg-type]
    assert executor.submitted == [first, second]


def test_a_lost_worker_is_retried_then_failed(settings: Settings, register: Callable[..., str]) -> None:
    dataset_id = register()
    storage = open_store(settings.resolved_storage_url)
    stale = utcnow() - timedelta(seconds=settings.heartbeat_timeout_s + 5)
    for attempt in range(1, MAX_DATASET_ATTEMPTS + 1):
        assert claim(settings, dataset_id) == attempt
        with session_scope(settings.resolved_database_url) as s:
            s.execute(update(Dataset).values(heartbeat_at=stale, runner_pid=None))
        assert reconcile_datasets(settings, LocalExecutor(settings)) == [dataset_id]
        ds = _row(settings, dataset_id)
        assert ds is not None and "no heartbeat" in ds.state_reason
        assert ds.state == (PENDING if attempt < MAX_DATASET_ATTEMPTS else FAILED)
    assert _folder_keys(settings, dataset_id) == [] and storage.list()[:1] == []
    # A fresh heartbeat is not lost.
    fresh = register("fresh")
    claim(settings, fresh)
    assert reconcile_datasets(settings, LocalExecutor(settings)) == []


def test_a_silence_of_every_node_judges_no_worker_lost(
    settings: Settings, register: Callable[..., str]
) -> None:
    """While the control plane hears no node at all (the API down, say: scheduler.intake), a stale
    heartbeat says nothing of the worker; once nodes are heard again it gets a whole bound."""
    from megatrain.scheduler.intake import Intake

    dataset_id = register()
    claim(settings, dataset_id)
    stale = utcnow() - timedelta(seconds=settings.heartbeat_timeout_s + 5)
    with session_scope(settings.resolved_database_url) as s:
        s.execute(update(Dataset).values(heartbeat_at=stale, runner_pid=None))
    intake = Intake(settings.node_lost_after_s)
    unheard = utcnow() - timedelta(seconds=settings.node_lost_after_s + 1)
    intake.observe(unheard, ready=2, now=utcnow())  # two ready nodes, none heard for a whole bound
    assert intake.deaf(utcnow())
    assert reconcile_datasets(settings, LocalExecutor(settings), intake) == []
    intake.observe(utcnow(), ready=2, now=utcnow())  # heard again: judged from now
    assert reconcile_datasets(settings, LocalExecutor(settings), intake) == []
    intake.resumed_at = utcnow() - timedelta(seconds=settings.heartbeat_timeout_s + 1)
    assert reconcile_datasets(settings, LocalExecutor(settings), intake) == [dataset_id]


class _Verdict:
    """An executor that says one thing of every background worker, and records what it was asked."""

    def __init__(self, verdict: bool | None):
        self.verdict = verdict
        self.asked: list[tuple[str | None, int | None]] = []

    def worker_alive(self, host: str | None, pid: int | None) -> bool | None:
        self.asked.append((host, pid))
        return self.verdict


def test_the_executor_judges_whether_a_workers_process_is_gone(
    settings: Settings, register: Callable[..., str]
) -> None:
    """The scheduler asks the executor (the worker/ seam), never the process table itself: its
    False requeues a heartbeating dataset at once; None leaves it to the heartbeats."""
    dataset_id = register()
    claim(settings, dataset_id)
    with session_scope(settings.resolved_database_url) as s:
        s.execute(update(Dataset).values(runner_host="node-7", runner_pid=4242, heartbeat_at=utcnow()))
    unsure = _Verdict(None)
    assert reconcile_datasets(settings, unsure) == []  # type: ignore[arg-type]
    assert unsure.asked == [("node-7", 4242)]
    assert reconcile_datasets(settings, _Verdict(False)) == [dataset_id]  # type: ignore[arg-type]
    ds = _row(settings, dataset_id)
    assert ds is not None and ds.state == PENDING
    assert ds.state_reason == "worker lost (worker pid 4242 on node-7 is gone); retrying"


def test_the_local_executor_preprocesses_through_the_scheduler(
    settings: Settings, register: Callable[..., str]
) -> None:
    """The real path: the scheduler hands the dataset to a detached worker process, which runs the
    engine's preprocessing; the result reads back as the corpus' bytes."""
    pytest.importorskip("megatrain.engine.data.preprocess")
    from megatrain.engine.data.indexed import IndexedDataset

    dataset_id = register()
    sched = Scheduler(settings, executor=LocalExecutor(settings))
    assert sched.datasets_once() == [dataset_id]
    wait_for(lambda: _row(settings, dataset_id).state in (READY, FAILED), 120, interval=0.2)  # type: ignore[union-attr]
    ds = _row(settings, dataset_id)
    assert ds is not None and ds.state == READY, ds.state_reason if ds else None
    assert ds.documents == len(TEXTS)
    assert ds.tokens == sum(len(t.encode()) + 1 for t in TEXTS)  # bytes + end-of-document each
    store = open_store(settings.resolved_storage_url)
    prefix = ds.prefix_url.removeprefix(settings.resolved_storage_url + "/")
    local = Path(str(store.local_path(prefix)))  # type: ignore[attr-defined]
    data = IndexedDataset(local)
    assert len(data) == len(TEXTS)
    assert bytes(data[3][:-1].tolist()) == TEXTS[3].encode()


def test_a_bad_source_fails_with_its_line(settings: Settings, register: Callable[..., str]) -> None:
    pytest.importorskip("megatrain.engine.data.preprocess")
    dataset_id = register(body=_jsonl(TEXTS[:4]) + b'{"other": "x"}\n')
    assert preprocess_dataset(dataset_id, settings) == FAILED
    ds = _row(settings, dataset_id)
    assert ds is not None and ds.state_reason.startswith(f"{ds.source_url}:5: "), ds.state_reason
    assert _folder_keys(settings, dataset_id) == []


def test_sources_and_outputs_on_s3(
    settings: Settings, register: Callable[..., str], s3_bucket_url: str, moto_s3_endpoint: str
) -> None:
    """Production's storage: the source streams from S3, the indexed dataset lands beside it."""
    pytest.importorskip("megatrain.engine.data.preprocess")
    store = f"{s3_bucket_url}/prefix"
    cfg = settings.model_copy(update={"storage_url": store, "s3_endpoint_url": moto_s3_endpoint})
    good = register(storage=store)
    assert preprocess_dataset(good, cfg) == READY
    ds = _row(cfg, good)
    assert ds is not None and ds.documents == len(TEXTS) and ds.input_bytes == len(_jsonl(TEXTS))
    keys = sorted(o.key for o in open_store(store).list() if good in o.key)
    assert [k.rsplit("/", 1)[1] for k in keys] == ["data.bin", "data.idx", "source.jsonl"]
    assert ds.output_bytes == sum(o.size for o in open_store(store).list() if "/data." in o.key)
    bad = register("bad", body=b'{"text": "fine"}\n{"text": ""}\n', storage=store)
    assert preprocess_dataset(bad, cfg) == FAILED
    failed = _row(cfg, bad)
    assert failed is not None and failed.state_reason.startswith(f"{failed.source_url}:2: "), (
        failed.state_reason
    )
    assert not any(bad in o.key for o in open_store(store).list())


@pytest.mark.redis
@pytest.mark.slow
def test_a_celery_worker_preprocesses_from_its_pools_queue(
    settings: Settings, redis_url: str, register: Callable[..., str], tmp_path: Path
) -> None:
    """Production's path: the scheduler sends the task to the pool's dataset queue, which the
    pool's worker consumes beside its node's own; a repeated delivery is a no-op."""
    pytest.importorskip("megatrain.engine.data.preprocess")
    import redis

    from megatrain.worker.celery_app import PREPROCESS_TASK_NAME, datasets_queue
    from megatrain.worker.executors import CeleryExecutor, runner_env

    pool = f"celery-ds-{uuid.uuid4().hex[:8]}"
    cfg = settings.model_copy(update={"executor": "celery", "redis_url": redis_url, "pool_name": pool})
    dataset_id = register()
    log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115 - closed below
    worker = subprocess.Popen(
        [sys.executable, "-m", "megatrain.worker.celery_app"],
        env=runner_env(cfg), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        sched = Scheduler(cfg)
        assert isinstance(sched.executor, CeleryExecutor)
        assert sched.datasets_once() == [dataset_id]
        wait_for(lambda: _row(cfg, dataset_id).state in (READY, FAILED), 120, interval=0.2)  # type: ignore[union-attr]
        ds = _row(cfg, dataset_id)
        assert ds is not None and ds.state == READY, ds.state_reason if ds else None
        assert ds.runner_host == socket.gethostname() and ds.documents == len(TEXTS)
        again = sched.executor.app.send_task(
            PREPROCESS_TASK_NAME, args=[dataset_id], queue=datasets_queue(pool)
        )
        assert again.get(timeout=30) is None
        assert _row(cfg, dataset_id).attempt == 1  # type: ignore[union-attr]
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        log.close()
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(f"megatrain.{pool}*"):
            client.delete(key)
