"""Sharded checkpoint speed and memory: save and load GB/s against torch.save / torch.load of the same
tensors, on 1 and 2 ranks, and the training stall of an async save against a sync one.

    python benchmarks/checkpoint.py                        # 0.5B parameters, 1 and 2 ranks
    python benchmarks/checkpoint.py --params 1e9 --ranks 1 # needs ~30 GB of host memory (state + copy)

Each rank holds its share of a mixed-precision training state, as the engine's distributed optimizer
keeps it: bf16 weights (2 bytes/param), fp32 main weights and two Adam moments (12 bytes/param), as
boxes of 2-D tensors shaped like transformer layers. Per rank, in this order:
  1. torch.save of the rank's tensors (one dict, one file) + fsync: the baseline.
  2. A sync sharded save (megatrain.engine.checkpoint.save_state, collective over the ranks): raw
     bytes, crc32 per box, sha256 per file, fsync, manifest last.
  3. An async save: the stall is the staging copy into reused host buffers (what the training loop
     waits for); the write then runs in a thread. Peak RSS during it is reported against the state.
  4. torch.load(weights_only=True) of the baseline file, and a sharded load into the live tensors.
Page caches are dropped before each load where this user may (root), else loads read from memory.
The figures print as a table; BENCHMARKS.md records them with this command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain.engine.checkpoint import open_folder, save_state  # noqa: E402
from megatrain.engine.checkpoint.sharded import load_state  # noqa: E402
from megatrain.engine.checkpoint.shards import Box, Entry, State  # noqa: E402
from megatrain.engine.checkpoint.training import Staging  # noqa: E402
from megatrain.spec import parse_spec  # noqa: E402

HIDDEN = 4096
SPEC = parse_spec({"name": "bench", "data": {"train": [{"path": "file:///dev/null.jsonl"}]}})


def _rss_peak_reset() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return True
    except OSError:
        return False


def make_state(params: int, rank: int) -> tuple[State, dict[str, torch.Tensor]]:
    """This rank's state: rows of HIDDEN-wide layer tensors, each as model/ (bf16) + optim/ (fp32 ×3)."""
    rows_total = max(1, params // HIDDEN)
    chunk = 8192  # rows per tensor: 32M parameters each
    state: State = {}
    flat: dict[str, torch.Tensor] = {}
    kinds = (("model", torch.bfloat16), ("optim/param", torch.float32), ("optim/exp_avg", torch.float32),
             ("optim/exp_avg_sq", torch.float32))  # fmt: skip
    for i, start in enumerate(range(0, rows_total, chunk)):
        rows = min(chunk, rows_total - start)
        for kind, dtype in kinds:
            t = torch.empty(rows, HIDDEN, dtype=dtype).uniform_()
            name = f"{kind}/layer{i}.rank{rank}.weight"  # each rank its own tensors: dp-sharded state
            state[name] = Entry((rows, HIDDEN), [Box((0, 0), t)])
            flat[name] = t
    return state, flat


def _timed(fn: Any, world: int) -> float:
    if world > 1:
        dist.barrier()
    began = time.perf_counter()
    fn()
    if world > 1:
        dist.barrier()
    return time.perf_counter() - began


def _rank(rank: int, world: int, store_path: str, params: int, root: str, rounds: int, out: Any) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if world > 1:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    state, flat = make_state(params // world, rank)
    nbytes = sum(t.numel() * t.element_size() for t in flat.values())
    base = Path(root)
    row: dict[str, Any] = {"ranks": world, "bytes_per_rank": nbytes}

    def torch_save() -> None:
        path = base / f"torch_{rank}.pt"
        torch.save(flat, path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())

    url = (base / "ckpt").as_uri()
    # Alternate the two, several rounds, and keep medians: this disk's speed drifts a lot.
    torch_times, sync_times = [], []
    for _ in range(rounds):
        torch_times.append(_timed(torch_save, world))
        _rss_peak_reset()
        sync_times.append(_timed(lambda: save_state(url, 1, state, {"consumed_samples": 0}, SPEC), world))
        row["sync_peak_rss_x_state"] = _status("VmHWM") / nbytes  # the state itself is 1.0
    row["torch_save_s"], row["sync_save_s"] = statistics.median(torch_times), statistics.median(sync_times)

    staging = Staging()
    staging.stage(state)  # first use allocates the buffers (a one-time cost, as in training)
    _rss_peak_reset()
    began = time.perf_counter()
    staged = staging.stage(state)
    row["async_stall_s"] = time.perf_counter() - began
    row["async_write_s"] = _timed(lambda: save_state(url, 2, staged, {"consumed_samples": 0}, SPEC), world)
    row["async_peak_rss_x_state"] = _status("VmHWM") / nbytes  # state + one staging copy is 2.0
    del staging

    row["cold_cache"] = _drop_caches() if rank == 0 else None
    if world > 1:
        dist.barrier()
    row["torch_load_s"] = _timed(lambda: torch.load(base / f"torch_{rank}.pt", weights_only=True), world)
    if rank == 0:
        _drop_caches()
    folder = open_folder(base / "ckpt" / "iter_0000001")
    row["sharded_load_s"] = _timed(lambda: load_state(folder, state), world)
    if world > 1:
        dist.destroy_process_group()
    out.put((rank, row))


def run(params: int, world: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="megatrain-bench-ckpt-", dir=os.environ.get("BENCH_DIR")) as tmp:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [
            ctx.Process(target=_rank, args=(r, world, f"{tmp}/store", params, tmp, rounds, q))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        rows = dict(q.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join()
    # A collective phase ends when the slowest rank does: every rank's times are the same barrier
    # to barrier; bytes add up over ranks.
    r0 = rows[0]
    total = sum(r["bytes_per_rank"] for r in rows.values())
    gb = total / 1e9
    return {
        "ranks": world,
        "state_GB": gb,
        "torch_save_GBps": gb / r0["torch_save_s"],
        "sync_save_GBps": gb / r0["sync_save_s"],
        "save_vs_torch": r0["torch_save_s"] / r0["sync_save_s"],
        "torch_load_GBps": gb / r0["torch_load_s"],
        "load_GBps": gb / r0["sharded_load_s"],
        "load_vs_torch": r0["torch_load_s"] / r0["sharded_load_s"],
        "async_stall_s": r0["async_stall_s"],
        "sync_save_s": r0["sync_save_s"],
        "stall_vs_sync": r0["async_stall_s"] / r0["sync_save_s"],
        "async_write_s": r0["async_write_s"],
        "sync_peak_rss_x_state": max(r["sync_peak_rss_x_state"] for r in rows.values()),
        "async_peak_rss_x_state": max(r["async_peak_rss_x_state"] for r in rows.values()),
        "cold_cache": r0["cold_cache"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=float, default=5e8, help="parameters over all ranks")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3, help="torch.save / sync save alternations")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = [run(int(args.params), w, args.rounds) for w in args.ranks]
    if args.json:
        print(json.dumps(results, indent=1))
        return
    cols = ["ranks", "state_GB", "torch_save_GBps", "sync_save_GBps", "save_vs_torch", "torch_load_GBps",
            "load_GBps", "load_vs_torch", "async_stall_s", "sync_save_s", "stall_vs_sync",
            "sync_peak_rss_x_state", "async_peak_rss_x_state", "cold_cache"]  # fmt: skip
    print(" | ".join(cols))
    for r in results:
        print(" | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols))


if __name__ == "__main__":
    main()
