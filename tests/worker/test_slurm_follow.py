"""The slurm executor's decisions without a cluster (worker.slurm.executor, worker.slurm.node): the
request it builds from a placement, how Slurm's end states reach the scheduler's retry, and that a
Slurm job of an old attempt runs nothing."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from fixtures.cluster import seed_job, seed_node
from sqlalchemy import select
from worker_helpers import job_spec

from megatrain.db.jobs import reserve_and_schedule, reserve_gang
from megatrain.db.models import FAILED, QUEUED, RUNNING, SCHEDULED, Job, JobEvent, Node, NodePool
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler
from megatrain.settings import Settings
from megatrain.worker.shard import KILL_GRACE_S
from megatrain.worker.slurm import executor as executor_module
from megatrain.worker.slurm.commands import SlurmError, SlurmNode
from megatrain.worker.slurm.executor import STATE_EVENT, SlurmExecutor
from megatrain.worker.slurm.node import run_node
from megatrain.worker.slurm.states import SlurmState


class FakeSlurm:
    """SlurmCommands answering from `states`, recording what was submitted and cancelled."""

    def __init__(self) -> None:
        self.scripts: list[str] = []
        self.states: dict[str, SlurmState] = {}
        self.cancelled: list[str] = []
        self.fail = False
        self.max_time_s: int | None = None

    def submit(self, script: str) -> str:
        self.scripts.append(script)
        sid = str(100 + len(self.scripts))
        self.states[sid] = SlurmState(sid, "PENDING", "Priority")
        return sid

    def status(self, slurm_ids: Sequence[str]) -> dict[str, SlurmState]:
        if self.fail:
            raise SlurmError("squeue failed (1): Unable to contact slurm controller")
        return {i: self.states[i] for i in slurm_ids if i in self.states}

    def cancel(self, slurm_id: str, signal: str | None = None) -> None:
        self.cancelled.append(slurm_id)

    def capacity(self, partition: str | None = None) -> list[SlurmNode]:
        if partition == "gpu-h100":  # a second partition (MEGATRAIN_SLURM_POOLS)
            return [SlurmNode("g1", 64, 8, "mix", "gpu-h100", 3600)]
        return [SlurmNode("c1", 4, 0, "idle", "p", self.max_time_s), SlurmNode("c2", 4, 0, "drain", "p")]


def _executor(settings: Settings) -> tuple[SlurmExecutor, FakeSlurm]:
    fake = FakeSlurm()
    slurm = settings.model_copy(update={"executor": "slurm", "slurm_partition": "p", "slurm_account": "ml"})
    return SlurmExecutor(slurm, commands=fake), fake


def _job(settings: Settings, job_id: str) -> Job:
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(Job, job_id)
        assert job is not None
        s.expunge(job)
        return job


def test_a_gang_becomes_one_slurm_job_over_its_nodes(settings: Settings) -> None:
    url = settings.resolved_database_url
    nodes = [seed_node(url, 2, "gangpool", f"g{i}") for i in range(2)]
    job_id = seed_job(url, 4, spec=job_spec(max_runtime_s=7200), pool="gangpool")
    with session_scope(url) as s:
        assert reserve_gang(s, job_id, [(nodes[0], [0, 1]), (nodes[1], [0, 1])], "test")
    ex, fake = _executor(settings)
    ex.submit(job_id)
    script = fake.scripts[0]
    for line in ("--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2", "--partition=p", "--account=ml"):
        assert f"#SBATCH {line}" in script
    assert "#SBATCH --time=0-02:00:00" in script and "#SBATCH --gpus-per-node" not in script
    assert "\nexport MEGATRAIN_DATABASE_URL=" in script  # the runners reach the same database


@pytest.mark.parametrize(
    ("max_runtime_s", "setting", "partition", "time"),
    [
        (7200, None, None, "0-02:00:00"),
        (7200, 3600, None, "0-01:00:00"),  # the site's cap on one Slurm job
        (7200, None, 1800, "0-00:30:00"),  # the partition's MaxTime, from sinfo
        (600, 3600, 1800, "0-00:10:00"),  # the job's own limit, when shortest
    ],
)
def test_each_slurm_job_asks_for_the_shortest_limit(
    settings: Settings,
    make_job: Callable[..., str],
    max_runtime_s: int,
    setting: int | None,
    partition: int | None,
    time: str,
) -> None:
    ex, fake = _executor(settings.model_copy(update={"slurm_time_limit_s": setting}))
    fake.max_time_s = partition
    ex.refresh_nodes()
    job_id = make_job(procs=1, max_runtime_s=max_runtime_s)
    ex.submit(job_id)
    assert f"#SBATCH --time={time}\n" in fake.scripts[0]
    assert (
        f"export MEGATRAIN_SLURM_TIME_LIMIT_S={int(time[2:4]) * 3600 + int(time[5:7]) * 60}\n"
        in fake.scripts[0]
    )


def test_slurm_time_limit_reaches_the_scheduler_retry(
    settings: Settings, make_job: Callable[..., str]
) -> None:
    url = settings.resolved_database_url
    ex, fake = _executor(settings)
    job_id = make_job(procs=1, max_retries=2)
    ex.submit(job_id)
    scheduler = Scheduler(ex.settings, executor=ex)
    scheduler.reconcile_once()  # pending in Slurm: alive, its reason recorded once
    scheduler.reconcile_once()
    assert _job(settings, job_id).status == SCHEDULED
    with session_scope(url) as s:
        noted = s.scalars(
            select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == STATE_EVENT)
        ).all()
    assert [(d["state"], d["reason"]) for d in noted] == [("PENDING", "Priority")]

    # Slurm killed it at its time limit before the runner could end the attempt itself.
    fake.states["101"] = SlurmState("101", "TIMEOUT", None)
    assert scheduler.reconcile_once() == [job_id]
    job = _job(settings, job_id)
    assert job.status == QUEUED and "retrying" in job.status_reason


@pytest.mark.parametrize("status", [SCHEDULED, RUNNING])
def test_slurm_out_of_memory_fails_the_job_at_once(
    settings: Settings, make_job: Callable[..., str], status: str
) -> None:
    """Slurm ended the attempt OUT_OF_MEMORY before its runner could say so (the runner itself was
    killed, or never started): failed at once, retries left unspent, naming the node."""
    url = settings.resolved_database_url
    ex, fake = _executor(settings)
    job_id = make_job(procs=1, max_retries=2)
    ex.submit(job_id)
    with session_scope(url) as s:
        s.get(Job, job_id).status = status  # type: ignore[union-attr]
    fake.states["101"] = SlurmState("101", "OUT_OF_MEMORY", None, "0:125")
    assert Scheduler(ex.settings, executor=ex).reconcile_once() == [job_id]
    job = _job(settings, job_id)
    assert (job.status, job.attempt) == (FAILED, 1)
    assert job.status_reason == (
        "out of memory on node testnode: OUT_OF_MEMORY: Slurm job 101 ended out of memory; not retried: "
        "this layout's ranks need more memory than the node has"
    )
    with session_scope(url) as s:
        event = s.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == FAILED)).one()
        assert event.data["failure"]["cause"] == "slurm_out_of_memory"
        assert event.data["failure"]["evidence"]["exit_code"] == "0:125"


def test_a_failed_status_query_leaves_the_job_alone(settings: Settings, make_job: Callable[..., str]) -> None:
    ex, fake = _executor(settings)
    job_id = make_job(procs=1)
    ex.submit(job_id)
    fake.fail = True
    assert Scheduler(ex.settings, executor=ex).reconcile_once() == []
    assert _job(settings, job_id).status == SCHEDULED


def test_cancel_of_a_queued_slurm_job_is_an_scancel(settings: Settings, make_job: Callable[..., str]) -> None:
    url = settings.resolved_database_url
    ex, fake = _executor(settings)
    job_id = make_job(procs=1)
    ex.submit(job_id)
    with session_scope(url) as s:
        s.get(Job, job_id).cancel_requested = True  # type: ignore[union-attr]
    ex.follow()
    assert fake.cancelled == ["101"]


def test_a_running_slurm_job_asked_to_cancel_is_scancelled_if_its_runner_does_not_end_it(
    settings: Settings, make_job: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = settings.resolved_database_url
    ex, fake = _executor(settings)
    job_id = make_job(procs=1)
    ex.submit(job_id)
    fake.states["101"] = SlurmState("101", "RUNNING")
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None
        job.status, job.cancel_requested = RUNNING, True
    ex.follow()
    assert fake.cancelled == []  # its runner stops the engine and ends the attempt itself
    later = time.monotonic() + KILL_GRACE_S + settings.heartbeat_timeout_s + 1
    monkeypatch.setattr(executor_module.time, "monotonic", lambda: later)
    ex.follow()
    assert fake.cancelled == ["101"]  # it did not: the nodes are freed anyway


def test_a_requeue_by_slurm_becomes_one_retry_and_the_requeued_job_is_scancelled(
    settings: Settings, make_job: Callable[..., str]
) -> None:
    url = settings.resolved_database_url
    ex, fake = _executor(settings)
    job_id = make_job(procs=1, max_retries=2)
    ex.submit(job_id)
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None
        job.status = RUNNING  # its runner claimed it; then Slurm requeued the Slurm job under it
    fake.states["101"] = SlurmState("101", "PENDING", "BeginTime")
    assert Scheduler(ex.settings, executor=ex).reconcile_once() == [job_id]
    job = _job(settings, job_id)
    assert (job.status, job.attempt, job.max_retries) == (QUEUED, 1, 2)  # the retry comes next
    assert fake.cancelled == ["101"]  # the requeued Slurm job will not run the attempt again


def test_refresh_registers_usable_slurm_nodes(settings: Settings) -> None:
    ex, _ = _executor(settings.model_copy(update={"pool_name": "slurmpool"}))
    ex.refresh_nodes()
    with session_scope(settings.resolved_database_url) as s:
        rows = s.execute(
            select(Node.hostname, Node.slots_total, Node.status)
            .join(NodePool)
            .where(NodePool.name == "slurmpool")
        ).all()
    assert [tuple(r) for r in rows] == [("c1", 4, "ready")]  # the drained node is not offered


def test_slurm_pools_fill_each_pool_from_its_partition_and_submit_there(settings: Settings) -> None:
    url = settings.resolved_database_url
    ex, fake = _executor(settings.model_copy(update={"slurm_pools": "cpus=p, h100=gpu-h100"}))
    ex.refresh_nodes()
    with session_scope(url) as s:
        rows = s.execute(
            select(NodePool.name, NodePool.accelerator, Node.hostname, Node.slots_total).join(Node)
        ).all()
    assert sorted(tuple(r) for r in rows) == [("cpus", "cpu", "c1", 4), ("h100", "gpu", "g1", 8)]
    job_id = seed_job(url, 2, spec=job_spec(max_runtime_s=7200), pool="h100")
    with session_scope(url) as s:
        node = s.scalar(select(Node.id).where(Node.hostname == "g1"))
        assert node is not None and reserve_and_schedule(s, job_id, node)
    ex.submit(job_id)
    script = fake.scripts[0]
    assert "#SBATCH --partition=gpu-h100\n" in script and "#SBATCH --gpus-per-node=2\n" in script
    assert "#SBATCH --time=0-01:00:00\n" in script  # that partition's MaxTime, not the job's 2 h


def test_a_slurm_job_of_an_old_attempt_runs_nothing(
    settings: Settings, make_job: Callable[..., str], tmp_path: Path
) -> None:
    job_id = make_job(procs=1)
    attempt = _job(settings, job_id).attempt
    # Slurm requeued (or a lost scheduler resubmitted) the previous attempt's job: node rank 0 of it
    # must neither claim the current attempt nor count as one.
    assert run_node(job_id, attempt - 1, settings, {"SLURM_NODEID": "0", "MEGATRAIN_NNODES": "1"}) == 0
    job = _job(settings, job_id)
    assert (job.status, job.attempt) == (SCHEDULED, attempt)
