"""Triton kernels (run on CUDA; on CPU only under Triton's interpreter, TRITON_INTERPRET=1, in tests)."""

from __future__ import annotations

import importlib.util


def triton_usable() -> bool:
    """Triton is installed and a CUDA device is there to run its kernels."""
    if importlib.util.find_spec("triton") is None:
        return False
    import torch

    return torch.cuda.is_available()
