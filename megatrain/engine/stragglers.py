"""Stragglers: each rank's step time split into busy time (its own work) and time waiting in the
step's collectives (gradient sync, pipeline receives), gathered at every log interval; a rank whose
busy time stays above `ratio` x the ranks' median for `intervals` log intervals in a row is named
(an event the runner records on the job, with the rank's host) until it recovers. A slow rank makes
everyone's step slow, but only its own busy time: the others spend the difference waiting for it
(Megatron's straggler detector reports the same per-rank spread)."""

from __future__ import annotations

import socket
import statistics
from typing import Any

import torch
import torch.distributed as dist

from megatrain.engine.sink import RunLog

RATIO = 1.3
INTERVALS = 3


def gather_times(busy_s: float, wait_s: float, device: torch.device | str) -> torch.Tensor | None:
    """(world, 2) every rank's (busy, wait) seconds per step; None in a single process. Collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    mine = torch.tensor([busy_s, wait_s], dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)  # (gloo has no all_gather_into_tensor)
    return torch.stack(out).cpu()


def spread_row(times: torch.Tensor) -> dict[str, Any]:
    """The per-rank spread for a metrics row."""
    busy, wait = times[:, 0], times[:, 1]
    return {
        "rank_busy_time_min_s": float(busy.min()),
        "rank_busy_time_median_s": float(busy.median()),
        "rank_busy_time_max_s": float(busy.max()),
        "slowest_rank": int(busy.argmax()),
        "rank_wait_time_max_s": float(wait.max()),
    }


class StragglerWatch:
    """Which ranks are persistently slow; every rank runs one on the same gathered times."""

    def __init__(self, ratio: float = RATIO, intervals: int = INTERVALS):
        self.ratio, self.intervals = ratio, intervals
        self.slow_for: dict[int, int] = {}
        self.named: set[int] = set()
        self._hosts: list[str] | None = None

    def observe(self, busy: list[float]) -> list[tuple[int, float, float]]:
        """(rank, its busy time / the median, the median) of each rank named by this interval."""
        median = statistics.median(busy)
        out = []
        for rank, b in enumerate(busy):
            slow = median > 0 and b > self.ratio * median
            self.slow_for[rank] = self.slow_for.get(rank, 0) + 1 if slow else 0
            if not slow:
                self.named.discard(rank)  # recovered: named again if it slows down again
            elif self.slow_for[rank] >= self.intervals and rank not in self.named:
                self.named.add(rank)
                out.append((rank, b / median, median))
        return out

    def hosts(self) -> list[str]:
        """Every rank's host (gathered once, when first needed: every rank asks at the same point)."""
        if self._hosts is None:
            names: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(names, socket.gethostname())
            self._hosts = [str(n) for n in names]
        return self._hosts


def report_stragglers(
    watch: StragglerWatch, step_s: float, wait_s: float, device: torch.device | str, log: RunLog, step: int
) -> dict[str, Any]:
    """Gather every rank's busy (step_s - wait_s) and waiting seconds per step of this log interval
    (collective: every rank calls it), name the ranks slow for long enough (an event and a console
    line), and return the spread for the metrics row ({} in a single process)."""
    times = gather_times(max(step_s - wait_s, 0.0), wait_s, device)
    if times is None:
        return {}
    for rank, ratio, median in watch.observe(times[:, 0].tolist()):
        host = watch.hosts()[rank]
        text = (
            f"rank {rank} on {host} is a straggler: its own work per step took {ratio:.2f}x the median "
            f"rank's {median:.3f} s for {watch.intervals} log intervals (the other ranks wait for it)"
        )
        log.events.write({"event": "straggler", "step": step, "rank": rank, "host": host,
                          "ratio": round(ratio, 3), "median_s": median, "reason": text})  # fmt: skip
        log.say(f"step {step} | {text}")
    return spread_row(times)
