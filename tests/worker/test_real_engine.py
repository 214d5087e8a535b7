"""The shard runner with the real engine (`megatrain.engine.train`) on a tiny spec, on CPU."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import select

from megatrain.db.models import (
    FAILED,
    QUEUED,
    SUCCEEDED,
    AttemptLedger,
    Checkpoint,
    Job,
    JobEvent,
    JobLog,
    JobMetric,
)
from megatrain.db.session import session_scope
from megatrain.plan.layout import resolve_layout
from megatrain.progress_files import read_progress
from megatrain.settings import Settings
from megatrain.spec import parse_spec
from megatrain.worker.nodes import node_name
from megatrain.worker.shard import run_shard

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]


def _engine_importable() -> bool:
    try:
        return importlib.util.find_spec("megatrain.engine.train") is not None
    except ImportError:
        return False


def _schedule_real_job(
    settings: Settings,
    make_job: Callable[..., str],
    tmp_path: Path,
    procs: int,
    max_retries: int = 2,
    model: dict[str, object] | None = None,
    parallelism: object = "auto",
) -> str:
    """A tiny real-engine job as the API stores it (spec and resolved layout), scheduled on testnode."""
    corpus = tmp_path / "corpus.jsonl"
    text = "def add(a, b):\n    return a + b\n" * 40
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(20)))
    url = settings.resolved_database_url
    job_id = make_job(schedule=False, procs=procs, max_retries=max_retries)
    spec = {
        "name": "tiny-real",
        "model": {
            "arch": "llama",
            "num_layers": 1,
            "hidden_size": 32,
            "num_attention_heads": 2,
            "seq_length": 32,
            **(model or {}),
        },
        "data": {"tokenizer": {"type": "byte"}, "train": [{"path": corpus.as_uri()}], "split": "90,10,0"},
        "training": {
            "train_iters": 6,
            "global_batch_size": 4,
            "micro_batch_size": 2,
            "precision": "fp32",
            "log_interval": 2,
            "checkpoint_interval": 3,
            "eval_interval": 0,
            "warmup_iters": 0,
        },
        "parallelism": parallelism,
        "resources": {"devices": procs, "max_runtime_s": 300},
    }
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        # What the API stores at submission: the spec and the layout resolved from it.
        job.spec, job.layout = spec, resolve_layout(parse_spec(spec)).as_dict()
    from megatrain.db.jobs import reserve_and_schedule
    from megatrain.db.models import Node

    with session_scope(url) as s:
        assert reserve_and_schedule(s, job_id, s.scalar(select(Node.id).where(Node.hostname == "testnode")))
    return job_id


@pytest.mark.skipif(not _engine_importable(), reason="megatrain.engine.train is not there yet")
@pytest.mark.parametrize(
    ("parallelism", "procs"),
    [("auto", 1), pytest.param({"tp": 2, "dp": 2}, 4, marks=pytest.mark.distributed)],
    ids=["single", "tp2-dp2"],
)
def test_real_engine_runs_under_the_runner(
    settings: Settings,
    make_job: Callable[..., str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    parallelism: object,
    procs: int,
) -> None:
    pytest.importorskip("torch")
    monkeypatch.delenv("MEGATRAIN_ENGINE_MODULE", raising=False)
    url = settings.resolved_database_url
    job_id = _schedule_real_job(settings, make_job, tmp_path, procs, parallelism=parallelism)
    rc = run_shard(job_id, settings)
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        steps = s.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id, JobMetric.kind == "train"))
        ckpts = s.scalars(
            select(Checkpoint.step).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)
        )
        log = "\n".join(s.scalars(select(JobLog.line).where(JobLog.job_id == job_id).order_by(JobLog.seq)))
        assert rc == 0 and job.status == SUCCEEDED, f"{job.status_reason}\n--- job log ---\n{log}"
        assert sorted(steps) == [2, 4, 6] and list(ckpts) == [3, 6]
        assert job.num_params and job.num_params > 0 and job.latest_loss is not None
        (data,) = s.scalars(
            select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == "started")
        )
        assert data["world_size"] == procs and data["precision"] == "fp32"
        assert data["layout"]["tp"] == (2 if procs == 4 else 1)
    latest = settings.home / "storage" / "jobs" / job_id / "checkpoints" / "latest"
    assert latest.read_text().strip() == "6"
    # Each rank kept a progress file for hang detection (worker.hang).
    progress = read_progress(settings.runs_dir / job_id / "attempt-1")
    assert sorted(p.rank for p in progress) == list(range(procs))


@pytest.mark.skipif(not _engine_importable(), reason="megatrain.engine.train is not there yet")
def test_an_out_of_memory_attempt_fails_the_job_at_once(
    settings: Settings, make_job: Callable[..., str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A job on a node that never reported its memory (so nothing refused it at the door): its
    # 4M × 16k embedding (256 GiB) is a real allocation failure of the CPU allocator, at once.
    pytest.importorskip("torch")
    monkeypatch.delenv("MEGATRAIN_ENGINE_MODULE", raising=False)
    model = {"hidden_size": 16384, "num_attention_heads": 128, "vocab_size": 1 << 22}
    job_id = _schedule_real_job(settings, make_job, tmp_path, 1, max_retries=2, model=model)
    rc = run_shard(job_id, settings)
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(Job, job_id)
        assert rc != 0 and job.status == FAILED, job.status_reason
        assert job.attempt == 1  # two retries were left: none was spent on an attempt bound to fail
        assert job.status_reason.startswith(
            f"out of memory on node {node_name(settings)} (rank 0) while building the model during setup: "
        )
        assert "RuntimeError: " in job.status_reason and "not retried" in job.status_reason
        assert "\n" not in job.status_reason


@pytest.mark.skipif(not _engine_importable(), reason="megatrain.engine.train is not there yet")
@pytest.mark.parametrize("procs", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_a_data_file_deleted_after_submission_fails_after_one_attempt(
    settings: Settings,
    make_job: Callable[..., str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    procs: int,
) -> None:
    pytest.importorskip("torch")
    monkeypatch.delenv("MEGATRAIN_ENGINE_MODULE", raising=False)
    job_id = _schedule_real_job(settings, make_job, tmp_path, procs, max_retries=2)
    corpus = tmp_path / "corpus.jsonl"
    corpus.unlink()
    rc = run_shard(job_id, settings)
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(Job, job_id)
        event = s.scalars(
            select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id.desc())
        ).first()
        log = "\n".join(s.scalars(select(JobLog.line).where(JobLog.job_id == job_id)))
        assert rc != 0 and job.status == FAILED and job.attempt == 1, job.status_reason
        # Every rank reads the data: the first to fail explains the attempt.
        pattern = rf"reading the data failed on rank [0-{procs - 1}] during setup: FileNotFoundError: "
        assert re.match(pattern, job.status_reason), job.status_reason
        assert str(corpus) in job.status_reason and "not retried" in job.status_reason
        assert "\n" not in job.status_reason
        assert event.data["failure"]["kind"] == "user" and event.data["failure"]["phase"] == "data"
        assert "Traceback (most recent call last):" in log  # the whole story stays in the log


@pytest.mark.skipif(not _engine_importable(), reason="megatrain.engine.train is not there yet")
def test_a_real_engine_made_to_hang_is_detected_and_its_retry_finishes(
    settings: Settings, make_job: Callable[..., str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    monkeypatch.delenv("MEGATRAIN_ENGINE_MODULE", raising=False)
    # The operator's fault injection: rank 0 stands still after step 5, the first attempt only.
    monkeypatch.setenv("MEGATRAIN_FAULTS", f"hang:rank=0,at_step=5,once={tmp_path / 'hung-once'}")
    monkeypatch.setattr(settings, "hang_min_s", 2.0)
    # The ranks' progress files say when they save (a save in flight when the rank hangs is never
    # reported saved): the grace, far above any wait here, never applies to the hung step.
    monkeypatch.setattr(settings, "hang_grace_s", 600.0)
    url = settings.resolved_database_url
    job_id = _schedule_real_job(settings, make_job, tmp_path, 1)
    run_shard(job_id, settings)
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        log = "\n".join(s.scalars(select(JobLog.line).where(JobLog.job_id == job_id).order_by(JobLog.seq)))
        assert job.status == QUEUED, f"{job.status_reason}\n{log[-3000:]}"
        assert (
            job.status_reason.startswith("hung: rank 0 on ")
            and " stopped at step 4 for " in job.status_reason
        )
    assert "most recent call first" in log and "in after_step" in log  # faulthandler's dump, at the fault
    from megatrain.db.jobs import reserve_and_schedule
    from megatrain.db.models import Node

    with session_scope(url) as s:
        assert reserve_and_schedule(s, job_id, s.scalar(select(Node.id).where(Node.hostname == "testnode")))
    assert run_shard(job_id, settings) == 0
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job.status == SUCCEEDED and job.attempt == 2
        resumed = s.scalars(
            select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == "resumed")
        ).all()
        assert [d["resumed_from"] for d in resumed] == [3]
        # The ledger: the hang and the checkpoint pauses measured, the retry's redone work counted.
        rows = s.scalars(
            select(AttemptLedger).where(AttemptLedger.job_id == job_id).order_by(AttemptLedger.attempt)
        )
        hung, retry = rows.all()
        assert hung.failure == "hung" and hung.hang_s >= 2.0
        assert retry.failure is None and retry.restart_s > 0 and retry.checkpoint_stall_s > 0
