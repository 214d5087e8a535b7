"""Run a function on N gloo ranks in fresh processes and hand back what each rank returned.

    results = run_distributed(fn, world_size, *args)   # fn(rank, world_size, *args) -> picklable

`fn` must be importable by name (a module-level function): ranks are fresh processes, forked from
a server that has imported torch and the engine once (multiprocessing's forkserver), each running
with the caller's environment of the moment. Rendezvous is a FileStore in a fresh temporary folder,
so concurrent test runs never race for a TCP port. A rank that raises has its traceback re-raised
in the parent; the other ranks (likely blocked in a collective) are terminated.
"""

from __future__ import annotations

import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank raised; the message carries its traceback."""


PRELOAD = ["torch", "torch.distributed.checkpoint", "megatrain.engine.train"]
"""What the fork server imports once, so that a rank starts in a fraction of a second instead of
importing torch and the engine again (~4 s of CPU each: most of a small parallel test's time)."""


def _context() -> Any:
    """Processes forked from a server that holds PRELOAD (one per test process, started on first
    use from a clean environment of its own: each rank applies the caller's, see _rank_main)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    results: Any,
    args: tuple,
    environ: dict[str, str],
) -> None:
    # The caller's environment as it is now (a test's monkeypatched variables), not the fork
    # server's as it was when it started.
    os.environ.clear()
    os.environ.update(environ)
    from megatrain.settings import reset_settings_cache

    reset_settings_cache()
    # Each rank gets one thread: the test machine has few cores and several ranks share them.
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle copies tensors by value; torch's queue pickling would share memory that
        # vanishes when this process exits before the parent reads it.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 — everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Spawn `world_size` gloo ranks running fn(rank, world_size, *args); return their results by rank."""
    ctx = _context()
    results = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="megatrain-dist-")
    store, environ = os.path.join(tmp, "store"), dict(os.environ)
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, world_size, store, results, args, environ))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"ranks {sorted(set(range(world_size)) - set(out))} did not finish "
                        f"within {timeout:.0f} s"
                    ) from None
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in out]
                if dead:
                    raise RankFailed(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}") from None
                continue
            if not ok:
                raise RankFailed(f"rank {rank} failed:\n{payload}")
            out[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)
    return [out[r] for r in range(world_size)]
