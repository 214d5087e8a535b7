"""What one attempt's time went to, measured by its runner for the goodput ledger (db.goodput).

- queued_s: from the job (re)entering the queue to this attempt's claim.
- restart_s (retries only): the restart overhead (claim to the first step) plus the work redone,
  i.e. the steps between the checkpoint it resumed from and the step the previous attempt reached,
  at this attempt's median step time.
- checkpoint_stall_s: the training pauses of its checkpoint saves (the engine's `stall_s`).
- hang_s: how long the step counter stood still before the attempt was declared hung.
- eval_s: its pauses between steps to evaluate (validation, training.eval_tasks: the engine's
  `evaluated` events).
- productive_s: the rest of the attempt's wall time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class AttemptClock:
    started: float
    """time.monotonic() at the claim."""
    attempt: int
    queued_s: float
    prev_step: int
    """The step the job had reached before this attempt (0 for a first attempt)."""
    resumed_from: int | None = None
    first_step_at: float | None = None
    stall_s: float = 0.0
    hang_s: float = 0.0
    step_times: list[float] = field(default_factory=list)
    _stalls: dict[int, float] = field(default_factory=dict)
    _evals: dict[tuple[int, str], float] = field(default_factory=dict)

    def observe_metrics(self, rows: list[dict[str, Any]], now: float) -> None:
        for row in rows:
            if not isinstance(row.get("step"), int):
                continue
            if self.first_step_at is None:
                self.first_step_at = now
            t = row.get("iter_time_s")
            if isinstance(t, (int, float)) and t > 0:
                self.step_times.append(float(t))

    def observe_events(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            if row.get("event") == "started" and isinstance(row.get("resumed_from"), int):
                self.resumed_from = row["resumed_from"]
            elif row.get("event") == "checkpoint_saved" and isinstance(row.get("step"), int):
                # Keyed by step: a re-read of the same line never counts twice.
                self._stalls[row["step"]] = float(row.get("stall_s") or 0.0)
            elif row.get("event") == "evaluated" and isinstance(row.get("step"), int):
                self._evals[(row["step"], str(row.get("what")))] = float(row.get("seconds") or 0.0)

    def seconds(self, now: float) -> dict[str, float]:
        wall = max(now - self.started, 0.0)
        restart = 0.0
        if self.attempt > 1:
            overhead = (self.first_step_at or now) - self.started
            median = statistics.median(self.step_times) if self.step_times else 0.0
            redone = max(self.prev_step - (self.resumed_from or 0), 0) * median
            restart = min(overhead + redone, wall)
        stall = min(sum(self._stalls.values()), wall - restart)
        hang = min(self.hang_s, wall - restart - stall)
        evaluating = min(sum(self._evals.values()), wall - restart - stall - hang)
        return {
            "queued_s": self.queued_s,
            "restart_s": restart,
            "checkpoint_stall_s": stall,
            "hang_s": hang,
            "eval_s": evaluating,
            "productive_s": wall - restart - stall - hang - evaluating,
        }
