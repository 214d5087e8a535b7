"""The dryrun's tensor world: fake tensors (shapes, no memory) whose storages are counted as they live.

`FakeMemory` is a TorchDispatchMode pushed on top of torch's FakeTensorMode. Every op passes through
it first: the storages an op returns are counted until Python frees them (a weakref finalizer on the
untyped storage, keyed by its C++ address `_cdata`, since a fake storage has no data pointer), so
`current` and `peak` are what a real rank's caching allocator would hand out, less its rounding and
fragmentation. Meta tensors (the model before materialisation) hold nothing and are not counted.

Host scalars cannot be read from a fake tensor (`.item()`, `float()`, `.tolist()` all end in
`aten._local_scalar_dense`). The engine reads a few that never decide an allocation: the model's
init seed (answered 0), the gradient norm (answered 1.0, so clipping scales in place as it would),
fp16's found-inf flag (answered False: the step is taken, the costlier path). Those are answered
here, by dtype; a routing count, which does decide shapes, is never read: the dryrun swaps in a
balanced dispatcher instead (megatrain.engine.dryrun.routing).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

_SCALAR = torch.ops.aten._local_scalar_dense.default


def storage_id(t: torch.Tensor) -> int:
    """The identity of a tensor's storage (its C++ address), valid for real and fake tensors."""
    return t.untyped_storage()._cdata


def storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """{storage id: bytes} of distinct, non-meta storages."""
    out: dict[int, int] = {}
    for t in tensors:
        if t is None or t.device.type == "meta" or is_traceable_wrapper_subclass(t):
            continue
        s = t.untyped_storage()
        out[s._cdata] = s.nbytes()
    return out


class FakeMemory(TorchDispatchMode):
    """Live and peak bytes of every storage created while active; host scalars answered by dtype."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.scalars_read = 0

    def reset_peak(self) -> None:
        self.peak = self.current

    def live_bytes(self, ids: Iterable[int]) -> int:
        """Bytes of those storages that are live and counted here."""
        return sum(self._live.get(i, 0) for i in set(ids))

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is _SCALAR and isinstance(args[0], FakeTensor):
            self.scalars_read += 1
            x = args[0]
            if x.dtype == torch.bool:
                return False
            return 1.0 if x.is_floating_point() else 0
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, FakeTensor):  # a meta tensor holds nothing; a real one is host-side
                continue
            storage = t.untyped_storage()
            key, nbytes = storage._cdata, storage.nbytes()
            # Views and in-place results share a storage already counted.
            if nbytes == 0 or key in self._live:
                continue
            self._live[key] = nbytes
            self.current += nbytes
            weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.current)
        return out


def tensors_in(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]
