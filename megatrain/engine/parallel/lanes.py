"""Two micro-batches in flight on one rank: one's forward and another's backward take turns, each
running while the other waits on an expert-parallel all-to-all or a pipeline receive (DualPipe's
overlap; Megatron's combined 1F1B, `--overlap-moe-expert-parallel-comm` across micro-batches),
`parallelism.moe_overlap_microbatches`.

    forward_out, backward_out = two_lanes(lambda: forward(i), lambda: backward(i - 1))

The first lane (the forward, in this thread) runs until it has posted an all-to-all and would wait
for it (`wait` below); it hands over to the second (the backward, in a helper thread), which runs
until it waits on one of its own, and so on. Each exchange is on the wire while the other lane
computes; the wait itself comes only when the lane gets its turn back:

    forward    embed, layer 0's attention, router | dispatch posted ...................... | experts ...
    backward   ................................... | head, norm, layer L's shared expert | combine-grad posted

which is the order Megatron's combined 1F1B writes out by hand, here without cutting the layers into
pieces: the hand-overs are where a lane would block. Exactly one lane runs at a time (a baton), so
every collective is issued in the same order on every rank and the result equals running the two
one after the other, to the bit: the same ops on the same tensors.

A layer's dispatcher keeps a call's splits from dispatch to combine; `exclusive` keeps the lanes
from meeting inside one (only a recompute, the backward lane rerunning a layer, can).

The helper thread runs in a copy of this thread's context (its context variables: the loss's token
counters) with its grad mode and CUDA device and stream (thread-local in torch). Random draws would
interleave in a schedule-dependent order, so the spec allows this with dropout 0 only.
On a GPU the waits are stream waits and the hand-over costs the launch queue only; on CPU gloo's
own threads move the rows while the other lane computes.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

import torch

A = TypeVar("A")
B = TypeVar("B")


class _Baton:
    """Whose turn it is (lane 0 or 1), and which lanes have finished."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.turn = 0
        self.done = [False, False]
        self.hand_overs = 0
        self.seconds = [0.0, 0.0]
        """Each lane's time holding the baton (its own compute, and its waits once its turn is back)."""
        self._since = 0.0
        self.inside: dict[int, int] = {}
        """id(object) -> the lane inside it (exclusive)."""

    def hand_over(self) -> None:
        """Called by the lane whose turn it is: let the other one run until it hands back."""
        with self.cond:
            me = self.turn
            if self.done[1 - me]:
                return
            self._switch(1 - me)
            self.hand_overs += 1
            self.cond.wait_for(lambda: self.turn == me)

    def _switch(self, lane: int) -> None:
        now = time.perf_counter()
        self.seconds[self.turn] += now - self._since
        self.turn, self._since = lane, now
        self.cond.notify_all()

    def begin(self, lane: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == lane)
            if lane == 0:
                self._since = time.perf_counter()

    def end(self, lane: int) -> None:
        with self.cond:
            self.done[lane] = True
            self._switch(1 - lane)


_baton: _Baton | None = None
hand_overs = 0
"""Hand-overs between lanes so far in this process (tests and benchmarks read the change)."""


def wait(*works: Any) -> None:
    """Wait for a transfer's pending work (an all-to-all, a pipeline receive); inside two_lanes, first
    let the other lane run until it waits too (or finishes). Every wait hands over, whether or not
    its rows have arrived: the turns must fall alike on every rank, or the ranks' all-to-alls would
    be issued in different orders."""
    hand_over()
    for work in works:
        work.wait()


def hand_over() -> None:
    """Inside two_lanes, let the other lane run until it waits too (or finishes); else nothing."""
    baton = _baton
    if baton is not None:
        baton.hand_over()


@contextmanager
def exclusive(obj: object) -> Iterator[None]:
    """One lane at a time inside `obj` (an MoE layer's dispatcher, which keeps a call's splits and
    orders from dispatch to combine): a lane that finds the other one inside hands over until it
    has left. Only a recompute (the backward lane rerunning a layer) can meet the forward lane in
    the same layer. A no-op outside two_lanes."""
    baton = _baton
    if baton is None:
        yield
        return
    me, key = baton.turn, id(obj)
    while baton.inside.get(key, me) != me:
        baton.hand_over()
    baton.inside[key] = me
    try:
        yield
    finally:
        del baton.inside[key]


def two_lanes(
    first: Callable[[], A], second: Callable[[], B], seconds: list[float] | None = None
) -> tuple[A, B]:
    """Run `first` (in this thread) and `second` (in a helper thread) taking turns at `wait`, first
    starting; returns both results, and adds each lane's time holding the baton into `seconds`
    (two entries). An exception in either is raised here once both have stopped (the other runs on
    alone to its end: a lane cannot be stopped halfway through a collective)."""
    global _baton, hand_overs
    if _baton is not None:
        raise RuntimeError("two_lanes cannot nest")
    baton = _Baton()
    results: list[Any] = [None, None]
    errors: list[BaseException | None] = [None, None]
    grad = torch.is_grad_enabled()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    device, stream = (torch.cuda.current_device(), torch.cuda.current_stream()) if cuda else (None, None)

    def run(lane: int, fn: Callable[[], Any]) -> None:
        baton.begin(lane)
        try:
            results[lane] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors[lane] = exc
        finally:
            baton.end(lane)

    def helper() -> None:
        torch.set_grad_enabled(grad)
        if device is not None:
            torch.cuda.set_device(device)
            torch.cuda.set_stream(stream)
        run(1, second)

    _baton = baton
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(helper,), name="megatrain-lane", daemon=True)
    try:
        thread.start()
        run(0, first)
        thread.join()
    finally:
        _baton = None
        hand_overs += baton.hand_overs
    if seconds is not None:
        seconds[0] += baton.seconds[0]
        seconds[1] += baton.seconds[1]
    for exc in errors:
        if exc is not None:
            raise exc
    return results[0], results[1]


def overlapped(
    items: Sequence[A],
    forward: Callable[[A], torch.Tensor],
    backward: Callable[[torch.Tensor, bool], None],
    seconds: list[float],
) -> list[torch.Tensor]:
    """Every item's forward (-> its loss) and backward(loss, last), item m's forward beside item
    m-1's backward (two_lanes, the forward first), the first forward and the last backward alone;
    returns the losses. Adds the forwards' time into seconds[0], the backwards' into seconds[1]."""
    t0 = time.perf_counter()
    losses = [forward(items[0])]
    seconds[0] += time.perf_counter() - t0
    for item in items[1:]:
        done = losses[-1]
        loss, _ = two_lanes(partial(forward, item), partial(backward, done, False), seconds)
        losses.append(loss)
    t0 = time.perf_counter()
    backward(losses[-1], True)
    seconds[1] += time.perf_counter() - t0
    return losses
