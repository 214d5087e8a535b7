"""`python -m megatrain.engine.dryrun --spec SPEC [--layout LAYOUT.json] --rank R --json`: one rank's
start and first training step, run by the real engine on fake tensors, with the bytes it held.

Memory proven at real scale on a CPU (DESIGN habit 17): rank R of the job's layout builds its model
(engine.build.build_model: meta build, parallelisation, materialisation of its shards, filled from
the seeded initial values), makes it trainable (make_trainable: cast, DataParallel's buffers, the
optimizer's fp32 mains) and runs one TrainLoop.step (every micro-batch's forward and backward,
through the pipeline schedule where there is one, the gradient reduction, AdamW), exactly as
`engine.train.run` does, under torch's FakeTensorMode: every tensor has its real shape and dtype and
no memory. The process group is torch's fake one (FakeStore + the "fake" backend): collectives and
point-to-point sends return at once, as if every peer answered. `fake.FakeMemory` counts every
storage while it lives, which gives

- the start-up peak: the most held before the first step (e.g. DataParallel's flat parameter
  buffer filled while the original parameters still exist, or the optimizer's fp32 mains on top of
  the weights and the gradient buffer: megatrain.plan.startup_memory);
- the model state after the step: parameters, the gradient buffer, the optimizer's mains and moments;
- activations: the step's forward/backward peak above that state, split into what is saved for
  backward (the most held when a backward starts) and the transient on top of it;
- the optimizer step's workspace, and the whole step's peak.

What differs from a run on a GPU, and why (each a narrow, named departure):
- host scalars are answered by dtype (the init seed 0, the grad norm 1.0, no fp16 overflow): none
  decides an allocation (fake.py);
- MoE routing is balanced (routing.py): the token counts per expert are data, and the planner
  assumes balance too; the router, the all-to-all and the experts are the engine's;
- the initial weights are not drawn (`block_fill` allocates the one fp32 block a draw holds, and
  fills nothing): build_model's `weights=` source, everything else of the build as run;
- the data are zeros from `SyntheticData` (same shapes as a loader's micro-batches);
- the experts' grouped GEMM is the CUDA backend's torch._grouped_mm (_gpu_kernels);
- tensors are "cpu" fake tensors, so the other kernels are the CPU ones (SDPA's CPU flash kernel keeps
  what the CUDA flash kernel keeps: the output and a log-sum-exp; fused AdamW as on CUDA). The caching
  allocator's rounding and fragmentation and NCCL's buffers are not counted (nor does the planner).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatrain import kernels
from megatrain.engine import build as build_module
from megatrain.engine.build import PARAM_DTYPES, build_model, make_trainable
from megatrain.engine.config import train_config, transformer_config
from megatrain.engine.data.batch import Batch
from megatrain.engine.dryrun.fake import FakeMemory, storages
from megatrain.engine.dryrun.routing import balance_routing
from megatrain.engine.loop import Rates, TrainLoop
from megatrain.engine.models.init import BLOCK_ELEMENTS
from megatrain.engine.parallel.state import ParallelState
from megatrain.plan.layout import Layout, with_micro_batch_size
from megatrain.plan.memory import planned_precision
from megatrain.spec import JobSpec, ParallelismSpec


@dataclass(frozen=True)
class DryRunReport:
    """Bytes one rank held, term by term as megatrain.plan.memory.MemoryEstimate breaks them down."""

    rank: int
    stage: int
    precision: str
    microbatches: int
    """Micro-batches per step on this rank (per dp rank), as run."""
    num_params: int
    """Parameters this rank holds."""
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    """Forward/backward peak above the model state: saved tensors + the largest transient."""
    stored_bytes: int
    """The most held above the model state when a backward started (what forward saved)."""
    transient_bytes: int
    """activations_bytes - stored_bytes."""
    optimizer_workspace_bytes: int
    """The optimizer step's peak above the state it leaves."""
    startup_peak_bytes: int
    """The most held while starting (build, cast, DataParallel, optimizer), before the first step."""
    first_step_peak_bytes: int
    """The most held during the first step, measured (Adam's moments appear only in its optimizer step)."""
    peak_bytes: int
    """The most held at any time: the start-up peak, or a later step's (the model state it leaves,
    moments included, plus the larger of the activations and the optimizer's workspace)."""
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class SyntheticData:
    """A loader's stand-in: every sample is `seq_length` zero tokens (values never matter here)."""

    def __init__(self, seq_length: int):
        self.seq_length = seq_length

    def batch(self, ids: list[int]) -> Batch:
        windows = np.zeros((len(ids), self.seq_length + 1), dtype=np.int64)
        return Batch.from_windows(windows)


@contextlib.contextmanager
def fake_world(layout: Layout, rank: int) -> Iterator[None]:
    """The default process group as the fake backend: rank `rank` of layout.world_size, no peers."""
    if dist.is_initialized():
        raise RuntimeError("a process group already exists; the dryrun needs its own (fake) one")
    dist.init_process_group("fake", rank=rank, world_size=layout.world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _backward_entries(mem: FakeMemory, seen: list[int]) -> Iterator[None]:
    """Record the live bytes at every torch.autograd.backward call (Tensor.backward goes through it)."""
    original = torch.autograd.backward

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(mem.current)
        return original(*args, **kwargs)

    torch.autograd.backward = recording  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.autograd.backward = original  # type: ignore[assignment]


@contextlib.contextmanager
def _swappable_params(mode: FakeTensorMode) -> Iterator[None]:
    """nn.Module.to() swaps a fake parameter with its cast copy (torch.utils.swap_tensors), which
    refuses tensors with weak references; fake mode's conversion memo holds some. Emptying the memo
    before each swap (it is only a cache of real-to-fake conversions) and keeping the parameter's
    attributes (a swap exchanges them; the real path's `param.data = ...` keeps them) lets
    make_trainable's cast run as it does on real tensors."""
    original = torch.utils.swap_tensors

    def swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
        mode.fake_tensor_converter.tensor_memo.clear()
        markers = dict(t1.__dict__)  # tensor/sequence/expert-parallel flags: `.data =` keeps them
        original(t1, t2)
        t1.__dict__.update(markers)

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


def block_fill(name: str, shape: tuple[int, ...], offsets: tuple[int, ...], box: torch.Tensor) -> None:
    """The dryrun's weight source: what models.init's draws hold (one fp32 block of BLOCK_ELEMENTS
    values at a time, copied into the box) without their per-block generator work, which on fake
    tensors would cost seconds per billion parameters and allocate nothing more."""
    n = min(box.numel(), BLOCK_ELEMENTS)
    block = torch.empty(n, dtype=torch.float32, device=box.device)
    box.reshape(-1)[:n].copy_(block) if box.is_contiguous() else box.zero_()


@contextlib.contextmanager
def _gpu_kernels() -> Iterator[None]:
    """The experts' GEMMs as a GPU rank runs them (torch._grouped_mm, whose fake implementation runs
    on any device) instead of the CPU backend, which pads groups and drops the padding with a
    boolean mask (a data-dependent shape). MEGATRAIN_KERNELS, as a debugging run would force it."""
    before = os.environ.get(kernels.ENV)
    forced = kernels.forced_backends()
    forced.setdefault("grouped_mlp", "grouped_mm")
    os.environ[kernels.ENV] = ",".join(f"{k}={v}" for k, v in forced.items())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(kernels.ENV, None)
        else:
            os.environ[kernels.ENV] = before


@contextlib.contextmanager
def _materialize_fake(fake: FakeTensorMode, mem: FakeMemory) -> Iterator[None]:
    """build_model with its meta phase as plain meta tensors and `materialize` (what allocates the
    rank's shards and fills them) under fake tensors and the byte count. Under FakeTensorMode a meta
    tensor is a fake one that no longer reports `is_meta`, so materialize would skip it."""
    original = build_module.materialize

    def materialize(*args: Any, **kwargs: Any) -> None:
        with fake, mem:
            original(*args, **kwargs)

    build_module.materialize = materialize  # type: ignore[assignment]
    try:
        yield
    finally:
        build_module.materialize = original  # type: ignore[assignment]


def dryrun(spec: JobSpec, layout: Layout, rank: int = 0, *, microbatches: int | None = None) -> DryRunReport:
    """Rank `rank`'s start and first step of `spec` on `layout`, on fake tensors (module docstring).

    microbatches: per step and dp rank (default: the spec's global batch over micro-batch × dp); fewer
    keep a large global batch quick, and the planner must then be given the same count."""
    t0 = time.perf_counter()
    if spec.model.vocab_size is None and spec.data.tokenizer.type != "byte":
        raise ValueError("model.vocab_size is unset: the dryrun reads no tokenizer; set it in the spec")
    vocab = spec.model.vocab_size or 257  # the byte tokenizer's, as the planner's from_spec
    mcfg = transformer_config(spec, vocab)
    cfg = train_config(with_micro_batch_size(spec, layout=layout), layout.dp)
    if microbatches is not None:
        gbs = microbatches * cfg.micro_batch_size * layout.dp
        cfg = dataclasses.replace(cfg, global_batch_size=gbs)
    # What a GPU rank runs ("auto" is bf16 there): the dryrun stands for the accelerator.
    precision = planned_precision(cfg.precision, None)
    cfg = dataclasses.replace(cfg, precision=precision)
    par = spec.parallelism if isinstance(spec.parallelism, ParallelismSpec) else ParallelismSpec()
    mem = FakeMemory()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_world(layout, rank), _gpu_kernels():
        state = ParallelState.build(layout, "cpu")
        # As engine.train.run starts a rank (the same calls, the same arguments); the meta build
        # stays plain meta, and only materialisation allocates (fake tensors).
        with _materialize_fake(fake, mem):
            model = build_model(
                mcfg, state, cfg.seed, "cpu", dtype=PARAM_DTYPES[precision], weights=block_fill, lora=cfg.lora
            )
        with fake, mem, _swappable_params(fake):
            balance_routing(model.module, state)
            train = make_trainable(model, cfg, par, precision, mcfg)
            startup_peak = mem.peak
            loop = TrainLoop(
                train, cfg, cast(Any, {"train": SyntheticData(mcfg.seq_length)}), cast(Any, None),
                Rates(1.0, 1, None), lambda progress: None,
            )  # fmt: skip
            optimizer_step = train.optimizer.step
            marks: dict[str, int] = {}

            def step_marked() -> Any:
                marks["before"], marks["fwd_bwd_peak"] = mem.current, mem.peak
                mem.reset_peak()
                result = optimizer_step()
                marks["opt_peak"], marks["after"] = mem.peak, mem.current
                return result

            train.optimizer.step = step_marked  # type: ignore[method-assign]
            base = mem.current
            mem.reset_peak()
            entries: list[int] = []
            with _backward_entries(mem, entries):
                loop.step(0)
            params = list(train.ddp.module.parameters())
            params_bytes = sum(storages(params).values())
            grads_bytes = sum(storages([train.ddp.grad_buffer]).values())
            opt = train.optimizer
            mains = [m for m, aliased in zip(opt._mains, opt._aliased, strict=True) if not aliased]
            moments = [
                t for st in opt.adam.state.values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")
            ]
            optimizer_bytes = sum(storages(mains + moments).values())
            num_params = sum(p.numel() for p in train.names)
    activations = marks["fwd_bwd_peak"] - base
    stored = max(entries, default=base) - base
    state = params_bytes + grads_bytes + optimizer_bytes
    return DryRunReport(
        rank=rank,
        stage=layout.coords(rank).pp,
        precision=precision,
        microbatches=cfg.grad_accum_steps,
        num_params=num_params,
        params_bytes=params_bytes,
        grads_bytes=grads_bytes,
        optimizer_bytes=optimizer_bytes,
        activations_bytes=activations,
        stored_bytes=stored,
        transient_bytes=activations - stored,
        optimizer_workspace_bytes=marks["opt_peak"] - marks["after"],
        startup_peak_bytes=startup_peak,
        first_step_peak_bytes=max(marks["fwd_bwd_peak"], marks["opt_peak"]),
        peak_bytes=max(startup_peak, state + max(activations, marks["opt_peak"] - marks["after"])),
        seconds=round(time.perf_counter() - t0, 2),
    )


__all__ = ["DryRunReport", "SyntheticData", "dryrun", "fake_world"]
