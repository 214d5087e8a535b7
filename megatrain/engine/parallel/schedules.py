"""Pipeline schedules: all-forward-all-backward, 1F1B, interleaved 1F1B; point-to-point; bubble timing.

A schedule is, for each stage, an ordered list of actions F(chunk, micro-batch) / B(chunk,
micro-batch) (`schedule_actions`, pure). `PipelineSchedule` runs one stage's list: a forward takes
its input from the previous stage (or the tokens), a backward its output gradient from the next stage
(or the loss). Sends are posted with batch_isend_irecv and not waited for until the end of the step;
receives are posted one ahead (the next activation and the next gradient are in flight while the
stage computes, as Megatron's overlap_p2p_comm) and waited for when needed: that wait is the stage's
bubble. Since every stage's list respects the dependencies, nothing can deadlock, and messages
between two stages match in order: the k-th activation stage s sends is the k-th one stage s+1
receives (the interleaved orders below keep this true across the wrap from the last stage to
stage 0). Activations and gradients travel on two process groups over the same ranks, so with pp=2
(where "next" and "previous" are the same rank) their streams cannot cross, on gloo or on NCCL,
which ignores tags.

Every stage holds each micro-batch (every rank loads the step's data): its position and segment ids
go to every chunk (attention needs them), its tokens to the first, its labels and loss mask to the
loss on the last; only activations and their gradients travel between stages.

Shapes are known ahead ((micro_batch, T, C), T/tp under sequence parallelism) and dtypes are the
model's, so no shape handshake precedes a transfer.

Orders (Megatron's, M micro-batches, p stages, V chunks per stage, stage s):
- all_forward_all_backward: every forward, then every backward (GPipe; holds M micro-batches).
- 1f1b: p-s-1 warm-up forwards, then one forward one backward, then the cool-down backwards; the
  first stage holds at most p micro-batches' activations. With `lanes` one more warm-up forward,
  and each steady pair's forward and backward (two micro-batches) run beside each other, taking
  turns at their transfers (engine.parallel.lanes): p-s+1 in flight.
- interleaved (1f1b with V > 1): the k-th forward runs chunk (k mod pV) // p on micro-batch
  (k // pV)·p + k mod p, backwards mirror it over the chunks in reverse; warm-up (p-s-1)·2 + (V-1)·p.
  Needs M divisible by p. The bubble shrinks by V: (p-1)/V / (M + (p-1)/V).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from megatrain.engine.microbatch import MicroBatch
from megatrain.engine.parallel import lanes
from megatrain.engine.parallel.p2p import P2P, Kind, StageTimes, _Receives  # noqa: F401  (re-exported)
from megatrain.engine.parallel.state import ParallelState
from megatrain.engine.parallel.zero_bubble import (
    SPLIT_SCHEDULES,
    Action,
    split_bubble,
    zb_h1_actions,
    zbv_actions,
    zbv_chunk_ids,
)
from megatrain.kernels.grad_accumulation import deferring_weight_grads

Schedule = Literal["1f1b", "all_forward_all_backward", "zb-h1", "zbv"]
SCHEDULES: tuple[str, ...] = ("1f1b", "all_forward_all_backward", "zb-h1", "zbv")


class ScheduleError(ValueError):
    """A pipeline configuration a schedule cannot run; the message says which rule and why."""


def stage_chunk_ids(stage: int, pp: int, virtual_stages: int, schedule: str = "1f1b") -> list[int]:
    """Global chunk ids held by `stage`, by local chunk index: s, s+pp, s+2pp, ... (Megatron's
    interleaving), or zbv's V (s, then 2p-1-s)."""
    if schedule == "zbv":
        return zbv_chunk_ids(stage, pp)
    return [v * pp + stage for v in range(virtual_stages)]


def chunk_stage(chunk: int, pp: int, virtual_stages: int, schedule: str = "1f1b") -> int:
    """The stage holding global chunk `chunk` (the inverse of stage_chunk_ids)."""
    if schedule == "zbv":
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


def check_schedule(
    schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1, lanes: bool = False
) -> None:
    """Raise ScheduleError explaining the first rule the configuration breaks."""
    if schedule not in SCHEDULES:
        raise ScheduleError(f"pipeline_schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    if pp < 1 or virtual_stages < 1 or num_microbatches < 1:
        raise ScheduleError("pp, virtual_stages and the number of micro-batches must be >= 1")
    if lanes and (schedule != "1f1b" or virtual_stages != 1):
        raise ScheduleError("two micro-batches in flight (lanes) pair 1F1B's steps: one chunk per stage")
    if schedule == "zb-h1" and virtual_stages != 1:
        raise ScheduleError(
            "pipeline_schedule=zb-h1 runs one chunk per stage: set virtual_stages=1 (or use zbv)"
        )
    if schedule == "zbv" and (virtual_stages != 2 or pp < 2):
        raise ScheduleError(
            "pipeline_schedule=zbv runs two chunks per stage in a V: it needs virtual_stages=2 and pp >= 2"
        )
    if schedule == "zbv":
        return  # the V takes any number of micro-batches
    if virtual_stages > 1 and pp == 1:
        raise ScheduleError("virtual_stages > 1 needs pp > 1: interleaving splits each stage's layers")
    if virtual_stages > 1 and num_microbatches % pp:
        raise ScheduleError(
            f"the interleaved schedule (virtual_stages={virtual_stages}) needs the number of "
            f"micro-batches per step ({num_microbatches} = global_batch_size / (micro_batch_size × dp)) "
            f"divisible by pp={pp}: micro-batches enter the pipeline in groups of pp, one group per chunk"
        )


def _interleaved_chunk(k: int, pp: int, v: int, forward: bool) -> int:
    chunk = (k % (pp * v)) // pp
    return chunk if forward else v - 1 - chunk


def _interleaved_microbatch(k: int, pp: int, v: int) -> int:
    return (k // (pp * v)) * pp + k % pp


def schedule_actions(
    schedule: str, pp: int, stage: int, num_microbatches: int, virtual_stages: int = 1, lanes: bool = False
) -> list[Action]:
    """The ordered forward/backward actions of one stage (pure; see the module docstring). `lanes`
    (1F1B, one chunk per stage): one more forward in the warm-up, so that each steady-state pair
    is the forward and backward of two different micro-batches, run beside each other."""
    check_schedule(schedule, pp, num_microbatches, virtual_stages, lanes)
    if schedule == "zb-h1":
        return zb_h1_actions(pp, stage, num_microbatches)
    if schedule == "zbv":
        return zbv_actions(pp, stage, num_microbatches)
    m, v = num_microbatches, virtual_stages
    total = m * v

    def fwd(k: int) -> Action:
        if v == 1:
            return Action("F", 0, k)
        return Action("F", _interleaved_chunk(k, pp, v, True), _interleaved_microbatch(k, pp, v))

    def bwd(k: int) -> Action:
        if v == 1:
            return Action("B", 0, k)
        return Action("B", _interleaved_chunk(k, pp, v, False), _interleaved_microbatch(k, pp, v))

    if schedule == "all_forward_all_backward":
        return [fwd(k) for k in range(total)] + [bwd(k) for k in range(total)]
    if v == 1:
        warmup = min(pp - stage - 1 + lanes, m)
    elif m == pp:
        warmup = total  # too few micro-batches for a steady state: all forwards first
    else:
        warmup = min((pp - stage - 1) * 2 + (v - 1) * pp, total)
    actions = [fwd(k) for k in range(warmup)]
    steady = total - warmup
    for k in range(steady):
        actions += [fwd(warmup + k), bwd(k)]
    actions += [bwd(k) for k in range(steady, total)]
    return actions


@dataclass(frozen=True)
class Simulation:
    makespan: float
    busy: tuple[float, ...]
    """Compute time per stage."""
    peak_in_flight: tuple[int, ...]
    """Most micro-batch chunks whose forward ran but whose backward did not, per stage."""

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the stages' time: 1 - mean(busy) / makespan."""
        return 1.0 - sum(self.busy) / len(self.busy) / self.makespan


def simulate(
    schedule: str,
    pp: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    weight_time: float | None = None,
) -> Simulation:
    """Run every stage's action list against the data dependencies with free communication.

    forward_time / backward_time are one stage's whole share of a micro-batch (split over its chunks);
    in a zero-bubble schedule weight_time of the backward is its W pass (default half of it).
    Peaks count a chunk's activations from its F until its backward is done (B, or W when split).
    Raises ScheduleError if the lists deadlock (a dependency that can never be met).
    """
    v = virtual_stages
    n_chunks = pp * v
    lists = [schedule_actions(schedule, pp, s, num_microbatches, v) for s in range(pp)]
    ids = [stage_chunk_ids(s, pp, v, schedule) for s in range(pp)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, global chunk, mb) -> finish time
    pos, clock, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    live, peak = [0] * pp, [0] * pp
    split = schedule in SPLIT_SCHEDULES
    tw = (backward_time / 2 if weight_time is None else weight_time) if split else 0.0
    cost = {"F": forward_time / v, "B": (backward_time - tw) / v, "W": tw / v}
    held = {"F": 1, "B": 0 if split else -1, "W": -1}
    while any(pos[s] < len(lists[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            while pos[s] < len(lists[s]):
                a = lists[s][pos[s]]
                c = ids[s][a.chunk]
                if a.kind == "F":
                    dep = ("F", c - 1, a.microbatch) if c > 0 else None
                elif a.kind == "W":
                    dep = ("B", c, a.microbatch)
                else:
                    dep = ("B", c + 1, a.microbatch) if c < n_chunks - 1 else ("F", c, a.microbatch)
                if dep is not None and dep not in done:
                    break
                start = max(clock[s], done[dep] if dep is not None else 0.0)
                clock[s] = start + cost[a.kind]
                busy[s] += cost[a.kind]
                done[(a.kind, c, a.microbatch)] = clock[s]
                live[s] += held[a.kind]
                peak[s] = max(peak[s], live[s])
                pos[s] += 1
                progressed = True
        if not progressed:
            raise ScheduleError(f"{schedule} with pp={pp}, V={v}, M={num_microbatches} deadlocks")
    return Simulation(max(clock), tuple(busy), tuple(peak))


def theoretical_bubble(
    pp: int, num_microbatches: int, virtual_stages: int = 1, schedule: str = "1f1b"
) -> float:
    """(p-1)/(m+p-1) for 1F1B; ((p-1)/V) / (m + (p-1)/V) interleaved (Narayanan et al. 2021);
    the zero-bubble schedules' with F = B = W (zero_bubble.split_bubble)."""
    if schedule in SPLIT_SCHEDULES:
        return split_bubble(schedule, pp, num_microbatches)
    b = (pp - 1) / virtual_stages
    return b / (num_microbatches + b)


# -- running a schedule ----------------------------------------------------------------------------


@dataclass
class _Slot:
    input: torch.Tensor | None = None
    output: torch.Tensor | None = None
    loss: torch.Tensor | None = None


@dataclass
class PipelineSchedule:
    """Runs one stage's share of a step over its model chunks.

    loss_fn(output, micro-batch) -> the micro-batch's loss (already scaled to its share of the step);
    scale_loss multiplies it for fp16; before_backward(is_last) is called before each backward with
    True only for this stage's last one (DataParallel starts its gradient buckets then; never under
    a zero-bubble schedule, whose W passes add weight gradients after the last backward).
    """

    chunks: Sequence[nn.Module]
    state: ParallelState
    activation_shape: tuple[int, ...]
    dtype: torch.dtype
    schedule: str = "1f1b"
    times: StageTimes = field(default_factory=StageTimes)
    output_shape: tuple[int, ...] | None = None
    """The shape of what this stage sends (and receives gradients of); None: activation_shape."""
    lanes: bool = False
    """1F1B's steady-state forward and backward (of two micro-batches) beside each other, taking
    turns at their transfers (engine.parallel.lanes; parallelism.moe_overlap_microbatches)."""

    def __post_init__(self) -> None:
        self.pp, self.v = self.state.pp_size, len(self.chunks)
        self.stage = self.state.pp_rank
        self.ids = stage_chunk_ids(self.stage, self.pp, self.v, self.schedule)
        self.split = self.schedule in SPLIT_SCHEDULES
        self._laned = False
        self.p2p = P2P(self.state, self.activation_shape, self.dtype, self.times, self.output_shape)
        self.n_chunks = self.pp * self.v
        self._local: dict[tuple[str, int, int], torch.Tensor] = {}
        """Tensors between two chunks of this stage (zbv's turn at the last stage), by (F or B,
        the chunk that takes it, micro-batch)."""
        self._weights: dict[tuple[int, int], list[Callable[[], None]]] = {}
        """A split backward's deferred weight gradients, by (local chunk, micro-batch)."""

    def _global(self, chunk: int) -> int:
        return self.ids[chunk]

    def _peer(self, chunk: int) -> int | None:
        """The rank holding global chunk `chunk`; None when it is this stage."""
        stage = chunk_stage(chunk, self.pp, self.v, self.schedule)
        return None if stage == self.stage else self.p2p.rank_of_stage(stage)

    def _timed(self, kind: str, fn: Callable[[], Any]) -> Any:
        if self._laned:  # timed per lane by _pair
            return fn()
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        if kind == "F":
            self.times.forward_s += dt
        else:
            self.times.backward_s += dt
        return out

    def _forward(
        self,
        a: Action,
        batches: Sequence[MicroBatch],
        slot: _Slot,
        loss_fn: Callable[[torch.Tensor, MicroBatch], torch.Tensor],
        grad: bool,
    ) -> None:
        c = self._global(a.chunk)
        mb = batches[a.microbatch]
        if c == 0:
            x = mb.tokens
        else:
            src = self._peer(c - 1)
            x = self._local.pop(("F", c, a.microbatch)) if src is None else self.p2p.recv("activation", src)
            if grad:
                x.requires_grad_()
        slot.input = x

        def run() -> torch.Tensor:
            with torch.set_grad_enabled(grad):
                return self.chunks[a.chunk](x, **mb.model_inputs)

        out = self._timed("F", run)
        if c == self.n_chunks - 1:
            slot.loss = self._timed("F", lambda: loss_fn(out, mb))
            return
        dst = self._peer(c + 1)
        if dst is None:
            self._local[("F", c + 1, a.microbatch)] = out.detach()
        else:
            self.p2p.send("activation", out, dst)
        slot.output = out

    def _backward(self, a: Action, slot: _Slot, scale_loss: Callable[[torch.Tensor], torch.Tensor]) -> None:
        c = self._global(a.chunk)
        if c == self.n_chunks - 1:
            assert slot.loss is not None
            loss = slot.loss

            def run() -> None:
                scale_loss(loss).backward()

        else:
            src = self._peer(c + 1)
            grad = self._local.pop(("B", c, a.microbatch)) if src is None else self.p2p.recv("grad", src)
            out = slot.output
            assert out is not None

            def run() -> None:
                torch.autograd.backward(out, grad)

        if self.split:  # B: input gradients now, the weight-gradient GEMMs at this chunk's W
            deferred = self._weights.setdefault((a.chunk, a.microbatch), [])
            with deferring_weight_grads(deferred):
                self._timed("B", run)
        else:
            self._timed("B", run)
        if c > 0:
            assert slot.input is not None and slot.input.grad is not None
            dst = self._peer(c - 1)
            if dst is None:
                self._local[("B", c - 1, a.microbatch)] = slot.input.grad
            else:
                self.p2p.send("grad", slot.input.grad, dst)
        slot.input = slot.output = None  # free this micro-batch's activations

    @torch.no_grad()
    def _weight(self, a: Action) -> None:
        """W: the weight gradients B left for this chunk and micro-batch."""

        def run() -> None:
            for accumulate in self._weights.pop((a.chunk, a.microbatch)):
                accumulate()

        self._timed("B", run)

    def forward_backward(
        self,
        batches: Sequence[MicroBatch | tuple[torch.Tensor, torch.Tensor]],
        loss_fn: Callable[[torch.Tensor, MicroBatch], torch.Tensor],
        *,
        scale_loss: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
        before_backward: Callable[[bool], None] | None = None,
        before_forward: Callable[[MicroBatch], None] | None = None,
    ) -> torch.Tensor:
        """One step over `batches` (one per micro-batch; a (tokens, labels) pair is a MicroBatch of
        them); the sum of the losses on the last stage, else 0. before_forward(micro-batch) is called
        before each of its chunks' forwards (the MoE aux-loss scale is set per micro-batch)."""
        batches = _microbatches(batches)
        m = len(batches)
        actions = schedule_actions(self.schedule, self.pp, self.state.pp_rank, m, self.v, self.lanes)
        self._expect(actions)
        slots: dict[tuple[int, int], _Slot] = {}
        total = torch.zeros((), device=self.state.device)
        last_b = max(i for i, a in enumerate(actions) if a.kind == "B")

        def forward(a: Action) -> None:
            slot = slots.setdefault((a.chunk, a.microbatch), _Slot())
            if before_forward is not None:
                before_forward(batches[a.microbatch])
            self._forward(a, batches, slot, loss_fn, grad=True)
            if slot.loss is not None:
                total.add_(slot.loss.detach().float())

        def backward(i: int, a: Action) -> None:
            if before_backward is not None:
                before_backward(i == last_b and not self.split)
            self._backward(a, slots.pop((a.chunk, a.microbatch)), scale_loss)

        i = 0
        while i < len(actions):
            a, after = actions[i], actions[i + 1] if i + 1 < len(actions) else None
            if self.lanes and a.kind == "F" and after is not None and after.kind == "B":
                self._pair(partial(forward, a), partial(backward, i + 1, after))
                i += 2
                continue
            if a.kind == "F":
                forward(a)
            elif a.kind == "B":
                backward(i, a)
            else:
                self._weight(a)
            i += 1
        self._finish()
        return total

    def _pair(self, forward: Callable[[], None], backward: Callable[[], None]) -> None:
        """A steady-state forward and backward in lanes; their compute times are each lane's turns
        less the waits on neighbours inside them (split in proportion)."""
        seconds, waited = [0.0, 0.0], self.times.wait_s
        self._laned = True
        try:
            lanes.two_lanes(forward, backward, seconds)
        finally:
            self._laned = False
        busy = sum(seconds)
        compute = max(0.0, busy - (self.times.wait_s - waited))
        if busy > 0:
            self.times.forward_s += compute * seconds[0] / busy
            self.times.backward_s += compute * seconds[1] / busy

    @torch.no_grad()
    def forward_only(
        self,
        batches: Sequence[MicroBatch | tuple[torch.Tensor, torch.Tensor]],
        loss_fn: Callable[[torch.Tensor, MicroBatch], torch.Tensor],
    ) -> torch.Tensor:
        """Forwards only (evaluation), in the forward order of the schedule; loss sum on the last stage."""
        batches = _microbatches(batches)
        total = torch.zeros((), device=self.state.device)
        forwards = [a for a in self._forward_order(len(batches)) if a.kind == "F"]
        self._expect(forwards)
        for a in forwards:
            slot = _Slot()
            self._forward(a, batches, slot, loss_fn, grad=False)
            if slot.loss is not None:
                total += slot.loss.float()
        self._finish()
        return total

    def _forward_order(self, m: int) -> list[Action]:
        """Every forward once in an order no stage waits on itself in: micro-batch by micro-batch
        through this stage's chunks in pipeline order (all-forward-all-backward's, or the V's)."""
        if self.schedule == "zbv":
            return [Action("F", chunk, k) for k in range(m) for chunk in range(self.v)]
        return schedule_actions("all_forward_all_backward", self.pp, self.stage, m, self.v)

    def _expect(self, actions: Sequence[Action]) -> None:
        """Tell P2P how many activations and gradients this stage's actions take from each peer."""
        last = self.n_chunks - 1
        counts: dict[tuple[Kind, int], int] = {}
        for a in actions:
            c = self._global(a.chunk)
            src = None
            if a.kind == "F" and c > 0:
                src, kind = self._peer(c - 1), "activation"
            elif a.kind == "B" and c < last:
                src, kind = self._peer(c + 1), "grad"
            if src is not None:
                counts[(kind, src)] = counts.get((kind, src), 0) + 1  # type: ignore[index]
        self.p2p.expect(counts)  # type: ignore[arg-type]

    def _finish(self) -> None:
        self.p2p.flush()
        if self._local or self._weights:
            raise RuntimeError(
                f"a pipeline step ended with work left: {sorted(self._local)} {sorted(self._weights)}"
            )
        # Line the stages up so each one's idle tail counts as waiting: the bubble is then measured
        # against a common makespan, as (p-1)/(m+p-1) is.
        t0 = time.perf_counter()
        if self.state.pp_group is not None:
            dist.all_reduce(torch.zeros(1, device=self.state.device), group=self.state.pp_group)
        self.times.wait_s += time.perf_counter() - t0
        self.times.steps += 1


def _microbatches(batches: Sequence[MicroBatch | tuple[torch.Tensor, torch.Tensor]]) -> list[MicroBatch]:
    return [b if isinstance(b, MicroBatch) else MicroBatch(b[0], b[1]) for b in batches]


def pipeline_loss(total: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """The last stage's loss on every stage (sum over pp: the other stages hold zero)."""
    if state.pp_group is None:
        return total
    total = total.clone()
    dist.all_reduce(total, group=state.pp_group)
    return total
