"""A node that holds no database URL: its runner reaches the control plane through the API alone,
with a node token (worker.reporter.HttpReporter, api/node/router.py).

The API runs as its own process (`megatrain api`), the runner as a node's would: its environment has
the API's URL, the token and storage, and no database URL, which /proc/PID/environ of the runner and
of the engine must show. The API is killed mid-run and started again: the numbered batches make the
job's rows whole, none lost and none doubled. A revoked token reports nothing more, and a token
reports only for its own node's jobs. What does not depend on the database runs on PostgreSQL only
(as clusters do).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fixtures.cluster import seed_job, seed_node
from fixtures.node_api import Api, clean_env
from sqlalchemy import select
from worker_helpers import environ_of, job_spec, wait_for

from megatrain.attempts import reports as control
from megatrain.db.jobs import reserve_and_schedule
from megatrain.db.models import RUNNING, SUCCEEDED, Checkpoint, Job, JobLog, JobMetric
from megatrain.db.node_tokens import create_node_token
from megatrain.db.session import session_scope, upgrade_database

FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")


@pytest.fixture
def api(db_url: str, tmp_path: Path) -> Iterator[Api]:
    home = tmp_path / "control"
    home.mkdir()
    upgrade_database(db_url)
    server = Api(db_url, home)
    server.start()
    yield server
    server.kill()


def _placed_job(db_url: str, node: str, train_iters: int, checkpoint_interval: int) -> str:
    with session_scope(db_url) as s:
        from megatrain.db.models import Node

        node_id = s.scalar(select(Node.id).where(Node.hostname == node))
    job_id = seed_job(db_url, 1, spec=job_spec(train_iters, checkpoint_interval), max_retries=2)
    with session_scope(db_url) as s:
        assert reserve_and_schedule(s, job_id, node_id, "test")
    return job_id


def _token(db_url: str, node: str) -> tuple[str, str]:
    with session_scope(db_url) as s:
        row, token = create_node_token(s, "default", node)
        return row.id, token


def _runner(
    api: Api, token: str, node: str, home: Path, job_id: str, step_s: float, print_secret: bool = False
) -> subprocess.Popen:
    """A node's runner: the API's URL, its token and storage; no database URL anywhere."""
    env = clean_env() | {
        "MEGATRAIN_HOME": str(home),
        "MEGATRAIN_API_URL": api.url,
        "MEGATRAIN_NODE_TOKEN": token,
        "MEGATRAIN_NODE_NAME": node,
        "MEGATRAIN_STORAGE_URL": (api.home / "storage").as_uri(),
        "MEGATRAIN_HEARTBEAT_INTERVAL_S": "0.3",
        "MEGATRAIN_ENGINE_MODULE": str(FAKE_ENGINE),
        "FAKE_ENGINE_STEP_S": str(step_s),
    }
    if print_secret:
        env["FAKE_ENGINE_PRINT_ENV"] = "WANDB_API_KEY"
    cmd = [sys.executable, "-m", "megatrain.worker.shard", "--job-id", job_id]
    log = open(home / "runner.log", "ab")  # noqa: SIM115
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _status(db_url: str, job_id: str) -> str:
    with session_scope(db_url) as s:
        return str(s.scalar(select(Job.status).where(Job.id == job_id)))


def _metric_steps(db_url: str, job_id: str) -> list[int]:
    with session_scope(db_url) as s:
        q = select(JobMetric.step).where(JobMetric.job_id == job_id, JobMetric.kind == "train")
        return sorted(s.scalars(q))


def test_a_node_with_only_a_token_runs_a_job_through_an_api_restart(
    api: Api, db_url: str, tmp_path: Path
) -> None:
    seed_node(db_url, 4, "default", "node-a")
    _, token = _token(db_url, "node-a")
    job_id = _placed_job(db_url, "node-a", train_iters=60, checkpoint_interval=10)
    node_home = tmp_path / "node-a"
    node_home.mkdir()
    runner = _runner(api, token, "node-a", node_home, job_id, step_s=0.05)
    try:
        wait_for(lambda: len(_metric_steps(db_url, job_id)) >= 5, timeout=60)
        assert _status(db_url, job_id) == RUNNING
        pids = node_home / "runs" / job_id / "attempt-1" / "pids" / "rank0.pid"
        engine = int(wait_for(lambda: pids.is_file() and pids.read_text(), timeout=30))
        for pid in (runner.pid, engine):
            env = environ_of(pid)
            assert "MEGATRAIN_DATABASE_URL" not in env and db_url not in "\0".join(env.values())
            assert env["MEGATRAIN_NODE_TOKEN"] == token if pid == runner.pid else True

        # The API dies mid-stream: the runner keeps its unacknowledged batch and sends it again.
        api.kill()
        time.sleep(1.5)
        api.start()
        assert runner.wait(timeout=90) == 0
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
    with session_scope(db_url) as s:
        job = s.get(Job, job_id)
        assert job.status == SUCCEEDED, job.status_reason
        assert job.current_step == 60
        lines = list(s.scalars(select(JobLog.line).where(JobLog.job_id == job_id).order_by(JobLog.seq)))
        seqs = list(s.scalars(select(JobLog.seq).where(JobLog.job_id == job_id).order_by(JobLog.seq)))
        ckpts = sorted(s.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id)))
    assert _metric_steps(db_url, job_id) == list(range(1, 61))  # none lost, none doubled
    steps = [line for line in lines if line.startswith("step ")]
    assert [int(line.split()[1]) for line in steps] == list(range(1, 61))  # each line once, in order
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert ckpts == [10, 20, 30, 40, 50, 60]
    assert not (node_home / "megatrain.db").exists()  # the node never opened a database


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_the_claim_answer_carries_the_jobs_secrets_and_the_node_no_key(
    api: Api, db_url: str, tmp_path: Path
) -> None:
    """The API decrypts the secrets a job names and hands them over with the attempt: the engine has
    them, the node holds no secrets key, and the value is redacted from what the runner reports."""
    import hashlib

    from megatrain.api.auth import create_api_key

    value = "wandb-" + uuid.uuid4().hex
    with session_scope(db_url) as s:
        key = create_api_key(s, "acme", "test")
    headers = {"Authorization": f"Bearer {key}"}
    put = httpx.put(f"{api.url}/v1/secrets/WANDB_API_KEY", json={"value": value}, headers=headers)
    assert put.status_code == 201, put.text
    seed_node(db_url, 4, "default", "node-a")
    _, token = _token(db_url, "node-a")
    job_id = seed_job(db_url, 1, spec=job_spec(5, 0) | {"secrets": ["WANDB_API_KEY"]}, max_retries=0)
    with session_scope(db_url) as s:
        from megatrain.db.models import Node

        node_id = s.scalar(select(Node.id).where(Node.hostname == "node-a"))
        assert reserve_and_schedule(s, job_id, node_id, "test")
    node_home = tmp_path / "node-a"
    node_home.mkdir()
    runner = _runner(api, token, "node-a", node_home, job_id, step_s=0.01, print_secret=True)
    assert runner.wait(timeout=60) == 0
    sha = node_home / "runs" / job_id / "attempt-1" / "pids" / "rank0.env.sha256"
    assert sha.read_text() == hashlib.sha256(value.encode()).hexdigest()  # the engine had it
    assert not (node_home / "secrets.key").exists()
    with session_scope(db_url) as s:
        lines = s.scalars(select(JobLog.line).where(JobLog.job_id == job_id)).all()
    assert "fake engine: WANDB_API_KEY=[secret:WANDB_API_KEY]" in lines
    assert value not in "\n".join(lines)


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_a_revoked_token_reports_nothing_more_and_its_runner_stops(
    api: Api, db_url: str, tmp_path: Path
) -> None:
    seed_node(db_url, 4, "default", "node-a")
    token_id, token = _token(db_url, "node-a")
    job_id = _placed_job(db_url, "node-a", train_iters=400, checkpoint_interval=0)
    node_home = tmp_path / "node-a"
    node_home.mkdir()
    runner = _runner(api, token, "node-a", node_home, job_id, step_s=0.05)
    try:
        wait_for(lambda: len(_metric_steps(db_url, job_id)) >= 3, timeout=60)
        from megatrain.db.models import utcnow
        from megatrain.db.node_tokens import NodeToken

        with session_scope(db_url) as s:
            s.get(NodeToken, token_id).revoked_at = utcnow()
        seen = len(_metric_steps(db_url, job_id))
        assert runner.wait(timeout=30) == 1  # refused: it stops its engine
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
    assert len(_metric_steps(db_url, job_id)) <= seen + 8  # at most the batch in flight
    assert "refused" in (node_home / "runner.log").read_text()
    r = httpx.post(f"{api.url}/v1/node/jobs/{job_id}/heartbeat", json={"host": "h", "pid": 1},
                   headers={"Authorization": f"Bearer {token}"})  # fmt: skip
    assert r.status_code == 401


def test_a_token_reports_only_for_its_own_nodes_jobs(api: Api, db_url: str) -> None:
    seed_node(db_url, 4, "default", "node-a")
    seed_node(db_url, 4, "default", "node-b")
    _, token_b = _token(db_url, "node-b")
    job_id = _placed_job(db_url, "node-a", train_iters=5, checkpoint_interval=0)
    headers = {"Authorization": f"Bearer {token_b}"}
    body = {"host": "h", "pid": 1, "packages": {}}
    r = httpx.post(f"{api.url}/v1/node/jobs/{job_id}/claim", json=body, headers=headers)
    assert r.status_code == 404 and "not placed on this node" in r.text
    assert _status(db_url, job_id) == "scheduled"
    bad = httpx.post(
        f"{api.url}/v1/node/jobs/{job_id}/claim", json=body, headers={"Authorization": "Bearer x"}
    )
    assert bad.status_code == 401
    # Registering as another node, or in another pool, is refused with the reason.
    report = {"pool": "default", "node": "node-a", "accelerator": "cpu", "slots": 2}
    other = httpx.post(f"{api.url}/v1/node/register", json=report, headers=headers)
    assert other.status_code == 403 and "speaks for node 'node-b', not 'node-a'" in other.text
    report_b = report | {"node": "node-b"}
    elsewhere = httpx.post(f"{api.url}/v1/node/register", json=report_b | {"pool": "gpu"}, headers=headers)
    assert elsewhere.status_code == 403 and "this token is for pool 'default', not 'gpu'" in elsewhere.text
    assert httpx.post(f"{api.url}/v1/node/register", json=report_b, headers=headers).status_code == 200


def test_a_batch_sent_twice_is_applied_once(db_url: str) -> None:
    """The answer to a batch was lost after the API committed it: the same batch again changes nothing."""
    from megatrain.settings import Settings

    upgrade_database(db_url)
    seed_node(db_url, 4, "default", "node-a")
    job_id = _placed_job(db_url, "node-a", train_iters=5, checkpoint_interval=0)
    settings = Settings(database_url=db_url)
    with session_scope(db_url) as s:
        answer = control.claim(s, settings, job_id, node="node-a", host="h", pid=7, packages={})
        assert answer["attempt"]["attempt"] == 1
    batch = {
        "attempt": 1, "seq": 1, "host": "h", "pid": 7, "heartbeat": True,
        "lines": ["one", "two"],
        "metrics": [{"step": 1, "loss": 2.0}],
        "events": [{"event": "checkpoint_saved", "step": 1, "uri": "file:///x"}],
    }  # fmt: skip
    for applied in (True, False):
        with session_scope(db_url) as s:
            assert control.report(s, job_id, batch, 1000) == {"verdict": None, "applied": applied}
    with session_scope(db_url) as s:
        assert list(s.scalars(select(JobLog.line).where(JobLog.job_id == job_id))) == ["one", "two"]
        assert len(s.scalars(select(Checkpoint.id).where(Checkpoint.job_id == job_id)).all()) == 1
    with session_scope(db_url) as s:  # the next batch is applied
        answer = control.report(s, job_id, batch | {"seq": 2, "lines": ["three"], "metrics": []}, 1000)
        assert answer["applied"]
        assert len(s.scalars(select(JobLog.id).where(JobLog.job_id == job_id)).all()) == 3


def test_a_claim_carries_the_pauses_predicted_for_the_job_on_its_pool(db_url: str) -> None:
    """The hang watch's bounds before the first step and for a save come from the job's state and its
    pool's storage (plan.attempt_times); a pool without a spec leaves the flat grace."""
    from sqlalchemy import update

    from megatrain.db.models import NodePool
    from megatrain.plan.pool import PoolSpec
    from megatrain.settings import Settings

    upgrade_database(db_url)
    seed_node(db_url, 4, "default", "node-a")
    settings = Settings(database_url=db_url, hang_min_s=5.0)
    job_id = _placed_job(db_url, "node-a", train_iters=50, checkpoint_interval=10)
    with session_scope(db_url) as s:
        wire = control.claim(s, settings, job_id, node="node-a", host="h", pid=7, packages={})["attempt"]
        assert wire["first_step_bound_s"] is None and wire["save_bound_s"] is None
        pool = PoolSpec(name="default", device_memory_bytes=1 << 30, peak_tflops={"fp32": 1.0},
                        devices_per_node=4, intra_node_bandwidth_gbps=10.0, inter_node_bandwidth_gbps=1.0,
                        startup_s=7.0)  # fmt: skip
        s.execute(update(NodePool).where(NodePool.name == "default").values(spec=pool.model_dump()))
        s.execute(update(Job).where(Job.id == job_id).values(status="scheduled", attempt=1))
    with session_scope(db_url) as s:
        wire = control.claim(s, settings, job_id, node="node-a", host="h", pid=8, packages={})["attempt"]
        assert wire["first_step_bound_s"] == 21.0  # 3 x the pool's 7 s start-up; nothing to read
        assert wire["save_bound_s"] == 5.0  # a tiny model's save: the floor, hang_min_s


def test_a_gangs_node_rank_0_hears_what_the_other_shards_said_of_their_ranks(db_url: str) -> None:
    """A follower's batches carry its ranks' progress; node rank 0's answers carry every other
    shard's latest (its hang report names the node that stopped first: worker.hang)."""
    from megatrain.settings import Settings

    upgrade_database(db_url)
    seed_node(db_url, 4, "default", "node-a")
    job_id = _placed_job(db_url, "node-a", train_iters=50, checkpoint_interval=10)
    with session_scope(db_url) as s:
        control.claim(s, Settings(database_url=db_url), job_id, node="node-a", host="h", pid=7, packages={})
    lead = {"attempt": 1, "seq": 1, "host": "h", "pid": 7, "heartbeat": True, "gang": True}
    with session_scope(db_url) as s:
        assert control.report(s, job_id, lead, 1000)["peers"] == []
    progress = {"node": "node-b", "step": 4, "ranks": [2, 3]}
    follower = {"attempt": 1, "node_rank": 1, "seq": 1, "host": "hb", "pid": 9, "follower": True}
    with session_scope(db_url) as s:
        answer = control.report(s, job_id, follower | {"progress": progress}, 1000)
        assert answer == {"verdict": None, "applied": True}  # a follower hears of no peers
    with session_scope(db_url) as s:
        assert control.report(s, job_id, lead | {"seq": 2}, 1000)["peers"] == [progress]
        assert "peers" not in control.report(s, job_id, lead | {"seq": 3, "gang": False}, 1000)


def test_an_ended_attempt_heard_again_keeps_only_its_checkpoints(db_url: str) -> None:
    """A runner judged lost while cut off reports again after its job moved on to another attempt:
    its lines and figures would interleave with the new attempt's and rewind the job's step; only
    the checkpoint it saved (a file in storage) is recorded, and it is told it is lost."""
    from sqlalchemy import update

    from megatrain.settings import Settings

    upgrade_database(db_url)
    seed_node(db_url, 4, "default", "node-a")
    job_id = _placed_job(db_url, "node-a", train_iters=50, checkpoint_interval=10)
    with session_scope(db_url) as s:
        control.claim(s, Settings(database_url=db_url), job_id, node="node-a", host="h", pid=7, packages={})
    first = {"attempt": 1, "seq": 1, "host": "h", "pid": 7, "heartbeat": True,
             "lines": ["step 10/50"], "metrics": [{"step": 10, "loss": 2.0}]}  # fmt: skip
    with session_scope(db_url) as s:
        assert control.report(s, job_id, first, 1000)["verdict"] is None
        # The scheduler ended attempt 1 and attempt 2 runs on (as a new claim leaves the row).
        s.execute(update(Job).where(Job.id == job_id).values(attempt=2, runner_pid=8, current_step=12))
    late = first | {
        "seq": 2, "lines": ["step 20/50", "step 30/50"], "metrics": [{"step": 30, "loss": 1.5}],
        "events": [{"event": "checkpoint_saved", "step": 30, "uri": "file:///ckpt/30"}],
    }  # fmt: skip
    with session_scope(db_url) as s:
        assert control.report(s, job_id, late, 1000) == {"verdict": "lost", "applied": True}
    with session_scope(db_url) as s:
        assert list(s.scalars(select(JobLog.line).where(JobLog.job_id == job_id))) == ["step 10/50"]
        assert list(s.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id))) == [10]
        assert s.get(Job, job_id).current_step == 12
        assert list(s.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id))) == [30]


@contextlib.contextmanager
def _token_worker(
    api: Api, token: str, pool: str, node: str, redis_url: str, home: Path
) -> Iterator[subprocess.Popen]:
    """`megatrain worker` as a node with only a token: the API's URL, the broker and storage."""
    home.mkdir()
    env = clean_env() | {
        "MEGATRAIN_HOME": str(home),
        "MEGATRAIN_API_URL": api.url,
        "MEGATRAIN_NODE_TOKEN": token,
        "MEGATRAIN_NODE_NAME": node,
        "MEGATRAIN_POOL_NAME": pool,
        "MEGATRAIN_REDIS_URL": redis_url,
        "MEGATRAIN_STORAGE_URL": (api.home / "storage").as_uri(),
        "MEGATRAIN_CPU_SLOTS": "2",
        "MEGATRAIN_HEARTBEAT_INTERVAL_S": "0.3",
        "MEGATRAIN_RENDEZVOUS_TIMEOUT_S": "60",
        "MEGATRAIN_ENGINE_MODULE": str(FAKE_ENGINE),
        "FAKE_ENGINE_STEP_S": "0.02",
    }
    log = open(home / "worker.log", "wb")  # noqa: SIM115
    cmd = [sys.executable, "-m", "megatrain.worker.celery_app"]
    worker = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield worker
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
        log.close()
        import redis

        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(f"megatrain.{pool}.{node}*"):
            client.delete(key)


def _node(db_url: str, pool: str, name: str) -> Any:
    from megatrain.db.models import Node, NodePool

    with session_scope(db_url) as s:
        return s.scalar(select(Node).join(NodePool).where(NodePool.name == pool, Node.hostname == name))


def _celery(db_url: str, redis_url: str, pool: str) -> Any:
    from megatrain.settings import Settings
    from megatrain.worker.executors import CeleryExecutor

    return CeleryExecutor(
        Settings(database_url=db_url, executor="celery", redis_url=redis_url, pool_name=pool)
    )


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
@pytest.mark.redis
def test_a_celery_node_with_only_a_token_registers_heartbeats_and_runs_a_job(
    api: Api, db_url: str, redis_url: str, tmp_path: Path
) -> None:
    """`megatrain worker` with MEGATRAIN_NODE_TOKEN and no database URL: it registers its node through
    the API (binding the token to it), heartbeats, and runs the job the executor sends its queue."""
    from megatrain.db.node_tokens import NodeToken

    pool = f"tok-{uuid.uuid4().hex[:8]}"
    with session_scope(db_url) as s:
        row, token = create_node_token(s, pool)  # bound to the first node that registers
        token_id = row.id
    node_home = tmp_path / "node"
    with _token_worker(api, token, pool, "tok-node", redis_url, node_home) as worker:
        registered = wait_for(lambda: _node(db_url, pool, "tok-node"), timeout=60)
        assert registered.slots_total == 2 and registered.packages
        with session_scope(db_url) as s:
            assert s.get(NodeToken, token_id).node_name == "tok-node"
        seen = registered.last_seen_at
        wait_for(lambda: _node(db_url, pool, "tok-node").last_seen_at > seen, timeout=10)  # it heartbeats
        job_id = seed_job(db_url, 1, spec=job_spec(20, 5), max_retries=1, pool=pool)
        with session_scope(db_url) as s:
            assert reserve_and_schedule(s, job_id, registered.id, "test")
        _celery(db_url, redis_url, pool).submit(job_id)
        wait_for(lambda: _status(db_url, job_id) == SUCCEEDED, timeout=90)
        env_seen = environ_of(worker.pid)
        assert "MEGATRAIN_DATABASE_URL" not in env_seen and db_url not in "\0".join(env_seen.values())
    assert _metric_steps(db_url, job_id) == list(range(1, 21))
    assert not (node_home / "megatrain.db").exists()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
@pytest.mark.redis
def test_a_gang_over_two_token_nodes_meets_and_reports_through_the_api(
    api: Api, db_url: str, redis_url: str, tmp_path: Path
) -> None:
    """A job over two nodes that hold only their tokens: node rank 0 claims and publishes the
    rendezvous through the API, the follower joins through it, its lines reach the job's log named
    by its node, and the attempt ends once."""
    from megatrain.db.jobs import reserve_gang
    from megatrain.db.models import JobEvent
    from megatrain.plan.layout import Layout

    pool = f"gang-{uuid.uuid4().hex[:8]}"
    tokens = {}
    with session_scope(db_url) as s:
        for name in ("node-a", "node-b"):
            tokens[name] = create_node_token(s, pool, name)[1]
    with (
        _token_worker(api, tokens["node-a"], pool, "node-a", redis_url, tmp_path / "a"),
        _token_worker(api, tokens["node-b"], pool, "node-b", redis_url, tmp_path / "b"),
    ):
        a, b = (wait_for(lambda n=n: _node(db_url, pool, n), timeout=60) for n in ("node-a", "node-b"))
        spec = job_spec(20, 5)
        layout = Layout(dp=2).as_dict()
        job_id = seed_job(db_url, 2, spec=spec, layout=layout, max_retries=0, pool=pool)
        with session_scope(db_url) as s:
            assert reserve_gang(s, job_id, [(a.id, [0]), (b.id, [0])], "test")
        _celery(db_url, redis_url, pool).submit(job_id)
        wait_for(lambda: _status(db_url, job_id) not in ("scheduled", RUNNING), timeout=120)
    with session_scope(db_url) as s:
        job = s.get(Job, job_id)
        lines = s.scalars(select(JobLog.line).where(JobLog.job_id == job_id).order_by(JobLog.seq)).all()
        kinds = s.scalars(select(JobEvent.kind).where(JobEvent.job_id == job_id)).all()
    assert job.status == SUCCEEDED, job.status_reason + "\n" + "\n".join(lines[-40:])
    assert kinds.count("rendezvous") == 1 and kinds.count("shard_joined") == 1
    assert any(line.startswith("[node-b] ") for line in lines)  # the follower's, named by its node
    assert _metric_steps(db_url, job_id) == list(range(1, 21))


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
@pytest.mark.slow
def test_a_slurm_attempt_reports_through_the_api_with_a_token_of_its_own(
    api: Api, db_url: str, slurm_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MEGATRAIN_RUNNERS_VIA_API: the batch script carries an attempt token and the API's URL,
    no database URL; the runner on the Slurm node claims, reports and ends the attempt through the
    API, and the token is revoked once the attempt is over."""
    from slurm_jobs import drive

    from megatrain.db.models import Node, NodePool
    from megatrain.db.node_tokens import NodeToken
    from megatrain.scheduler.loop import Scheduler
    from megatrain.settings import get_settings, reset_settings_cache
    from megatrain.worker.slurm.commands import SlurmCli
    from megatrain.worker.slurm.executor import SlurmExecutor

    for name, value in {
        "EXECUTOR": "slurm",
        "POOL_NAME": "slurm",
        "SLURM_PARTITION": slurm_cluster.partition,
        "HEARTBEAT_INTERVAL_S": "0.5",
        "API_URL": api.url,
        "RUNNERS_VIA_API": "true",
        "STORAGE_URL": (api.home / "storage").as_uri(),
        "ENGINE_MODULE": str(FAKE_ENGINE),
    }.items():
        monkeypatch.setenv(f"MEGATRAIN_{name}", value)
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.02")
    monkeypatch.setenv("FAKE_ENGINE_PRINT_ENV", "MEGATRAIN_DATABASE_URL")
    reset_settings_cache()
    settings = get_settings()
    scheduler = Scheduler(settings, executor=SlurmExecutor(settings, SlurmCli(env=slurm_cluster.env)))
    scheduler.reconcile_once()  # the pool's nodes, from sinfo
    with session_scope(db_url) as s:
        node_id = s.scalar(select(Node.id).join(NodePool).where(NodePool.name == "slurm").limit(1))
    job_id = seed_job(db_url, 1, spec=job_spec(20, 5), max_retries=0, pool="slurm")
    with session_scope(db_url) as s:
        assert reserve_and_schedule(s, job_id, node_id, "test")
    scheduler.executor.submit(job_id)
    job = drive(scheduler, db_url, job_id, lambda j: j.status not in ("scheduled", RUNNING), timeout=120)
    assert job.status == SUCCEEDED, job.status_reason
    assert _metric_steps(db_url, job_id) == list(range(1, 21))
    script = (settings.runs_dir / job_id / "attempt-1" / "slurm" / "job.sbatch").read_text()
    assert "MEGATRAIN_DATABASE_URL" not in script and db_url not in script
    assert "export MEGATRAIN_NODE_TOKEN=(attempt token)" in script  # the copy keeps no token
    with session_scope(db_url) as s:
        lines = s.scalars(select(JobLog.line).where(JobLog.job_id == job_id)).all()
        tokens = s.scalars(select(NodeToken).where(NodeToken.job_id == job_id)).all()
        assert len(tokens) == 1 and tokens[0].revoked_at is not None  # over with its attempt
    assert "fake engine: MEGATRAIN_DATABASE_URL=" in lines  # the engine had none


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_under_megatrain_up_a_local_runner_holds_no_database_url(
    live_stack: Any, fake_engine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded stack's local executor mints a token per attempt and hands its runner the API's
    URL instead of the database's: neither the runner nor the engine can open the database, the job
    runs to its end through the API, and the attempt's token is revoked once it is over."""
    from megatrain.client import Client
    from megatrain.db.node_tokens import NodeToken

    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.2")
    db = live_stack.settings.resolved_database_url
    with Client() as c:
        job = c.submit(live_stack.spec("via-api"))
        pids = live_stack.settings.runs_dir / job.id / "attempt-1" / "pids" / "rank0.pid"
        engine = int(wait_for(lambda: pids.is_file() and pids.read_text(), timeout=60))
        with session_scope(db) as s:
            runner = s.get(Job, job.id).runner_pid
        for pid in (runner, engine):
            env = environ_of(pid)
            assert "MEGATRAIN_DATABASE_URL" not in env and db not in "\0".join(env.values())
        assert environ_of(runner)["MEGATRAIN_API_URL"] == live_stack.url
        assert environ_of(runner)["MEGATRAIN_NODE_TOKEN"].startswith("mtn_")
        # One of the node's two CPU slots: the engine runs on its half of the cores.
        cores = os.sched_getaffinity(0)
        if len(cores) >= 2:
            assert len(os.sched_getaffinity(engine)) == len(cores) // 2
        final = c.wait(job.id, timeout_s=90, poll_interval_s=0.3)
        assert final.status == "succeeded", final.status_reason
        assert [m["step"] for m in c.metrics(job.id) if m.get("kind", "train") == "train"][-1] == 10
    with session_scope(db) as s:
        tokens = list(s.scalars(select(NodeToken).where(NodeToken.job_id == job.id)))
    assert len(tokens) == 1 and tokens[0].revoked_at is not None
