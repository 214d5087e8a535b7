"""A rank the kernel's OOM killer ended: it dies of SIGKILL and writes no failure record, so without
this the runner would retry it like any crash, and it would run out of memory again.

The evidence is the OOM kill counter around the attempt: the runner's memory cgroup's `oom_kill`
(cgroup v2 `memory.events`, v1 `memory.oom_control`; both count the cgroup's descendants too, i.e.
the ranks), or, where no cgroup counter can be read, the node's (`/proc/vmstat`). A rank that died
of SIGKILL while that counter rose was the OOM killer's: the runner then writes the failure record
the rank could not (kind out_of_memory, its node and rank), and the attempt ends as a Python-level
out-of-memory error ends it: failed at once, not retried.

Which rank died of what is torchrun's to say (its failure report, read line by line as the engine's
output passes by), or the exit status itself for a single process run without torchrun.
`oom_record` is pure: tests drive it with fabricated counters and exits.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatrain.failures import OUT_OF_MEMORY
from megatrain.progress_files import RankProgress, read_progress

PROC = Path("/proc")
CGROUP_FS = Path("/sys/fs/cgroup")
OOM_KILLER = "oom_killer"
"""The `cause` of a record this module writes (the engine's own records have none)."""
MESSAGE = "killed by the kernel's OOM killer"


@dataclass(frozen=True)
class OomCounts:
    """OOM kills counted so far: None where a counter cannot be read."""

    cgroup: int | None
    """`oom_kill` of this process's memory cgroup (and of every cgroup below it)."""
    node: int | None
    """`oom_kill` of /proc/vmstat: every OOM kill on the node since boot."""


def _field(text: str, key: str) -> int | None:
    """The value of line `key N` in a flat-keyed kernel file (memory.events, vmstat, ...)."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def _read_field(path: Path | None, key: str) -> int | None:
    if path is None:
        return None
    try:
        return _field(path.read_text(), key)
    except OSError:
        return None


def cgroup_counter_file(proc: Path, cgroup_fs: Path) -> Path | None:
    """The file holding this process's memory cgroup's oom_kill count: v2 `memory.events` under the
    unified hierarchy, else v1 `memory.oom_control` under the memory controller; None if neither."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        # "ID:CONTROLLERS:PATH": v2's one line is "0::PATH"; v1 names its controllers.
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "-", "")
        rel = path.lstrip("/")
        if controllers == "":
            for base in (cgroup_fs, cgroup_fs / "unified"):
                found.append(base / rel / "memory.events")
        elif "memory" in controllers.split(","):
            found.append(cgroup_fs / "memory" / rel / "memory.oom_control")
    return next((f for f in found if f.is_file()), None)


def read_oom_counts() -> OomCounts:
    """The OOM kill counters now (PROC and CGROUP_FS say where the kernel's files are)."""
    return OomCounts(
        cgroup=_read_field(cgroup_counter_file(PROC, CGROUP_FS), "oom_kill"),
        node=_read_field(PROC / "vmstat", "oom_kill"),
    )


def oom_evidence(before: OomCounts, after: OomCounts) -> dict[str, Any] | None:
    """Which counter rose between the readings, as data; None when none did. The cgroup's decides
    where it can be read both times (an OOM kill elsewhere on the node is not ours); the node's
    only where it cannot."""
    for counter in ("cgroup", "node"):
        old, new = getattr(before, counter), getattr(after, counter)
        if old is not None and new is not None:
            return {"counter": counter, "before": old, "after": new} if new > old else None
    return None


_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:")
_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)\s*\(pid:")


class RankExits:
    """The ranks torchrun's failure report says a signal ended: its entries read
    `rank      : R (local_rank: L)` then `exitcode  : -N (pid: P)`."""

    def __init__(self) -> None:
        self.signalled: dict[int, int] = {}
        """Global rank → the number of the signal that ended it."""
        self._rank: int | None = None

    def observe(self, line: str) -> None:
        if m := _RANK.match(line):
            self._rank = int(m.group(1))
        elif (m := _EXIT.match(line)) and self._rank is not None:
            code = int(m.group(1))
            if code < 0:
                self.signalled[self._rank] = -code
            self._rank = None


def killed_ranks(rc: int, signalled: Mapping[int, int], launcher: bool) -> list[int | None]:
    """The ranks SIGKILL ended: torchrun's word where it ran (`launcher`), else the exit status of
    the one process (rank 0). [None] when torchrun itself died of SIGKILL, its ranks unknown."""
    kill = int(signal.SIGKILL)
    if not launcher:
        return [0] if rc == -kill else []
    ranks: list[int | None] = sorted(r for r, sig in signalled.items() if sig == kill)
    return ranks or ([None] if rc == -kill else [])


def oom_record(
    before: OomCounts,
    after: OomCounts,
    killed: Sequence[int | None],
    node: str,
    progress: Sequence[RankProgress] = (),
) -> dict[str, Any] | None:
    """The failure record of an attempt whose rank(s) `killed` (by SIGKILL) the OOM killer ended
    on `node`, as the counters `before` and `after` it show; None when they show no OOM kill or no
    rank died of SIGKILL. `progress`: the ranks' progress files (what the rank was doing)."""
    evidence = oom_evidence(before, after)
    if evidence is None or not killed:
        return None
    rank = killed[0]
    last = next((p for p in progress if p.rank == rank), None)
    # An engine that does not say its phase writes progress only from the training loop.
    phase = (last.phase or ("training" if last.step else None)) if last is not None else None
    return {
        "kind": OUT_OF_MEMORY,
        "rank": rank,
        "node": node,
        "phase": phase,
        "step": last.step + 1 if last is not None and phase == "training" else None,
        "exception": "SIGKILL",
        "message": MESSAGE,
        "at": time.time(),
        "cause": OOM_KILLER,
        "evidence": evidence | {"killed_ranks": list(killed)},
    }


class OomWatch:
    """One attempt's OOM evidence: the counters when it started, torchrun's report as it passes by,
    and at a failed end the record the killed rank could not write."""

    def __init__(self, launcher: bool, read: Callable[[], OomCounts] = read_oom_counts):
        self.launcher = launcher
        """Whether the engine runs under torchrun (else one plain process, rank 0)."""
        self.read = read
        self.before = read()
        self.exits = RankExits()

    def observe(self, line: str) -> None:
        self.exits.observe(line)

    def conclude(self, rc: int, out_dir: Path, node: str) -> dict[str, Any] | None:
        """After the engine exited with `rc` != 0: write OUT/failure.rank{R}.json if the OOM killer
        ended a rank (megatrain.failures reads it like the engine's own); the record, or None."""
        killed = killed_ranks(rc, self.exits.signalled, self.launcher)
        record = oom_record(self.before, self.read(), killed, node, read_progress(out_dir))
        if record is not None:
            name = (
                f"failure.rank{record['rank']}.json" if record["rank"] is not None else "failure.rank-.json"
            )
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / name).write_text(json.dumps(record))
        return record
