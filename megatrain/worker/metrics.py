"""A worker's Prometheus metrics: the attempts it runs, their pace (from the engine's metrics.jsonl
rows its runners already read), where their time went (the goodput ledger's kinds), their
heartbeats, and its node's.

One WorkerMetrics per process (`worker_metrics()`): a Celery worker's runners are threads of it, and
`megatrain worker --metrics-port` serves its registry. The local executor's runners are processes
of their own: each writes its series to files under `runner_metrics_dir` (prometheus_client's
multiprocess mode, switched on by PROMETHEUS_MULTIPROC_DIR in its environment), which `RunnerFiles`
sums for the scheduler's or the embedded API's /metrics.

Only rank 0 writes metrics rows, so a multi-node job's pace is counted on node rank 0's worker, for
the whole job (tokens/s is the job's; device memory is rank 0's device's).
"""

from __future__ import annotations

import glob
import os
import re
import threading
import time
from collections import Counter as Tally
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

from megatrain.settings import Settings
from megatrain.worker.procs import pid_alive

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
RUNNING = "megatrain_worker_running_attempts"

GOODPUT_KINDS = ("productive", "queued", "restart", "checkpoint_stall", "hang", "preempt")
"""The ledger's kinds (worker.ledger's `*_s` keys without the suffix)."""

OUTCOMES = (
    "completed", "failed", "cancel", "preempt", "time_limit", "timeout", "hung", "lost", "runner_error",
)  # fmt: skip
"""How an attempt ended on this worker: the engine exited 0 or not, why the runner stopped it, or
the runner itself raised."""

MEMORY_FIELDS = {
    "device_memory_used_bytes": "used",
    "device_memory_total_bytes": "total",
    "peak_memory_bytes": "peak",
}
"""metrics.jsonl field -> the memory gauge's `kind` (rank 0's device; RSS on a CPU)."""


def _multiprocess() -> bool:
    return MULTIPROC_ENV in os.environ


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # Per-attempt gauges carry `job_id` (never `job`: Prometheus's own target label).
        self.running = self._gauge(
            RUNNING.removeprefix("megatrain_worker_"), "Attempts this worker runs now", []
        )
        self.ended = Counter(
            "megatrain_worker_attempts_ended", "Attempts ended, by outcome", ["outcome"], registry=r
        )
        self.steps = Counter("megatrain_worker_steps", "Training steps its attempts took", registry=r)
        self.tokens = Counter(
            "megatrain_worker_tokens", "Tokens its attempts trained on (whole job)", registry=r
        )
        self.goodput = Counter(
            "megatrain_worker_goodput_seconds",
            "Ended attempts' wall time by goodput kind (productive, queued, restart, checkpoint_stall, ...)",
            ["kind"],
            registry=r,
        )
        job = ["job_id"]
        self.step_time = self._gauge("step_seconds", "Mean step time of the last log interval", job)
        self.tokens_per_s = self._gauge("tokens_per_second", "Tokens/s of the last interval (whole job)", job)
        self.mfu = self._gauge("mfu_ratio", "Model FLOPs utilization of the last interval (0-1)", job)
        self.memory = self._gauge(
            "device_memory_bytes", "Rank 0's device memory: used, total, peak allocated", [*job, "kind"]
        )
        self.heartbeat_at = self._gauge(
            "heartbeat_timestamp_seconds",
            "Unix time of the attempt's last heartbeat the control plane took (age: time() - this)",
            job,
            mode="livemax",
        )
        self.node_heartbeat_at = self._gauge(
            "node_heartbeat_timestamp_seconds",
            "Unix time of the node's last heartbeat the control plane took",
            ["node"],
            mode="livemax",
        )
        self.node_memory_free = self._gauge(
            "node_memory_free_bytes",
            "Free memory of the node's freest device (GPU), or of the host (CPU), at its last heartbeat",
            ["node"],
            mode="livemax",
        )
        for kind in GOODPUT_KINDS:
            self.goodput.labels(kind)
        for outcome in OUTCOMES:
            self.ended.labels(outcome)
        self._lock = threading.Lock()
        self._running: Tally[str] = Tally()
        """Job id -> its attempts running here: a heartbeat thread that outlives its attempt's end by
        a beat must not bring the attempt's series back."""

    def _gauge(
        self, name: str, doc: str, labels: list[str], mode: Literal["livesum", "livemax"] = "livesum"
    ) -> Gauge:
        """megatrain_worker_NAME; in multiprocess mode a dead runner's values drop out (live*) and
        the live ones' are summed (or their max taken)."""
        return Gauge(f"megatrain_worker_{name}", doc, labels, registry=self.registry, multiprocess_mode=mode)

    def attempt(self, job_id: str) -> AttemptMetrics:
        """The series of one attempt, counted as running until its `end`."""
        return AttemptMetrics(self, job_id)

    def heartbeat(self, job_id: str) -> None:
        with self._lock:
            if self._running[job_id]:
                self.heartbeat_at.labels(job_id).set(time.time())

    def node_heartbeat(self, node: str, memory_free_bytes: int | None) -> None:
        self.node_heartbeat_at.labels(node).set(time.time())
        if memory_free_bytes is not None:
            self.node_memory_free.labels(node).set(memory_free_bytes)


class AttemptMetrics:
    def __init__(self, metrics: WorkerMetrics, job_id: str):
        self.metrics, self.job_id = metrics, job_id
        self.last_step: int | None = None
        self.done = False
        with metrics._lock:
            metrics._running[job_id] += 1
        metrics.running.inc()

    def observe(self, rows: Iterable[dict[str, Any]], resumed_from: int | None) -> None:
        """The engine's new metrics rows: steps and tokens since the last row (from the step the
        attempt resumed at, for its first), and the gauges of the latest interval."""
        m, job = self.metrics, self.job_id
        for row in rows:
            step, iter_time = row.get("step"), row.get("iter_time_s")
            # Training rows only: eval and test rows repeat a step and carry no step time.
            if not isinstance(step, int) or not isinstance(iter_time, (int, float)) or iter_time <= 0:
                continue
            new = max(step - (self.last_step if self.last_step is not None else resumed_from or 0), 0)
            self.last_step = max(step, self.last_step or 0)
            m.steps.inc(new)
            m.step_time.labels(job).set(iter_time)
            rate = row.get("tokens_per_s")
            if isinstance(rate, (int, float)):
                m.tokens.inc(rate * iter_time * new)  # tokens per step x steps
                m.tokens_per_s.labels(job).set(rate)
            if isinstance(row.get("mfu"), (int, float)):
                m.mfu.labels(job).set(row["mfu"])
            for field, kind in MEMORY_FIELDS.items():
                if isinstance(row.get(field), (int, float)):
                    m.memory.labels(job, kind).set(row[field])

    def end(self, outcome: str, rc: int, seconds: dict[str, float] | None) -> None:
        """Once per attempt (a retried report of its end counts nothing again): its outcome and its
        ledger seconds; its own series go (in multiprocess mode, with its runner process)."""
        m = self.metrics
        with m._lock:
            if self.done:
                return
            self.done = True
            m._running[self.job_id] -= 1
            gone = m._running[self.job_id] <= 0
            if gone:
                del m._running[self.job_id]
        m.running.dec()
        m.ended.labels(("completed" if rc == 0 else "failed") if outcome == "exited" else outcome).inc()
        for key, value in (seconds or {}).items():
            kind = key.removesuffix("_s")
            if kind in GOODPUT_KINDS and value > 0:
                m.goodput.labels(kind).inc(value)
        if gone and not _multiprocess():  # prometheus_client cannot remove series there
            for gauge in (m.step_time, m.tokens_per_s, m.mfu, m.heartbeat_at):
                gauge.remove(self.job_id)
            for kind in MEMORY_FIELDS.values():
                m.memory.remove(self.job_id, kind)


_PROCESS: WorkerMetrics | None = None
_MADE = threading.Lock()


def worker_metrics() -> WorkerMetrics:
    """This process's WorkerMetrics (made on first use: by whichever runner thread comes first)."""
    global _PROCESS
    with _MADE:
        if _PROCESS is None:
            _PROCESS = WorkerMetrics()
        return _PROCESS


# -- the local executor's runner processes ---------------------------------------------------------


def runner_metrics_dir(settings: Settings) -> Path:
    """Where the local executor's runners write their series (one set of files per runner pid)."""
    return settings.home / "metrics" / "runners"


_PID = re.compile(r"_(\d+)\.db$")


def sweep_runner_files(path: Path) -> None:
    """At a scheduler's start: forget runners that are gone (Prometheus reads the drop in their
    counters as a reset); live ones, orphans of the last scheduler, keep writing and counting."""
    path.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(path):
        match = _PID.search(name)
        if match and not pid_alive(int(match.group(1))):
            (path / name).unlink(missing_ok=True)


class RunnerFiles(Collector):
    """The local runners' series, summed over their processes; a dead runner's live gauges
    (running attempts, its job's pace) are dropped at each scrape."""

    def __init__(self, path: Path):
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.files = MultiProcessCollector(None, str(path))

    def collect(self) -> Iterable[Any]:
        for name in glob.glob(os.path.join(self.path, "gauge_live*_*.db")):
            match = _PID.search(name)
            if match and not pid_alive(int(match.group(1))):
                mark_process_dead(int(match.group(1)), str(self.path))
        families = list(self.files.collect())
        if not any(f.name == RUNNING for f in families):  # no runner lives: none runs, not "no data"
            families.append(GaugeMetricFamily(RUNNING, "Attempts this worker runs now", value=0))
        return families

    def describe(self) -> Iterable[Any]:
        return []  # names vary with what the runners wrote; nothing to check at registration
