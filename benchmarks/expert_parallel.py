"""An MoE layer's forward + backward under expert parallelism, on gloo CPU ranks next to one process.

    python benchmarks/expert_parallel.py                     # ep 1, 2, 4; hidden 256, 8 experts, top-2
    python benchmarks/expert_parallel.py --ep 1 2 --tokens 1024 --steps 3

Every rank (one thread each) runs one MoELayer (the engine's router, GroupedExperts on the CPU
grouped_mlp kernel) on its own `--tokens` tokens per step: ep=1 is one process with all E experts;
ep=P is P ranks (Layout(dp=P, ep=P)) each holding E/P experts behind the AllToAllDispatcher. Expert
work per rank is the same at every ep (each rank computes ~tokens·k routed rows, now from all ranks),
so the time difference is the price of the exchange. Per ep it prints: the step time (the slowest
rank's median), the all-to-all bytes each rank sends per step (measured: rows that leave the rank in
dispatch and combine, forward and backward, × hidden × 4 bytes; next to the analytical figure for
uniform routing, 4·tokens·k·(P-1)/P rows) and the expert weight bytes each rank holds.

Ranks beyond the machine's cores time-share: on a 2-core machine ep=4 runs four ranks on two cores,
so its step time reads about twice what four cores would give. The table says how many cores there
were.
"""

from __future__ import annotations

import argparse
import os
import pickle
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

from megatrain.engine.config import MoEConfig, TransformerConfig  # noqa: E402
from megatrain.engine.models.moe import MoELayer  # noqa: E402
from megatrain.engine.parallel.expert import AllToAllDispatcher, parallelize_experts  # noqa: E402
from megatrain.engine.parallel.state import ParallelState  # noqa: E402
from megatrain.plan.layout import Layout  # noqa: E402


def layer_config(args: argparse.Namespace) -> TransformerConfig:
    moe = MoEConfig(
        num_experts=args.experts, router_topk=args.topk, ffn_hidden_size=args.ffn, aux_loss_coeff=1e-2
    )
    return TransformerConfig.preset("tiny-llama", hidden_size=args.hidden, moe=moe)


def measure(rank: int, ep: int, args: argparse.Namespace) -> dict[str, Any]:
    """One rank's timings and volumes (ep=1: the single process)."""
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    layer: Any = MoELayer(layer_config(args))  # the full layer on every rank, as build_model does
    state = ParallelState.build(Layout(dp=ep, ep=ep)) if ep > 1 else ParallelState.single()
    parallelize_experts(layer, state)
    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    x = torch.randn(1, args.tokens, args.hidden, generator=g, requires_grad=True)
    upstream = torch.randn(x.shape, generator=g)
    times, sent = [], []
    for step in range(args.warmup + args.steps):
        if ep > 1:
            dist.barrier()
        began = time.perf_counter()
        layer(x).backward(upstream)
        if ep > 1:
            dist.barrier()  # the step ends when the slowest rank is done
        elapsed = time.perf_counter() - began
        if step >= args.warmup:
            times.append(elapsed)
            d = layer.dispatcher
            rows = d.rows_sent + d.rows_received if isinstance(d, AllToAllDispatcher) else 0
            # dispatch sends rows_sent, combine sends back rows_received; backward does the reverse.
            sent.append(2 * rows * args.hidden * x.element_size())
        layer.zero_grad(set_to_none=True)
        x.grad = None
    expert_bytes = sum(p.numel() * p.element_size() for p in layer.experts.parameters())
    return {"time_s": statistics.median(times), "sent": statistics.mean(sent), "expert_bytes": expert_bytes}


def _rank_main(rank: int, ep: int, args: argparse.Namespace, store_path: str, out: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, ep), rank=rank, world_size=ep)
    try:
        out.put((rank, pickle.dumps(measure(rank, ep, args))))
    finally:
        dist.destroy_process_group()


def run_ep(ep: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    if ep == 1:
        return [measure(0, 1, args)]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="megatrain-ep-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(r, ep, args, store, out)) for r in range(ep)]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=600) for _ in range(ep))
        for p in procs:
            p.join()
    return [pickle.loads(results[r]) for r in range(ep)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512, help="each expert's MLP width")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank per step")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    print(
        f"MoE layer: hidden {args.hidden}, {args.experts} experts of width {args.ffn} (SwiGLU), "
        f"top-{args.topk}, {args.tokens} tokens per rank; fp32, one thread per rank, "
        f"{os.cpu_count()} cores, torch {torch.__version__}"
    )
    print(
        "| ep | experts per rank | step (s) | all-to-all sent per rank per step (MiB) "
        "| uniform-routing figure (MiB) | expert weights per rank (MiB) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    mib = 1 / 2**20
    for ep in args.ep:
        ranks = run_ep(ep, args)
        step = max(r["time_s"] for r in ranks)
        sent = statistics.mean(r["sent"] for r in ranks)
        analytic = 4 * args.tokens * args.topk * (ep - 1) / ep * args.hidden * 4
        print(
            f"| {ep} | {args.experts // ep} | {step:.3f} | {sent * mib:.2f} | {analytic * mib:.2f} | "
            f"{ranks[0]['expert_bytes'] * mib:.2f} |"
        )


if __name__ == "__main__":
    main()
