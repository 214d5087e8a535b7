"""A CPU's matmul peak, measured: the denominator of MFU on a host without a datasheet figure.

A GPU's peak comes from its datasheet (metrics.GPU_PEAK_TFLOPS). A CPU has no such table worth
trusting (the figure depends on the vector units, the BLAS torch was built with and the threads a rank
is given), so the host's peak for a dtype is the best TFLOP/s that square torch.mm GEMMs reach with
the run's thread count: MFU on a CPU then reads as "fraction of what this process's matmuls can do".

The measurement takes about a second, once: it is cached in one small JSON file per key
(hostname, CPU model, dtype, threads, torch version) under the cache directory
(MEGATRAIN_CACHE_DIR, else $XDG_CACHE_HOME/megatrain, else ~/.cache/megatrain). Only the rank that
reports MFU (rank 0) asks, so a job's ranks do not time GEMMs against each other. Files are written
to a temporary name and renamed, so processes that calibrate at once (two jobs on one host) never
read a half-written file (the last rename wins; they measured the same thing). An unwritable cache
directory only means the next run measures again; a failed measurement means no peak (MFU is then
shown as n/a).
Delete the file to measure again (after a BIOS or power-profile change, say).

A measurement taken while other processes kept the cores busy (hostinfo.OtherLoad) is kept but
marked contended: it is taken again, at most every REMEASURE_S, until a quiet one replaces it, and
the best figure wins (other work can only make GEMMs look slower). The worker's pool description and
so the planner read this figure; a low one predicted steps ~40% slower than they ran.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from megatrain.hostinfo import REMEASURE_CONTENDED_S, OtherLoad, cpu_model
from megatrain.settings import get_settings

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SIZES = (256, 512, 1024, 2048)
"""Square GEMM sizes tried in turn; small ones warm the BLAS, large ones reach the peak."""
REPEATS = 3
SLOW_GEMM_S = 0.1
"""A size whose GEMM takes this long is big enough: larger ones would only cost time."""
BUDGET_S = 1.5
"""Stop growing the size once this much time has gone into measuring."""
REMEASURE_S = REMEASURE_CONTENDED_S


def cache_dir() -> Path:
    configured = get_settings().cache_dir
    if configured is not None:
        return configured
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "megatrain"


def cache_key(precision: str, threads: int) -> dict[str, Any]:
    """What the measured peak depends on; a change in any of these means measuring again."""
    return {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "dtype": precision,
        "threads": threads,
        "torch": torch.__version__,
    }


def _cache_path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"cpu_matmul_peak-{key['dtype']}-{key['threads']}t-{digest}.json"


def measure_matmul_tflops(dtype: torch.dtype) -> float:
    """Best TFLOP/s of square torch.mm GEMMs in `dtype` with torch's current thread count."""
    best = 0.0
    start = time.perf_counter()
    # Its own generator: the global one seeds the run's dropout, which must not depend on whether
    # this host's peak was already cached.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in SIZES:
            a = torch.randn(n, n, generator=gen).to(dtype)
            b = torch.randn(n, n, generator=gen).to(dtype)
            torch.mm(a, b)  # warm-up: first-call dispatch and packing buffers are not the GEMM's rate
            fastest = math.inf
            for _ in range(REPEATS):
                t0 = time.perf_counter()
                torch.mm(a, b)
                fastest = min(fastest, time.perf_counter() - t0)
                if fastest >= SLOW_GEMM_S:
                    break  # one slow sample is already a long, steady measurement
            best = max(best, 2 * n**3 / fastest / 1e12)
            if fastest >= SLOW_GEMM_S or time.perf_counter() - start >= BUDGET_S:
                break
    return best


def contended(other_cores: float | None, threads: int) -> bool:
    """Whether other work took cores the GEMMs needed: more than the cores left beside `threads`
    (less half a core of slack), and at least a quarter of a core."""
    if other_cores is None:
        return False
    return other_cores > max(0.25, (os.cpu_count() or 1) - threads - 0.5)


def _read(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict):
        return None
    value = entry.get("tflops")
    if entry.get("key") != key or not isinstance(value, int | float) or not 0 < value < math.inf:
        return None  # another key's file under a colliding name, or a damaged one: measure again
    return entry


def _write(path: Path, entry: dict[str, Any]) -> None:
    """Atomic (temporary file + rename); never raises: the cache is an optimisation."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        log.warning("cannot cache the CPU matmul peak in %s: %s", path.parent, exc)


def cpu_peak(precision: str) -> dict[str, Any] | None:
    """This host's matmul peak per process for `precision`: {"tflops", "contended", "other_cores",
    "measured_at"}, measured once and cached (again while contended, see the module's docstring).

    Measured with torch's current thread count, so call it after the run has set its threads
    (each rank's share of the cores). None for a precision torch cannot multiply on a CPU.
    """
    dtype = DTYPES.get(precision)
    if dtype is None:
        return None
    threads = torch.get_num_threads()
    key = cache_key(precision, threads)
    path = _cache_path(key)
    cached = _read(path, key)
    if cached is not None and not (
        cached.get("contended") and time.time() - cached.get("measured_at", 0) >= REMEASURE_S
    ):
        return cached
    try:
        with OtherLoad() as load:
            tflops = measure_matmul_tflops(dtype)
    except RuntimeError as exc:  # e.g. a dtype this torch build has no CPU GEMM for
        log.warning("no CPU matmul peak for %s: %s", precision, exc)
        return cached
    if not 0 < tflops < math.inf:
        return cached
    busy = contended(load.cores, threads)
    entry = {
        "key": key,
        "tflops": tflops,
        "contended": busy,
        "other_cores": load.cores,
        "measured_at": time.time(),
    }
    if cached is not None and cached["tflops"] > tflops:
        # Still below a figure taken before: that one stands; quiet now means it was the truth.
        entry["tflops"] = cached["tflops"]
        entry["contended"] = busy and bool(cached.get("contended"))
    _write(path, entry)
    return entry


def cpu_peak_tflops(precision: str) -> float | None:
    """cpu_peak's TFLOP/s."""
    entry = cpu_peak(precision)
    return None if entry is None else float(entry["tflops"])
