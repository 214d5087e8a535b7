"""What the Triton launchers share: where a kernel can run, its block size and warps, and how many
programs split the rows of a weight-gradient reduction."""

from __future__ import annotations

import torch
import triton

from megatrain.kernels.triton import interpreted

MAX_BLOCK = 65536
"""Widest row one program holds (elements): the kernels keep a whole row in registers."""

INTERPRETED_PROGRAMS = 4
"""Programs of a row-split reduction under the interpreter: few, so that test sizes leave some
programs with fewer rows than others (the masking the tests exercise)."""


def runs_here(*tensors: torch.Tensor) -> bool:
    """Whether Triton can run on these tensors: all on CUDA, or the interpreter on."""
    return interpreted() or all(t.is_cuda for t in tensors)


def block_and_warps(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of n elements: the next power of two, and more warps for wider
    blocks (one warp per 256 elements, 4 to 32: Liger-Kernel's rule)."""
    block = triton.next_power_of_2(n)
    if block > MAX_BLOCK:
        raise ValueError(f"a row of {n} elements is wider than one Triton program holds ({MAX_BLOCK})")
    return block, max(4, min(32, block // 256))


def reduction_programs(rows: int, device: torch.device) -> int:
    """Programs of a backward whose weight gradient is summed per program then reduced after: one
    per streaming multiprocessor on CUDA (Liger-Kernel's choice), a few under the interpreter."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(rows, sms))
    return max(1, min(rows, INTERPRETED_PROGRAMS))
