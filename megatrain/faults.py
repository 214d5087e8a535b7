"""Fault injection, an operator's switch: `MEGATRAIN_FAULTS` in a worker's environment (which the
engines it starts inherit) makes chosen ranks fail the ways real ones do, to test and measure the
self-healing (the hang watch, retries from checkpoints, the straggler report). Never a tenant's: a
spec carries no environment, and a secret may not be named MEGATRAIN_*.

`kind:key=value,...` entries, `;`-separated:
- `hang:rank=R,at_step=N[,once=PATH]`: rank R stands still after step N (a deadlocked collective);
- `kill:rank=R,at_step=N[,signal=9][,once=PATH]`: rank R dies of that signal after step N;
- `stop:rank=R,at_step=N[,once=PATH]`: rank R stops itself (SIGSTOP: frozen, not dead);
- `slow:rank=R,factor=F[,from_step=N]`: rank R's steps take F times as long (a thermally throttled
  or shared device).
`once=PATH`: the fault fires only if PATH does not exist yet, and creates it, so a retry runs through.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "MEGATRAIN_FAULTS"
KINDS = {"hang": {"rank", "at_step", "once"}, "kill": {"rank", "at_step", "signal", "once"},
         "stop": {"rank", "at_step", "once"}, "slow": {"rank", "factor", "from_step"}}  # fmt: skip
REQUIRED = {"hang": {"rank", "at_step"}, "kill": {"rank", "at_step"}, "stop": {"rank", "at_step"},
            "slow": {"rank", "factor"}}  # fmt: skip


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    at_step: int = 0
    factor: float = 1.0
    from_step: int = 1
    signal: int = signal.SIGKILL
    once: str | None = None


def parse(text: str) -> list[Fault]:
    """The faults `text` lists; ValueError naming the entry and what is wrong with it."""
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        kind, _, args = entry.partition(":")
        if kind not in KINDS:
            raise ValueError(f"{ENV}: {entry!r}: unknown fault {kind!r} (one of {', '.join(KINDS)})")
        fields: dict[str, str] = {}
        for pair in filter(None, (p.strip() for p in args.split(","))):
            key, eq, value = pair.partition("=")
            if not eq or key not in KINDS[kind]:
                raise ValueError(f"{ENV}: {entry!r}: {kind} takes {', '.join(sorted(KINDS[kind]))}")
            fields[key] = value
        missing = REQUIRED[kind] - set(fields)
        if missing:
            raise ValueError(f"{ENV}: {entry!r}: {kind} needs {', '.join(sorted(missing))}")
        try:
            fault = Fault(
                kind, int(fields["rank"]), int(fields.get("at_step", 0)), float(fields.get("factor", 1.0)),
                int(fields.get("from_step", 1)), int(fields.get("signal", signal.SIGKILL)),
                fields.get("once"),
            )  # fmt: skip
        except ValueError:
            raise ValueError(
                f"{ENV}: {entry!r}: rank, steps and signal are integers, factor a number"
            ) from None
        if fault.kind == "slow" and fault.factor < 1:
            raise ValueError(f"{ENV}: {entry!r}: factor is at least 1")
        faults.append(fault)
    return faults


class RankFaults:
    """The faults of one rank, asked at its step boundaries."""

    def __init__(self, faults: list[Fault], rank: int):
        self.rank = rank
        self.faults = [f for f in faults if f.rank == rank]

    @classmethod
    def from_env(cls, rank: int) -> RankFaults:
        return cls(parse(os.environ.get(ENV, "")), rank)

    def __bool__(self) -> bool:
        return bool(self.faults)

    def stretch(self, step: int, step_s: float) -> None:
        """Inside a step's time: a slowed rank's step takes `factor` times its `step_s`."""
        for f in self.faults:
            if f.kind == "slow" and step >= f.from_step:
                time.sleep((f.factor - 1.0) * step_s)

    def after_step(self, step: int) -> None:
        """After step `step` (and its checkpoint): hang, die or stop where a fault says so."""
        for f in self.faults:
            if f.kind == "slow" or f.at_step != step or not _first_time(f.once):
                continue
            print(f"rank {self.rank}: injected fault {f.kind} after step {step} ({ENV})", flush=True)
            if f.kind == "hang":
                while True:
                    time.sleep(1)
            os.kill(os.getpid(), f.signal if f.kind == "kill" else signal.SIGSTOP)


def _first_time(marker: str | None) -> bool:
    if marker is None:
        return True
    path = Path(marker)
    if path.exists():
        return False
    path.write_text("fired")
    return True
