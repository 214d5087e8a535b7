"""The soak's cluster on one machine, as production runs it: `megatrain api` (two processes) and
`megatrain scheduler` on PostgreSQL, object storage on S3 (moto's server over HTTP), and either
(`executor="celery"`) Redis/Celery with two `megatrain worker` "nodes" that hold only a node token,
the API's URL, the broker and storage (no database URL), or (`executor="slurm"`) a real single-host
Slurm (munged, slurmctld, slurmd: tests/fixtures/slurm.py) whose batch jobs run the attempts with an
attempt token and the API's URL only (settings.runners_via_api).

Each node (a Slurm node: the scheduler's exports, which its runners inherit) reaches the API and
S3 through a TCP forwarder of its own, as it would through its own
network path: a fault cuts one (a partition: the node's heartbeats and reports stop, or its storage
is unreachable) and restores it, with the services behind them untouched.

Every process is started in a session of its own so that a fault can kill it whole (a node's worker
with its runners and engines) and start it again. The database is a fresh schema of the `test`
database whose connections carry an application_name of their own, so a fault can drop exactly the
soak's connections (pg_terminate_backend) and nothing else's.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from megatrain.worker.procs import start_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fixtures.slurm import SlurmCluster, start_cluster  # noqa: E402
from fixtures.tcp_proxy import TcpProxy  # noqa: E402

POSTGRES_URL = os.environ.get(
    "MEGATRAIN_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("MEGATRAIN_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
SECRETS_KEY = "c29hay1iZW5jaG1hcmstb25seS0zMi1ieXRlcy1rZXk="
BUCKET = "soak"
AWS_DUMMIES = {"AWS_ACCESS_KEY_ID": "soak", "AWS_SECRET_ACCESS_KEY": "soak",
               "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
NODES = ("node-a", "node-b")
"""The Celery executor's nodes (a Slurm cluster's are what its slurmd runs: one or two)."""
TENANTS = ("acme", "globex", "initech")


def _dsn(url: str) -> str:
    return url.split("?")[0].replace("postgresql+psycopg://", "postgresql://")


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MEGATRAIN_")}


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    """One long-lived process of the cluster (its whole session is what a fault kills)."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    cpus: set[int] | None = None
    """The cores it (and every process it starts) may run on: a node's own, as on a real cluster."""
    popen: subprocess.Popen | None = None

    def start(self) -> None:
        # Dies with the driver (a driver killed by a timeout left the whole cluster running), pinned.
        pin = functools.partial(start_engine, os.getpid(), self.cpus)
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.cmd,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=pin,
            )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen is not None and self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class Cluster:
    home: Path
    redis_db: int = 13
    """The Redis database the cluster's broker uses, emptied at the start and the end."""
    hang_min_s: float = 15.0
    heartbeat_timeout_s: float = 20.0
    storage: str = "s3"
    """'s3' (moto's server, each node through its own forwarder) or 'file' (a shared folder)."""
    storage_error_rate: float = 0.0
    """The fraction of the nodes' S3 requests answered 503 (megatrain.faults' `storage`)."""
    executor: str = "celery"
    """'celery' (two worker nodes) or 'slurm' (a real Slurm on this machine)."""
    nodes: tuple[str, ...] = NODES
    slurm: SlurmCluster | None = None
    db_url: str = ""
    schema: str = ""
    app_name: str = ""
    redis_url: str = ""
    api_url: str = ""
    s3_url: str = ""
    keys: dict[str, str] = field(default_factory=dict)
    procs: dict[str, Proc] = field(default_factory=dict)
    links: dict[tuple[str, str], TcpProxy] = field(default_factory=dict)
    """(node, 'api' or 's3') -> the forwarder that node reaches that service through."""

    # -- setup -----------------------------------------------------------------------------------

    def create(self) -> None:
        """A fresh schema, a Redis database of its own, the tenants' keys and the nodes' tokens."""
        import psycopg
        import redis

        from megatrain.api.auth import create_api_key
        from megatrain.db.node_tokens import create_node_token
        from megatrain.db.session import get_engine, session_scope, upgrade_database

        if self.executor == "slurm":
            self.slurm = start_cluster(self.home / "slurm")
            self.nodes = tuple(self.slurm.node_names)
        tag = uuid.uuid4().hex[:10]
        self.schema, self.app_name = f"soak_{tag}", f"megatrain-soak-{tag}"
        with psycopg.connect(_dsn(POSTGRES_URL), autocommit=True, connect_timeout=3) as conn:
            conn.execute(f"CREATE SCHEMA {self.schema}")
        sep = "&" if "?" in POSTGRES_URL else "?"
        self.db_url = (
            f"{POSTGRES_URL}{sep}options=-csearch_path%3D{self.schema}&application_name={self.app_name}"
        )
        base, _, _ = REDIS_URL.rpartition("/")
        self.redis_url = f"{base}/{self.redis_db}"
        redis.Redis.from_url(self.redis_url).flushdb()
        upgrade_database(self.db_url)
        tokens = {}
        with session_scope(self.db_url) as s:
            for tenant in TENANTS:
                self.keys[tenant] = create_api_key(s, tenant, "soak")
            for node in self.nodes if self.executor == "celery" else ():
                tokens[node] = create_node_token(s, "default", node)[1]
        get_engine(self.db_url).dispose()
        (self.home / "data").mkdir(parents=True, exist_ok=True)
        port = _port()
        self.api_url = f"http://127.0.0.1:{port}"
        for path in self.paths:
            self._link(path, "api", port)
        if self.storage == "s3":
            s3_port = _port()
            self.s3_url = f"http://127.0.0.1:{s3_port}"
            moto = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3_port)]
            self._add("s3", moto, _clean_env())
            for path in self.paths:
                self._link(path, "s3", s3_port)
        control = self._control_env()
        api_cmd = [sys.executable, "-m", "megatrain.cli", "api", "--port", str(port), "--workers", "2"]
        self._add("api", api_cmd, control)
        scheduler_env = control if self.slurm is None else self._slurm_env(control)
        self._add("scheduler", [sys.executable, "-m", "megatrain.cli", "scheduler"], scheduler_env)
        cores = sorted(os.sched_getaffinity(0))
        for i, node in enumerate(self.nodes if self.slurm is None else ()):
            worker = [sys.executable, "-m", "megatrain.cli", "worker"]
            # One core each where there are enough: two engines sharing every core run slower than
            # two with one each, and a node's engine would compete with the other node's.
            mine = set(cores[i :: len(self.nodes)]) if len(cores) >= len(self.nodes) else None
            self._add(node, worker, self._node_env(node, tokens[node]), mine)

    def _add(self, name: str, cmd: list[str], env: dict[str, str], cpus: set[int] | None = None) -> None:
        self.procs[name] = Proc(name, cmd, env, self.home / f"{name}.log", cpus)

    def _link(self, node: str, service: str, port: int) -> None:
        link = self.links[node, service] = TcpProxy(("127.0.0.1", port))
        link.port = _port()  # known now, for the node's environment; it listens from start()

    def _control_env(self) -> dict[str, str]:
        home = self.home / "control"
        home.mkdir(parents=True, exist_ok=True)
        return (
            _clean_env()
            | {
                "MEGATRAIN_HOME": str(home),
                "MEGATRAIN_DATABASE_URL": self.db_url,
                "MEGATRAIN_REDIS_URL": self.redis_url,
                "MEGATRAIN_EXECUTOR": "celery",
                "MEGATRAIN_STORAGE_URL": self.storage_url,
                "MEGATRAIN_SECRETS_KEY": SECRETS_KEY,
                "MEGATRAIN_API_URL": self.api_url,
                "MEGATRAIN_ALLOWED_DATA_ROOTS": (self.home / "data").as_uri(),
                "MEGATRAIN_SCHEDULER_INTERVAL_S": "0.5",
                "MEGATRAIN_HEARTBEAT_TIMEOUT_S": str(self.heartbeat_timeout_s),
                "MEGATRAIN_NODE_LOST_AFTER_S": str(self.heartbeat_timeout_s),
                # The faults are the soak's own: a node that suffers them is not a bad node.
                "MEGATRAIN_NODE_QUARANTINE_FAILURES": "1000",
            }
            | self._s3_env(self.s3_url)
        )

    def _slurm_env(self, control: dict[str, str]) -> dict[str, str]:
        """The scheduler's: the Slurm executor, and what its batch jobs export to the runners (the
        nodes' settings of _node_env; the API and S3 through one pair of forwarders, "slurm": every
        Slurm node's runners get the same exports, so a cut partitions them all)."""
        assert self.slurm is not None
        runner = self._node_env("slurm", token="")
        runner.pop("MEGATRAIN_NODE_TOKEN")  # each attempt gets its own
        for name in ("MEGATRAIN_NODE_NAME", "MEGATRAIN_REDIS_URL", "MEGATRAIN_HOME"):
            runner.pop(name)
        return (
            control
            | runner
            | {
                "MEGATRAIN_EXECUTOR": "slurm",
                "MEGATRAIN_SLURM_PARTITION": self.slurm.partition,
                "MEGATRAIN_RUNNERS_VIA_API": "true",
                "SLURM_CONF": str(self.slurm.conf),
            }
        )

    def _s3_env(self, endpoint: str) -> dict[str, str]:
        return AWS_DUMMIES | {"MEGATRAIN_S3_ENDPOINT_URL": endpoint} if self.storage == "s3" else {}

    @property
    def paths(self) -> tuple[str, ...]:
        """The network paths to the API and S3 a fault can cut: each worker node's, or Slurm's one."""
        return self.nodes if self.slurm is None else ("slurm",)

    def _node_env(self, node: str, token: str) -> dict[str, str]:
        home = self.home / node
        home.mkdir(parents=True, exist_ok=True)
        env = _clean_env() | {
            "MEGATRAIN_HOME": str(home),
            "MEGATRAIN_API_URL": f"http://127.0.0.1:{self.links[node, 'api'].port}",
            "MEGATRAIN_NODE_TOKEN": token,
            "MEGATRAIN_NODE_NAME": node,
            "MEGATRAIN_REDIS_URL": self.redis_url,
            "MEGATRAIN_STORAGE_URL": self.storage_url,
            "MEGATRAIN_CPU_SLOTS": "1",
            "MEGATRAIN_HEARTBEAT_INTERVAL_S": "1.0",
            "MEGATRAIN_HANG_MIN_S": str(self.hang_min_s),
            "MEGATRAIN_HANG_GRACE_S": "120",
        }
        if self.storage == "s3":
            env |= self._s3_env(f"http://127.0.0.1:{self.links[node, 's3'].port}")
            if self.storage_error_rate:
                env["MEGATRAIN_FAULTS"] = f"storage:rate={self.storage_error_rate:g},status=503"
        return env

    @property
    def storage_url(self) -> str:
        return f"s3://{BUCKET}/storage" if self.storage == "s3" else (self.home / "storage").as_uri()

    # -- processes -------------------------------------------------------------------------------

    def start(self, timeout_s: float = 120.0) -> None:
        for link in self.links.values():
            link.start()
        if self.storage == "s3":
            self.procs["s3"].start()
            self.wait_s3(timeout_s)
            os.environ.update(self._s3_env(self.s3_url))  # the driver reads checkpoints back
        self.procs["api"].start()
        self.wait_api(timeout_s)
        for name in ("scheduler", *(self.nodes if self.slurm is None else ())):
            self.procs[name].start()
        self.wait_nodes(timeout_s)

    def wait_api(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.procs["api"].alive():
                raise RuntimeError(f"megatrain api exited; see {self.procs['api'].log_path}")
            try:
                if httpx.get(self.api_url + "/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"megatrain api did not answer within {timeout_s:.0f} s")

    def wait_s3(self, timeout_s: float) -> None:
        """Until moto's server answers; then the bucket."""
        import boto3

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.procs["s3"].alive():
                raise RuntimeError(f"moto's server exited; see {self.procs['s3'].log_path}")
            try:
                httpx.get(self.s3_url, timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            raise RuntimeError(f"moto's server did not answer within {timeout_s:.0f} s")
        s3 = boto3.client("s3", endpoint_url=self.s3_url, **_boto_keys())
        s3.create_bucket(Bucket=BUCKET)

    def cut(self, node: str, service: str, for_s: float) -> None:
        """Partition `node` from `service` ('api' or 's3') for `for_s` seconds, in the background:
        its open connections reset, new ones refused, then the link is back on the same port."""
        import threading

        link = self.links[node if self.slurm is None else "slurm", service]
        link.stop()
        threading.Timer(for_s, link.start).start()

    def wait_nodes(self, timeout_s: float) -> None:
        """Until every node registered (a Slurm node: the scheduler read it from sinfo) and is ready."""
        from sqlalchemy import select

        from megatrain.db.models import Node

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.session() as s:
                ready = set(s.scalars(select(Node.hostname).where(Node.status == "ready")))
            if ready >= set(self.nodes):
                return
            for name in ("scheduler", *(self.nodes if self.slurm is None else ())):
                if not self.procs[name].alive():
                    raise RuntimeError(f"{name} exited; see {self.procs[name].log_path}")
            time.sleep(0.5)
        raise RuntimeError(f"the nodes did not register within {timeout_s:.0f} s")

    def kill_node(self, node: str, down_s: float) -> None:
        """The node dies with everything on it and is back after `down_s`: a worker node's whole
        process session killed; a Slurm node set DOWN (Slurm ends its jobs: NODE_FAIL), then RESUMEd."""
        if self.slurm is None:
            self.restart(node, down_s)
            return
        down = self.slurm.client("scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=soak")
        if down.returncode != 0:
            raise RuntimeError(f"scontrol could not take {node} down: {down.stderr}")
        time.sleep(down_s)
        self.slurm.client("scontrol", "update", f"NodeName={node}", "State=RESUME")

    def slurm_node(self, job_id: str) -> tuple[str, int] | None:
        """Where Slurm runs the job's current attempt (Slurm picks the node, not our placement) and
        how many jobs run there; None off Slurm or when squeue does not say."""
        if self.slurm is None:
            return None
        from sqlalchemy import select

        from megatrain.db.models import JobEvent
        from megatrain.worker.slurm.executor import SUBMITTED_EVENT

        with self.session() as s:
            data = s.scalars(
                select(JobEvent.data)
                .where(JobEvent.job_id == job_id, JobEvent.kind == SUBMITTED_EVENT)
                .order_by(JobEvent.id.desc())
                .limit(1)
            ).first()
        if not data:
            return None
        node = self.slurm.client("squeue", "-h", "-j", str(data["slurm_id"]), "-o", "%N").stdout.strip()
        if node not in self.nodes:
            return None
        there = self.slurm.client("squeue", "-h", "-w", node, "-t", "RUNNING", "-o", "%i").stdout.split()
        return node, len(there)

    @property
    def slots(self) -> int:
        """How many jobs run at once: one per worker node; on Slurm, its CPUs up to this machine's."""
        from fixtures.slurm import CPUS_PER_NODE

        if self.slurm is None:
            return len(self.nodes)
        return min(len(self.nodes) * CPUS_PER_NODE, len(os.sched_getaffinity(0)))

    def restart(self, name: str, down_s: float = 0.0) -> None:
        self.procs[name].kill()
        time.sleep(down_s)
        self.procs[name].start()
        if name == "api":
            self.wait_api()

    def session(self):  # type: ignore[no-untyped-def]
        from megatrain.db.session import session_scope

        return session_scope(self.db_url)

    def drop_connections(self) -> int:
        """Terminate every database connection of the soak's processes; how many there were."""
        import psycopg

        with psycopg.connect(_dsn(POSTGRES_URL), autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s "
                "AND pid <> pg_backend_pid()",
                (self.app_name,),
            ).fetchall()
        return len(rows)

    def engine_pid(self, node: str, job_id: str, attempt: int) -> int | None:
        """Rank 0's pid of the job's attempt on `node`, from its progress file (once it stepped)."""
        from megatrain.progress_files import read_progress

        where = "control" if self.slurm is not None else node  # Slurm's runners share the control's home
        out = self.home / where / "runs" / job_id / f"attempt-{attempt}"
        ranks = [r for r in read_progress(out) if r.rank == 0 and r.pid and r.step > 0]
        return ranks[0].pid if ranks else None

    def stop(self, keep: bool = False) -> None:
        for name in (*self.nodes, "scheduler", "api", "s3"):
            if name in self.procs:
                self.procs[name].kill(signal.SIGTERM)
        if self.slurm is not None:
            self.slurm.client("scancel", "--partition", self.slurm.partition)
            self.slurm.stop()
        for link in self.links.values():
            link.stop()
        if keep or not self.schema:
            return
        import psycopg
        import redis

        from megatrain.db.session import get_engine

        get_engine(self.db_url).dispose()
        with psycopg.connect(_dsn(POSTGRES_URL), autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {self.schema} CASCADE")
        redis.Redis.from_url(self.redis_url).flushdb()

    def describe(self) -> str:
        return json.dumps({"home": str(self.home), "api": self.api_url, "schema": self.schema,
                           "storage": self.storage_url, "s3": self.s3_url or None,
                           "executor": self.executor, "nodes": list(self.nodes)})  # fmt: skip


def _boto_keys() -> dict[str, str]:
    return {"aws_access_key_id": AWS_DUMMIES["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": AWS_DUMMIES["AWS_SECRET_ACCESS_KEY"],
            "region_name": AWS_DUMMIES["AWS_DEFAULT_REGION"]}  # fmt: skip
