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

from sqlalchemy.orm import Session

from megatrain.db.models import Node, NodePool
from megatrain.db.node_registry import apply_measured_spec, node_seen, register_node  # noqa: F401
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


def slot_cpus(devices: Sequence[int] | None, slots: int | None, cores: Sequence[int]) -> set[int] | None:
    """On a CPU node, the cores of a job placed on `devices` of the node's `slots`: each slot owns
    an equal share of the cores (several slots per core where there are more slots than cores), so
    jobs side by side do not each spread a thread per core over every core (two such 1-slot jobs on
    2 cores stepped 15-60x slower than with a core each: benchmarks/soak.py). None where nothing is
    to be pinned: a job holding every slot, or indices this node does not have."""
    if not devices or not slots or not cores or len(set(devices)) >= slots:
        return None
    if any(d < 0 or d >= slots for d in devices):
        return None
    cores = sorted(cores)
    if slots >= len(cores):
        return {cores[d * len(cores) // slots] for d in devices}
    return {c for d in devices for c in cores[d * len(cores) // slots : (d + 1) * len(cores) // slots]}


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
    """What this machine registers as a node (db.node_registry.register_node, or the API's
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
