"""The scheduler's Prometheus metrics: how long its ticks take, what it decided, why jobs wait.

A standalone `megatrain scheduler --metrics-port` serves them on its own registry; the embedded stack
(`megatrain up`) puts them on the API's, so its /metrics holds both. Either way the executor's
runners' series join them where only this process can serve them (the local executor's). Decisions
are counted where the loop makes them (megatrain.scheduler.loop), each label set made at zero up
front so a rate over it exists before the first decision does.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.registry import Collector
from sqlalchemy.exc import SQLAlchemyError

from megatrain.scheduler.placement import Decision
from megatrain.scheduler.reasons import CANCEL_REQUESTED

DECISIONS = {
    "placed": "a queued job reserved its nodes and went to the executor",
    "submit_failed": "the executor could not start a placed job (requeued or failed)",
    "lost_race": "another scheduler reserved first; the tick decided again on a fresh snapshot",
    "preempted": "a running job was asked to checkpoint and stop for a higher-priority one",
    "node_lost": "a ready node unheard for node_lost_after_s was marked lost",
    "failed_over": "an active job left a lost node (requeued, failed or cancelled)",
    "runner_lost": "an active job whose runner is gone was requeued or failed",
    "cancelled": "a queued job asked to stop was cancelled before it started",
}
"""The decision label's values, and what each counts."""

STEPS = ("reconcile", "schedule", "datasets", "exports", "samples")
"""A tick's steps, in the order Scheduler.run takes them (the `_once` methods without the suffix)."""

TICK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class SchedulerMetrics:
    """One scheduler's series on `registry` (a fresh one by default: tests build many schedulers)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.ticks = Histogram(
            "megatrain_scheduler_tick_seconds", "Time of one whole tick", registry=r, buckets=TICK_BUCKETS
        )
        self.steps = Histogram(
            "megatrain_scheduler_step_seconds",
            "Time of one step of a tick, by step",
            ["step"],
            registry=r,
            buckets=TICK_BUCKETS,
        )
        self.errors = Counter(
            "megatrain_scheduler_errors",
            "Steps that raised, by step and kind (database or unexpected); the loop goes on",
            ["step", "kind"],
            registry=r,
        )
        self.decisions = Counter(
            "megatrain_scheduler_decisions",
            "What the scheduler decided (DECISIONS)",
            ["decision"],
            registry=r,
        )
        self.waiting = Gauge(
            "megatrain_scheduler_waiting_jobs",
            "Queued jobs at the last placement, by pool and why they wait (a reason code)",
            ["pool", "reason"],
            registry=r,
        )
        self.last_tick = Gauge(
            "megatrain_scheduler_last_tick_timestamp_seconds", "Unix time the last tick ended", registry=r
        )
        for decision in DECISIONS:
            self.decisions.labels(decision)
        for step in STEPS:
            self.steps.labels(step)
        self._waits: set[tuple[str, str]] = set()

    def include(self, collector: Collector | None) -> None:
        """Serve another source's series beside these (the executor's runners', where only this
        process can: Executor.runner_metrics)."""
        if collector is not None:
            self.registry.register(collector)

    def decided(self, decision: str, n: int = 1) -> None:
        """Count `n` decisions of one kind (a name of DECISIONS)."""
        if decision not in DECISIONS:
            raise ValueError(f"unknown scheduler decision {decision!r}")
        if n:
            self.decisions.labels(decision).inc(n)

    def waits(self, decisions: Iterable[Decision]) -> None:
        """Set the waiting gauge from one placement's decisions; a (pool, reason) no job waits for
        any longer reads 0, not the count of some earlier tick."""
        counts = Tally(
            (d.wait.pool, d.wait.code)
            for d in decisions
            if d.wait is not None and d.wait.code != CANCEL_REQUESTED
        )
        for key in self._waits | set(counts):
            self.waiting.labels(*key).set(counts.get(key, 0))
        self._waits |= set(counts)

    @contextmanager
    def tick(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.ticks.observe(time.perf_counter() - start)
            self.last_tick.set(time.time())

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Time one step; an exception out of it is counted (then passed on to the loop's handler)."""
        label = name.removesuffix("_once")
        start = time.perf_counter()
        try:
            yield
        except SQLAlchemyError:
            self.errors.labels(label, "database").inc()
            raise
        except Exception:
            self.errors.labels(label, "unexpected").inc()
            raise
        finally:
            self.steps.labels(label).observe(time.perf_counter() - start)
