"""Process-tree helpers for the shard runner and the reconciler (Linux /proc; portable fallbacks)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
# Loaded in the parent: a preexec_fn must not import or dlopen anything after fork.
try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - non-glibc platforms
    _LIBC = None


def pid_alive(pid: int) -> bool:
    """True while `pid` exists on this host and is not a zombie."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        # /proc/PID/stat: "pid (comm) state ..."; comm may hold spaces, so split after the last ')'.
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (children first), read from /proc; [] where /proc is missing."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{name}/stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out: list[int] = []
    frontier = [pid]
    while frontier:
        kids = children.get(frontier.pop(), [])
        out.extend(kids)
        frontier.extend(kids)
    return out


def die_with_parent(parent_pid: int) -> None:
    """preexec_fn: SIGTERM this child when the process (thread) that spawned it dies.

    torchrun answers SIGTERM by terminating its ranks, so `kill -9` of a runner leaves no orphans.
    Use as `functools.partial(die_with_parent, os.getpid())`: a parent that died before prctl took
    effect is caught by the ppid check.
    """
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
        os._exit(1)


def start_engine(parent_pid: int, cpus: set[int] | None) -> None:
    """preexec_fn of an engine: die_with_parent, and run on `cpus` only (with its children: torchrun's
    ranks inherit the mask and size their thread pools by it) when given."""
    die_with_parent(parent_pid)
    if cpus:
        os.sched_setaffinity(0, cpus)


def _signal_all(groups: set[int], pids: set[int], sig: int) -> None:
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def terminate_tree(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM (and SIGCONT) the process group of `proc` and of each descendant; SIGKILL what is left
    after grace_s.

    torchrun starts every rank in a session of its own, so killing torchrun's group alone would
    orphan the ranks: the tree is snapshotted first, while the ranks still hang below torchrun.
    """
    pids = set(descendants(proc.pid))
    groups = {proc.pid}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            groups.add(os.getpgid(pid))
    _signal_all(groups, pids, signal.SIGTERM)
    # A stopped process (SIGSTOP, a debugger's) acts on SIGTERM only once continued; without this a
    # frozen rank would sit out the whole grace and die of SIGKILL, its last words unsaid.
    _signal_all(groups, pids, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not any(pid_alive(p) for p in pids):
            break
        time.sleep(0.05)
    pids |= set(descendants(proc.pid)) if proc.poll() is None else set()
    _signal_all(groups, pids, signal.SIGKILL)
    proc.wait()
