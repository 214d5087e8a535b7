"""A two-node job on a real Slurm (tests/fixtures/slurm.py): a tp=2 × dp=2 job placed by the
scheduler over two Slurm nodes of 2 CPUs runs as one sbatch job, its shards meeting through
torchrun's c10d rendezvous, and trains to the losses of one process."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from fixtures.slurm import SlurmCluster
from sqlalchemy import select
from test_multinode import _job, _losses, _spec
from worker_helpers import wait_for

from megatrain.db.jobs import reserve_and_schedule
from megatrain.db.models import FAILED, SUCCEEDED, Job, JobAllocation, JobLog, Node
from megatrain.db.session import session_scope
from megatrain.plan.layout import resolve_layout
from megatrain.scheduler.loop import Scheduler
from megatrain.settings import Settings
from megatrain.spec import parse_spec
from megatrain.worker.shard import run_shard
from megatrain.worker.slurm.commands import SlurmCli
from megatrain.worker.slurm.executor import SlurmExecutor

# PostgreSQL, as a Slurm deployment runs (the runner's SQL is the same on SQLite: tests/db).
pytestmark = [pytest.mark.slow, pytest.mark.parametrize("db_url", ["postgres"], indirect=True)]


def test_a_tp2_dp2_job_over_two_slurm_nodes_trains_like_one_process(
    settings: Settings,
    slurm_cluster: SlurmCluster,
    make_job: Callable[..., str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("torch")
    if len(slurm_cluster.node_names) < 2:
        pytest.skip("this slurmd cannot run two nodes on one host")
    url = settings.resolved_database_url
    if url.startswith("sqlite"):
        pytest.skip("one database is enough for this long run: PostgreSQL, as in production")
    monkeypatch.delenv("MEGATRAIN_ENGINE_MODULE", raising=False)
    pool = "slurm-gang"
    slurm = settings.model_copy(
        update={
            "executor": "slurm",
            "pool_name": pool,
            "slurm_partition": slurm_cluster.partition,
            "rendezvous_timeout_s": 120,
        }
    )
    executor = SlurmExecutor(slurm, commands=SlurmCli(env=slurm_cluster.env))
    corpus = tmp_path / "corpus.jsonl"
    text = "def add(a, b):\n    return a + b\n" * 40
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(20)))

    job_id = _job(url, _spec(corpus, {"tp": 2, "dp": 2}, 4), 4, pool)
    scheduler = Scheduler(slurm, executor=executor)
    scheduler.reconcile_once()  # registers the Slurm nodes (sinfo) as the pool's
    assert scheduler.schedule_once() == [job_id]
    with session_scope(url) as s:
        slots = s.scalars(select(JobAllocation.slots).where(JobAllocation.job_id == job_id)).all()
    assert sorted(slots) == [2, 2]  # whole tp groups on each node

    def ended() -> bool:
        scheduler.reconcile_once()
        with session_scope(url) as s:
            return s.scalar(select(Job.status).where(Job.id == job_id)) in (SUCCEEDED, FAILED)

    wait_for(ended, 240, 1.0)
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None
        lines = s.scalars(select(JobLog.line).where(JobLog.job_id == job_id).order_by(JobLog.seq)).all()
        assert job.status == SUCCEEDED, job.status_reason + "\n" + "\n".join(lines[-60:])
        assert job.attempt == 1
    assert any(line.startswith("[n2] ") for line in lines)  # the follower's log, named by its node
    gang = _losses(url, job_id)

    # The same spec, seed and data in one process.
    ref_id = make_job(schedule=False, procs=1)
    with session_scope(url) as s:
        ref = s.get(Job, ref_id)
        assert ref is not None
        ref.spec = _spec(corpus, {"tp": 1, "dp": 1}, 1)
        ref.layout = resolve_layout(parse_spec(ref.spec)).as_dict()
    with session_scope(url) as s:
        node = s.scalar(select(Node.id).where(Node.hostname == "testnode"))
        assert reserve_and_schedule(s, ref_id, node)
    assert run_shard(ref_id, settings.model_copy(update={"executor": "local"})) == 0
    single = _losses(url, ref_id)
    assert sorted(gang) == sorted(single) == [1, 2, 3, 4, 5, 6]
    for step, loss in single.items():
        assert gang[step] == pytest.approx(loss, rel=1e-4), step
