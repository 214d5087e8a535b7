"""Live tensor bytes, tracked op by op: a stand-in for torch.cuda.max_memory_allocated on any device.

CPU has no allocator statistics, so `LiveTensorBytes` (a TorchDispatchMode) records the storage of
every tensor an op returns and drops it when the storage is freed (a weakref finalizer on the
untyped storage, which lives exactly as long as the C++ storage). Storages that existed before
(parameters, gradients, optimizer state, inputs) are passed in `ignore` and never counted, so
`peak` is the high-water mark of what the tracked code allocated on top of them: activations,
their gradients and every temporary an op hands back. Scratch memory an op allocates and frees
inside its own kernel is invisible here; the estimate does not model it either.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def tensors_of(*objs: Any) -> list[torch.Tensor]:
    """Every tensor in modules (parameters, buffers, grads), optimizers (state) and nested containers."""
    out: list[torch.Tensor] = []
    for obj in objs:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                out.append(p)
                if p.grad is not None:
                    out.append(p.grad)
            out.extend(obj.buffers())
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        else:
            out.extend(t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor))
    return out


class LiveTensorBytes(TorchDispatchMode):
    """Current and peak bytes of live storages created while the mode is active."""

    def __init__(self, ignore: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._ignore: set[int] = set()
        for t in ignore:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._ignore:
                self._ignore.add(storage.data_ptr())
                # A freed ignored storage's address may be reused by a tracked one.
                weakref.finalize(storage, self._ignore.discard, storage.data_ptr())
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.current

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            # A tensor subclass wrapping others (torchao's float8 tensors) has no storage of its
            # own: its inner tensors came through here already.
            if not isinstance(t, torch.Tensor) or is_traceable_wrapper_subclass(t):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            # Views and in-place results share a storage already seen (or one we ignore).
            if nbytes == 0 or key in self._live or key in self._ignore:
                continue
            self._live[key] = nbytes
            self.current += nbytes
            weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.current)
        return out
