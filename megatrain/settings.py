"""Runtime settings, read once from MEGATRAIN_* environment variables.

The embedded default needs none of them: SQLite under MEGATRAIN_HOME, file:// storage under it,
the local executor. Production swaps settings, never code.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from megatrain import REPO_ROOT


def cpu_cores() -> int:
    """Cores this process may run on: its CPU affinity (a container's or taskset's share), else all."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


SERVE_TOKEN_ENV = "MEGATRAIN_SERVE_TOKEN"
"""Where a serve job's engine process finds its attempt's bearer token (db.models.Job.serve_token),
put there by its runner; not an operator's setting."""

CONTROL_PLANE_SETTINGS = (
    "database_url",
    "redis_url",
    "secrets_key",
    "api_key",
    "slurm_jwt",
    "slurm_jwt_file",
)
"""Credentials of the control plane: a node that holds a node token gets none of them (it reaches
the control plane through the API), and a job's engine never does (its runner reports for it)."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MEGATRAIN_", extra="ignore")

    home: Path = Field(default_factory=lambda: Path.home() / ".megatrain")
    """Data directory of the embedded default: database, storage, run folders, the local API key."""

    environment: Literal["dev", "production"] = "dev"
    """`production` refuses the embedded defaults that are unsafe with several machines."""

    database_url: str = ""
    """SQLAlchemy URL; empty means sqlite:///{home}/megatrain.db."""

    storage_url: str = ""
    """file:///abs/path or s3://bucket/prefix; empty means file://{home}/storage."""

    s3_endpoint_url: str | None = None
    """Endpoint for S3-compatible stores (MinIO, moto); None means AWS."""

    storage_role_arn: str | None = None
    """An IAM role (arn:PARTITION:iam::ACCOUNT:role/NAME) the control plane assumes for each attempt
    with a session policy (megatrain.storage_scope): the job's processes then hold a key that reads
    and writes the job's own prefix and reads what its tenant may read, expiring within
    storage_credentials_ttl_s and renewed by its runner, instead of the control plane's own key.
    Needs s3:// storage; the role must trust the control plane's identity."""
    storage_credentials_ttl_s: int = Field(3600, ge=1800, le=43200)
    """How long each scoped key lives: at most the role's maximum session (an hour by default, and
    always for a control plane that itself runs on an assumed role); at least 30 minutes, as a
    runner renews a key 20 minutes before it expires and botocore wants 15 left."""
    sts_endpoint_url: str | None = None
    """Endpoint for AssumeRole on S3-compatible stores (MinIO serves it on its S3 port); None: the
    s3_endpoint_url where one is set, else AWS."""

    executor: Literal["local", "celery", "slurm"] = "local"
    redis_url: str = "redis://127.0.0.1:6379/0"

    # The slurm executor (worker.slurm): where its sbatch jobs go. runs_dir must be on a filesystem
    # the cluster's nodes share (each node's log is written there).
    slurm_partition: str | None = None
    slurm_account: str | None = None
    slurm_qos: str | None = None
    slurm_pools: str = ""
    """Pools filled from Slurm partitions, 'POOL=PARTITION,…' (e.g. 'h100=gpu-h100,cpu=debug'): each
    partition's nodes (sinfo) become its pool's, and a job placed on a pool is submitted to its
    partition. Empty: one pool, pool_name, from slurm_partition (or every partition)."""
    slurm_time_limit_s: int | None = Field(default=None, ge=60)
    """The longest one Slurm job may run (the partition's MaxTime, a QoS's MaxWall); None: no limit
    but the job's max_runtime_s. A job that needs longer runs as a chain of Slurm jobs, each
    checkpointing before its limit and the next resuming there."""
    slurm_bin_dir: str | None = None
    """Folder of sbatch, squeue, sacct, scancel and sinfo; None: found on PATH."""
    slurm_python: str | None = None
    """The interpreter (with megatrain installed) on the cluster's nodes; None: this one."""
    slurm_requeue: bool = False
    """Let Slurm requeue a job after a node failure or preemption itself (else the product retries)."""
    slurm_rest_url: str | None = None
    """slurmrestd's address ("http://host:6820"): when set, the executor talks to Slurm through it
    (worker.slurm.rest) instead of the CLI tools, for a scheduler host that is not a login node."""
    slurm_user: str | None = None
    """The Slurm user slurmrestd acts as (X-SLURM-USER-NAME); None: this process's user."""
    slurm_jwt: str | None = None
    """The JWT slurmrestd passes to slurmctld (X-SLURM-USER-TOKEN), e.g. from `scontrol token`."""
    slurm_jwt_file: str | None = None
    """A file holding the JWT instead, re-read when it changes, so an operator can rotate it."""

    secrets_key: str | None = None
    """Fernet key(s) tenant secrets are encrypted under, comma-separated: the first encrypts, every one
    decrypts (to rotate, put a new key first; rows written before stay readable under the old one).
    Unset: on the embedded default (SQLite) a key is made once in {home}/secrets.key (mode 0600);
    with a server database, storing a secret is refused (503) until it is set."""

    api_url: str = "http://127.0.0.1:8000"
    """Where the CLI and SDK find the API (MEGATRAIN_API_URL)."""

    api_key: str | None = None
    """Key the CLI uses; if unset it reads {home}/credentials, written by the embedded default."""

    host: str = "127.0.0.1"
    port: int = 8000

    allowed_data_roots: str = ""
    """Comma-separated roots (file:///… or s3://…) any tenant may read training data from, added to
    the defaults: in dev, the user's home directory and the checkout's examples/ (when megatrain
    runs from a checkout); in production, none."""

    runners_via_api: bool | None = None
    """The local and Slurm executors' runners reach the control plane through the API at api_url,
    each attempt with a token of its own (minted at submission, valid for that job only, revoked when
    the attempt ends): no process of a job holds the database's URL, and a Slurm node need reach
    only the API. None: on under `megatrain up` (its API is right there), off otherwise."""

    node_token: str | None = None
    """This node's token (`megatrain nodes token create POOL`): with it, the node's worker and runners
    reach the control plane only through the API at api_url, and need no database URL."""

    pool_name: str = "default"
    node_name: str | None = None
    """This worker's node name in its pool (and its Celery queue); None means the machine's
    hostname. Two workers on one machine with distinct names act as two nodes."""
    node_address: str | None = None
    """Where the other nodes of a multi-node job reach this one (torchrun's c10d rendezvous
    endpoint when it holds node rank 0); None means the machine's hostname."""
    rendezvous_timeout_s: float = Field(default=300.0, gt=0)
    """How long the shards of a multi-node attempt wait for each other (the follower for node
    rank 0's endpoint, torchrun for every node to join) before the attempt fails."""
    cpu_slots: int | None = Field(default=None, ge=1, le=1024)
    """Processes the local pool offers when the machine has no GPU (gloo ranks on CPU); None means
    one per core this process may run on (`cpu_cores`)."""

    cache_dir: Path | None = None
    """Per-host measurements kept between runs (the CPU matmul peak behind MFU on a CPU);
    None means $XDG_CACHE_HOME/megatrain, else ~/.cache/megatrain."""

    cpu_low_precision: bool = False
    """Run bf16/fp16 jobs in that precision on CPUs without native bf16 (AVX512-BF16/AMX), where it
    is emulated and many times slower; by default such jobs run in fp32 there and say so."""

    max_request_bytes: int = Field(default=1 << 20, ge=1024)
    max_dataset_upload_bytes: int = Field(default=10 << 30, ge=1024)
    """The largest JSONL file POST /v1/datasets takes as an upload (streamed to storage, never held
    in memory); larger corpora are registered by storage URL instead."""
    scheduler_interval_s: float = Field(default=1.0, gt=0)
    heartbeat_interval_s: float = Field(default=2.0, gt=0)
    heartbeat_timeout_s: float = Field(default=30.0, gt=0)
    node_lost_after_s: float = Field(default=30.0, gt=0)
    """A node unseen this long is marked lost and its jobs fail over (requeued, avoiding it). Workers
    heartbeat every heartbeat_interval_s (the local executor's node every 10 s), so the default
    outlasts many missed beats; a dead node is noticed within node_lost_after_s +
    scheduler_interval_s of its last heartbeat."""
    hang_factor: float = Field(default=10.0, gt=1)
    hang_min_s: float = Field(default=120.0, gt=0)
    hang_grace_s: float = Field(default=900.0, gt=0)
    """An attempt is hung when its step counter stops for hang_factor x its median step time (at
    least hang_min_s); before its first step, and while a checkpoint is being saved, it is allowed
    what the control plane predicted for it (plan.attempt_times), or hang_grace_s where nothing was
    predicted, and during an evaluation (setup, compilation, resuming and saving are slower than a
    step)."""
    collective_timeout_s: float = Field(default=600.0, gt=0)
    """A job's process group gives up on a collective after this long (the attempt fails naming it,
    and is retried) instead of waiting forever; on CUDA, NCCL's flight recorder then dumps each
    rank's last collectives into the attempt folder (nccl_trace.rank{R})."""
    preempt_grace_s: float = Field(default=120.0, gt=0)
    """A preempted job's engine gets this long to checkpoint at its next step boundary and exit
    before its runner sends SIGTERM (the attempt is requeued either way)."""
    node_quarantine_failures: int = Field(default=3, ge=1)
    node_quarantine_window_s: float = Field(default=3600.0, gt=0)
    """A node on which this many attempts fail with infrastructure errors (crashes, hangs) within
    the window is quarantined: no job is placed on it until an operator releases it."""
    pools_file: Path | None = None
    """YAML of pool descriptions (one mapping or a list, as `megatrain pools apply` reads) applied
    when the stack or the scheduler starts; None: none."""
    max_log_lines: int = Field(default=100_000, ge=100)
    """Log lines kept per job; older ones are dropped first."""
    # HTTP server limits (megatrain.api.server): a request's head and body must arrive in time and
    # within bounds; past max concurrent connections + requests, a 503.
    http_max_header_bytes: int = Field(default=16 * 1024, ge=1024, le=1 << 20)
    http_max_headers: int = Field(default=100, ge=8, le=10_000)
    http_first_byte_timeout_s: float = Field(default=3.0, gt=0)
    """A new connection that sends nothing this long is closed (idle sockets held open count against
    http_max_concurrency)."""
    http_header_timeout_s: float = Field(default=10.0, gt=0)
    http_body_timeout_s: float = Field(default=30.0, gt=0)
    http_keepalive_timeout_s: float = Field(default=5.0, gt=0)
    http_max_concurrency: int = Field(default=2048, ge=1)
    http_max_connections_per_client: int = Field(default=512, ge=1)
    """Connections one client address may hold open on one API process; its requests past them are a
    429 (the probes still answer), so one client cannot take every place of http_max_concurrency."""
    http_trusted_proxies: str = ""
    """Comma-separated addresses or networks (10.0.0.0/8) of the proxies and load balancers in front
    of the API: their connections carry many clients' requests and are not capped per client (the
    proxy is where per-client limits belong then)."""
    http_shutdown_timeout_s: float = Field(default=10.0, gt=0)
    api_workers: int = Field(default=2, ge=1, le=256)
    """API processes `megatrain api` runs (the production entry point; `megatrain up` runs one)."""
    api_threads: int = Field(default=4, ge=1, le=256)
    """Threads one API process runs blocking work (database calls, body parsing) on."""
    max_streams_per_tenant: int = Field(default=256, ge=1)
    """Live streams (SSE) one tenant may hold open on one API process; past it, a 429."""
    max_pending_samples_per_tenant: int = Field(default=8, ge=1)
    """Samples (text generated from a checkpoint) one tenant may have waiting or running; past it, a 429."""
    openai_training_method: Literal["lora", "full"] = "lora"
    """How a job of the OpenAI-compatible fine-tuning API (/openai/v1/fine_tuning/jobs) trains
    unless its request chooses (`megatrain.training_method`): LoRA adapters, or every weight."""
    max_active_fine_tuning_jobs_per_tenant: int = Field(default=16, ge=1)
    """Unfinished jobs one tenant may have through /openai/v1/fine_tuning/jobs; past it, a 429."""
    serve_idle_timeout_s: float = Field(default=600.0, gt=0)
    """A serve job (the model server behind /openai/v1/chat/completions) ends after this long without
    a request; the next request starts another."""
    serve_start_timeout_s: float = Field(default=120.0, gt=0)
    """How long a chat request waits for its model's serve job to listen before a 503 (Retry-After)."""
    serve_max_batch: int = Field(default=16, ge=1, le=4096)
    """Sequences one model server decodes together (continuous batching: more wait for a free row)."""

    @field_validator("home", mode="before")
    @classmethod
    def _expand_home(cls, v: object) -> object:
        return Path(os.path.expanduser(str(v))).resolve() if v else v

    @field_validator("pools_file", mode="before")
    @classmethod
    def _expand_pools_file(cls, v: object) -> object:
        return Path(os.path.expanduser(str(v))) if v else None

    @field_validator("slurm_pools")
    @classmethod
    def _check_slurm_pools(cls, v: str) -> str:
        parse_slurm_pools(v)
        return v

    @field_validator("cache_dir", mode="before")
    @classmethod
    def _expand_cache_dir(cls, v: object) -> object:
        return Path(os.path.expanduser(str(v))).resolve() if v else None  # empty: the default

    @model_validator(mode="after")
    def _refuse_unsafe_production_defaults(self) -> Settings:
        if self.environment == "production":
            if not self.database_url or self.database_url.startswith("sqlite"):
                raise ValueError("MEGATRAIN_DATABASE_URL must name a server database in production")
            if not self.storage_url.startswith("s3://"):
                raise ValueError("MEGATRAIN_STORAGE_URL must be s3://… in production")
        return self

    @model_validator(mode="after")
    def _check_storage_role(self) -> Settings:
        if self.storage_role_arn is None:
            return self
        if not re.fullmatch(r"arn:[a-z-]+:iam::\d{12}:role/[\w+=,.@/-]{1,512}", self.storage_role_arn):
            raise ValueError(
                f"MEGATRAIN_STORAGE_ROLE_ARN={self.storage_role_arn!r} is not an IAM role ARN "
                "(arn:aws:iam::123456789012:role/NAME)"
            )
        if not self.resolved_storage_url.startswith("s3://"):
            raise ValueError(
                "MEGATRAIN_STORAGE_ROLE_ARN scopes S3 credentials: MEGATRAIN_STORAGE_URL must be s3://…"
            )
        return self

    @property
    def slurm_pool_partitions(self) -> dict[str, str | None]:
        """Pool → the Slurm partition it is filled from (None: Slurm's default partition)."""
        return parse_slurm_pools(self.slurm_pools) or {self.pool_name: self.slurm_partition}

    @property
    def resolved_cpu_slots(self) -> int:
        """cpu_slots as configured, else this machine's usable cores."""
        return self.cpu_slots if self.cpu_slots is not None else cpu_cores()

    @property
    def multi_node_executor(self) -> bool:
        """Whether the executor runs one job over several nodes (a gang): all but `local`."""
        return self.executor != "local"

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'megatrain.db'}"

    @property
    def resolved_storage_url(self) -> str:
        return (self.storage_url or (self.home / "storage").as_uri()).rstrip("/")

    @property
    def data_roots(self) -> list[str]:
        """The configured roots after the defaults: setting the variable must not take away the
        home directory that the README's exported model lies in."""
        roots = [r.strip().rstrip("/") for r in self.allowed_data_roots.split(",") if r.strip()]
        return [r for r in self.default_data_roots if r not in roots] + roots

    @property
    def default_data_roots(self) -> list[str]:
        """Roots allowed with nothing configured: in dev, $HOME and the checkout's examples/ (so a
        clone outside $HOME runs its own examples); in production, none."""
        if self.environment != "dev":
            return []
        roots = [Path.home().resolve().as_uri()]
        examples = examples_dir()
        if examples is not None:
            roots.append(examples.resolve().as_uri())
        return roots

    @property
    def credentials_path(self) -> Path:
        return self.home / "credentials"

    @property
    def runs_dir(self) -> Path:
        return self.home / "runs"


def examples_dir() -> Path | None:
    """The checkout's examples/ when megatrain runs from one (an editable install too), else None."""
    examples = REPO_ROOT / "examples"
    return examples if (examples / "README.md").is_file() else None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


def reset_settings_cache() -> None:
    """Tests change MEGATRAIN_* variables; this makes the next get_settings() read them again."""
    get_settings.cache_clear()


def parse_slurm_pools(text: str) -> dict[str, str | None]:
    """'POOL=PARTITION,…' as {pool: partition}; ValueError naming the item and the rule broken."""
    pools: dict[str, str | None] = {}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        pool, sep, partition = (s.strip() for s in item.partition("="))
        if not sep or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", pool) or not partition:
            raise ValueError(f"slurm_pools item {item!r} must be POOL=PARTITION (e.g. 'h100=gpu-h100')")
        if pool in pools:
            raise ValueError(f"slurm_pools names pool {pool!r} twice")
        pools[pool] = partition
    return pools
