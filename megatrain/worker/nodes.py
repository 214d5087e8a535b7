"""Node registration: this machine's GPUs, or CPU slots when it has none, as a node of its pool.

The worker side registers what it can run: the local executor's scheduler on each tick (through
`LocalExecutor.refresh_nodes`), a Celery worker when it starts. Registering also describes the pool
by measurement (worker.pool_facts) unless an operator described it.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import case, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from megatrain.db.models import QUARANTINED, Node, NodePool, utcnow
from megatrain.plan.memory import host_memory_bytes
from megatrain.settings import Settings
from megatrain.spec import parse_spec
from megatrain.spec_packages import installed_packages, package_problems
from megatrain.worker.pool_facts import cached_facts, heartbeat_values, local_facts, pool_spec_dict


def detect_gpus() -> list[str]:
    """Names of this machine's NVIDIA GPUs via nvidia-smi (the control plane never imports torch)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def detect_gpu_memory() -> list[int]:
    """Total memory (bytes) of each of this machine's NVIDIA GPUs via nvidia-smi, in its order."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    query = ["--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run([exe, *query], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return [int(line.strip()) << 20 for line in out.stdout.splitlines() if line.strip().isdigit()]  # MiB


def device_memory(accelerator: str, slots: int) -> int | None:
    """Memory of one device of this node: the smallest GPU this worker may use, or on a CPU node
    the memory its processes may use shared among its slots (None when unknown)."""
    if accelerator == "cpu":
        return host_memory_bytes() // max(1, slots)
    sizes = detect_gpu_memory()[: slots or None]
    return min(sizes) if sizes else None


def _visible(env: Mapping[str, str]) -> list[str] | None:
    """The CUDA_VISIBLE_DEVICES an operator gave this worker, as a list; None when unset."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [d.strip() for d in value.split(",") if d.strip()]


def local_capacity(settings: Settings) -> tuple[str, int]:
    """(accelerator, slots): GPUs when there are any (only those CUDA_VISIBLE_DEVICES leaves to this
    worker, if set), else the CPU slots: as configured, or one per usable core."""
    gpus = detect_gpus()
    visible = _visible(os.environ)
    if gpus and visible is not None:
        gpus = gpus[: len(visible)]
    if gpus:
        return gpus[0], len(gpus)
    return "cpu", settings.resolved_cpu_slots


def node_name(settings: Settings) -> str:
    """This worker's node name: MEGATRAIN_NODE_NAME, else the machine's hostname."""
    return settings.node_name or socket.gethostname()


def device_env(devices: Sequence[int] | None, accelerator: str, env: Mapping[str, str]) -> dict[str, str]:
    """The variables that give a job's ranks exactly the devices it was placed on.

    `devices` index the node's GPUs in nvidia-smi (PCI bus) order, hence CUDA_DEVICE_ORDER; where
    the worker itself was given CUDA_VISIBLE_DEVICES, the indices count within that list. Inside a
    Slurm step given GPUs (SLURM_STEP_GPUS) Slurm chose them and set CUDA_VISIBLE_DEVICES itself: the
    scheduler's indices (a capacity plan there) are not applied. On a CPU node (or for a job placed
    before devices were recorded) nothing changes.
    """
    if not devices or accelerator == "cpu":
        return {}
    # One hardware work queue per device: kernels start in the order they are launched, so a
    # sequence-parallel all-gather launched before the GEMM it overlaps does run beside it
    # (Megatron-LM requires the same for its communication overlap).
    queues = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    if env.get("SLURM_STEP_GPUS"):
        return queues
    visible = _visible(env)
    names = [str(d) for d in devices]
    if visible is not None and all(d < len(visible) for d in devices):
        names = [visible[d] for d in devices]
    return {"CUDA_VISIBLE_DEVICES": ",".join(names), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"} | queues


def measured_spec(
    settings: Settings, accelerator: str, slots: int, memory: int | None, wait: bool, cached: bool = False
) -> dict[str, Any] | None:
    """This machine's pool description by measurement (a PoolSpec dict), or None while it is not
    measured. Without `wait`, a first measurement runs in the background and a later call finds it;
    `cached`: only a measurement made before (never start one)."""
    if cached:
        facts = cached_facts(settings, accelerator, slots)
    else:
        facts = local_facts(settings, accelerator, slots, wait=wait)
    return None if facts is None else pool_spec_dict(settings.pool_name, accelerator, slots, memory, facts)


def apply_measured_spec(pool: NodePool, spec: dict[str, Any] | None) -> None:
    """Describe `pool` by a worker's measurement, unless an operator described it."""
    if pool.spec_source == "operator" or spec is None:
        return
    if pool.spec != spec or pool.spec_source != "measured":
        pool.spec, pool.spec_source = spec, "measured"


def record_measured_spec(
    pool: NodePool, settings: Settings, accelerator: str, slots: int, memory: int | None, wait: bool
) -> None:
    """Describe `pool` by this machine's measured facts, unless an operator described it. Without
    `wait`, a first measurement runs in the background and a later registration records it."""
    if pool.spec_source == "operator":
        return
    apply_measured_spec(pool, measured_spec(settings, accelerator, slots, memory, wait))


def cached_spec(
    settings: Settings, accelerator: str, slots: int, memory: int | None
) -> tuple[dict | None, bool]:
    """(this machine's pool description once measured, whether the measurement is final): a worker's
    heartbeat sends it until it is (one measured beside other work is measured again)."""
    facts = cached_facts(settings, accelerator, slots)
    if facts is None:
        return None, False
    return pool_spec_dict(settings.pool_name, accelerator, slots, memory, facts), not facts.get("contended")


def record_cached_facts(
    session: Session, settings: Settings, node_id: str, accelerator: str, slots: int
) -> bool:
    """Describe the node's pool by this machine's facts once they are measured (a worker's
    heartbeat asks until then); False while they are not, or were measured beside other work
    (measured again, pool_facts.stale). The caller commits."""
    node = session.get(Node, node_id)
    spec, final = cached_spec(settings, accelerator, slots, node.device_memory_bytes if node else None)
    pool = None if node is None else session.get(NodePool, node.pool_id)
    if pool is not None:
        apply_measured_spec(pool, spec)
    return final


_packages = functools.cache(installed_packages)
"""What this process can import: read once (a registration refreshes on every heartbeat)."""


def package_problem(spec: dict[str, Any], hostname: str) -> str | None:
    """What a job's spec needs installed and this node cannot import, in one line (None: nothing).
    Judged as it is claimed: the API judged it only against nodes that reported their packages."""
    problems = package_problems(parse_spec(spec), {hostname: _packages()}, f"node {hostname}")
    return "; ".join(p["message"] for p in problems) or None


def node_report(
    settings: Settings, slots: int | None = None, *, wait_for_facts: bool = False, busy: int | None = None
) -> dict[str, Any]:
    """What this machine registers as a node (worker.control's register_node, or the API's
    /v1/node/register): its name, pool, capacity, device memory, packages, health and, once
    measured, its pool's description. `slots` overrides the detected capacity; `busy` as in
    ensure_local_pool."""
    accelerator, detected = local_capacity(settings)
    slots = detected if slots is None else slots
    memory = device_memory(accelerator, slots)
    return {
        "pool": settings.pool_name,
        "node": node_name(settings),
        "accelerator": accelerator,
        "slots": slots,
        "device_memory_bytes": memory,
        "packages": _packages(),
        # Measured here (the API's machine is not this one); a CPU node's free slots, unknown here
        # unless `busy` says, are the scheduler's count (register_node).
        "heartbeat": heartbeat_values(accelerator, slots, busy),
        "pool_spec": measured_spec(settings, accelerator, slots, memory, wait_for_facts),
    }


def ensure_local_pool(
    session: Session,
    settings: Settings,
    slots: int | None = None,
    *,
    wait_for_facts: bool = False,
    busy: int | None = None,
) -> Node:
    """Register (or refresh) this machine as a node of pool `settings.pool_name`; the caller commits.

    `slots` overrides the detected capacity (a worker advertises only what it can run at once);
    `busy` is the devices its jobs hold (default: the slots the scheduler counts as used), for the
    heartbeat's devices_free.
    """
    return register_node(session, node_report(settings, slots, wait_for_facts=wait_for_facts, busy=busy))


def register_node(session: Session, report: dict[str, Any]) -> Node:
    """Register (or refresh) the node a node_report describes; the caller commits. A lost node
    registering again is ready. Safe to call from several processes at once: a lost insert race is
    retried as a lookup."""
    pool_name, hostname = str(report["pool"]), str(report["node"])
    accelerator, slots = str(report["accelerator"]), int(report["slots"])
    for _ in range(3):
        pool = session.scalar(select(NodePool).where(NodePool.name == pool_name))
        if pool is None:
            try:
                with session.begin_nested():
                    pool = NodePool(name=pool_name, accelerator=accelerator)
                    session.add(pool)
            except IntegrityError:
                continue
        node = session.scalar(select(Node).where(Node.pool_id == pool.id, Node.hostname == hostname))
        if node is None:
            try:
                with session.begin_nested():
                    node = Node(pool_id=pool.id, hostname=hostname, slots_total=slots)
                    session.add(node)
            except IntegrityError:
                continue
        node.slots_total = slots
        node.device_memory_bytes = report.get("device_memory_bytes")
        node.packages = report.get("packages")
        node.last_seen_at = utcnow()
        if node.status != QUARANTINED:  # only an operator lifts a quarantine
            node.status = "ready"
        values = dict(report.get("heartbeat") or {})
        if values.get("devices_free") is None and accelerator == "cpu":
            values["devices_free"] = max(0, slots - (node.slots_used or 0))
        for column in ("devices_free", "memory_free_bytes", "health"):
            setattr(node, column, values.get(column))
        pool.accelerator = accelerator
        apply_measured_spec(pool, report.get("pool_spec"))
        session.flush()
        return node
    raise RuntimeError(f"could not register node {hostname} in pool {pool_name}")


def node_seen(
    session: Session, node_id: str, values: dict[str, Any], pool_spec: dict[str, Any] | None
) -> None:
    """One heartbeat of a worker's node: seen now, ready (a node marked lost comes back; a
    quarantined one stays so: only an operator lifts it), what it measured (`values`: devices free,
    free memory, health; a CPU node's free slots are the scheduler's count) and, once measured, its
    pool's description. The caller commits."""
    fields: dict[str, Any] = {k: values.get(k) for k in ("devices_free", "memory_free_bytes", "health")}
    if fields["devices_free"] is None:
        # A CPU node cannot see which slots are busy: the scheduler's count says.
        fields["devices_free"] = Node.slots_total - Node.slots_used
    session.execute(
        update(Node)
        .where(Node.id == node_id)
        .values(
            last_seen_at=utcnow(),
            status=case((Node.status == QUARANTINED, QUARANTINED), else_="ready"),
            **fields,
        )
        .execution_options(synchronize_session=False)
    )
    if pool_spec is not None:
        pool = session.scalar(
            select(NodePool).join(Node, Node.pool_id == NodePool.id).where(Node.id == node_id)
        )
        if pool is not None:
            apply_measured_spec(pool, pool_spec)
