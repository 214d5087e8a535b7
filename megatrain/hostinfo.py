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


def _tree_pids(root: int) -> list[int]:
    """`root` and every process below it (/proc/PID/task/TID/children), alive now."""
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except (OSError, ValueError):
                continue  # the task or process ended meanwhile
    return pids


def tree_cpu_s(root: int) -> float | None:
    """CPU seconds a process tree has run: each live process's own time plus that of the children
    it reaped (so a data-loading worker that ended still counts, once). None without /proc."""
    total = 0.0
    for pid in _tree_pids(root):
        try:
            # Fields after the command (which may hold spaces): utime stime cutime cstime are 14-17.
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            if pid == root:
                return None
            continue
        total += sum(int(f) for f in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def under_load(other_cores: float, own_cores: float, host_cores: int) -> bool:
    """Whether other work took cores a job could have used: more than the cores the job left idle
    (less half a core of slack) and at least a quarter of a core. A GPU job that keeps one core
    per rank busy is not slowed by a few other busy cores; a CPU job that fills the host is."""
    return other_cores > max(0.25, host_cores - own_cores - 0.5)


class HostLoad:
    """The host's load beside a job between samples: cores that processes outside the job's tree
    (rooted at `root`: torchrun's agent, or the engine itself) kept busy, and the job's own.

        load = HostLoad(os.getppid())
        ...
        load.sample()  # {"host_other_cores": 1.3, "host_job_cores": 0.9, "host_cores": 2,
                       #  "host_under_load": True}; {} where /proc is missing
    """

    def __init__(self, root: int):
        self.root = root
        self.cores = os.cpu_count() or 1  # /proc/stat counts every core of the host
        self._last = (host_busy_s(), tree_cpu_s(root), time.perf_counter())

    def sample(self) -> dict[str, float | int | bool]:
        now = (host_busy_s(), tree_cpu_s(self.root), time.perf_counter())
        (busy0, ours0, t0), (busy1, ours1, t1) = self._last, now
        self._last = now
        if None in (busy0, ours0, busy1, ours1) or t1 <= t0:
            return {}
        assert busy0 is not None and busy1 is not None and ours0 is not None and ours1 is not None
        own = max(0.0, (ours1 - ours0) / (t1 - t0))
        other = max(0.0, (busy1 - busy0) / (t1 - t0) - own)
        return {
            "host_other_cores": round(other, 3),
            "host_job_cores": round(own, 3),
            "host_cores": self.cores,
            "host_under_load": under_load(other, own, self.cores),
        }


def job_root_pid() -> int:
    """The root of this job's processes on this host: torchrun's agent (the parent of every local
    rank, which it sets TORCHELASTIC_RUN_ID for), else this process."""
    return os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else os.getpid()
