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

from sqlalchemy import select
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


def record_measured_spec(
    pool: NodePool, settings: Settings, accelerator: str, slots: int, memory: int | None, wait: bool
) -> None:
    """Describe `pool` by this machine's measured facts, unless an operator described it. Without
    `wait`, a first measurement runs in the background and a later registration records it."""
    if pool.spec_source == "operator":
        return
    facts = local_facts(settings, accelerator, slots, wait=wait)
    spec = None if facts is None else pool_spec_dict(pool.name, accelerator, slots, memory, facts)
    if spec is not None and (pool.spec != spec or pool.spec_source != "measured"):
        pool.spec, pool.spec_source = spec, "measured"


def record_cached_facts(
    session: Session, settings: Settings, node_id: str, accelerator: str, slots: int
) -> bool:
    """Describe the node's pool by this machine's facts once they are measured (a worker's
    heartbeat asks until then); False while they are not, or were measured beside other work
    (measured again, pool_facts.stale). The caller commits."""
    facts = cached_facts(settings, accelerator, slots)
    if facts is None:
        return False
    node = session.get(Node, node_id)
    pool = None if node is None else session.get(NodePool, node.pool_id)
    if node is not None and pool is not None:
        record_measured_spec(pool, settings, accelerator, slots, node.device_memory_bytes, wait=False)
    return not facts.get("contended")


_packages = functools.cache(installed_packages)
"""What this process can import: read once (a registration refreshes on every heartbeat)."""


def package_problem(spec: dict[str, Any], hostname: str) -> str | None:
    """What a job's spec needs installed and this node cannot import, in one line (None: nothing).
    Judged as it is claimed: the API judged it only against nodes that reported their packages."""
    problems = package_problems(parse_spec(spec), {hostname: _packages()}, f"node {hostname}")
    return "; ".join(p["message"] for p in problems) or None


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
    A lost node registering again is ready. Safe to call from several processes at once: a lost
    insert race is retried as a lookup.
    """
    accelerator, detected = local_capacity(settings)
    slots = detected if slots is None else slots
    hostname = node_name(settings)
    for _ in range(3):
        pool = session.scalar(select(NodePool).where(NodePool.name == settings.pool_name))
        if pool is None:
            try:
                with session.begin_nested():
                    pool = NodePool(name=settings.pool_name, accelerator=accelerator)
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
        node.device_memory_bytes = device_memory(accelerator, slots)
        node.packages = _packages()
        node.last_seen_at = utcnow()
        if node.status != QUARANTINED:  # only an operator lifts a quarantine
            node.status = "ready"
        busy = (node.slots_used or 0) if busy is None else busy
        for column, value in heartbeat_values(accelerator, slots, busy).items():
            setattr(node, column, value)
        pool.accelerator = accelerator
        record_measured_spec(pool, settings, accelerator, slots, node.device_memory_bytes, wait_for_facts)
        session.flush()
        return node
    raise RuntimeError(f"could not register node {hostname} in pool {settings.pool_name}")
