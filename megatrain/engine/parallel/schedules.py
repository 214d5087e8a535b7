"""Pipeline schedules: all-forward-all-backward, 1F1B, interleaved 1F1B; point-to-point; bubble timing.

A schedule is, for each stage, an ordered list of actions F(chunk, micro-batch) / B(chunk,
micro-batch) (`schedule_actions`, pure). `PipelineSchedule` runs one stage's list: a forward takes
its input from the previous stage (or the tokens), a backward its output gradient from the next stage
(or the loss). Sends are posted with batch_isend_irecv and not waited for until the end of the step;
receives are posted one ahead (the next activation and the next gradient are in flight while the
stage computes, as Megatron's overlap_p2p_comm) and waited for when needed: that wait is the stage's
bubble. Since every stage's list
respects the dependencies, nothing can deadlock, and messages between two stages match in order:
the k-th activation stage s sends is the k-th one stage s+1 receives (the interleaved orders below
keep this true across the wrap from the last stage to stage 0). Activations and gradients travel on
two process groups over the same ranks, so with pp=2 (where "next" and "previous" are the same rank)
their streams cannot cross, on gloo or on NCCL, which ignores tags.

Every stage holds each micro-batch (every rank loads the step's data): its position and segment ids
go to every chunk (attention needs them), its tokens to the first, its labels and loss mask to the
loss on the last; only activations and their gradients travel between stages.

Shapes are known ahead ((micro_batch, T, C), T/tp under sequence parallelism) and dtypes are the
model's, so no shape handshake precedes a transfer.

Orders (Megatron's, M micro-batches, p stages, V chunks per stage, stage s):
- all_forward_all_backward: every forward, then every backward (GPipe; holds M micro-batches).
- 1f1b: p-s-1 warm-up forwards, then one forward one backward, then the cool-down backwards; the
  first stage holds at most p micro-batches' activations.
- interleaved (1f1b with V > 1): the k-th forward runs chunk (k mod pV) // p on micro-batch
  (k // pV)·p + k mod p, backwards mirror it over the chunks in reverse; warm-up (p-s-1)·2 + (V-1)·p.
  Needs M divisible by p. The bubble shrinks by V: (p-1)/V / (M + (p-1)/V).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from megatrain.engine.microbatch import MicroBatch
from megatrain.engine.parallel.state import ParallelState

Schedule = Literal["1f1b", "all_forward_all_backward"]
SCHEDULES: tuple[str, ...] = ("1f1b", "all_forward_all_backward")


class ScheduleError(ValueError):
    """A pipeline configuration a schedule cannot run; the message says which rule and why."""


class Action(NamedTuple):
    kind: Literal["F", "B"]
    chunk: int
    """Local chunk index on this stage (0 .. virtual_stages-1)."""
    microbatch: int


def check_schedule(schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    """Raise ScheduleError explaining the first rule the configuration breaks."""
    if schedule not in SCHEDULES:
        raise ScheduleError(f"pipeline_schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    if pp < 1 or virtual_stages < 1 or num_microbatches < 1:
        raise ScheduleError("pp, virtual_stages and the number of micro-batches must be >= 1")
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
    schedule: str, pp: int, stage: int, num_microbatches: int, virtual_stages: int = 1
) -> list[Action]:
    """The ordered forward/backward actions of one stage (pure; see the module docstring)."""
    check_schedule(schedule, pp, num_microbatches, virtual_stages)
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
        warmup = min(pp - stage - 1, m)
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
) -> Simulation:
    """Run every stage's action list against the data dependencies with free communication.

    forward_time / backward_time are one stage's whole share of a micro-batch (split over its chunks).
    Raises ScheduleError if the lists deadlock (a dependency that can never be met).
    """
    v = virtual_stages
    n_chunks = pp * v
    lists = [schedule_actions(schedule, pp, s, num_microbatches, v) for s in range(pp)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, global chunk, mb) -> finish time
    pos, clock, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    live, peak = [0] * pp, [0] * pp
    tf, tb = forward_time / v, backward_time / v
    while any(pos[s] < len(lists[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            while pos[s] < len(lists[s]):
                a = lists[s][pos[s]]
                c = a.chunk * pp + s
                if a.kind == "F":
                    dep = ("F", c - 1, a.microbatch) if c > 0 else None
                else:
                    dep = ("B", c + 1, a.microbatch) if c < n_chunks - 1 else ("F", c, a.microbatch)
                if dep is not None and dep not in done:
                    break
                start = max(clock[s], done[dep] if dep is not None else 0.0)
                cost = tf if a.kind == "F" else tb
                clock[s] = start + cost
                busy[s] += cost
                done[(a.kind, c, a.microbatch)] = clock[s]
                live[s] += 1 if a.kind == "F" else -1
                peak[s] = max(peak[s], live[s])
                pos[s] += 1
                progressed = True
        if not progressed:
            raise ScheduleError(f"{schedule} with pp={pp}, V={v}, M={num_microbatches} deadlocks")
    return Simulation(max(clock), tuple(busy), tuple(peak))


def theoretical_bubble(pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """(p-1)/(m+p-1) for 1F1B; ((p-1)/V) / (m + (p-1)/V) interleaved (Narayanan et al. 2021)."""
    b = (pp - 1) / virtual_stages
    return b / (num_microbatches + b)


# -- point-to-point --------------------------------------------------------------------------------


@dataclass
class StageTimes:
    """Seconds this stage spent computing and waiting on its neighbours in the current interval."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    wait_s: float = 0.0
    steps: int = 0

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def bubble_fraction(self) -> float:
        total = self.compute_s + self.wait_s
        return self.wait_s / total if total > 0 else 0.0

    def reset(self) -> None:
        self.forward_s = self.backward_s = self.wait_s = 0.0
        self.steps = 0


class _Receives:
    """One kind of receive (activations from the previous stage, or gradients from the next) in the
    order the stage takes them; the next one is posted as soon as the one before is taken, so its
    transfer runs while the stage computes."""

    def __init__(self, p2p: P2P, peer: int, group: Any, shape: tuple[int, ...]):
        self.p2p, self.peer, self.group, self.shape = p2p, peer, group, shape
        self.left = 0
        """Receives of this step not posted yet."""
        self.posted: tuple[torch.Tensor, list[Any]] | None = None

    def expect(self, count: int) -> None:
        if self.posted is not None or self.left:
            raise RuntimeError("a pipeline step began with receives of the last one outstanding")
        self.left = count
        self._post()

    def _post(self) -> None:
        if self.left > 0:
            self.left -= 1
            p = self.p2p
            buf = torch.empty(self.shape, dtype=p.dtype, device=p.device)
            self.posted = (buf, p.irecv(buf, self.peer, self.group))

    def take(self) -> torch.Tensor:
        if self.posted is None:  # not announced by expect(): received on demand
            self.left += 1
            self._post()
        assert self.posted is not None
        buf, works = self.posted
        self.posted = None
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        if self.p2p.device.type == "cuda":
            torch.cuda.current_stream(self.p2p.device).synchronize()
        self.p2p.times.wait_s += time.perf_counter() - t0
        self._post()  # the next one's transfer overlaps what the stage does with this one
        return buf


class P2P:
    """Sends and receives between neighbouring stages of one (tp, cp, dp) pipeline column.

    Receives are posted ahead (Megatron's overlap_p2p_comm): once a step's schedule says how many
    activations and gradients the stage will take (`expect`), the first of each is posted at once
    and each next one when the one before is taken. Messages between two stages match in order, so
    a receive posted early still gets the tensor meant for it. Sends are posted and not waited for
    until the end of the step (`flush`). On gloo both progress in its transport's own threads."""

    def __init__(
        self,
        state: ParallelState,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        times: StageTimes,
        grad_shape: tuple[int, ...] | None = None,
    ):
        """`shape`: the activations this stage receives; `grad_shape`: the gradients it receives
        (of what it sends; default `shape`)."""
        self.state = state
        self.dtype, self.device = dtype, state.device
        self.times = times
        c, pp = state.coords, state.pp_size
        self.next_rank = state.layout.rank_of(tp=c.tp, cp=c.cp, dp=c.dp, pp=(c.pp + 1) % pp)
        self.prev_rank = state.layout.rank_of(tp=c.tp, cp=c.cp, dp=c.dp, pp=(c.pp - 1) % pp)
        self.fwd_group = state.pp_group
        self.bwd_group = state.groups.get("pp_bwd")
        self._pending: list[Any] = []
        self._activations = _Receives(self, self.prev_rank, self.fwd_group, shape)
        self._grads = _Receives(self, self.next_rank, self.bwd_group, grad_shape or shape)

    def _post(self, ops: list[dist.P2POp]) -> list[Any]:
        return dist.batch_isend_irecv(ops) if ops else []

    def irecv(self, buf: torch.Tensor, peer: int, group: Any) -> list[Any]:
        return self._post([dist.P2POp(dist.irecv, buf, peer, group)])

    def expect(self, activations: int, grads: int) -> None:
        """This step's receives, counted from its action list; the first of each kind is posted now."""
        self._activations.expect(activations)
        self._grads.expect(grads)

    def _send(self, t: torch.Tensor, peer: int, group: Any) -> None:
        t = t.detach().contiguous()
        works = self._post([dist.P2POp(dist.isend, t, peer, group)])
        self._pending.append((t, works))  # keep the tensor alive until the send completes

    def recv_forward(self) -> torch.Tensor:
        return self._activations.take()

    def send_forward(self, t: torch.Tensor) -> None:
        self._send(t, self.next_rank, self.fwd_group)

    def recv_backward(self) -> torch.Tensor:
        return self._grads.take()

    def send_backward(self, t: torch.Tensor) -> None:
        self._send(t, self.prev_rank, self.bwd_group)

    def flush(self) -> None:
        """Wait for every send posted so far (the end of a step); counted as waiting."""
        t0 = time.perf_counter()
        for _, works in self._pending:
            for w in works:
                w.wait()
        self._pending.clear()
        self.times.wait_s += time.perf_counter() - t0


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
    True only for this stage's last one (DataParallel starts its gradient buckets then).
    """

    chunks: Sequence[nn.Module]
    state: ParallelState
    activation_shape: tuple[int, ...]
    dtype: torch.dtype
    schedule: str = "1f1b"
    times: StageTimes = field(default_factory=StageTimes)

    def __post_init__(self) -> None:
        self.pp, self.v = self.state.pp_size, len(self.chunks)
        self.p2p = P2P(self.state, self.activation_shape, self.dtype, self.times)
        self.n_chunks = self.pp * self.v

    def _global(self, chunk: int) -> int:
        return chunk * self.pp + self.state.pp_rank

    def _timed(self, kind: str, fn: Callable[[], Any]) -> Any:
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
            x = self.p2p.recv_forward()
            if grad:
                x.requires_grad_()
        slot.input = x

        def run() -> torch.Tensor:
            with torch.set_grad_enabled(grad):
                return self.chunks[a.chunk](x, **mb.model_inputs)

        out = self._timed("F", run)
        if c == self.n_chunks - 1:
            slot.loss = self._timed("F", lambda: loss_fn(out, mb))
        else:
            self.p2p.send_forward(out)
            slot.output = out

    def _backward(self, a: Action, slot: _Slot, scale_loss: Callable[[torch.Tensor], torch.Tensor]) -> None:
        c = self._global(a.chunk)
        if c == self.n_chunks - 1:
            assert slot.loss is not None
            loss = slot.loss
            self._timed("B", lambda: scale_loss(loss).backward())
        else:
            grad = self.p2p.recv_backward()
            out = slot.output
            assert out is not None
            self._timed("B", lambda: torch.autograd.backward(out, grad))
        if c > 0:
            assert slot.input is not None and slot.input.grad is not None
            self.p2p.send_backward(slot.input.grad)
        slot.input = slot.output = None  # free this micro-batch's activations

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
        actions = schedule_actions(self.schedule, self.pp, self.state.pp_rank, len(batches), self.v)
        self._expect(actions)
        slots: dict[tuple[int, int], _Slot] = {}
        total = torch.zeros((), device=self.state.device)
        last_b = max(i for i, a in enumerate(actions) if a.kind == "B")
        for i, a in enumerate(actions):
            if a.kind == "F":
                slot = slots.setdefault((a.chunk, a.microbatch), _Slot())
                if before_forward is not None:
                    before_forward(batches[a.microbatch])
                self._forward(a, batches, slot, loss_fn, grad=True)
                if slot.loss is not None:
                    total += slot.loss.detach().float()
            else:
                if before_backward is not None:
                    before_backward(i == last_b)
                self._backward(a, slots.pop((a.chunk, a.microbatch)), scale_loss)
        self._finish()
        return total

    @torch.no_grad()
    def forward_only(
        self,
        batches: Sequence[MicroBatch | tuple[torch.Tensor, torch.Tensor]],
        loss_fn: Callable[[torch.Tensor, MicroBatch], torch.Tensor],
    ) -> torch.Tensor:
        """Forwards only (evaluation), in the forward order of the schedule; loss sum on the last stage."""
        batches = _microbatches(batches)
        total = torch.zeros((), device=self.state.device)
        rank = self.state.pp_rank
        order = schedule_actions("all_forward_all_backward", self.pp, rank, len(batches), self.v)
        forwards = [a for a in order if a.kind == "F"]
        self._expect(forwards)
        for a in forwards:
            slot = _Slot()
            self._forward(a, batches, slot, loss_fn, grad=False)
            if slot.loss is not None:
                total += slot.loss.float()
        self._finish()
        return total

    def _expect(self, actions: Sequence[Action]) -> None:
        """Tell P2P how many activations and gradients this stage's actions receive."""
        last = self.n_chunks - 1
        forwards = sum(1 for a in actions if a.kind == "F" and self._global(a.chunk) > 0)
        backwards = sum(1 for a in actions if a.kind == "B" and self._global(a.chunk) < last)
        self.p2p.expect(forwards, backwards)

    def _finish(self) -> None:
        self.p2p.flush()
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
