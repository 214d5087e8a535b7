"""Point-to-point between pipeline stages: activations forward, their gradients back.

Receives are posted ahead (Megatron's overlap_p2p_comm): once a step's schedule says how many tensors
of each kind the stage takes from each peer (`expect`), the first of each stream is posted at once
and each next one when the one before is taken, so its transfer runs while the stage computes.
Messages between two ranks on one process group match in order, so a receive posted early still
gets the tensor meant for it: every schedule here sends and receives each stream in the same order
(micro-batch order per chunk). Sends are posted and not waited for until the end of the step
(`flush`). On gloo both progress in its transport's own threads; on NCCL on its streams.

Activations and gradients travel on two process groups over the same ranks, so with pp=2 (where
"next" and "previous" are the same rank) their streams cannot cross, on gloo or on NCCL, which
ignores tags. Shapes are known ahead ((micro_batch, T, C), T/tp under sequence parallelism) and
dtypes are the model's, so no shape handshake precedes a transfer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from megatrain.engine.parallel import lanes
from megatrain.engine.parallel.state import ParallelState

Kind = Literal["activation", "grad"]


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
    """One stream of receives (one kind, from one peer) in the order the stage takes them; the next
    is posted as soon as the one before is taken."""

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
        lanes.hand_over()  # with two micro-batches in flight, the other one runs meanwhile
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        if self.p2p.device.type == "cuda":
            torch.cuda.current_stream(self.p2p.device).synchronize()
        self.p2p.times.wait_s += time.perf_counter() - t0
        self._post()  # the next one's transfer overlaps what the stage does with this one
        return buf


class P2P:
    """Sends and receives between the stages of one (tp, cp, dp) pipeline column, by peer rank."""

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
        self.shapes: dict[Kind, tuple[int, ...]] = {"activation": shape, "grad": grad_shape or shape}
        self.groups: dict[Kind, Any] = {"activation": state.pp_group, "grad": state.groups.get("pp_bwd")}
        self.next_rank = self.rank_of_stage((state.pp_rank + 1) % state.pp_size)
        self.prev_rank = self.rank_of_stage((state.pp_rank - 1) % state.pp_size)
        self._pending: list[Any] = []
        self._streams: dict[tuple[Kind, int], _Receives] = {}

    def rank_of_stage(self, stage: int) -> int:
        """The global rank of `stage` in this rank's pipeline column."""
        c = self.state.coords
        return self.state.layout.rank_of(tp=c.tp, cp=c.cp, dp=c.dp, pp=stage)

    def _post(self, ops: list[dist.P2POp]) -> list[Any]:
        return dist.batch_isend_irecv(ops) if ops else []

    def irecv(self, buf: torch.Tensor, peer: int, group: Any) -> list[Any]:
        return self._post([dist.P2POp(dist.irecv, buf, peer, group)])

    def _stream(self, kind: Kind, peer: int) -> _Receives:
        key = (kind, peer)
        if key not in self._streams:
            self._streams[key] = _Receives(self, peer, self.groups[kind], self.shapes[kind])
        return self._streams[key]

    def expect(self, counts: dict[tuple[Kind, int], int]) -> None:
        """This step's receives per (kind, peer rank), counted from its actions; the first of each
        stream is posted now."""
        for key in set(self._streams) | set(counts):
            self._stream(*key).expect(counts.get(key, 0))

    def recv(self, kind: Kind, peer: int) -> torch.Tensor:
        return self._stream(kind, peer).take()

    def send(self, kind: Kind, t: torch.Tensor, peer: int) -> None:
        t = t.detach().contiguous()
        works = self._post([dist.P2POp(dist.isend, t, peer, self.groups[kind])])
        self._pending.append((t, works))  # keep the tensor alive until the send completes

    def flush(self) -> None:
        """Wait for every send posted so far (the end of a step); counted as waiting."""
        t0 = time.perf_counter()
        for _, works in self._pending:
            for w in works:
                w.wait()
        self._pending.clear()
        self.times.wait_s += time.perf_counter() - t0
