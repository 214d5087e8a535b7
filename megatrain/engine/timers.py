"""Wall time per phase of a training step (data, forward, backward, grad_sync, optimizer), per interval.

    timers = StepTimers(device)
    for step in ...:
        timers.begin_step(sync=step % log_interval == 0)
        with timers("data"): ...
        with timers("forward"): ...
        ...
        timers.end_step()
        if step % log_interval == 0:
            row.update(timers.report())       # {"time_forward_s": 0.012, ..., "timed_steps": 1}

On a GPU, kernels run asynchronously: without a synchronize at each phase boundary, a host-side
clock measures only how long the launches took, and a phase's real cost shows up in whichever later
phase first waits for the device. Synchronizing at every boundary gives true per-phase times but
stalls the launch queue and serialises work meant to overlap (gradient reduction with backward,
the next batch's copy with compute), so it costs throughput on every step. So by default the
timers synchronise only on the steps asked for (the log steps: one step per interval pays the stall)
and average only those steps on a GPU; on CPU every step is exact and every step is averaged.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

PHASES = ("data", "forward", "backward", "grad_sync", "optimizer")


class StepTimers:
    """Accumulates seconds per phase over the timed steps of the current interval."""

    def __init__(self, device: Any = "cpu", *, sync_every_step: bool = False):
        """device: a torch.device or its name; sync_every_step: synchronise on every step (profiling)."""
        self.cuda = str(device).startswith("cuda")
        self.device = device
        self.sync_every_step = sync_every_step
        self._sums: dict[str, float] = {}
        self._timed_steps = 0
        self._sync = False
        self._timing = True
        self._open: dict[str, float] = {}
        self.annotate = False
        """Label each phase as a range in a torch.profiler trace (while a profile records)."""

    def _synchronize(self) -> None:
        if self.cuda and self._sync:
            import torch

            torch.cuda.synchronize(self.device)

    def begin_step(self, sync: bool = False) -> None:
        """Start a step; on a GPU only steps with sync (or sync_every_step) are timed."""
        self._sync = sync or self.sync_every_step
        self._timing = self._sync or not self.cuda
        if self._timing:
            self._synchronize()  # earlier work must not count towards this step's first phase

    def end_step(self) -> None:
        if self._open:
            raise RuntimeError(f"phases still running at end_step: {sorted(self._open)}")
        if self._timing:
            self._timed_steps += 1

    def start(self, phase: str) -> None:
        if phase in self._open:
            raise RuntimeError(f"phase {phase!r} is already running")
        if self._timing:
            self._synchronize()
            self._open[phase] = time.perf_counter()

    def stop(self, phase: str) -> None:
        if not self._timing:
            return
        if phase not in self._open:
            raise RuntimeError(f"phase {phase!r} was not started")
        self._synchronize()
        elapsed = time.perf_counter() - self._open.pop(phase)
        self._sums[phase] = self._sums.get(phase, 0.0) + elapsed

    def add(self, phase: str, seconds: float) -> None:
        """Seconds measured elsewhere (the pipeline schedule's own clocks) for a phase of this step."""
        if self._timing:
            self._sums[phase] = self._sums.get(phase, 0.0) + seconds

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        """`with timers("forward"): ...`; a phase run several times in a step (micro-batches) adds up."""
        self.start(phase)
        try:
            if self.annotate:
                import torch

                with torch.profiler.record_function(phase):
                    yield
            else:
                yield
        finally:
            self.stop(phase)

    @property
    def timed_steps(self) -> int:
        return self._timed_steps

    def means(self) -> dict[str, float]:
        """Mean seconds per timed step for each phase seen in this interval."""
        n = max(self._timed_steps, 1)
        return {phase: total / n for phase, total in self._sums.items()}

    def report(self, reset: bool = True) -> dict[str, float | int]:
        """{"time_<phase>_s": mean seconds per timed step, "timed_steps": n} (no phases when n = 0)."""
        out: dict[str, float | int] = (
            {f"time_{p}_s": v for p, v in self.means().items()} if self._timed_steps else {}
        )
        out["timed_steps"] = self._timed_steps
        if reset:
            self.reset()
        return out

    def reset(self) -> None:
        self._sums.clear()
        self._timed_steps = 0
