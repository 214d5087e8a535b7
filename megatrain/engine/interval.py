"""What a training log interval accumulates (losses, grad norms, skipped steps, token hits, time)
and the pipeline's share of it (compute, wait, the bubble), apart from the loop that steps."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from megatrain.engine.parallel.schedules import PipelineSchedule
from megatrain.engine.parallel.state import ParallelState


class Window:
    """What a log interval accumulates: losses, the last grad norm and loss scale, skipped steps, time."""

    def __init__(self, previous: Window | None) -> None:
        self.loss_sum: torch.Tensor | float = 0.0
        self.hits: torch.Tensor | None = None
        """Σ (correctly predicted loss tokens, fused cross-entropy calls) on this rank."""
        self.tokens = 0.0
        """Σ every dp·cp rank's loss tokens."""
        self.steps = 0
        self.skipped = 0
        # An interval of skipped (fp16 overflow) steps still shows the last real norm.
        self.grad_norm = previous.grad_norm if previous else 0.0
        self.loss_scale: float | None = previous.loss_scale if previous else None
        self.start = time.perf_counter()
        self.excluded = 0.0
        """Seconds spent validating and checkpointing, kept out of the iteration time."""

    def add(self, loss: torch.Tensor, result: Any, hits: tuple[torch.Tensor, float] | None = None) -> None:
        self.loss_sum = loss if isinstance(self.loss_sum, float) else self.loss_sum + loss
        if hits is not None:
            self.hits = hits[0] if self.hits is None else self.hits + hits[0]
            self.tokens += hits[1]
        self.steps += 1
        if result.skipped:
            self.skipped += 1
        else:
            self.grad_norm = result.grad_norm
        self.loss_scale = result.loss_scale


def pipeline_metrics(pipeline: PipelineSchedule, state: ParallelState, steps: int) -> dict[str, Any]:
    """Per-step compute and wait seconds averaged over the stages, and the bubble: wait / (wait + compute).

    Collective over the pipeline group; every stage's schedule ends on a common barrier, so each
    stage's wait + compute is the same makespan and the fraction compares with (p-1)/(m+p-1).
    """
    t = pipeline.times
    sums = torch.tensor([t.wait_s, t.compute_s, t.wait_s], dtype=torch.float64)
    if state.pp_group is not None:
        sums = sums.to(state.device)
        dist.all_reduce(sums[:2], group=state.pp_group)
        top = sums[2:].clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=state.pp_group)
        sums[2] = top[0]
    wait, compute, worst = (float(v) for v in sums.cpu())
    pp = state.pp_size
    return {
        "pipeline_bubble_fraction": wait / (wait + compute) if wait + compute > 0 else 0.0,
        "pipeline_wait_time_s": wait / pp / max(1, steps),
        "pipeline_compute_time_s": compute / pp / max(1, steps),
        "pipeline_max_stage_wait_time_s": worst / max(1, steps),
    }
