"""Measured memory for the metrics row, comparable with the planner's estimate (megatrain.plan.memory).

- `model_state_bytes`: the bytes of this rank's real tensors that the estimate's static part
  covers: the model's parameters, the fp32 gradient buffer, and the optimizer's fp32 main weights
  and Adam moments. Measured the same way on every device, so a user sees whether the planner's
  params + grads + optimizer was right.
- `peak_memory_bytes` (GPU): torch.cuda.max_memory_allocated, every tensor the step allocated
  (activations included), comparable with the estimate's total.
- `process_rss_bytes` (CPU): the process's peak resident set. It holds the Python runtime, torch's
  libraries and the allocator's caches besides the tensors, so it is no measure of the estimate.
"""

from __future__ import annotations

import os
import resource
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatrain.engine.build import Trainable


def model_state_bytes(train: Trainable) -> dict[str, int]:
    """This rank's parameter, gradient-buffer and optimizer-state bytes, and their sum."""
    # parameters() yields a tied weight once, as the planner counts it.
    params = sum(p.numel() * p.element_size() for p in train.model.module.parameters())
    grad_buffer = train.ddp.grad_buffer
    grads = grad_buffer.numel() * grad_buffer.element_size()
    optimizer = train.optimizer.state_bytes()
    return {
        "measured_params_bytes": params,
        "measured_grads_bytes": grads,
        "measured_optimizer_bytes": optimizer,
        "model_state_bytes": params + grads + optimizer,
    }


def _peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss * 1024 if os.uname().sysname == "Linux" else rss)  # KiB on Linux, bytes on macOS


def memory_row(device: str, train: Trainable) -> dict[str, int]:
    """The memory figures of a metrics row on `device` (see the module docstring)."""
    row = model_state_bytes(train)
    if device.startswith("cuda"):
        import torch

        row["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device))
    else:
        row["process_rss_bytes"] = _peak_rss_bytes()
    return row
