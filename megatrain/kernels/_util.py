"""What several kernels share."""

from __future__ import annotations

import torch


def fp32_at_least(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 when it is 16-bit (the kernels compute in fp32 at least), else x itself."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
