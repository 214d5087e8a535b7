"""Facts about this host that need no torch: the CPU's model name (a cache key for measurements
taken on it, by the engine's calibration and the worker's pool description) and how busy other
processes keep it (a timing taken beside other work is not this machine's peak)."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

REMEASURE_CONTENDED_S = 120.0
"""A timing marked contended (taken beside other work) is taken again when asked for this long
after it was taken (the engine's matmul calibration, the worker's pool facts)."""


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (x86 `model name`, Arm `CPU part`), else platform's."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "CPU part") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def host_busy_s() -> float | None:
    """CPU seconds every process on the host has run so far (/proc/stat's busy time: all but idle
    and iowait); None where /proc/stat is missing."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """Cores that other processes kept busy while a block ran (the host's busy time less this
    process's own CPU time, over the wall time). A timing taken beside other work measures that work
    too: callers keep such a timing only until a quieter one replaces it.

        with OtherLoad() as load:
            measure()
        load.cores   # e.g. 0.03 on a quiet host; None where /proc/stat is missing
    """

    cores: float | None = None

    def __enter__(self) -> OtherLoad:
        self._busy, self._ours, self._t = host_busy_s(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        busy, wall = host_busy_s(), time.perf_counter() - self._t
        if busy is None or self._busy is None or wall <= 0:
            return
        others = (busy - self._busy) - (time.process_time() - self._ours)
        self.cores = max(0.0, others / wall)
