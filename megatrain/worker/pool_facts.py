"""This machine's hardware facts, as a pool description (PoolSpec) and as a heartbeat's health.

The peak TFLOP/s of a device is measured where the node runs: a GPU's from the engine's datasheet
table (megatrain.engine.metrics), measured with a bf16 GEMM if the GPU is not listed; a CPU slot's
as the matmul peak of one rank's share of the cores (megatrain.engine.calibrate). Both import
torch, which the process registering the node may not have loaded (the embedded stack's scheduler
shares its process with the API), so the measurement runs in a subprocess
(`python -m megatrain.worker.pool_facts`) and its answer is cached in one JSON file per
(host, CPU model, accelerator, slots, cores) under the cache directory, like calibrate's.

A CPU pool's ranks talk over gloo on loopback TCP: its intra-node bandwidth and latency are
measured the same way (two ranks all-reducing 16 MiB and 4 bytes), with CPU_LINK's documented
orders of magnitude where that fails; across CPU hosts, CPU_LINK's Ethernet figure. A GPU node's
NVLink figure comes from NVLINK_GBPS by model (PCIe otherwise), unmeasured. An operator's
description (`megatrain pools apply`) replaces all of it.

A CPU peak measured while other processes kept the cores busy is marked `contended` (see
megatrain.engine.calibrate): such facts are served but measured again in the background once they
are REMEASURE_CONTENDED_S old, and the worker keeps re-describing its pool until a quiet figure
replaces them (a peak taken under load made the planner predict steps ~40% slower than they ran).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from megatrain.hostinfo import REMEASURE_CONTENDED_S, cpu_model
from megatrain.settings import Settings, cpu_cores

log = logging.getLogger(__name__)

CPU_LINK = {"intra_gbps": 2.0, "intra_us": 50.0, "inter_gbps": 1.25, "inter_us": 100.0}
"""gloo on loopback TCP between ranks of one host moves roughly 1-4 GB/s per direction at tens of
microseconds per message; across hosts, a 10 Gb/s Ethernet (1.25 GB/s). Orders of magnitude for
the planner, not measurements: describe the pool for better figures."""
NVLINK_GBPS = {"B200": 900.0, "H100 PCIe": 25.0, "H100": 450.0, "H200": 450.0, "H800": 200.0}
NVLINK_GBPS |= {"GH200": 450.0, "A100": 300.0, "A800": 200.0, "V100": 150.0}
"""NVLink per GPU per direction by model (first substring match, specific names first); any other
GPU is taken to talk over PCIe 4.0 x16 (PCIE_GBPS)."""
PCIE_GBPS = 25.0
GPU_INTER_NODE = {"inter_gbps": 12.5, "inter_us": 10.0}
"""Across GPU nodes, unmeasured: one 100 Gb/s NIC's share per GPU. Describe the pool to do better."""
MEASURE_TIMEOUT_S = 300.0

_pending: set[str] = set()
_pending_lock = threading.Lock()


def cache_dir(settings: Settings) -> Path:
    if settings.cache_dir is not None:
        return settings.cache_dir
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "megatrain"


def _key(accelerator: str, slots: int) -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "accelerator": accelerator,
        "slots": slots,
        "cores": cpu_cores(),
    }


def _path(settings: Settings, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir(settings) / f"node_facts-{digest}.json"


def cached_facts(settings: Settings, accelerator: str, slots: int) -> dict[str, Any] | None:
    """The measured facts of this machine with `slots` devices, if measured before."""
    key = _key(accelerator, slots)
    try:
        entry = json.loads(_path(settings, key).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("key") != key or not entry.get("peak_tflops"):
        return None
    return entry


def stale(facts: dict[str, Any]) -> bool:
    """Whether cached facts were measured beside other work long enough ago to measure again."""
    age = time.time() - float(facts.get("measured_at", 0))
    return bool(facts.get("contended")) and age >= REMEASURE_CONTENDED_S


def measure_facts(settings: Settings, accelerator: str, slots: int) -> dict[str, Any] | None:
    """Measure in a subprocess (it imports torch), cache and return the facts; None on failure."""
    key = _key(accelerator, slots)
    cmd = [sys.executable, "-m", "megatrain.worker.pool_facts", "--accelerator", accelerator]
    cmd += ["--slots", str(slots)]
    env = dict(os.environ)
    if settings.cache_dir is not None:
        env["MEGATRAIN_CACHE_DIR"] = str(settings.cache_dir)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=MEASURE_TIMEOUT_S, env=env)
        facts = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        log.warning("measuring this node's facts failed: %s", exc)
        return None
    if not isinstance(facts, dict) or not facts.get("peak_tflops"):
        log.warning("measuring this node's facts failed: %s", (out.stderr or "")[-500:])
        return None
    entry = {"key": key, **facts, "measured_at": time.time()}
    path = _path(settings, key)
    try:  # temporary file + rename: a concurrent reader never sees half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot cache this node's facts in %s: %s", path.parent, exc)
    return entry


def local_facts(settings: Settings, accelerator: str, slots: int, wait: bool) -> dict[str, Any] | None:
    """The cached facts, else measure: now (`wait`) or in a background thread, returning None until
    a later call finds them cached (the scheduler's tick must not stall for seconds)."""
    cached = cached_facts(settings, accelerator, slots)
    if cached is None and wait:
        return measure_facts(settings, accelerator, slots)
    if cached is not None and not stale(cached):
        return cached
    name = json.dumps(_key(accelerator, slots), sort_keys=True)
    with _pending_lock:
        if name in _pending:
            return cached
        _pending.add(name)

    def measure() -> None:
        try:
            measure_facts(settings, accelerator, slots)
        finally:
            with _pending_lock:
                _pending.discard(name)

    threading.Thread(target=measure, daemon=True, name="measure-node").start()
    return cached  # None on a first measurement; stale facts stand until the new ones land


def pool_spec_dict(
    name: str, accelerator: str, slots: int, device_memory: int | None, facts: dict[str, Any]
) -> dict[str, Any] | None:
    """A PoolSpec (as a dict) of a pool of this one node, from measured facts; None without memory."""
    if device_memory is None:
        return None
    return {
        "name": name,
        "accelerator": accelerator,
        "device_memory_bytes": device_memory,
        "peak_tflops": facts["peak_tflops"],
        "devices_per_node": slots,
        "nodes": 1,
        "intra_node_bandwidth_gbps": facts["intra_node_bandwidth_gbps"],
        "intra_node_latency_us": facts["intra_node_latency_us"],
        "inter_node_bandwidth_gbps": facts["inter_node_bandwidth_gbps"],
        "inter_node_latency_us": facts["inter_node_latency_us"],
    }


# -- heartbeat health (no torch: nvidia-smi and /proc) -------------------------------------------


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gpu_memory() -> list[tuple[int, int]] | None:
    """(used, total) bytes per GPU via nvidia-smi; None when it fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    query = ["--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run([exe, *query], capture_output=True, text=True, timeout=10)
        rows = [line.split(",") for line in out.stdout.splitlines() if line.strip()]
        return [(int(u) << 20, int(t) << 20) for u, t in rows] if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


IDLE_GPU_BYTES = 1 << 30
"""A GPU using less than this is idle (a CUDA context alone takes a few hundred MiB)."""


def heartbeat_values(accelerator: str, slots: int, busy: int | None) -> dict[str, Any]:
    """What a heartbeat writes on its node: devices_free, memory_free_bytes, health.

    `busy` is the devices this worker's running jobs hold (CPU nodes: the only way to tell a slot
    is in use); None when unknown. A GPU counts as free when its memory is nearly unused.
    """
    problems: list[str] = []
    if accelerator == "cpu":
        devices, free_mem = slots, _mem_available()
        free = None if busy is None else max(0, slots - busy)
    else:
        gpus = _gpu_memory()
        if gpus is None:
            problems.append("nvidia-smi failed: the GPUs cannot be queried")
            devices, free, free_mem = 0, None, None
        else:
            gpus = gpus[:slots]
            devices = len(gpus)
            free = sum(1 for used, _ in gpus if used < IDLE_GPU_BYTES)
            free_mem = min((total - used for used, total in gpus), default=None)
    if devices < slots:
        problems.append(f"{devices} of its {slots} devices are visible")
    if free_mem is not None and accelerator == "cpu" and free_mem < 256 << 20:
        problems.append(f"only {free_mem >> 20} MiB of memory available")
    health = {"ok": not problems, "devices": devices, "problems": problems}
    return {"devices_free": free, "memory_free_bytes": free_mem, "health": health}


# -- the measurement itself (runs in its own process: imports torch) -----------------------------


def _cuda_bf16_tflops() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 10
    for _ in range(n):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * n / (time.perf_counter() - t0) / 1e12


GLOO_BYTES = 16 << 20


def _gloo_rank(rank: int, port: int, threads: int, results: Any) -> None:
    """One of two gloo ranks on loopback: times a 4-byte and a GLOO_BYTES all-reduce; rank 0
    reports (seconds per small, seconds per big)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    small, big = torch.zeros(1), torch.zeros(GLOO_BYTES // 4)
    for _ in range(3):  # connections and buffers set up before timing
        dist.all_reduce(small)
        dist.all_reduce(big)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(50):
        dist.all_reduce(small)
    t_small = (time.perf_counter() - t0) / 50
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(big)
    t_big = (time.perf_counter() - t0) / 5
    if rank == 0:
        results.put((t_small, t_big))
    dist.destroy_process_group()


def measure_gloo_loopback(threads: int) -> tuple[float, float] | None:
    """(GB/s per direction, latency µs) between two gloo ranks of this host; None on failure.

    A two-rank ring all-reduce sends each rank's whole buffer once per direction (half in the
    reduce-scatter, half in the all-gather) in two messages: bandwidth = bytes / (time − 2 latencies),
    latency = a 4-byte all-reduce's time over 2.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # a fork after torch's threads started may hang
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, threads, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        t_small, t_big = results.get(timeout=120)
    except Exception as exc:  # noqa: BLE001 - any failure means: use the documented figures
        log.warning("gloo loopback measurement failed: %s", exc)
        return None
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    latency = t_small / 2
    return GLOO_BYTES / max(t_big - 2 * latency, 1e-9) / 1e9, latency * 1e6


def measure_here(accelerator: str, slots: int) -> dict[str, Any]:
    """Peaks per precision and link figures of one device of this machine (imports torch)."""
    if accelerator == "cpu":
        import torch

        from megatrain.engine.calibrate import cpu_peak
        from megatrain.engine.runtime import cpu_has_native_bf16

        # One device is one rank, which the engine gives its share of the cores (runtime._set_threads).
        threads = max(1, cpu_cores() // max(1, slots))
        torch.set_num_threads(threads)
        measured = {"fp32": cpu_peak("fp32")}
        if cpu_has_native_bf16():  # elsewhere bf16 jobs run in fp32: fp32's peak stands for them
            measured["bf16"] = cpu_peak("bf16")
        peaks = {p: e["tflops"] for p, e in measured.items() if e is not None}
        contended = any(e is not None and e.get("contended") for e in measured.values())
        gloo = measure_gloo_loopback(threads) if slots > 1 else None
        link = dict(CPU_LINK, source="constant")
        if gloo is not None:
            link |= {
                "intra_gbps": round(gloo[0], 4),
                "intra_us": round(gloo[1], 2),
                "source": "gloo loopback",
            }
    else:
        from megatrain.engine.metrics import gpu_peak_tflops

        peaks = {p: gpu_peak_tflops(accelerator, p) for p in ("bf16", "fp16", "fp32")}
        if not any(peaks.values()):  # a GPU the datasheet table does not list: measure bf16
            peaks = {"bf16": _cuda_bf16_tflops()}
        nvlink = next((v for k, v in NVLINK_GBPS.items() if k.lower() in accelerator.lower()), None)
        link = {"intra_gbps": nvlink or PCIE_GBPS, "intra_us": 5.0 if nvlink else 10.0, **GPU_INTER_NODE}
        link["source"] = "datasheet"
        contended = False
    return {
        "contended": contended,
        "peak_tflops": {p: round(v, 4) for p, v in peaks.items() if v},
        "intra_node_bandwidth_gbps": link["intra_gbps"],
        "intra_node_latency_us": link["intra_us"],
        "inter_node_bandwidth_gbps": link["inter_gbps"],
        "inter_node_latency_us": link["inter_us"],
        "links_from": link["source"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megatrain.worker.pool_facts", description=__doc__)
    parser.add_argument("--accelerator", required=True)
    parser.add_argument("--slots", type=int, required=True)
    args = parser.parse_args(argv)
    print(json.dumps(measure_here(args.accelerator, args.slots)))


if __name__ == "__main__":
    main()
