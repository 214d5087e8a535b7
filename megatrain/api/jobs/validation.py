"""Every check a submission runs, all of them, answered in one 422 listing every error.

The spec's own rules first (megatrain.spec.check_spec: field errors and every cross-field rule),
then the plan (`parallelism: auto` is planned for its pool: megatrain.plan.planner), the layout,
the pool and its fit, the named datasets, data access, data existence, init_from, priority and the
packages the spec needs, as its pool's nodes reported them.
A check whose inputs are broken is skipped rather than run on a stand-in: a value the spec rules
dropped (Findings.unknown) is never judged again, and memory fit waits for a valid layout, pool and
model.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from megatrain.api.datasets.service import resolve_datasets
from megatrain.api.jobs.data_access import data_url_problem, data_urls, task_fields
from megatrain.api.jobs.data_exists import data_checks, missing_data
from megatrain.api.jobs.hf_init import fill_model
from megatrain.api.plan.service import derived_pool
from megatrain.db.models import Job, Node, NodePool, Tenant
from megatrain.eval_tasks import TaskError, load_task
from megatrain.eval_tasks import data_urls as task_data_urls
from megatrain.plan.layout import Layout, resolve_layout, with_micro_batch_size
from megatrain.plan.memory import from_spec
from megatrain.plan.planner import plan
from megatrain.scheduler.placement import fit_problem, memory_problem, startup_memory_problem
from megatrain.scheduler.pools import OPERATOR, describe
from megatrain.settings import Settings
from megatrain.spec import JOB_SECTIONS, JobSpec, ParallelismSpec, SpecError, check_spec
from megatrain.spec_errors import Findings, Problem
from megatrain.spec_packages import package_problems

JOB_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,39}$")

LAYOUT_INPUTS = (
    "model.num_layers",
    "model.hidden_size",  # (and arch) size ffn_hidden_size when it is not given
    "model.arch",
    "model.num_attention_heads",
    "model.num_query_groups",
    "model.ffn_hidden_size",
    "model.vocab_size",
    "model.seq_length",
    "training.global_batch_size",
    "training.micro_batch_size",
    "training.precision",  # fp8's width rules (megatrain.plan.fp8)
    "parallelism",
    "resources.gpus",
    "resources.devices",  # the device-neutral name of resources.gpus
)
"""The spec fields resolve_layout reads: with one of them dropped, its verdict would be the stand-in's."""
MEMORY_INPUTS = ("model", "training", "parallelism")
"""The memory estimate reads the whole model and training setup: any error there, and it waits."""


def _problem(field: str, message: str) -> Problem:
    return {"field": field, "message": message}


@dataclasses.dataclass(frozen=True)
class PoolView:
    """The spec's pool and its nodes, read once per submission (the plan, fit and package checks
    all judge this one snapshot)."""

    row: NodePool
    nodes: list[Node]


@dataclasses.dataclass
class Submission:
    """A submission that passed every check: the spec to store (planned), its layout, the planner's
    prediction for it (`{layout, predicted, devices, pool, precision, explicit_layout}`; None when
    its pool has no description and no nodes to plan on), and what each "auto" became."""

    spec: JobSpec
    layout: Layout
    plan: dict[str, Any] | None
    auto: dict[str, Any] = dataclasses.field(default_factory=dict)
    """{field: value} for each field the spec left to auto (auto_choices)."""


PLANNED_LAYOUT = ("tp", "pp", "dp", "cp", "ep", "virtual_stages", "sequence_parallel", "pipeline_layers")
"""The layout fields `parallelism: auto` chooses (as Layout names them)."""


def auto_choices(written: JobSpec, spec: JobSpec, layout: Layout) -> dict[str, Any]:
    """What each "auto" of the spec as written became in the spec to store (and its layout), by
    field: parallelism auto's layout (and the recompute, distributed optimizer and devices planning
    set where they changed), dp auto's degree, micro_batch_size auto's size."""
    out: dict[str, Any] = {}
    if not isinstance(written.parallelism, ParallelismSpec):  # parallelism: auto
        out.update({f"parallelism.{k}": getattr(layout, k) for k in PLANNED_LAYOUT})
        if isinstance(spec.parallelism, ParallelismSpec):  # planned (else today's auto: dp fills)
            out["parallelism.distributed_optimizer"] = spec.parallelism.distributed_optimizer
        if out["parallelism.pipeline_layers"] is None:
            del out["parallelism.pipeline_layers"]
        else:
            out["parallelism.pipeline_layers"] = list(layout.pipeline_layers or ())
        if spec.training.recompute != written.training.recompute:
            out["training.recompute"] = spec.training.recompute
        if written.resources.devices is None:
            out["resources.devices"] = layout.world_size
    elif written.parallelism.dp == "auto":
        out["parallelism.dp"] = layout.dp
    if written.training.micro_batch_size == "auto":
        out["training.micro_batch_size"] = spec.training.micro_batch_size
    return out


def _plan(
    session: Session, settings: Settings, spec: JobSpec, pool_view: PoolView | None, findings: Findings
) -> tuple[JobSpec, dict[str, Any] | None] | None:
    """`spec` with `parallelism: auto` replaced by the planner's fastest layout that fits its pool,
    and the prediction for the layout it runs (an explicit one's too).

    Devices: resources.devices when given, else one node of the pool (a job asking for no count gets
    no more than a node: the planner may not spread it over nodes the scheduler would have to gang).
    A pool with no nodes, or none that reported its memory and no operator's description (a guess
    would refuse jobs that fit), or a tokenizer file's vocabulary the planner cannot
    size (no model.vocab_size), keeps today's auto (tp=pp=1, dp fills the devices). None when the
    planner finds nothing that fits (its reasons are in `findings`). Planning `parallelism: auto`
    sets recompute too (Choice.apply); a micro-batch size is the planner's only where the spec says
    auto (a number written is planned with, and kept)."""
    if findings.errors:  # a spec the rules refuse is judged as written: no plan to hide its errors
        return spec, None
    if spec.kind in ("serve", "eval"):  # one process on a model: no training step to plan
        return spec, None
    if spec.model.vocab_size is None and spec.data.tokenizer.type != "byte":
        return spec, None
    if pool_view is None:
        return spec, None
    nodes = pool_view.nodes
    described, source = describe(pool_view.row, nodes)
    if source != OPERATOR and not any(n.device_memory_bytes for n in nodes):
        return spec, None  # memory known only from the operator or the nodes themselves
    pool = described or derived_pool(settings, pool_view.row, nodes)
    if pool is None:
        return spec, None
    auto = spec.parallelism == "auto"
    devices = spec.resources.devices or (pool.devices_per_node if auto else None)
    try:
        planned = plan(spec, pool, devices)
    except SpecError as exc:
        if auto:  # nothing fits: the planner's reasons are the submission's errors
            findings.add_for_new_fields(exc.errors)
            return None
        # An explicit layout's problems are the layout and fit checks' to name (no double report).
        return spec, None
    answer = planned.as_dict()
    answer.pop("candidates")  # the runners-up and rejections are POST /v1/plan's, not the job's
    if auto:
        spec = planned.choice.apply(spec)
    else:
        spec = with_micro_batch_size(spec, planned.choice.micro_batch_size)  # (a number is kept)
    return spec, answer


def _layout(spec: JobSpec, findings: Findings) -> Layout | None:
    if findings.depends_on_unknown(*LAYOUT_INPUTS):
        return None
    try:
        return resolve_layout(spec)
    except SpecError as exc:
        findings.add_for_new_fields(exc.errors)
        return None


def _pool_view(session: Session, spec: JobSpec, findings: Findings) -> PoolView | None:
    """The pool and its nodes, or None when the pool is unknown or not named well."""
    if findings.depends_on_unknown("resources.pool"):
        return None
    pool = spec.resources.pool
    pool_row = session.scalar(select(NodePool).where(NodePool.name == pool))
    if pool_row is None:
        known = sorted(session.scalars(select(NodePool.name)).all())
        findings.add(
            [
                _problem(
                    "resources.pool",
                    f"resources.pool={pool!r} is not a known pool (known: {', '.join(known) or 'none'})",
                )
            ]
        )
        return None
    return PoolView(pool_row, list(session.scalars(select(Node).where(Node.pool_id == pool_row.id))))


def _fit(
    spec: JobSpec,
    layout: Layout,
    pool_view: PoolView,
    findings: Findings,
    multi_node: bool = False,
) -> None:
    pool = spec.resources.pool
    nodes, accelerator = pool_view.nodes, pool_view.row.accelerator
    slots = [n.slots_total for n in nodes]
    problem = fit_problem(layout, slots, pool, multi_node=multi_node)
    if problem:
        findings.add([_problem("resources.pool" if not slots else "resources.devices", problem)])
    if findings.has_error(*MEMORY_INPUTS) or spec.kind in ("serve", "eval"):
        return  # (a model server or an eval holds no gradients nor optimizer state: training's overshoots)
    # A job whose per-device memory (the engine's analytical estimate, worst pipeline stage, in the
    # precision the pool's devices run) exceeds every device of its pool would fail allocating on
    # every attempt.
    try:
        estimate = from_spec(spec, layout, accelerator=accelerator)
    except ValueError:  # a Hugging Face tokenizer without model.vocab_size: sized only by the engine
        return
    text = f"tp={layout.tp} pp={layout.pp} dp={layout.dp} cp={layout.cp}"
    memory = [n.device_memory_bytes for n in nodes if n.device_memory_bytes]
    # The step, then the start (judged apart: its buffers are not the step's, plan.startup_memory).
    problem = memory_problem(estimate.total_bytes, text, memory, pool) or startup_memory_problem(
        estimate.startup_bytes, text, memory, pool
    )
    if problem:
        findings.add([_problem("model", problem)])


def _datasets(session: Session, spec: JobSpec, tenant: Tenant, findings: Findings) -> None:
    """Named datasets become their indexed prefixes (megatrain.api.datasets)."""
    named = [f"{field}.dataset" for field, src in spec.data.sources() if src.dataset]
    if not named or findings.depends_on_unknown("data.tokenizer", *named):
        return
    try:
        resolve_datasets(session, spec, tenant)
    except SpecError as exc:
        findings.add(exc.errors)


def _data(spec: JobSpec, settings: Settings, tenant: Tenant, findings: Findings) -> None:
    """Each data URL the tenant may read, then whether it exists (only those it may read: the API
    answers no questions about other files)."""
    readable = set()
    for field, url in data_urls(spec):
        if findings.depends_on_unknown(field):
            continue
        problem = data_url_problem(field, url, settings, tenant.name)
        if problem:
            findings.add([_problem(field, problem)])
        else:
            readable.add(field)
    checks = [c for c in data_checks(spec) if c.field in readable]
    findings.add(missing_data(checks, settings.s3_endpoint_url))
    for field, task in task_fields(spec):
        if field in readable:
            findings.add(_eval_task(field, task, settings, tenant))


def _eval_task(field: str, url: str, settings: Settings, tenant: Tenant) -> list[Problem]:
    """What lm-eval could not run in the task file at `url` (megatrain.eval_tasks), and the items it
    names that the tenant may not read: each named by the task's field, before anything runs."""
    try:
        config = load_task(url)
    except TaskError as exc:
        return [_problem(field, f"{exc.field}: {exc.message}")]
    problems = [data_url_problem(field, item, settings, tenant.name) for item in task_data_urls(config)]
    return [_problem(field, p) for p in problems if p]


def _init_from(session: Session, spec: JobSpec, tenant: Tenant, field: str) -> Problem | None:
    """`checkpoint:JOB_ID[@STEP]` in model.init_from (or model.adapter_from) must name one of the
    tenant's own jobs (no reading others' weights); hf:URL was checked (and the model filled) before
    parsing, by hf_init.fill_model (an adapter folder by the data-access rules)."""
    value = getattr(spec.model, field.removeprefix("model."))
    if not value or not value.startswith("checkpoint:"):
        return None
    job_id, _, step = value.removeprefix("checkpoint:").partition("@")
    if step and not step.isdigit():
        return _problem(field, f"{field}={value!r}: STEP must be an integer")
    owned = (
        JOB_ID_PATTERN.match(job_id)
        and session.execute(
            select(Job.id, Job.spec).where(Job.id == job_id, Job.tenant_id == tenant.id)
        ).first()
    )
    if not owned:
        return _problem(field, f"{field} names job {job_id!r}, which does not exist")
    method = ((owned.spec or {}).get("training") or {}).get("method", "full")
    if (
        spec.kind == "eval"
        and field == "model.init_from"
        and (spec.resources.devices or 1) > 1
        and method != "full"
    ):
        # Its checkpoint holds adapters; one device folds them into the weights (load_checkpoint),
        # the ranks of a layout would read the base weights alone.
        why = f"{field} names a {method} fine-tune: its eval runs on one device (resources.devices: 1)"
        return _problem(field, why)
    return None


def _secrets(session: Session, spec: JobSpec, tenant: Tenant) -> list[Problem]:
    """Each secret the job names must be one the tenant stored (PUT /v1/secrets/NAME)."""
    from megatrain.db.secrets import TenantSecret

    if not spec.secrets:
        return []
    stored = set(
        session.scalars(
            select(TenantSecret.name).where(
                TenantSecret.tenant_id == tenant.id, TenantSecret.name.in_(spec.secrets)
            )
        )
    )
    return [
        _problem(f"secrets[{i}]", f"no secret named {name!r}: store it first (PUT /v1/secrets/{name})")
        for i, name in enumerate(spec.secrets)
        if name not in stored
    ]


def _priority(session: Session, spec: JobSpec, tenant: Tenant) -> Problem | None:
    if spec.resources.priority <= 0:
        return None
    # Read now: the request's tenant may be a few seconds old (api.auth's cache of keys), and an
    # operator's `megatrain tenants set` counts from the moment it returns.
    allowed = session.scalar(select(Tenant.max_priority).where(Tenant.id == tenant.id)) or 0
    if spec.resources.priority <= allowed:
        return None
    return _problem(
        "resources.priority",
        f"resources.priority={spec.resources.priority} exceeds this tenant's maximum priority {allowed}",
    )


def _packages(spec: JobSpec, pool_view: PoolView | None) -> list[Problem]:
    """What the spec needs installed (flash-attn, Transformer Engine, torchao), judged against the
    packages its pool's nodes reported, not this API host's: a pool none of whose nodes reported
    is judged when a worker claims the job (worker.shard)."""
    rows = pool_view.nodes if pool_view else []
    nodes = {n.hostname: n.packages for n in rows if n.packages is not None}
    return package_problems(spec, nodes, f"pool {spec.resources.pool!r}")


def validate_submission(
    session: Session, settings: Settings, tenant: Tenant, data: Any
) -> tuple[JobSpec, Layout]:
    """The spec and its layout, or SpecError listing every rule the submission breaks."""
    checked = check_submission(session, settings, tenant, data)
    return checked.spec, checked.layout


def check_submission(session: Session, settings: Settings, tenant: Tenant, data: Any) -> Submission:
    """The planned spec, its layout and prediction, or SpecError listing every rule the submission
    breaks."""
    findings = Findings(JOB_SECTIONS)
    try:
        # hf:NAME becomes the registered hf:URL first: the stored spec never depends on the registry.
        data = fill_model(session, settings, tenant, data)
    except SpecError as exc:
        # The model section was to come from the folder: what the spec holds of it is partial.
        findings.add(exc.errors, unknown=["model"])
    if not isinstance(data, dict):
        raise SpecError([_problem("spec", "a job spec must be a mapping (YAML or JSON object)")])
    spec, findings = check_spec(data, findings)
    if spec is None:
        findings.raise_if_any()
        raise SpecError([_problem("spec", "not a valid job spec")])  # unreachable: see check_spec
    pool = _pool_view(session, spec, findings)
    prediction, written = None, spec
    planned = _plan(session, settings, spec, pool, findings)
    if planned is not None:
        spec, prediction = planned
    # A plan that fits nothing leaves no layout to judge: the planner named why.
    layout = _layout(spec, findings) if planned is not None else None
    if layout is not None and pool is not None:
        # The Celery executor runs a job across several nodes (worker.gang); the local one cannot.
        _fit(spec, layout, pool, findings, multi_node=settings.multi_node_executor)
    _datasets(session, spec, tenant, findings)
    _data(spec, settings, tenant, findings)
    for field in ("model.init_from", "model.adapter_from"):
        if not findings.depends_on_unknown(field):
            findings.add(filter(None, [_init_from(session, spec, tenant, field)]))
    if not findings.depends_on_unknown("resources.priority"):
        findings.add(filter(None, [_priority(session, spec, tenant)]))
    findings.add(_secrets(session, spec, tenant))
    if not findings.depends_on_unknown("resources.pool"):
        findings.add(_packages(spec, pool))
    findings.raise_if_any()
    assert layout is not None  # no error: every check ran, the layout's too
    spec = with_micro_batch_size(spec, layout=layout)  # an auto one no planner chose: stored as a number
    return Submission(spec, layout, prediction, auto_choices(written, spec, layout))
