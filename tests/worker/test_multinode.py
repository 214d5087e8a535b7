"""Multi-node jobs: two Celery workers on this machine act as two nodes of one pool, and a tp=2 × dp=2
MoE job (ep=2 across the nodes, its all-to-alls in two hops) split 2+2 across them trains to the
losses of one process (worker.gang, torchrun's c10d)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fixtures.cluster import seed_job
from sqlalchemy import func, select
from worker_helpers import wait_for

from megatrain.db.models import (
    FAILED,
    QUEUED,
    SCHEDULED,
    SUCCEEDED,
    Checkpoint,
    Job,
    JobAllocation,
    JobEvent,
    JobLog,
    JobMetric,
    Node,
    NodePool,
)
from megatrain.db.session import session_scope
from megatrain.plan.layout import resolve_layout
from megatrain.scheduler.loop import Scheduler
from megatrain.settings import Settings
from megatrain.spec import parse_spec
from megatrain.worker.executors import CeleryExecutor, runner_env
from megatrain.worker.shard import Rendezvous, engine_command, run_shard

pytestmark = [pytest.mark.slow, pytest.mark.redis]
SQLITE = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
"""One database: the runner's SQL is the same on both (tests/db and tests/scheduler run both)."""


def test_a_share_of_a_gang_runs_under_torchrun_at_the_rendezvous(tmp_path: Path) -> None:
    rdzv = Rendezvous(1, 2, "vm:29400", "job.3", 120)
    cmd = engine_command(2, tmp_path, "file:///ckpt", rdzv)
    assert "--standalone" not in cmd
    for arg in ("--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=vm:29400", "--max-restarts=0"):
        assert arg in cmd
    assert "--rdzv-id=job.3" in cmd and "--nproc-per-node=2" in cmd
    assert "--rdzv-conf=is_host=0,join_timeout=120" in cmd  # only node rank 0 hosts the store
    # A one-slot share still runs under torchrun: it must meet the others.
    assert "torch.distributed.run" in engine_command(
        1, tmp_path, "file:///c", Rendezvous(0, 2, "h:1", "r", 9)
    )


@pytest.fixture
def pool_settings(settings: Settings, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Settings]:
    monkeypatch.delenv("MEGATRAIN_ENGINE_MODULE", raising=False)
    pool = f"gang-{uuid.uuid4().hex[:8]}"
    yield settings.model_copy(
        update={"executor": "celery", "redis_url": redis_url, "pool_name": pool, "rendezvous_timeout_s": 120}
    )
    import redis

    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"megatrain.{pool}*"):
        client.delete(key)


@contextlib.contextmanager
def node_worker(settings: Settings, name: str, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m megatrain.worker.celery_app` acting as node `name` with 2 CPU slots."""
    env = runner_env(settings) | {"MEGATRAIN_NODE_NAME": name, "MEGATRAIN_CPU_SLOTS": "2"}
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    worker = subprocess.Popen(
        [sys.executable, "-m", "megatrain.worker.celery_app"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield worker
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(20)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        log.close()


@contextlib.contextmanager
def scheduled_nodes(
    settings: Settings, names: list[str], tmp_path: Path
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """Node workers `names` registered in the pool, and the scheduler's loop running on a thread."""
    url = settings.resolved_database_url
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        workers = {n: stack.enter_context(node_worker(settings, n, tmp_path / f"{n}.log")) for n in names}

        def registered() -> bool:
            with session_scope(url) as s:
                pool = select(Node.hostname).join(NodePool).where(NodePool.name == settings.pool_name)
                return sorted(s.scalars(pool)) == names

        wait_for(registered, 60)
        scheduler = Scheduler(settings, executor=CeleryExecutor(settings))
        loop = threading.Thread(target=scheduler.run, args=(stop,), daemon=True)
        loop.start()
        stack.callback(loop.join, 30)
        stack.callback(stop.set)
        yield workers


def wait_until_ended(url: str, job_id: str, timeout: float) -> None:
    def ended() -> bool:
        with session_scope(url) as s:
            return s.scalar(select(Job.status).where(Job.id == job_id)) in (SUCCEEDED, FAILED)

    wait_for(ended, timeout)


def _spec(corpus: Path, parallelism: object, devices: int, **model: object) -> dict[str, object]:
    return {
        "name": "gang",
        "model": {
            "arch": "llama",
            "num_layers": 1,
            "hidden_size": 32,
            "num_attention_heads": 2,
            "seq_length": 32,
            **model,
        },
        "data": {"tokenizer": {"type": "byte"}, "train": [{"path": corpus.as_uri()}], "split": "90,10,0"},
        "training": {
            "train_iters": 6,
            "global_batch_size": 4,
            "micro_batch_size": 2,
            "precision": "fp32",
            "log_interval": 1,
            "checkpoint_interval": 3,
            "eval_interval": 0,
            "warmup_iters": 0,
        },
        "parallelism": parallelism,
        "resources": {"devices": devices, "max_runtime_s": 300},
    }


def _job(url: str, spec: dict[str, object], procs: int, pool: str, max_retries: int = 1) -> str:
    layout = resolve_layout(parse_spec(spec)).as_dict()
    return seed_job(url, procs, name="gang", spec=spec, layout=layout, max_retries=max_retries, pool=pool)


def _losses(url: str, job_id: str) -> dict[int, float]:
    with session_scope(url) as s:
        rows = s.execute(
            select(JobMetric.step, JobMetric.loss).where(
                JobMetric.job_id == job_id, JobMetric.kind == "train"
            )
        ).all()
    return {r.step: r.loss for r in rows}


MOE = {"num_experts": 4, "router_topk": 2, "ffn_hidden_size": 32}
TWO_NODES = {"tp": 2, "dp": 2, "ep": 2, "moe_dispatch": "nodes", "moe_overlap_chunks": 2}
"""tp pairs on each node; ep carved from dp, so each ep group has one rank on each node."""


@SQLITE
def test_a_tp2_dp2_ep2_job_split_across_two_nodes_trains_like_one_process(
    pool_settings: Settings, make_job: Callable[..., str], tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    settings = pool_settings
    url = settings.resolved_database_url
    corpus = tmp_path / "corpus.jsonl"
    text = "def add(a, b):\n    return a + b\n" * 40
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(20)))

    with (
        node_worker(settings, "node-a", tmp_path / "a.log"),
        node_worker(settings, "node-b", tmp_path / "b.log"),
    ):

        def both_registered() -> bool:
            with session_scope(url) as s:
                names = s.scalars(
                    select(Node.hostname).join(NodePool).where(NodePool.name == settings.pool_name)
                )
                return sorted(names) == ["node-a", "node-b"]

        wait_for(both_registered, 60)
        job_id = _job(url, _spec(corpus, TWO_NODES, 4, moe=MOE), 4, settings.pool_name)
        scheduler = Scheduler(settings, executor=CeleryExecutor(settings))
        assert scheduler.schedule_once() == [job_id]
        with session_scope(url) as s:
            shares = s.execute(
                select(Node.hostname, JobAllocation.node_rank, JobAllocation.slots)
                .join(Node, Node.id == JobAllocation.node_id)
                .where(JobAllocation.job_id == job_id)
            ).all()
            assert sorted(r.slots for r in shares) == [2, 2]  # whole tp groups on each node

        wait_until_ended(url, job_id, 240)

    with session_scope(url) as s:
        job = s.get(Job, job_id)
        lines = s.scalars(select(JobLog.line).where(JobLog.job_id == job_id).order_by(JobLog.seq)).all()
        kinds = s.scalars(select(JobEvent.kind).where(JobEvent.job_id == job_id)).all()
        assert job.status == SUCCEEDED, job.status_reason + "\n" + "\n".join(lines[-60:])
        assert job.attempt == 1 and "rendezvous" in kinds
        # The follower's lines reach the job's log, named by their node.
        follower = next(r.hostname for r in shares if r.node_rank == 1)
        assert any(line.startswith(f"[{follower}] ") for line in lines)
        # The ep pair {0, 2} has a rank on each node: the two hops, hop 1 in 2 chunks.
        exchange = "in two hops, once per node, then per rank (1 ep ranks per node), the hop across "
        assert any(exchange + "nodes pipelined in 2 token chunks" in line for line in lines), lines[-40:]
        allocations = s.scalars(select(JobAllocation.id).where(JobAllocation.job_id == job_id)).all()
        assert allocations == []  # the gang's slots were given back on both nodes
        assert s.scalars(
            select(Node.slots_used).join(NodePool).where(NodePool.name == settings.pool_name)
        ).all() == [
            0,
            0,
        ]
    gang = _losses(url, job_id)

    # The same spec, seed and data in one process.
    ref_id = make_job(schedule=False, procs=1)
    with session_scope(url) as s:
        ref = s.get(Job, ref_id)
        ref.spec = _spec(corpus, {"tp": 1, "dp": 1}, 1, moe=MOE)
        ref.layout = resolve_layout(parse_spec(ref.spec)).as_dict()
    from megatrain.db.jobs import reserve_and_schedule

    with session_scope(url) as s:
        node = s.scalar(select(Node.id).where(Node.hostname == "testnode"))
        assert reserve_and_schedule(s, ref_id, node)
    assert run_shard(ref_id, settings.model_copy(update={"executor": "local"})) == 0
    single = _losses(url, ref_id)
    assert sorted(gang) == sorted(single) == [1, 2, 3, 4, 5, 6]
    for step, loss in single.items():
        assert gang[step] == pytest.approx(loss, rel=1e-4), step


@SQLITE
@pytest.mark.skipif(
    os.environ.get("MEGATRAIN_TEST_LONG") != "1",
    reason="three node workers and two real 4-rank attempts: ~2 min, and on a 2-core CI host the tests "
    "beside it ran 2-10x slower (the suite's run with it took 38 min, 27 before); run it alone: "
    "MEGATRAIN_TEST_LONG=1 python -m pytest -n 0 tests/worker/test_multinode.py -k sigkill",
)
def test_sigkill_of_one_nodes_worker_requeues_the_gang_and_it_resumes_on_the_rest(
    pool_settings: Settings, make_job: Callable[..., str], tmp_path: Path
) -> None:
    # Three 2-slot nodes; the 4-process job takes two of them. Killing the worker of its second node
    # (kill -9: its ranks die with it) fails the attempt; the job is requeued and resumes from its
    # checkpoint on the two nodes left, and its loss curve is the one process's, each step once.
    pytest.importorskip("torch")
    # Nodes are marked lost after 30 s (the default): the shard on node rank 0 notices sooner that
    # its peer's shard went silent, and the retry avoids that node.
    settings = pool_settings.model_copy(update={"node_lost_after_s": 30.0, "scheduler_interval_s": 0.3})
    url = settings.resolved_database_url
    corpus = tmp_path / "corpus.jsonl"
    text = "def add(a, b):\n    return a + b\n" * 40
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(20)))
    spec = _spec(corpus, {"tp": 2, "dp": 2}, 4)
    spec["training"] |= {"train_iters": 40, "checkpoint_interval": 4}  # type: ignore[operator]
    with scheduled_nodes(settings, ["node-a", "node-b", "node-c"], tmp_path) as workers:
        job_id = _job(url, spec, 4, settings.pool_name, max_retries=2)

        def checkpointed() -> str | None:
            with session_scope(url) as s:
                saved = s.scalar(select(Checkpoint.step).where(Checkpoint.job_id == job_id).limit(1))
                rank1 = s.scalar(
                    select(Node.hostname)
                    .join(JobAllocation, JobAllocation.node_id == Node.id)
                    .where(JobAllocation.job_id == job_id, JobAllocation.node_rank == 1)
                )
            return rank1 if saved is not None else None

        victim = wait_for(checkpointed, 120, interval=0.02)
        workers[victim].kill()
        workers[victim].wait()

        wait_until_ended(url, job_id, 300)

    with session_scope(url) as s:
        job = s.get(Job, job_id)
        lines = s.scalars(select(JobLog.line).where(JobLog.job_id == job_id).order_by(JobLog.seq)).all()
        assert job.status == SUCCEEDED, job.status_reason + "\n" + "\n".join(lines[-80:])
        assert job.attempt == 2
        events = s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).all()
        (requeued,) = [e for e in events if e.to_status == QUEUED]
        assert f"no word from the shard on {victim} (avoided next time)" in requeued.reason
        resumed = [e.data for e in events if e.kind == "resumed"]
        assert resumed and resumed[-1]["attempt"] == 2  # from its checkpoint, not step 0
        last = [e.data for e in events if e.to_status == SCHEDULED][-1]
        dead = s.scalar(
            select(Node.id).join(NodePool).where(NodePool.name == settings.pool_name, Node.hostname == victim)
        )
        assert dead not in {n["node_id"] for n in last["nodes"]}  # the two nodes left ran it
    gang = _losses(url, job_id)

    ref_id = make_job(schedule=False, procs=1)
    with session_scope(url) as s:
        ref = s.get(Job, ref_id)
        ref.spec = {**spec, "parallelism": {"tp": 1, "dp": 1}, "resources": {"devices": 1}}
        ref.layout = resolve_layout(parse_spec(ref.spec)).as_dict()
    from megatrain.db.jobs import reserve_and_schedule

    with session_scope(url) as s:
        node = s.scalar(select(Node.id).where(Node.hostname == "testnode"))
        assert reserve_and_schedule(s, ref_id, node)
    assert run_shard(ref_id, settings.model_copy(update={"executor": "local"})) == 0
    single = _losses(url, ref_id)
    assert sorted(gang) == sorted(single) == list(range(1, 41))  # no step lost, none twice
    for step, loss in single.items():
        assert gang[step] == pytest.approx(loss, rel=1e-4), step


@SQLITE
def test_a_rank_hung_on_the_second_node_is_named_by_the_first_and_the_gang_resumes(
    pool_settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two 2-slot nodes run a 4-rank job (the fake engine under torchrun); global rank 3, on node rank
    # 1, stops before step 8 and the other ranks wait for it at the next step, as at a collective.
    # Node rank 0's watch sees its own ranks stopped one step ahead of its peer's: it names rank 3 on
    # that node, and the retry resumes from the step-5 checkpoint and finishes.
    monkeypatch.setenv("MEGATRAIN_ENGINE_MODULE", str(Path(__file__).with_name("fake_engine.py")))
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.05")
    monkeypatch.setenv("FAKE_ENGINE_HANG_AT", "8")
    monkeypatch.setenv("FAKE_ENGINE_HANG_RANK", "3")
    monkeypatch.setenv("FAKE_ENGINE_FAIL_MARKER", str(tmp_path / "hung-once"))
    settings = pool_settings.model_copy(
        update={"hang_min_s": 2.0, "hang_grace_s": 60.0, "scheduler_interval_s": 0.3}
    )
    url = settings.resolved_database_url
    spec = _spec(tmp_path / "unread.jsonl", {"tp": 2, "dp": 2}, 4)
    spec["training"] |= {"train_iters": 12, "checkpoint_interval": 5}  # type: ignore[operator]
    with scheduled_nodes(settings, ["node-a", "node-b"], tmp_path):
        job_id = _job(url, spec, 4, settings.pool_name, max_retries=1)
        wait_until_ended(url, job_id, 240)

    with session_scope(url) as s:
        job = s.get(Job, job_id)
        lines = s.scalars(select(JobLog.line).where(JobLog.job_id == job_id).order_by(JobLog.seq)).all()
        assert job.status == SUCCEEDED and job.attempt == 2, job.status_reason + "\n" + "\n".join(lines[-80:])
        events = s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).all()
        first = [e.data["nodes"] for e in events if e.to_status == SCHEDULED][0]  # in node-rank order
        follower = s.scalar(select(Node.hostname).where(Node.id == first[1]["node_id"]))
        (hung,) = [e for e in events if e.to_status == QUEUED]
        assert hung.reason.startswith(f"hung: rank 3 on {follower} stopped at step 7 for "), hung.reason
        assert hung.data["cause"] == "hung" and hung.data["ranks"] == [3] and hung.data["step"] == 7
        resumed = [e.data for e in events if e.kind == "resumed"]
        assert resumed and resumed[-1]["attempt"] == 2
        assert s.scalar(select(func.max(JobMetric.step)).where(JobMetric.job_id == job_id)) == 12
