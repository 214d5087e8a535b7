"""Data parallelism: one flat gradient buffer, cut into buckets that are reduced while backward runs.

Megatron's design (DistributedDataParallel over a ParamAndGradBuffer), written for our explicit groups:

- Every trainable parameter gets `param.main_grad`, a view into one contiguous gradient buffer
  (fp32 by default, whatever the parameter dtype), so gradients accumulate over micro-batches in
  full precision and a whole bucket is reduced with one collective.
- The buffer is laid out in reverse parameter order, the order backward produces gradients, and cut
  into buckets of about `bucket_elements`. A parameter is never split across buckets.
- The model's Linear/Embedding layers and the fused loss add their weight gradients straight into
  `main_grad` (gradient-accumulation fusion, megatrain.kernels.grad_accumulation); for any other
  parameter a post-accumulate-grad hook adds `param.grad` into `main_grad` and frees it. On the last
  micro-batch, once every parameter of a bucket has its gradient, the bucket's collective starts
  asynchronously (all-reduce; reduce-scatter with the distributed optimizer), overlapping the rest of
  backward. Buckets always start in index order, so every rank issues the same sequence.
- Gradients are averaged over dp by scaling each bucket by 1/dp *before* the collective, as Megatron
  does: the reduction is then a plain SUM (gloo has no AVG), and the summed values stay the size of
  one rank's gradient, which matters when the buffer is bf16.

With the distributed optimizer each bucket is padded to a multiple of dp and rank r owns the r-th
contiguous 1/dp of every bucket: reduce-scatter leaves the averaged gradient for exactly that range
on rank r. Model parameters then also live in one flat buffer with the same layout, so the updated
shards are all-gathered bucket by bucket straight into the parameters.

A parameter used twice (GPT-2's tied embedding) is one Parameter: it has one slot and one hook, and
autograd accumulates both uses before the hook runs.

Expert-parallel parameters (`expert_parallel`, parallel.expert) are replicated only over the
expert-data-parallel group edp (dp·cp/ep ranks): their buckets hold no other parameter and are
reduced (and sharded, with the distributed optimizer) over edp. They are scaled by the same 1/(dp·cp):
each rank's expert gradient already sums its whole ep group's losses (Megatron's expert buffers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatrain.engine.parallel.mappings import is_expert_parallel
from megatrain.engine.parallel.state import Group, ParallelState

DEFAULT_BUCKET_ELEMENTS = 40_000_000

# torch 2.13 renamed the flat-tensor collectives; keep working on older releases.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class OwnedSlice:
    """The part of one parameter this rank updates: flat elements [start, end) of the parameter."""

    param: nn.Parameter
    start: int
    end: int
    offset: int
    """Where element `start` sits in the flat buffer."""

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end == self.param.numel()


@dataclass(eq=False)
class Bucket:
    index: int
    params: list[nn.Parameter]
    """In the order backward produces their gradients."""
    start: int
    end: int
    """[start, end) in the flat buffers, padded to a multiple of dp with the distributed optimizer."""
    grad: torch.Tensor
    param_data: torch.Tensor | None = None
    ready: set[int] = field(default_factory=set)
    """id() of the parameters whose gradient arrived in this synchronised backward."""
    handle: Any = None
    launched: bool = False
    group: Group = None
    """The ranks holding the same parameters: dp (dp×cp under cp), or edp for experts."""
    size: int = 1
    rank: int = 0
    """This rank's index in `group` (which shard it owns with the distributed optimizer)."""
    expert: bool = False

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard(self, rank: int, size: int) -> tuple[int, int]:
        """Rank `rank`'s contiguous range of this bucket, in flat-buffer offsets."""
        step = self.numel // size
        return self.start + rank * step, self.start + (rank + 1) * step


class DataParallel(nn.Module):
    """Wraps a module (already on its device and in its dtype) with bucketed gradient reduction over dp.

    Each step: forward/backward every micro-batch (all but the last inside `no_sync()`), then
    `finish_grad_sync()`; after it `param.main_grad` holds the dp-averaged gradient (with the
    distributed optimizer: only this rank's shard of each bucket is reduced). `zero_grad()` before
    the next step. The caller averages the loss over micro-batches.

    gradient_accumulation_fusion: the model's weight gradients are added into main_grad inside
    backward (megatrain.kernels.grad_accumulation) instead of through a fresh `.grad` and the hook.
    """

    def __init__(
        self,
        module: nn.Module,
        state: ParallelState,
        *,
        bucket_elements: int = DEFAULT_BUCKET_ELEMENTS,
        overlap_grad_reduce: bool = True,
        use_distributed_optimizer: bool = False,
        grad_dtype: torch.dtype = torch.float32,
        gradient_accumulation_fusion: bool = True,
    ):
        super().__init__()
        if bucket_elements < 1:
            raise ValueError(f"bucket_elements={bucket_elements} must be positive")
        self.module = module
        self.state = state
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        self.grad_dtype = grad_dtype
        self.dp_group: Group = state.dp_group
        self.dp_size = state.dp_size
        self.dp_rank = state.dp_rank
        if state.layout.cp > 1:
            # Megatron reduces over the joint dp×cp group; ParallelState has no such group yet.
            self.dp_group = state.groups.get("dp_cp")
            self.dp_size, self.dp_rank = (
                state.layout.dp * state.layout.cp,
                state.coords.cp + state.layout.cp * state.dp_rank,
            )
            if self.dp_group is None:
                raise ValueError("context parallelism needs a joint dp×cp group ('dp_cp') in ParallelState")

        # parameters() yields each Parameter once, so a tied weight gets one slot.
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the module has no trainable parameters")
        self.params: list[nn.Parameter] = list(reversed(params))  # backward order
        dtypes = {p.dtype for p in self.params}
        if use_distributed_optimizer and len(dtypes) > 1:
            raise ValueError(
                f"the distributed optimizer needs one parameter dtype, found {sorted(map(str, dtypes))}"
            )
        self.param_dtype = params[0].dtype
        device = params[0].device
        # Experts are replicated over edp only; with ep = 1 nothing is marked and edp would be dp.
        self.edp_group, self.edp_size, self.edp_rank = self.dp_group, self.dp_size, self.dp_rank
        if state.layout.ep > 1:
            self.edp_group, self.edp_size, self.edp_rank = state.edp_group, state.edp_size, state.edp_rank

        # Lay out buckets: consecutive params (in backward order) until a bucket reaches bucket_elements;
        # a bucket holds experts only or none (they reduce over another group).
        layout: list[tuple[list[nn.Parameter], int, int, bool]] = []
        self._offset: dict[int, int] = {}  # id(param) -> flat offset
        cursor, current, bucket_start = 0, [], 0
        for i, p in enumerate(self.params):
            self._offset[id(p)] = cursor
            cursor += p.numel()
            current.append(p)
            expert = is_expert_parallel(p) and state.layout.ep > 1
            last = i == len(self.params) - 1
            switch = not last and expert != (is_expert_parallel(self.params[i + 1]) and state.layout.ep > 1)
            if cursor - bucket_start >= bucket_elements or last or switch:
                # Pad the bucket so it splits evenly over the ranks that shard it.
                pad = (self.edp_size if expert else self.dp_size) if use_distributed_optimizer else 1
                cursor = -(-cursor // pad) * pad
                layout.append((current, bucket_start, cursor, expert))
                current, bucket_start = [], cursor
        self.numel = cursor

        # With the distributed optimizer, params become views into one flat buffer of the same layout
        # so updated shards can be all-gathered bucket by bucket straight into them.
        self.param_buffer = self._flat_params(device) if use_distributed_optimizer else None
        self.grad_buffer = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        for index, (bucket_params, start, end, expert) in enumerate(layout):
            bucket = Bucket(index, bucket_params, start, end, self.grad_buffer[start:end], expert=expert)
            bucket.group, bucket.size, bucket.rank = (
                (self.edp_group, self.edp_size, self.edp_rank)
                if expert
                else (self.dp_group, self.dp_size, self.dp_rank)
            )
            if self.param_buffer is not None:
                bucket.param_data = self.param_buffer[start:end]
            self.buckets.append(bucket)
            for p in bucket_params:
                self._bucket_of[id(p)] = bucket
        for p in self.params:
            lo = self._offset[id(p)]
            p.main_grad = self.grad_buffer[lo : lo + p.numel()].view(p.shape)  # type: ignore[attr-defined]
            p.grad_accumulation_fusion = gradient_accumulation_fusion  # type: ignore[attr-defined]
            p.grad = None

        self._sync = True
        self._next_launch = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    # --- forward -------------------------------------------------------------------------------------

    @torch.no_grad()
    def _flat_params(self, device: torch.device) -> torch.Tensor:
        """One flat buffer holding every parameter, which become views into it. Filled (each original
        freed as it moves) before the gradient buffer exists: the start-up peak is two copies of the
        weights, not two copies plus the gradients."""
        flat = torch.zeros(self.numel, dtype=self.param_dtype, device=device)  # zero: bucket padding
        for p in self.params:
            lo = self._offset[id(p)]
            flat[lo : lo + p.numel()].copy_(p.detach().reshape(-1))
            p.data = flat[lo : lo + p.numel()].view_as(p)
        return flat

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # --- gradient accumulation and synchronisation -------------------------------------------------

    @property
    def is_last_microbatch(self) -> bool:
        """False while accumulating: backward adds into main_grad without starting any collective."""
        return self._sync

    @is_last_microbatch.setter
    def is_last_microbatch(self, value: bool) -> None:
        self._sync = bool(value)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (every micro-batch but the last)."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    @torch.no_grad()
    def _on_grad(self, param: torch.Tensor) -> None:
        track = self._sync and self.overlap_grad_reduce
        bucket = self._bucket_of[id(param)]
        # Checked before touching main_grad: the bucket may be in flight in an async collective.
        if track and (bucket.launched or id(param) in bucket.ready):
            raise RuntimeError(
                "a parameter's gradient arrived twice in one synchronised backward; call "
                "finish_grad_sync() between steps and use no_sync() for all but the last micro-batch"
            )
        if getattr(param, "grad_added_to_main_grad", False):
            # Gradient-accumulation fusion already added it (megatrain.kernels.grad_accumulation);
            # param.grad is an unread placeholder.
            param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        elif param.grad is not None:
            param.main_grad.add_(param.grad)  # type: ignore[attr-defined]  # upcasts into the fp32 buffer
        param.grad = None
        if not track:
            return
        bucket.ready.add(id(param))
        # Start buckets strictly in order so every rank issues the same sequence of collectives.
        while self._next_launch < len(self.buckets):
            nxt = self.buckets[self._next_launch]
            if len(nxt.ready) < len(nxt.params):
                break
            self._launch(nxt)
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        if self.dp_size == 1:
            return
        # Average before the SUM (see the module docstring); experts too, though they sum over edp.
        bucket.grad.mul_(1.0 / self.dp_size)
        if bucket.size == 1:
            return
        if self.use_distributed_optimizer:
            lo, hi = bucket.shard(bucket.rank, bucket.size)
            # In place: this rank's shard of the bucket receives the reduced values.
            shard = self.grad_buffer[lo:hi]
            bucket.handle = _reduce_scatter_flat(shard, bucket.grad, group=bucket.group, async_op=True)
        else:
            bucket.handle = dist.all_reduce(bucket.grad, group=bucket.group, async_op=True)

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Start every bucket not started yet (all of them without overlap), then wait for all."""
        for bucket in self.buckets[self._next_launch :]:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.handle, bucket.launched = None, False
            bucket.ready.clear()
        self._next_launch = 0

    def zero_grad(self) -> None:
        """Zero the gradient buffer (every main_grad) for the next step."""
        self.grad_buffer.zero_()
        for p in self.params:
            p.grad = None
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.launched = False
        self._next_launch = 0

    # --- layout queries for the optimizer -----------------------------------------------------------

    def offset(self, param: nn.Parameter) -> int:
        return self._offset[id(param)]

    def owned_slices(self) -> list[OwnedSlice]:
        """The (parts of) parameters this rank updates, in buffer order.

        Without the distributed optimizer: every parameter whole. With it: for each bucket, the
        intersection of each parameter with this rank's shard; a parameter that straddles a shard
        boundary is updated in pieces by two (or more) ranks.
        """
        if not self.use_distributed_optimizer:
            return [OwnedSlice(p, 0, p.numel(), self._offset[id(p)]) for p in self.params]
        out = []
        for bucket in self.buckets:
            lo, hi = bucket.shard(bucket.rank, bucket.size)
            for p in bucket.params:
                start = self._offset[id(p)]
                a, b = max(lo, start), min(hi, start + p.numel())
                if a < b:
                    out.append(OwnedSlice(p, a - start, b - start, a))
        return out

    @torch.no_grad()
    def gather_shards(self, flat: torch.Tensor) -> None:
        """In place: every rank's shard of each bucket of `flat` (laid out like the buffers) to all ranks."""
        if not self.use_distributed_optimizer or self.dp_size == 1:
            return
        handles = []
        for bucket in self.buckets:
            if bucket.size == 1:
                continue
            lo, hi = bucket.shard(bucket.rank, bucket.size)
            handles.append(
                _all_gather_flat(
                    flat[bucket.start : bucket.end], flat[lo:hi], group=bucket.group, async_op=True
                )
            )
        for h in handles:
            h.wait()

    @torch.no_grad()
    def gather_grad_shards(self, param: nn.Parameter) -> None:
        """With the distributed optimizer: make `param.main_grad` whole again (every rank's reduced shard).

        After the reduce-scatter a rank holds only its shard of each bucket; a gradient that must be
        combined with another stage's (a tied embedding) needs all of it. A no-op without sharding.
        """
        if not self.use_distributed_optimizer or self.dp_size == 1:
            return
        bucket = self._bucket_of[id(param)]
        if bucket.size == 1:
            return
        lo, hi = bucket.shard(bucket.rank, bucket.size)
        _all_gather_flat(
            self.grad_buffer[bucket.start : bucket.end], self.grad_buffer[lo:hi], group=bucket.group
        )

    def gather_params(self) -> None:
        """After the distributed optimizer updated this rank's shards: all-gather them into every param."""
        if self.param_buffer is not None:
            self.gather_shards(self.param_buffer)

    def remove_hooks(self) -> None:
        """Detach from the module: its parameters go back to plain `.grad` (no main_grad, no fusion)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self.params:
            for attr in ("main_grad", "grad_accumulation_fusion", "grad_added_to_main_grad"):
                if hasattr(p, attr):
                    delattr(p, attr)
