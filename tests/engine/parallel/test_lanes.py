"""Two micro-batches in flight (megatrain/engine/parallel/lanes.py, parallelism.moe_overlap_microbatches):
the baton's turns in one process, then on two gloo ranks a step whose forwards run beside the
backwards before them, against the same step run one micro-batch after the other. The lanes run the
same ops on the same tensors, so the gradients are equal to the bit, with the pairs dispatch, in
token chunks and in two hops, and with each layer recomputed in backward."""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Any

import pytest
import torch

from megatrain.engine.parallel import lanes
from megatrain.engine.parallel.state import ParallelState
from megatrain.plan.layout import Layout

from ._ep_common import loss_of, micro_batches, options, trainable
from ._launch import run_distributed


class _Work:
    """A stand-in for an all-to-all's pending work: records when it is waited on."""

    def __init__(self, log: list[str], name: str):
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"{self.name} waited")


def test_lanes_take_turns_where_they_would_wait_the_first_starting() -> None:
    log: list[str] = []
    var: contextvars.ContextVar[str] = contextvars.ContextVar("lane_test", default="unset")
    var.set("caller's")

    def lane(name: str, parts: int) -> str:
        for i in range(parts):
            log.append(f"{name} computes {i}")
            lanes.wait(_Work(log, f"{name} {i}"))
        return f"{name} done in {threading.current_thread().name} seeing {var.get()}"

    before = lanes.hand_overs
    seconds = [0.0, 0.0]
    a, b = lanes.two_lanes(lambda: lane("b", 3), lambda: lane("f", 2), seconds)
    assert log == [
        "b computes 0", "f computes 0", "b 0 waited", "b computes 1", "f 0 waited", "f computes 1",
        "b 1 waited", "b computes 2", "f 1 waited", "b 2 waited",
    ]  # fmt: skip
    assert a == f"b done in {threading.current_thread().name} seeing caller's"
    assert b == "f done in megatrain-lane seeing caller's"  # the helper runs in a copy of the context
    assert lanes.hand_overs - before == 5
    assert seconds[0] > 0 and seconds[1] > 0
    lanes.wait(_Work(log, "alone"))  # outside two_lanes: a plain wait
    assert log[-1] == "alone waited"


def test_an_error_in_either_lane_is_raised_once_both_stopped() -> None:
    ran: list[str] = []

    def fails() -> None:
        lanes.wait(_Work(ran, "fails"))
        raise ValueError("lane broke")

    def other() -> str:
        lanes.wait(_Work(ran, "other 0"))
        lanes.wait(_Work(ran, "other 1"))
        return "finished"

    with pytest.raises(ValueError, match="lane broke"):
        lanes.two_lanes(other, fails)
    assert ran == ["other 0 waited", "fails waited", "other 1 waited"]  # the other ran to its end
    with pytest.raises(RuntimeError, match="cannot nest"):
        lanes.two_lanes(lambda: lanes.two_lanes(lambda: 1, lambda: 2), lambda: 3)


VARIANTS: dict[str, tuple[dict[str, Any], bool]] = {
    "pairs": ({}, False),
    "pairs-recomputed": ({}, True),
    "chunks-recomputed": ({"overlap_chunks": 2}, True),
    "two-hops": ({"ep_ranks_per_node": 1, "overlap_chunks": 2}, False),
    "two-hops-recomputed": ({"ep_ranks_per_node": 1}, True),
}
"""(options, full recompute): recomputed, the backward lane reruns a layer's exchange while the
forward lane may reach the same layer (lanes.exclusive keeps them apart)."""


def lanes_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Per variant: one step's gradients run one micro-batch after the other, then in lanes."""
    torch.set_num_threads(1)
    state = ParallelState.build(Layout(dp=2, ep=2))
    return {name: _both_ways(options(dp=2, ep=2, global_batch=16, micro_batch=2, **extra), state, full)
            for name, (extra, full) in VARIANTS.items()}  # fmt: skip


def _both_ways(opts: dict[str, Any], state: ParallelState, recompute: bool) -> list[dict[str, Any]]:
    ddp = trainable(opts, state).ddp
    ddp.module.set_recompute("full" if recompute else "none")
    batches = micro_batches(opts, 0, state.dp_rank, state.dp_size)

    def forward(mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return loss_of(opts, ddp(mb[0]), mb[1]) / len(batches)

    def backward(loss: torch.Tensor, last: bool) -> None:
        with contextlib.nullcontext() if last else ddp.no_sync():
            loss.backward()

    runs = []
    for overlap in (False, True):
        ddp.zero_grad()
        before = lanes.hand_overs
        if overlap:
            losses = lanes.overlapped(batches, forward, backward, [0.0, 0.0])
        else:
            losses = []
            for i, mb in enumerate(batches):
                losses.append(forward(mb))
                backward(losses[-1], i == len(batches) - 1)
        ddp.finish_grad_sync()
        grads = {n: p.main_grad.clone() for n, p in ddp.module.named_parameters()}
        turns = lanes.hand_overs - before
        runs.append({"losses": [float(x) for x in losses], "grads": grads, "hand_overs": turns})
    return runs


@pytest.mark.distributed
def test_forwards_beside_backwards_give_the_gradients_of_one_after_the_other() -> None:
    for rank, result in enumerate(run_distributed(lanes_worker, 2)):
        for name, (alone, laned) in result.items():
            assert alone["hand_overs"] == 0, name
            # 4 micro-batches: 3 pairs in lanes, each layer's dispatch and combine a turn or more.
            assert laned["hand_overs"] >= 3 * 2, (name, laned["hand_overs"])
            assert laned["losses"] == alone["losses"], (rank, name)
            assert alone["grads"].keys() == laned["grads"].keys()
            for p, g in alone["grads"].items():
                assert torch.equal(laned["grads"][p], g), (rank, name, p)
