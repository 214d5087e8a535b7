"""Triton kernels (Liger-Kernel's shape: a jit kernel, a launcher, an autograd.Function, the
PyTorch twin in megatrain.kernels), registered in megatrain.kernels for CUDA devices.

Triton compiles for GPUs only; on a CPU its interpreter runs the same kernels op by op in numpy
(TRITON_INTERPRET=1). The interpreter is chosen when `triton.jit` decorates a kernel, that is when a
kernel module is first imported, so the variable must be set before then: tests/conftest.py
sets it when no CUDA device is present. Production code never sets it (a GPU host must compile).
A launcher given tensors that neither compiled Triton nor the interpreter can run (CPU tensors with
the interpreter off) falls back to the "torch" twin, as flash_varlen falls back to SDPA.
"""

from __future__ import annotations

import importlib.util
import os


def interpreted() -> bool:
    """Whether Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_usable() -> bool:
    """Triton importable, and a CUDA device present or the interpreter enabled."""
    if importlib.util.find_spec("triton") is None:
        return False
    if interpreted():
        return True
    import torch

    return torch.cuda.is_available()
