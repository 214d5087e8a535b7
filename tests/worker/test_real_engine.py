"""The shard runner with the real engine (`megatrain.engine.train`) on a tiny spec, on CPU."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import select

from megatrain.db.models import SUCCEEDED, Checkpoint, Job, JobEvent, JobLog, JobMetric
from megatrain.db.session import session_scope
from megatrain.plan.layout import resolve_layout
from megatrain.settings import Settings
from megatrain.spec import parse_spec
from megatrain.worker.shard import run_shard

pytestmark = pytest.mark.slow


def _engine_importable() -> bool:
    try:
        return importlib.util.find_spec("megatrain.engine.train") is not None
    except ImportError:
        return False


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
    corpus = tmp_path / "corpus.jsonl"
    text = "def add(a, b):\n    return a + b\n" * 40
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(20)))
    url = settings.resolved_database_url
    job_id = make_job(schedule=False, procs=procs)
    spec = {
        "name": "tiny-real",
        "model": {
            "arch": "llama",
            "num_layers": 1,
            "hidden_size": 32,
            "num_attention_heads": 2,
            "seq_length": 32,
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
        "resources": {"gpus": procs, "max_runtime_s": 300},
    }
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        # What the API stores at submission: the spec and the layout resolved from it.
        job.spec, job.layout = spec, resolve_layout(parse_spec(spec)).as_dict()
    from megatrain.db.jobs import reserve_and_schedule
    from megatrain.db.models import Node

    with session_scope(url) as s:
        assert reserve_and_schedule(s, job_id, s.scalar(select(Node.id).where(Node.hostname == "testnode")))
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
