"""Triton's interpreter for the kernel tests on a machine without CUDA: Triton picks it when a kernel
is decorated, so it is set here, before any test imports megatrain.kernels.triton."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
