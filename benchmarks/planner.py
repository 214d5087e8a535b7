"""Layout planner latency, and the gloo-on-localhost link constants the CPU pool uses.

    python benchmarks/planner.py                 # plan latency for several model / pool sizes
    python benchmarks/planner.py --repeat 5      # best of 5 calls each
    python benchmarks/planner.py --gloo          # measure all-reduce latency and bandwidth (2 ranks)

The table: for each model (Llama shapes from 1B to 405B) and pool (8-GPU H100 nodes), the number
of candidate layouts considered, the best-of-N wall time of one `plan()` call, and the chosen layout
with its predicted step time and MFU. The target (issue 16): a 400B-class model on 6,000 GPUs
planned in under a second.

--gloo times `all_reduce` of 4 KiB to 16 MiB between two gloo processes on this host (one thread
each) and fits t = 2·latency + bytes / bandwidth, the two-rank ring formula of megatrain.plan.cost
(latency from the small messages, bandwidth from the large ones):
the figures behind megatrain.plan.cost.CPU_LINKS.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain.plan.planner import plan  # noqa: E402
from megatrain.plan.pool import PoolSpec  # noqa: E402
from megatrain.spec import parse_spec  # noqa: E402

MODELS: dict[str, dict[str, Any]] = {
    "1B": {"num_layers": 16, "hidden_size": 2048, "num_attention_heads": 32, "num_query_groups": 8,
           "ffn_hidden_size": 8192, "seq_length": 4096, "vocab_size": 128256},
    "8B": {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 8,
           "ffn_hidden_size": 14336, "seq_length": 8192, "vocab_size": 128256},
    "70B": {"num_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, "num_query_groups": 8,
            "ffn_hidden_size": 28672, "seq_length": 8192, "vocab_size": 128256},
    "405B": {"num_layers": 126, "hidden_size": 16384, "num_attention_heads": 128, "num_query_groups": 8,
             "ffn_hidden_size": 53248, "seq_length": 8192, "vocab_size": 128256},
}  # fmt: skip
CASES = [("1B", 8, 64), ("8B", 64, 512), ("70B", 512, 1024), ("70B", 2048, 2048), ("405B", 2048, 2048),
         ("405B", 6000, 2000), ("405B", 16384, 2048)]  # fmt: skip
"""(model, GPUs, global batch in sequences)."""


def h100_pool(gpus: int) -> PoolSpec:
    return PoolSpec(
        name="h100",
        accelerator="NVIDIA H100 80GB HBM3",
        device_memory_bytes=80 << 30,
        peak_tflops={"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0},
        devices_per_node=8,
        nodes=-(-gpus // 8),
        intra_node_bandwidth_gbps=450.0,
        inter_node_bandwidth_gbps=50.0,
    )


def plan_latency(repeat: int) -> list[dict[str, Any]]:
    rows = []
    for name, gpus, batch in CASES:
        spec = parse_spec({
            "name": f"llama-{name}",
            "model": {"arch": "llama", **MODELS[name]},
            "data": {"train": [{"dataset": "corpus"}]},
            "training": {"global_batch_size": batch, "micro_batch_size": 1, "precision": "bf16"},
            "resources": {"devices": gpus},
        })  # fmt: skip
        pool = h100_pool(gpus)
        times, result = [], None
        for _ in range(repeat):
            start = time.perf_counter()
            result = plan(spec, pool)
            times.append(time.perf_counter() - start)
        assert result is not None
        d = result.as_dict()
        lay = d["layout"]
        rows.append({
            "model": name, "gpus": gpus, "global_batch": batch, "considered": d["candidates"]["considered"],
            "plan_ms": min(times) * 1e3,
            "layout": f"tp={lay['tp']} pp={lay['pp']} dp={lay['dp']} v={lay['virtual_stages']} "
                      f"mbs={lay['micro_batch_size']} {lay['recompute']}"
                      f"{' sp' if lay['sequence_parallel'] else ''}"
                      f"{' dist-opt' if lay['distributed_optimizer'] else ''}",
            "step_s": d["predicted"]["step_time_s"], "mfu": d["predicted"]["mfu"],
            "gib": d["predicted"]["memory_per_gpu_bytes"] / (1 << 30),
        })  # fmt: skip
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| model | GPUs | global batch | candidates | plan (ms) | chosen layout | step (s) | MFU | GiB/GPU |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['gpus']:,} | {r['global_batch']:,} | {r['considered']:,} | "
              f"{r['plan_ms']:.1f} | {r['layout']} | {r['step_s']:.2f} | {r['mfu']:.1%} | {r['gib']:.1f} |")  # fmt: skip  # noqa: E501


# -- gloo link constants ----------------------------------------------------------------------------

SIZES = [1 << k for k in range(12, 25, 2)]  # 4 KiB .. 16 MiB


def _gloo_rank(rank: int, store_path: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    results = {}
    for size in SIZES:
        t = torch.ones(size // 4)
        for _ in range(3):
            dist.all_reduce(t)
        samples = []
        for _ in range(15):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            samples.append(time.perf_counter() - start)
        results[size] = statistics.median(samples)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def gloo_links() -> dict[str, float]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_gloo_rank, args=(r, os.path.join(tmp, "store"), out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        times = {int(k): v for k, v in json.loads(Path(out).read_text()).items()}
    # Two-rank ring all-reduce: t = 2·latency + bytes / bandwidth. The latency from the small
    # messages (their median), the bandwidth from the slope between the two largest.
    xs = sorted(times)
    a = statistics.median(times[x] for x in xs[:3])
    b = (times[xs[-1]] - times[xs[-2]]) / (xs[-1] - xs[-2])
    print("| bytes | all-reduce (ms) | fit (ms) |")
    print("|---:|---:|---:|")
    for x, y in times.items():
        print(f"| {x:,} | {y * 1e3:.3f} | {(a + b * x) * 1e3:.3f} |")
    links = {"bandwidth_gbps": 1 / b / 1e9, "latency_us": max(a, 0.0) / 2 * 1e6}
    print(f"bandwidth {links['bandwidth_gbps']:.2f} GB/s, latency {links['latency_us']:.0f} us")
    return links


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=3, help="plan() calls per case (the best is shown)")
    parser.add_argument("--gloo", action="store_true", help="measure gloo all-reduce on localhost instead")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    result: Any = gloo_links() if args.gloo else plan_latency(args.repeat)
    if not args.gloo:
        print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
