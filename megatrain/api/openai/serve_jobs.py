"""Which model server answers a requested model, and the serve job that runs it.

A requested `model` is resolved in the tenant's own namespace (another tenant's job, checkpoint or
model is the same 404 as a missing one) to a Target: the base a server must hold, and the LoRA
adapters it adds, if any:

- a fine-tuned model `ft:BASE:TENANT:SUFFIX:JOB_ID` (read loosely: the last field is the job id,
  or its hex as /openai/v1/fine_tuning writes it),
  or one of its checkpoints (`…:JOB_ID:ckpt-step-N`, `checkpoint:JOB_ID[@STEP]`, or the bare job
  id): a LoRA job's checkpoint is its adapters over the base it names (model.init_from), so every
  LoRA job on one base shares one server; a full job's checkpoint is a base of its own;
- a registered model's name (/v1/models): its Hugging Face folder is the base; a registered PEFT
  LoRA adapter folder's adapters answer over the server of the base it was registered on.

The server is a job of kind `serve` (placed by the scheduler, run by a worker like any job), found
among the tenant's queued or running ones by its base, or submitted through the job service. A
submission's Idempotency-Key names the spec and how many serve jobs of that spec came before, so
concurrent requests for one base submit one job, and a later request after it ended submits the
next. Its address is the `serving` event its model server writes once it listens.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from megatrain.api.jobs.service import submit_job
from megatrain.api.jobs.validation import JOB_ID_PATTERN
from megatrain.api.registry import find_named, visible
from megatrain.db.models import (
    QUEUED,
    RUNNING,
    SCHEDULED,
    Checkpoint,
    Job,
    JobEvent,
    NodePool,
    RegisteredModel,
    Tenant,
)
from megatrain.settings import Settings
from megatrain.spec import SpecError
from megatrain.spec_data import TokenizerSpec
from megatrain.storage import StorageError, open_store

SERVE = "serve"
WAITING = (QUEUED, SCHEDULED, RUNNING)
CHECKPOINT_FIELD = re.compile(r"ckpt-step-(\d+)")
JOB_PREFIX = "job-"
MAX_RUNTIME_S = 30 * 86400
"""A server ends when idle (settings.serve_idle_timeout_s), not at a training job's day."""
UNSUPPORTED = "unsupported_endpoint"
"""The error code of a request its model cannot answer (embeddings of a decoder, and the converse)."""


class ServeError(Exception):
    """A request the serving side cannot answer: OpenAI's error fields and an HTTP status."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        retry_after: int | None = None,
    ):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after


@dataclass(frozen=True)
class Target:
    spec: dict[str, Any]
    """The serve job's spec: the base (model.init_from), its tokenizer, precision and pool."""
    adapter: str | None = None
    """The LoRA checkpoint folder whose adapters answer (None: the base alone)."""
    chat_template: str | None = None
    """The fine-tuned job's data.chat_template (its chats are rendered as its training data were)."""
    arch: str | None = None
    """The model's arch (a job's spec) or model_type (a folder's config.json), where known: bert
    embeds, t5 is not served, the others generate."""

    @property
    def base(self) -> str:
        return str(self.spec["model"]["init_from"])

    def endpoint_problem(self, model: str, embeddings: bool) -> ServeError | None:
        """A 400 for a request its model's server cannot answer (refused here, before a serve job
        starts; the server refuses it too): embeddings of a decoder, text of an encoder, any of a T5."""
        if self.arch == "t5":
            return ServeError(400, f"model {model!r} is a T5 (arch t5): it cannot be served yet",
                              param="model", code=UNSUPPORTED)  # fmt: skip
        if embeddings and self.arch is not None and self.arch != "bert":
            return ServeError(400, f"model {model!r} is a decoder; embeddings need an encoder (arch bert)",
                              param="model", code=UNSUPPORTED)  # fmt: skip
        if not embeddings and self.arch == "bert":
            why = (
                f"model {model!r} is an encoder (arch bert): it answers /embeddings, not chat or completions"
            )
            return ServeError(400, why, param="model", code=UNSUPPORTED)
        return None


def _not_found(model: str, why: str = "does not exist") -> ServeError:
    return ServeError(404, f"The model {model!r} {why}.", param="model", code="model_not_found")


def parse_job_model(model: str) -> tuple[str, int | None] | None:
    """(job id, step or None) named by a fine-tuned model or checkpoint id, else None."""
    if model.startswith("checkpoint:"):
        job_id, _, step = model.removeprefix("checkpoint:").partition("@")
        return (job_id, int(step)) if step.isdigit() or not step else None
    fields = model.split(":")
    if model.startswith("ft:") and len(fields) >= 2:
        step = CHECKPOINT_FIELD.fullmatch(fields[-1])
        if step is not None and len(fields) >= 3:
            return _job_id(fields[-2]), int(step.group(1))
        return _job_id(fields[-1]), None
    return (model, None) if JOB_ID_PATTERN.match(model) and model.startswith(JOB_PREFIX) else None


def _job_id(field: str) -> str:
    """A job id from an ft: id's last field: the id itself, or its hex (as /openai/v1 writes it)."""
    return field if field.startswith(JOB_PREFIX) else JOB_PREFIX + field


def resolve_model(session: Session, settings: Settings, tenant: Tenant, model: str) -> Target:
    """The server and adapters that answer `model` for `tenant`; ServeError 404 when it has none."""
    named = parse_job_model(model)
    if named is not None:
        return _from_job(session, tenant, model, *named)
    found = find_named(session, RegisteredModel, tenant, model)
    if found is None:
        raise _not_found(model)
    if (found.kind or "model") == "model":
        return _from_folder(session, settings, found.url, found.name, model)
    # A PEFT adapter folder: its adapters over the server of the base it was registered on.
    base_url = str(found.base_url)
    bases = session.scalars(
        select(RegisteredModel).where(visible(RegisteredModel, tenant), RegisteredModel.url == base_url)
    ).all()
    named = min((b.name for b in bases if (b.kind or "model") == "model"), default=None)
    base = _from_folder(session, settings, base_url, named or _digest(base_url), model)
    return Target(base.spec, f"hf:{found.url.rstrip('/')}", base.chat_template, base.arch)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _from_job(session: Session, tenant: Tenant, model: str, job_id: str, step: int | None) -> Target:
    job = None
    if JOB_ID_PATTERN.match(job_id):
        job = session.scalar(select(Job).where(Job.id == job_id, Job.tenant_id == tenant.id))
    if job is None or job.kind == SERVE:
        raise _not_found(model)
    rows = select(Checkpoint).where(Checkpoint.job_id == job.id)
    rows = rows.where(Checkpoint.step == step) if step is not None else rows.order_by(Checkpoint.step.desc())
    checkpoint = session.scalars(rows.limit(1)).first()
    if checkpoint is None:
        raise _not_found(
            model, "has no checkpoint yet" if step is None else f"has no checkpoint at step {step}"
        )
    spec = job.spec
    training, data = spec.get("training") or {}, spec.get("data") or {}
    base = spec["model"].get("init_from")
    lora = training.get("method") in ("lora", "qlora") and base is not None
    if not lora:  # the checkpoint is a whole model (a LoRA job's from seeded weights: merged)
        base = f"checkpoint:{job.id}@{checkpoint.step}"
    model_section = {**spec["model"], "init_from": base, "adapter_from": None,
                     "hidden_dropout": 0.0, "attention_dropout": 0.0}  # fmt: skip
    pool = (spec.get("resources") or {}).get("pool", "default")
    tokenizer = data.get("tokenizer") or {"type": "byte"}
    # Named by the base alone: the LoRA jobs of one base ask for one and the same serve job.
    name = f"serve-{_digest(base)}"
    served = serve_spec(session, name, model_section, tokenizer, pool)
    arch = spec["model"].get("arch")
    return Target(served, checkpoint.uri if lora else None, data.get("chat_template"), arch)


def _from_folder(session: Session, settings: Settings, url: str, name: str, model: str) -> Target:
    """The Hugging Face folder at `url` (registered as `name`) as a base: its tokenizer.json, its
    tokenizer_config.json's template, its config.json's model type (bert: an encoder)."""
    url = url.rstrip("/")
    try:
        store = open_store(url, settings.s3_endpoint_url)
        if not store.exists("tokenizer.json"):
            raise ServeError(
                400, f"{model!r} has no tokenizer.json in {url}: it cannot be served", param="model"
            )
        template = None
        if store.exists("tokenizer_config.json"):
            config = json.loads(store.get_bytes("tokenizer_config.json"))
            template = (
                f"{url}/tokenizer_config.json"
                if isinstance(config, dict) and config.get("chat_template")
                else None
            )
        arch = _folder_arch(store)
    except (StorageError, ValueError) as exc:
        raise ServeError(400, f"cannot read the folder of {model!r}: {exc}", param="model") from None
    name = re.sub(r"[^A-Za-z0-9._-]", "-", f"serve-{name}")[:100]
    tokenizer = {"type": "hf", "path": f"{url}/tokenizer.json"}
    spec = serve_spec(session, name, {"init_from": f"hf:{url}"}, tokenizer, "default", template)
    return Target(spec, None, template, arch)


def _folder_arch(store: Any) -> str | None:
    """The folder's config.json model_type; None when it has none (the serve job's submission says
    what is wrong with it)."""
    if not store.exists("config.json"):
        return None
    config = json.loads(store.get_bytes("config.json"))
    kind = config.get("model_type") if isinstance(config, dict) else None
    return kind if isinstance(kind, str) else None


def serve_spec(
    session: Session,
    name: str,
    model: dict[str, Any],
    tokenizer: Any,
    pool: str,
    chat_template: str | None = None,
) -> dict[str, Any]:
    """A serve job's spec: one process (its layout planned as any job's), for as long as it is used.

    Its precision is the pool's, not a fine-tune's (every adapter of a base shares one server):
    fp32 on CPUs, where a greedy answer is then `megatrain generate`'s token for token (a CPU with
    native bf16 would otherwise take `auto` to bf16), bf16 on GPUs."""
    accelerator = session.scalar(select(NodePool.accelerator).where(NodePool.name == pool)) or "cpu"
    return {
        "name": name,
        "kind": SERVE,
        "model": model,
        "data": {"tokenizer": tokenizer, "chat_template": chat_template},
        "training": {"precision": "fp32" if accelerator == "cpu" else "bf16"},
        "parallelism": {"tp": 1, "pp": 1, "dp": 1},
        "resources": {"pool": pool, "devices": 1, "max_runtime_s": MAX_RUNTIME_S},
    }


def find_or_submit(session: Session, settings: Settings, tenant: Tenant, target: Target) -> Job:
    """The tenant's queued or running serve job holding the target's base (and tokenizer), else a
    new one (one for any number of concurrent callers: see the module's docstring)."""
    tokenizer = target.spec["data"]["tokenizer"]
    jobs = session.scalars(
        select(Job)
        .where(Job.tenant_id == tenant.id, Job.kind == SERVE, Job.status.in_(WAITING))
        .where(Job.cancel_requested.is_(False))
        .order_by(Job.created_at.desc())
    )
    for job in jobs:
        model, data = job.spec.get("model") or {}, job.spec.get("data") or {}
        if model.get("init_from") == target.base and _tokenizer_key(data.get("tokenizer")) == _tokenizer_key(
            tokenizer
        ):
            return job
    digest = hashlib.sha256(json.dumps(target.spec, sort_keys=True).encode()).hexdigest()[:16]
    prefix = f"serve:{digest}:"
    before = session.scalar(
        select(func.count())
        .select_from(Job)
        .where(Job.tenant_id == tenant.id, Job.idempotency_key.like(f"{prefix}%"))
    )
    try:
        job, _ = submit_job(session, settings, tenant, target.spec, f"{prefix}{before}")
    except SpecError as exc:
        first = exc.errors[0]
        raise ServeError(400, f"the model cannot be served: {first['field']}: {first['message']}",
                         param="model") from None  # fmt: skip
    return job


def _tokenizer_key(tokenizer: Any) -> Any:
    """The tokenizer as a stored spec holds it (the shorthand expanded, defaults filled)."""
    try:
        return TokenizerSpec.model_validate(tokenizer).model_dump(mode="json")
    except ValueError:
        return tokenizer


class Serving(NamedTuple):
    status: str
    reason: str
    url: str | None
    """The model server's address once the job's current attempt listens, else None."""
    token: str | None
    """The bearer token it asks of every request (db.models.Job.serve_token)."""


def serving_address(session: Session, job_id: str) -> Serving:
    """Where the serve job stands, and its server's address and token once it listens."""
    job = session.get(Job, job_id)
    if job is None:
        return Serving("missing", "the serve job is gone", None, None)
    if job.status != RUNNING:
        return Serving(job.status, job.status_reason, None, None)
    events = session.scalars(
        select(JobEvent.data)
        .where(JobEvent.job_id == job_id, JobEvent.kind == "serving")
        .order_by(JobEvent.id.desc())
    )
    for data in events:
        if data.get("attempt") == job.attempt and isinstance(data.get("url"), str):
            return Serving(job.status, job.status_reason, data["url"], job.serve_token)
    return Serving(job.status, job.status_reason, None, None)
