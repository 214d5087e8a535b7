"""Tables of the control plane. Names are singular snake_case; timestamps end in _at (UTC)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from megatrain.job_states import (  # noqa: F401 - re-exported for the database's users
    ACTIVE_STATES,
    CANCELLED,
    FAILED,
    JOB_STATES,
    QUEUED,
    RUNNING,
    SCHEDULED,
    SUCCEEDED,
    TERMINAL_STATES,
)

QUARANTINED = "quarantined"
"""Node.status of a node taken out of placement after repeated infrastructure failures."""

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware on PostgreSQL; SQLite keeps naive values, so they are stored and read as UTC."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is not None and dialect.name == "sqlite":
            value = value.astimezone(UTC).replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Tenant(Base):
    __tablename__ = "tenant"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ten"))
    name: Mapped[str] = mapped_column(String(100), unique=True)
    max_priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """The highest resources.priority this tenant's jobs may ask for; the operator sets it (default:
    no boost above the normal 0). Negative priorities are always allowed."""
    max_devices: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """The most devices (GPUs, or CPU slots) this tenant's scheduled and running jobs may hold at
    once, over all pools; None: unlimited. A job that would exceed it waits (reason over_quota)."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_key"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("key"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenant.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    """sha256 hex of the whole key; the key itself is shown once and never stored."""
    prefix: Mapped[str] = mapped_column(String(16))
    """First characters of the key, to tell keys apart in listings."""
    name: Mapped[str] = mapped_column(String(100), default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class NodePool(Base):
    __tablename__ = "node_pool"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("pool"))
    name: Mapped[str] = mapped_column(String(100), unique=True)
    accelerator: Mapped[str] = mapped_column(String(32), default="cpu")
    """cpu, or the GPU model name (e.g. 'NVIDIA H100 80GB HBM3')."""
    spec: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    """Its hardware description (megatrain.plan.pool.PoolSpec as a dict); None until an operator
    applies one or a worker measures this machine (scheduler.pools.pool_for then derives one)."""
    spec_source: Mapped[str | None] = mapped_column(String(16), nullable=True)
    """'operator' (`megatrain pools apply`, MEGATRAIN_POOLS_FILE) or 'measured' (a worker's own
    facts); an operator's description is never replaced by a measured one."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Node(Base):
    __tablename__ = "node"
    __table_args__ = (UniqueConstraint("pool_id", "hostname"),)
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("node"))
    pool_id: Mapped[str] = mapped_column(ForeignKey("node_pool.id", ondelete="CASCADE"), index=True)
    hostname: Mapped[str] = mapped_column(String(255))
    slots_total: Mapped[int] = mapped_column(Integer)
    slots_used: Mapped[int] = mapped_column(Integer, default=0)
    """Changed only by guarded UPDATEs (see db.jobs) so concurrent schedulers never oversubscribe."""
    device_memory_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    """Memory of one of its devices (the smallest GPU; a CPU node's memory over its slots); None for
    a node registered before it was recorded, which then refuses nothing at submission."""
    status: Mapped[str] = mapped_column(String(16), default="ready")
    """'ready', or 'lost' once its heartbeats stopped for settings.node_lost_after_s (the
    scheduler's reconcile marks it; its next heartbeat makes it ready again), or 'quarantined'
    after repeated infrastructure failures (only `megatrain nodes release` lifts it)."""
    quarantine_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    last_seen_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    lost_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    """When it was last marked lost (kept after it comes back, for the record)."""
    devices_free: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """Devices the worker saw idle at its last heartbeat (None: never reported)."""
    memory_free_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    """Free memory of its fullest device (GPU), or the host's available memory (CPU), last heartbeat."""
    health: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    """The last heartbeat's health: {"ok": bool, "devices": n, "problems": [text, …]}."""
    packages: Mapped[dict[str, str] | None] = mapped_column(JSON, nullable=True)
    """{module: version} it can import (megatrain.spec_packages.installed_packages), as it last
    registered; None for a node that never reported (its jobs are checked when it claims them)."""


class Job(Base):
    __tablename__ = "job"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key"),
        Index("ix_job_status_priority", "status", "priority", "created_at"),
        Index("ix_job_tenant_created", "tenant_id", "created_at"),
    )
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("job"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenant.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(100))
    kind: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), default=QUEUED)
    status_reason: Mapped[str] = mapped_column(Text, default="")
    """Human-readable, for the job's owner (never names another tenant's job)."""
    wait_reason: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    """While queued: why the job waits, as data (scheduler.reasons: a code and its fields)."""
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    spec_hash: Mapped[str] = mapped_column(String(64))
    idempotency_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    pool: Mapped[str] = mapped_column(String(100), default="default")
    layout: Mapped[dict[str, Any]] = mapped_column(JSON)
    num_procs: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    """Number of times the job has been started; retries bump it."""
    max_retries: Mapped[int] = mapped_column(Integer, default=2)
    """The user's budget of failed attempts (resources.max_retries); nothing changes it."""
    preemptions: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Attempts that ended preempted (checkpointed and requeued for a higher-priority job): not
    failures, so not counted against max_retries."""
    max_preemptions: Mapped[int] = mapped_column(Integer, default=10, server_default="10")
    """resources.max_preemptions: once `preemptions` reaches it the job is no longer preempted."""
    continuations: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Attempts that ended at an allocation's time limit shorter than max_runtime_s and continued
    (a chain on Slurm): not failures either."""
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    paused_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    """Set while the user holds the job (a pause): the scheduler leaves it queued. A running job
    asked to pause is first checkpointed and stopped (preempt_for = job_states.PAUSE_REQUEST)."""
    preempt_for: Mapped[str | None] = mapped_column(String(40), nullable=True)
    """While running: the id of the higher-priority job it is being preempted for (its runner then
    checkpoints, stops and requeues it); cleared when it goes back to the queue."""
    node_id: Mapped[str | None] = mapped_column(ForeignKey("node.id", ondelete="SET NULL"), nullable=True)
    devices: Mapped[list[int] | None] = mapped_column(JSON, nullable=True)
    """While scheduled/running: the node's device indices the job was placed on (CUDA_VISIBLE_DEVICES
    of its ranks on a GPU node; recorded, without effect, on a CPU node)."""
    avoid_nodes: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    """Ids of nodes an attempt of this job was lost on: placement prefers any other node with room."""
    runner_host: Mapped[str | None] = mapped_column(String(255), nullable=True)
    runner_pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    serve_token: Mapped[str | None] = mapped_column(String(64), nullable=True)
    """A serve job's current attempt: the bearer token its model server asks of every request (set
    by the runner that claims the attempt, handed to the server in its environment, sent by the
    API that forwards to it; never in a response, an event or the spec)."""
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    current_step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int] = mapped_column(Integer, default=0)
    latest_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    latest_tokens_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    latest_mfu: Mapped[float | None] = mapped_column(Float, nullable=True)
    num_params: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)
    scheduled_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class JobAllocation(Base):
    """One node's share of a multi-node job (a gang) while it is scheduled or running: the slots and
    devices it holds there. Written with the reservation (db.jobs.reserve_gang), removed, with the
    slots given back, when the job leaves scheduled/running. A single-node job has none: its node and
    devices are on its own row (the job row of a gang names its first node, node_rank 0)."""

    __tablename__ = "job_allocation"
    __table_args__ = (UniqueConstraint("job_id", "node_id"),)
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("job.id", ondelete="CASCADE"), index=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("node.id", ondelete="CASCADE"), index=True)
    node_rank: Mapped[int] = mapped_column(Integer)
    """The node's place in the gang (torchrun's --node-rank): its ranks follow the earlier nodes'."""
    slots: Mapped[int] = mapped_column(Integer)
    devices: Mapped[list[int]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class AttemptLedger(Base):
    """The goodput ledger: one row per ended attempt of a job on a node, in seconds. A job's goodput
    sums its rows; a node's sums the rows of attempts placed on it. `failure` ('infrastructure' or
    'hung') marks attempts that count toward the node's quarantine."""

    __tablename__ = "attempt_ledger"
    __table_args__ = (Index("ix_attempt_ledger_node_ended", "node_id", "ended_at"),)
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("job.id", ondelete="CASCADE"), index=True)
    node_id: Mapped[str | None] = mapped_column(ForeignKey("node.id", ondelete="SET NULL"), nullable=True)
    attempt: Mapped[int] = mapped_column(Integer)
    outcome: Mapped[str] = mapped_column(String(16))
    failure: Mapped[str | None] = mapped_column(String(16), nullable=True)
    productive_s: Mapped[float] = mapped_column(Float, default=0.0)
    queued_s: Mapped[float] = mapped_column(Float, default=0.0)
    restart_s: Mapped[float] = mapped_column(Float, default=0.0)
    checkpoint_stall_s: Mapped[float] = mapped_column(Float, default=0.0)
    hang_s: Mapped[float] = mapped_column(Float, default=0.0)
    preempt_s: Mapped[float] = mapped_column(Float, default=0.0)
    """A preempted attempt: from the request to checkpoint and stop to the engine's exit."""
    eval_s: Mapped[float] = mapped_column(Float, default=0.0)
    """Pauses between steps to evaluate (validation, training.eval_tasks): the engine's `evaluated`
    events."""
    ended_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class JobEvent(Base):
    __tablename__ = "job_event"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("job.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    kind: Mapped[str] = mapped_column(String(32))
    """A state ('queued', 'running', …) for transitions, or 'checkpoint_saved', 'resumed', 'info'."""
    from_status: Mapped[str | None] = mapped_column(String(16), nullable=True)
    to_status: Mapped[str | None] = mapped_column(String(16), nullable=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class JobMetric(Base):
    __tablename__ = "job_metric"
    __table_args__ = (UniqueConstraint("job_id", "kind", "step"),)
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("job.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(8))
    """'train' (loss, lr, grad_norm, tokens_per_s, mfu, …) or 'val' (val_loss)."""
    step: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    data: Mapped[dict[str, Any]] = mapped_column(JSON)
    """The engine's whole row, as written to metrics.jsonl."""


class JobLog(Base):
    __tablename__ = "job_log"
    __table_args__ = (UniqueConstraint("job_id", "seq"),)
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("job.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(BigInteger)
    """Monotonic per job across attempts, so clients can follow with ?after_seq=."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    line: Mapped[str] = mapped_column(Text)


class Checkpoint(Base):
    __tablename__ = "checkpoint"
    __table_args__ = (UniqueConstraint("job_id", "step"),)
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("job.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    uri: Mapped[str] = mapped_column(Text)
    """Storage URL of the iter_{step:07d} folder."""
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


# Dataset states: registered and waiting for a worker, being preprocessed, usable, or failed.
PENDING, PROCESSING, READY = "pending", "processing", "ready"
DATASET_STATES = (PENDING, PROCESSING, READY, FAILED)


class Dataset(Base):
    """A corpus registered through POST /v1/datasets and preprocessed on the workers into an
    indexed dataset (.bin/.idx) under `prefix_url`."""

    __tablename__ = "dataset"
    __table_args__ = (
        UniqueConstraint("tenant_id", "name"),
        Index("ix_dataset_state", "state", "submitted_at"),
    )
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ds"))
    tenant_id: Mapped[str | None] = mapped_column(
        ForeignKey("tenant.id", ondelete="CASCADE"), nullable=True, index=True
    )
    """The owner; None for a shared dataset an operator registered (every tenant sees it)."""
    name: Mapped[str] = mapped_column(String(100))
    state: Mapped[str] = mapped_column(String(16), default=PENDING)
    state_reason: Mapped[str] = mapped_column(Text, default="")
    source_url: Mapped[str] = mapped_column(Text)
    """The JSONL it is made from: the stored upload, or the storage URL the tenant named."""
    uploaded: Mapped[bool] = mapped_column(Boolean, default=False)
    prefix_url: Mapped[str] = mapped_column(Text)
    """Where the indexed dataset lives: PREFIX.bin + PREFIX.idx (what a JobSpec's path becomes)."""
    tokenizer: Mapped[dict[str, Any]] = mapped_column(JSON)
    json_key: Mapped[str] = mapped_column(String(128), default="text")
    record_format: Mapped[str] = mapped_column(String(32), default="text", server_default="text")
    """text: documents under json_key, preprocessed into the index. chat, prompt_completion,
    preference: records a fine-tune or DPO job reads as they are (checked at upload; ready at once)."""
    records_url: Mapped[str | None] = mapped_column(Text, nullable=True)
    """Record formats: the records in the engine's shape (written beside the upload, converted line
    by line), which jobs read; source_url keeps the file as uploaded."""
    filename: Mapped[str | None] = mapped_column(String(255), nullable=True)
    """The uploaded file's own name, where the client sent one (the OpenAI Files API's filename)."""
    append_eod: Mapped[bool] = mapped_column(Boolean, default=True)
    documents: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    vocab_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    input_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    output_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    """Times a worker started preprocessing it; a lost worker's dataset is retried a few times."""
    runner_host: Mapped[str | None] = mapped_column(String(255), nullable=True)
    runner_pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    submitted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    """When the scheduler handed it to the executor (None: not yet, or handed back after a loss)."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


# Background work on one checkpoint (exports, samples): waiting for a worker, running, done, or
# failed (with its error). scheduler/worker.checkpoint_tasks move these rows.
RUNNING_EXPORT = "running"
EXPORT_STATES = (PENDING, RUNNING_EXPORT, READY, FAILED)
SAMPLE_STATES = EXPORT_STATES
# What an export holds: the whole model, or (a LoRA job's only) its adapters.
MODEL_FORM, ADAPTER_FORM = "model", "adapter"
EXPORT_FORMS = (MODEL_FORM, ADAPTER_FORM)


class CheckpointTaskColumns:
    """The checkpoint a row works on, and the columns scheduler.checkpoint_tasks and
    worker.checkpoint_tasks read and write."""

    job_id: Mapped[str] = mapped_column(ForeignKey("job.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default=PENDING)
    error: Mapped[str] = mapped_column(Text, default="")
    """Why it failed, or why a lost worker's attempt is being retried (empty otherwise)."""
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    runner_host: Mapped[str | None] = mapped_column(String(255), nullable=True)
    runner_pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    submitted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    """When the scheduler handed it to the executor (None: not yet, or handed back after a loss)."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class CheckpointExport(CheckpointTaskColumns, Base):
    """A checkpoint converted to another format (Hugging Face: safetensors + config.json) by a worker
    into `{storage}/jobs/{job_id}/exports/{format}/iter_{step:07d}-{dtype}/` (`…-adapter/` for a
    LoRA job's adapters)."""

    __tablename__ = "checkpoint_export"
    __table_args__ = (
        Index("ix_checkpoint_export_status", "status", "submitted_at"),
        # One live (not failed) export per step, format, form and dtype: concurrent POSTs share it.
        Index(
            "uq_checkpoint_export_live", "job_id", "step", "format", "form", "dtype", unique=True,
            sqlite_where=text("status != 'failed'"), postgresql_where=text("status != 'failed'"),
        ),
    )  # fmt: skip
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("exp"))
    format: Mapped[str] = mapped_column(String(16), default="hf")
    form: Mapped[str] = mapped_column(String(16), default=MODEL_FORM, server_default=MODEL_FORM)
    """model: the whole model (a LoRA job's with its adapters merged in); adapter: a LoRA job's
    adapters alone (PEFT's adapter_config.json + adapter_model.safetensors)."""
    dtype: Mapped[str] = mapped_column(String(8), default="bf16")
    uri: Mapped[str | None] = mapped_column(Text, nullable=True)
    """Storage URL of the exported folder, once ready."""
    size_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)

    @property
    def folder_key(self) -> str:
        """Its folder's key in the storage layout; one per (step, form, dtype), so a bf16 and an fp32
        export of the same step, or its model and its adapter, never overwrite each other."""
        suffix = "" if self.form == MODEL_FORM else f"-{self.form}"
        return f"jobs/{self.job_id}/exports/{self.format}/iter_{self.step:07d}-{self.dtype}{suffix}"

    @property
    def complete_marker(self) -> str:
        """The file a worker writes last: a folder holding it is complete."""
        return "adapter_config.json" if self.form == ADAPTER_FORM else "config.json"


class CheckpointSample(CheckpointTaskColumns, Base):
    """Text generated from a job's checkpoint by a worker (worker.samples): the prompt and options as
    asked, the continuation once ready."""

    __tablename__ = "checkpoint_sample"
    __table_args__ = (Index("ix_checkpoint_sample_status", "status", "submitted_at"),)
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("smp"))
    prompt: Mapped[str] = mapped_column(Text)
    max_new_tokens: Mapped[int] = mapped_column(Integer, default=64)
    temperature: Mapped[float | None] = mapped_column(Float, nullable=True)
    top_k: Mapped[int | None] = mapped_column(Integer, nullable=True)
    top_p: Mapped[float | None] = mapped_column(Float, nullable=True)
    seed: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    text: Mapped[str | None] = mapped_column(Text, nullable=True)
    """The continuation alone, decoded (once ready)."""
    prompt_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    new_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    elapsed_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    """Loading (when not warm) plus generating, as the worker measured it."""


class RegisteredModel(Base):
    """A Hugging Face model folder registered under a name (POST /v1/models), so that a JobSpec's
    `model.init_from: hf:NAME` stands for `hf:URL`. Registering only checks and records: nothing
    is copied, and submission stores the resolved URL, so deleting the row never touches a job."""

    __tablename__ = "registered_model"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("mdl"))
    tenant_id: Mapped[str | None] = mapped_column(
        ForeignKey("tenant.id", ondelete="CASCADE"), nullable=True, index=True
    )
    """The owner; None for a shared model an operator registered (every tenant sees it)."""
    name: Mapped[str] = mapped_column(String(100))
    url: Mapped[str] = mapped_column(Text)
    """The folder (file:///… or s3://…), normalised as the data-access rule checked it."""
    model_type: Mapped[str] = mapped_column(String(64))
    """config.json's model_type (gpt2, llama, mistral, qwen2)."""
    fields: Mapped[dict[str, Any]] = mapped_column(JSON)
    """The model.* fields its config.json maps to (megatrain.hf_config.model_fields_from_hf); an
    adapter's are its base's."""
    kind: Mapped[str] = mapped_column(String(16), default="model", server_default="model")
    """model: a whole model folder. adapter: a PEFT LoRA folder over the registered base at base_url
    (a job naming it trains on from its adapters: api/jobs/hf_init)."""
    base_url: Mapped[str | None] = mapped_column(Text, nullable=True)
    """An adapter's base model folder (model_type and fields are the base's)."""
    adapter: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    """An adapter's settings as training.lora takes them (rank, alpha, dropout, targets, use_rslora)."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


# The OpenAI-compatible surface's own rows (kept apart to keep this module short); imported here so
# that Base.metadata, and therefore migrations and create_all, know its tables.
from megatrain.db import audit, fine_tuning, node_tokens, secrets, stream_leases  # noqa: E402, F401
