"""Cancelling a job while a background checkpoint save is in flight (real engine, CPU): the job ends
cancelled, the save it caught never reads as complete (data files, no manifest), the checkpoint
before it is the latest, and only complete checkpoints are recorded."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import select, update
from worker_helpers import wait_for

from megatrain.db.jobs import reserve_and_schedule
from megatrain.db.models import CANCELLED, Checkpoint, Job, Node
from megatrain.db.session import session_scope
from megatrain.engine.checkpoint.folder import complete_steps, find_latest
from megatrain.plan.layout import resolve_layout
from megatrain.settings import Settings
from megatrain.spec import parse_spec
from megatrain.worker.shard import run_shard

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]

SLOW_ENGINE = Path(__file__).with_name("slow_save_engine.py")


def _tiny_async_job(settings: Settings, make_job: Callable[..., str], tmp_path: Path) -> str:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": "def add(a, b):\n    return a + b\n" * 40}) + "\n" for _ in range(20))
    )
    spec = {
        "name": "async-save",
        "model": {
            "arch": "llama",
            "num_layers": 1,
            "hidden_size": 32,
            "num_attention_heads": 2,
            "seq_length": 32,
        },
        "data": {"tokenizer": {"type": "byte"}, "train": [{"path": corpus.as_uri()}], "split": "90,10,0"},
        "training": {
            "train_iters": 9,
            "global_batch_size": 4,
            "micro_batch_size": 2,
            "precision": "fp32",
            "log_interval": 1,
            "checkpoint_interval": 3,
            "async_checkpoint": True,
            "eval_interval": 0,
            "warmup_iters": 0,
        },
        "resources": {"devices": 1, "max_runtime_s": 300},
    }
    url = settings.resolved_database_url
    job_id = make_job(schedule=False)
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        job.spec, job.layout = spec, resolve_layout(parse_spec(spec)).as_dict()
    with session_scope(url) as s:
        assert reserve_and_schedule(s, job_id, s.scalar(select(Node.id).where(Node.hostname == "testnode")))
    return job_id


def test_cancel_during_an_async_save_never_leaves_a_partial_checkpoint_that_reads_complete(
    settings: Settings, make_job: Callable[..., str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    marker = tmp_path / "save-in-flight"
    monkeypatch.setenv("MEGATRAIN_ENGINE_MODULE", str(SLOW_ENGINE))
    monkeypatch.setenv("SLOW_SAVE_STEP", "6")
    monkeypatch.setenv("SLOW_SAVE_MARKER", str(marker))
    url = settings.resolved_database_url
    job_id = _tiny_async_job(settings, make_job, tmp_path)
    runner = threading.Thread(target=run_shard, args=(job_id, settings))
    runner.start()
    wait_for(marker.exists, timeout=120)  # step 6's files are written, its manifest is not
    with session_scope(url) as s:
        s.execute(update(Job).where(Job.id == job_id).values(cancel_requested=True))
    runner.join(60)
    assert not runner.is_alive()
    root = settings.home / "storage" / "jobs" / job_id / "checkpoints"
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job.status == CANCELLED, job.status_reason
        recorded = sorted(s.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id)))
    partial = root / "iter_0000006"
    assert partial.is_dir() and any(partial.iterdir())  # caught in flight: data, no manifest
    assert not (partial / "manifest.json").exists()
    assert complete_steps(root.as_uri()) == [3] and find_latest(root.as_uri()) == 3
    assert recorded == [3]
