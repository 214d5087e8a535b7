"""Fault injection, an operator's switch: `MEGATRAIN_FAULTS` in a worker's environment (which the
engines it starts inherit) makes chosen ranks fail the ways real ones do, to test and measure the
self-healing (the hang watch, retries from checkpoints, the straggler report). Never a tenant's: a
spec carries no environment, and a secret may not be named MEGATRAIN_*.

`kind:key=value,...` entries, `;`-separated:
- `hang:rank=R,at_step=N[,once=PATH]`: rank R stands still after step N (a deadlocked collective);
- `kill:rank=R,at_step=N[,signal=9][,once=PATH]`: rank R dies of that signal after step N;
- `stop:rank=R,at_step=N[,once=PATH]`: rank R stops itself (SIGSTOP: frozen, not dead);
- `slow:rank=R,factor=F[,from_step=N]`: rank R's steps take F times as long (a thermally throttled
  or shared device);
- `corrupt:at_step=N[,once=PATH]`: the runner flips one bit in the largest file of the checkpoint
  saved at step N, once it is complete (bit rot, a torn write that passed): the next resume must
  find it and fall back to the checkpoint before;
- `silence:node=NAME,after_s=S,for_s=D`: from S seconds after a worker or runner process of node
  NAME starts, for D seconds, nothing it sends reaches the control plane (a network partition): no
  node or job heartbeat, no report; what it holds is sent once the silence ends;
- `storage:rate=P[,status=503]`: that fraction of this process's object-store (S3) requests is
  answered with that 5xx before it leaves the process, below boto's own retries, as a struggling
  endpoint answers (every process of the job that has the variable: its ranks, its runner).
`once=PATH`: the fault fires only if PATH does not exist yet, and creates it, so a retry runs through.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "MEGATRAIN_FAULTS"
KINDS = {"hang": {"rank", "at_step", "once"}, "kill": {"rank", "at_step", "signal", "once"},
         "stop": {"rank", "at_step", "once"}, "slow": {"rank", "factor", "from_step"},
         "storage": {"rate", "status"}, "corrupt": {"at_step", "once"},
         "silence": {"node", "after_s", "for_s"}}  # fmt: skip
REQUIRED = {"hang": {"rank", "at_step"}, "kill": {"rank", "at_step"}, "stop": {"rank", "at_step"},
            "slow": {"rank", "factor"}, "storage": {"rate"}, "corrupt": {"at_step"},
            "silence": {"node", "after_s", "for_s"}}  # fmt: skip


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int = -1
    """-1: every rank (a storage fault is the process's)."""
    at_step: int = 0
    factor: float = 1.0
    from_step: int = 1
    signal: int = signal.SIGKILL
    once: str | None = None
    rate: float = 0.0
    status: int = 503
    node: str | None = None
    after_s: float = 0.0
    for_s: float = 0.0


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
                kind, int(fields.get("rank", -1)), int(fields.get("at_step", 0)),
                float(fields.get("factor", 1.0)), int(fields.get("from_step", 1)),
                int(fields.get("signal", signal.SIGKILL)), fields.get("once"),
                float(fields.get("rate", 0.0)), int(fields.get("status", 503)), fields.get("node"),
                float(fields.get("after_s", 0.0)), float(fields.get("for_s", 0.0)),
            )  # fmt: skip
        except ValueError:
            raise ValueError(
                f"{ENV}: {entry!r}: rank, steps, signal and status are integers, the others numbers"
            ) from None
        if fault.kind == "slow" and fault.factor < 1:
            raise ValueError(f"{ENV}: {entry!r}: factor is at least 1")
        if fault.kind == "storage" and not (0 <= fault.rate <= 1 and 500 <= fault.status <= 599):
            raise ValueError(f"{ENV}: {entry!r}: rate is within 0..1 and status a 5xx")
        faults.append(fault)
    return faults


class RankFaults:
    """The faults of one rank, asked at its step boundaries."""

    def __init__(self, faults: list[Fault], rank: int):
        self.rank = rank
        self.faults = [f for f in faults if f.rank == rank and f.kind in ("hang", "kill", "stop", "slow")]

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


STARTED = time.monotonic()
"""When this process started (as near as its first import of this module): `silence` counts from it."""


def silences(node: str, environ: Mapping[str, str] | None = None) -> list[tuple[float, float]]:
    """(from, until) in this process's time.monotonic() of the `silence:` faults of `node`."""
    faults = parse((environ or os.environ).get(ENV, ""))
    return [
        (STARTED + f.after_s, STARTED + f.after_s + f.for_s)
        for f in faults
        if f.kind == "silence" and f.node == node
    ]


def checkpoints_to_corrupt(environ: Mapping[str, str] | None = None) -> dict[int, Fault]:
    """Step → the `corrupt:` fault of the checkpoint saved at that step (the runner's to inject)."""
    return {f.at_step: f for f in parse((environ or os.environ).get(ENV, "")) if f.kind == "corrupt"}


def corrupt_checkpoint(store: Any, fault: Fault | None = None) -> str | None:
    """Flip one bit in the middle of the largest file of a checkpoint folder (`store`: a
    megatrain.storage Store opened on it, file:// or s3://); the file's key, or None when the
    fault fired before (`once`) or the folder is empty."""
    if fault is not None and not _first_time(fault.once):
        return None
    files = [o for o in store.list() if not o.key.endswith("manifest.json")]
    if not files:
        return None
    victim = max(files, key=lambda o: o.size).key
    data = bytearray(store.get_bytes(victim))
    data[len(data) // 2] ^= 0x01
    store.put_bytes(victim, bytes(data))
    return victim


class _Body:
    """The body of an injected answer, as botocore reads one."""

    def __init__(self, data: bytes):
        self.data = data

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self.data


def install_storage_faults(client: Any, environ: Mapping[str, str] | None = None) -> StorageFaults | None:
    """Make a boto3 S3 client fail requests as `storage:` faults say (None when none is set): an
    answer with the fault's 5xx instead of sending the request, which botocore then retries."""
    faults = [f for f in parse((environ or os.environ).get(ENV, "")) if f.kind == "storage"]
    if not faults:
        return None
    injector = StorageFaults(faults[0].rate, faults[0].status)
    client.meta.events.register("before-send.s3", injector.before_send)
    return injector


class StorageFaults:
    def __init__(self, rate: float, status: int):
        self.rate, self.status = rate, status
        self.injected = 0
        self._random = random.Random()

    def before_send(self, request: Any, **_: Any) -> Any:
        if self._random.random() >= self.rate:
            return None  # sent as usual
        from botocore.awsrequest import AWSResponse

        self.injected += 1
        body = b"<Error><Code>ServiceUnavailable</Code><Message>injected (MEGATRAIN_FAULTS)</Message></Error>"
        return AWSResponse(request.url, self.status, {"Content-Type": "application/xml"}, _Body(body))


def _first_time(marker: str | None) -> bool:
    if marker is None:
        return True
    path = Path(marker)
    if path.exists():
        return False
    path.write_text("fired")
    return True
