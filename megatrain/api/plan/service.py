"""Planning a spec on a pool: the request's parts checked (each error naming its field), the pool
described from the database when the request gives none, and the planner run.

`pool_for` is the one place that turns a stored pool into the planner's PoolSpec. Today it builds one
from the NodePool and Node rows (accelerator, device memory, slots per node, node count) with
default link speeds; stored operator descriptions replace it without touching the router.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from megatrain.api.errors import FieldError
from megatrain.db.models import Node, NodePool
from megatrain.plan.cost import CPU_LINKS
from megatrain.plan.flops import gpu_peak_tflops
from megatrain.plan.planner import plan
from megatrain.plan.pool import PoolSpec, parse_pool
from megatrain.scheduler.pools import describe
from megatrain.settings import Settings
from megatrain.spec import SpecError, parse_spec

DEFAULT_CPU_PEAK_TFLOPS = 0.05
"""A CPU slot's fp32 matmul peak when this host never measured it (one modern core, roughly)."""
DEFAULT_GPU_PEAK_TFLOPS = 100.0
"""bf16 peak of a GPU whose name is not in megatrain.plan.flops.GPU_PEAK_TFLOPS."""
# Links when the operator described none: gloo over loopback on a CPU host (measured, see
# megatrain.plan.cost.CPU_LINKS), a PCIe-class GPU node and a 100 Gb/s NIC per GPU across nodes.
GPU_LINKS = {"intra_node_bandwidth_gbps": 100.0, "intra_node_latency_us": 10.0,
             "inter_node_bandwidth_gbps": 12.5, "inter_node_latency_us": 20.0}  # fmt: skip


_peaks: dict[tuple[Path, int], tuple[int, float | None]] = {}
"""(calibration folder, slots) -> (the folder's mtime when read, the peak): each submission would
glob and read the folder again; a calibration written since (a new file) changes the mtime."""


def _measured_cpu_peak(settings: Settings, slots: int) -> float | None:
    """This host's fp32 matmul peak per rank as megatrain.engine.calibrate cached it (read without
    torch), for the threads a rank gets when `slots` ranks share the cores; None if never measured."""
    if settings.cache_dir is not None:
        folder = settings.cache_dir
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        folder = (Path(xdg) if xdg else Path.home() / ".cache") / "megatrain"
    try:
        mtime = folder.stat().st_mtime_ns
    except OSError:
        return None
    cached = _peaks.get((folder, slots))
    if cached is not None and cached[0] == mtime:
        return cached[1]
    peak = _read_cpu_peak(folder, slots)
    _peaks[(folder, slots)] = mtime, peak
    return peak


def _read_cpu_peak(folder: Path, slots: int) -> float | None:
    threads = max(1, (os.cpu_count() or 1) // max(1, slots))
    found: dict[int, float] = {}
    for path in folder.glob("cpu_matmul_peak-fp32-*.json"):
        try:
            entry = json.loads(path.read_text())
            key = entry["key"]
            if key["hostname"] == socket.gethostname() and float(entry["tflops"]) > 0:
                found[int(key["threads"])] = float(entry["tflops"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if threads in found:
        return found[threads]
    return min(found.values()) if found else None


def pool_for(session: Session, settings: Settings, name: str) -> PoolSpec | None:
    """Pool `name` as the planner sees it: its stored description (an operator's, else the one its
    worker measured: megatrain.scheduler.pools), else one derived from its nodes; None when it is
    unknown or has no nodes."""
    pool = session.scalar(select(NodePool).where(NodePool.name == name))
    if pool is None:
        return None
    nodes = list(session.scalars(select(Node).where(Node.pool_id == pool.id)))
    return describe(pool, nodes)[0] or derived_pool(settings, pool, nodes)


def derived_pool(settings: Settings, pool: NodePool, nodes: list[Node]) -> PoolSpec | None:
    """The pool as its node rows tell it (no description stored): the most slots any node has, the
    smallest device memory, the accelerator's peak (a CPU pool's as this host measured it)."""
    slots = max((n.slots_total for n in nodes), default=0)
    if not nodes or not slots:
        return None
    memory = min((n.device_memory_bytes for n in nodes if n.device_memory_bytes is not None), default=None)
    name, count = pool.name, len(nodes)
    cpu = pool.accelerator == "cpu"
    if cpu:
        peak = _measured_cpu_peak(settings, slots) or DEFAULT_CPU_PEAK_TFLOPS
        peaks = {"fp32": peak}
    else:
        peaks = {
            p: value
            for p in ("bf16", "fp16", "fp32")
            if (value := gpu_peak_tflops(pool.accelerator, p)) is not None
        } or {"bf16": DEFAULT_GPU_PEAK_TFLOPS}
    return PoolSpec(
        name=name,
        accelerator=pool.accelerator,
        device_memory_bytes=memory or (80 << 30),
        peak_tflops=peaks,
        devices_per_node=slots,
        nodes=count,
        **(CPU_LINKS if cpu else GPU_LINKS),
    )


def _prefixed(exc: SpecError, prefix: str) -> SpecError:
    return SpecError([{"field": f"{prefix}.{e['field']}", "message": e["message"]} for e in exc.errors])


def plan_request(session: Session, settings: Settings, body: Any) -> dict[str, Any]:
    """POST /v1/plan's answer for a parsed body `{spec, pool?, devices?}`."""
    if not isinstance(body, dict):
        raise FieldError("body", "the body must be an object: {spec, pool?, devices?}")
    unknown = sorted(set(body) - {"spec", "pool", "devices"})
    if unknown:
        raise FieldError(unknown[0], f"unknown field {unknown[0]!r}: the body is {{spec, pool?, devices?}}")
    if "spec" not in body:
        raise FieldError("spec", "a job spec is required")
    errors: list[dict[str, str]] = []
    spec = pool = None
    try:
        spec = parse_spec(body["spec"])
    except SpecError as exc:
        errors += _prefixed(exc, "spec").errors
    if body.get("pool") is not None:
        try:
            pool = parse_pool(body["pool"])
        except SpecError as exc:
            errors += _prefixed(exc, "pool").errors
    devices = body.get("devices")
    if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int) or devices < 1):
        errors.append({"field": "devices", "message": "devices must be a positive integer"})
    if errors:
        raise SpecError(errors)
    assert spec is not None
    if pool is None:
        name = spec.resources.pool
        pool = pool_for(session, settings, name)
        if pool is None:
            known = sorted(session.scalars(select(NodePool.name)).all())
            raise FieldError(
                "spec.resources.pool",
                f"pool {name!r} is not a known pool with nodes (known: {', '.join(known) or 'none'}); "
                "or plan on a pool description (docs/pool-reference.md): `megatrain plan SPEC --pool "
                "POOL.yaml`, the SDK's plan(spec, pool=…), the request's `pool`",
            )
    try:
        result = plan(spec, pool, devices).as_dict()
    except SpecError as exc:  # (a PlanError) its fields are the spec's, as the body nests them
        raise _prefixed(exc, "spec") from None
    result["pool_description"] = pool.model_dump(mode="json")  # the facts the prediction used
    return result
