"""How long an attempt may legitimately stand still: before its first step, and while it saves a
checkpoint. The hang watch (worker.hang) allows these pauses instead of its usual multiple of the
median step; a flat allowance (settings.hang_grace_s, 15 minutes) is too long for a small model,
whose frozen rank then holds its slot for a quarter of an hour, and too short for a large one,
whose checkpoint takes longer to write than that. So they are predicted per job: the model and
optimizer state one node holds (plan.memory, the worst pipeline stage's rank times the node's
ranks), which it writes at every checkpoint and reads on a resume, over its pool's storage
bandwidth, plus the pool's startup time and a compilation's. The watch allows SAFETY times the
prediction, never less than settings.hang_min_s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatrain.plan.layout import Layout
from megatrain.plan.memory import from_spec
from megatrain.plan.pool import PoolSpec

SAFETY = 3.0
"""How many predicted times the watch allows: storage and start-up vary, a false hang costs a restart."""
COMPILE_S = 600.0
"""What torch.compile may add to the first step of a large model (its graphs are built then)."""


@dataclass(frozen=True)
class AttemptTimes:
    """Predicted seconds of an attempt's pauses on one node."""

    first_step_s: float
    """From the attempt's start to its first step."""
    save_s: float
    """To write one checkpoint's shards."""
    state_bytes: int
    """The model and optimizer state the node writes at a checkpoint and reads on a resume."""

    def bounds(self, floor_s: float) -> dict[str, float]:
        """What the hang watch allows: SAFETY times each prediction, at least floor_s."""
        return {
            "first_step_bound_s": round(max(floor_s, SAFETY * self.first_step_s), 1),
            "save_bound_s": round(max(floor_s, SAFETY * self.save_s), 1),
        }


def predict_attempt_times(
    spec: Any, layout: Layout, pool: PoolSpec, ranks: int, resuming: bool
) -> AttemptTimes:
    """The pauses of one node's share of an attempt of `spec` on `layout` (`ranks` of its processes
    on that node); `resuming`: it starts from a checkpoint, which it reads first. Raises ValueError
    where the model's size cannot be known without its tokenizer (a Hugging Face one, no vocab_size)."""
    est = from_spec(spec, layout, accelerator=pool.accelerator)
    state = (est.params_bytes + est.optimizer_bytes) * max(ranks, 1)
    read_s = state / (pool.storage_read_gbps * 1e9) if resuming else 0.0
    first = pool.startup_s + read_s + (COMPILE_S if spec.training.compile else 0.0)
    return AttemptTimes(first, state / (pool.storage_write_gbps * 1e9), int(state))
