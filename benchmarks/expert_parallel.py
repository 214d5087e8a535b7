"""An MoE layer's forward + backward under expert parallelism, on gloo CPU ranks next to one process.

    python benchmarks/expert_parallel.py                     # ep 1, 2, 4; hidden 256, 8 experts, top-2
    python benchmarks/expert_parallel.py --ep 1 2 --tokens 1024 --steps 3
    python benchmarks/expert_parallel.py --ep 1 2 --overlap 2 4         # the exchange hidden in chunks
    python benchmarks/expert_parallel.py --ep 4 --nodes 1 2 4           # two hops, once per node
    python benchmarks/expert_parallel.py --ep 2 4 --lanes 4             # 4 micro-batches in lanes
    python benchmarks/expert_parallel.py --ep 2 --overlap 2 --lanes 4 --wire-gbs 0.4  # a slower wire

Every rank (one thread each) runs one MoELayer (the engine's router, GroupedExperts on the CPU
grouped_mlp kernel) on its own `--tokens` tokens per step: ep=1 is one process with all E experts;
ep=P is P ranks (Layout(dp=P, ep=P)) each holding E/P experts behind the AllToAllDispatcher. Expert
work per rank is the same at every ep (each rank computes ~tokens·k routed rows, now from all ranks),
so the time difference is the price of the exchange. Per ep it prints: the step time (the slowest
rank's median), the all-to-all bytes each rank sends per step (measured: rows that leave the rank in
dispatch and combine, forward and backward, × hidden × 4 bytes; next to the analytical figure for
uniform routing, 4·tokens·k·(P-1)/P rows) and the expert weight bytes each rank holds.

With `--overlap K`, every ep > 1 also runs with the exchange pipelined behind the experts in K token
chunks (parallelism.moe_overlap_chunks; engine.parallel.expert_overlap), next to the parts it
overlaps: the experts' compute alone (every rank at once running a layer of E/ep experts with no
exchange, the GEMM shapes an ep rank's experts get) and the exchange alone (four all-to-alls per
step, dispatch and combine forward and backward, of the uniform-routing volume, timed on the same
ranks with nothing else running). Overlap works when the step falls from about their sum toward
the larger of the two.

With `--nodes R`, every ep divisible by R also runs the two-hop dispatch (parallelism.moe_dispatch
nodes; engine.parallel.expert_dedup) with its ranks taken as nodes of R: a token goes once to each
node holding one of its experts, then once to each rank there (with `--overlap K` also with the
hop across nodes pipelined in K chunks). Its rows show the bytes sent and the part of them that
crossed nodes.

With `--lanes M`, every ep > 1 also runs the step as M micro-batches of tokens/M, one after the
other and then in lanes (parallelism.moe_overlap_microbatches; engine.parallel.lanes: micro-batch
m's forward beside m-1's backward, each one's all-to-alls on the wire while the other computes).
The overlap works when the lanes' step falls below the one-after-the-other step toward the larger
of compute and exchange.

With `--wire-gbs G` every all-to-all (the engine's and the exchange timed alone) completes no sooner
than its bytes at G GB/s after it is posted, the CPU free meanwhile: an emulated slower wire, as a
GPU's NICs are to its compute, where on this machine's loopback gloo the exchange is a few per cent
of a step and there is little for any overlap to hide.

Every row also says what the layer's forward leaves held for backward beyond its output (live
tensor bytes, one untimed step under engine.memtrack); with `--recompute` every step runs inside a
non-reentrant checkpoint, as training.recompute full runs a layer, so that figure is what recompute
keeps (the input, and the chunks' row indices).

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
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain.engine.config import MoEConfig, TransformerConfig  # noqa: E402
from megatrain.engine.memtrack import LiveTensorBytes, tensors_of  # noqa: E402
from megatrain.engine.models.moe import MoELayer  # noqa: E402
from megatrain.engine.parallel import lanes  # noqa: E402
from megatrain.engine.parallel.expert import AllToAllDispatcher, parallelize_experts  # noqa: E402
from megatrain.engine.parallel.expert_dedup import NodeDispatcher, dedup_experts  # noqa: E402
from megatrain.engine.parallel.expert_overlap import overlap_experts  # noqa: E402
from megatrain.engine.parallel.state import ParallelState  # noqa: E402
from megatrain.plan.layout import Layout  # noqa: E402


def layer_config(args: argparse.Namespace, experts: int | None = None) -> TransformerConfig:
    e = experts or args.experts
    moe = MoEConfig(num_experts=e, router_topk=args.topk, ffn_hidden_size=args.ffn, aux_loss_coeff=1e-2)
    return TransformerConfig.preset("tiny-llama", hidden_size=args.hidden, moe=moe)


class _Late:
    """An all-to-all's work that completes no sooner than `due` (time.perf_counter)."""

    def __init__(self, work: Any, due: float):
        self.work, self.due = work, due

    def wait(self) -> bool:
        self.work.wait()
        time.sleep(max(0.0, self.due - time.perf_counter()))
        return True


def slow_wire(bytes_per_s: float) -> None:
    """Every dist.all_to_all_single from now on completes its input's bytes at `bytes_per_s` after
    it is posted, at the soonest."""
    real = dist.all_to_all_single

    def posted(out: torch.Tensor, x: torch.Tensor, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        due = time.perf_counter() + x.numel() * x.element_size() / bytes_per_s
        late = _Late(real(out, x, *args, async_op=True, **kwargs), due)
        if async_op:
            return late
        late.wait()
        return None

    dist.all_to_all_single = posted  # type: ignore[assignment]


def measure(rank: int, ep: int, args: argparse.Namespace) -> dict[str, Any]:
    """One rank's timings and volumes for each chunk count (ep=1: the single process)."""
    torch.set_num_threads(1)
    if args.wire_gbs:
        slow_wire(args.wire_gbs * 1e9)
    state = ParallelState.build(Layout(dp=ep, ep=ep)) if ep > 1 else ParallelState.single()
    out: dict[Any, Any] = {}
    for variant in variants(ep, args):
        out[variant] = measure_layer(rank, ep, state, variant, args)
    if ep > 1:
        out["exchange_s"] = measure_exchange(ep, state, args)
        out["compute_s"] = measure_layer(rank, ep, state, 1, args, local=True)["time_s"]
    return out


def measure_exchange(ep: int, state: ParallelState, args: argparse.Namespace) -> float:
    """The four all-to-alls of a step on their own, at the uniform-routing volume (median)."""
    rows = args.tokens * args.topk // ep  # to each rank, this one included
    x = torch.randn(rows * ep, args.hidden)
    out = torch.empty_like(x)
    splits = [rows] * ep
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        began = time.perf_counter()
        for _ in range(4):
            dist.all_to_all_single(out, x, splits, splits, group=state.ep_group)
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def variants(ep: int, args: argparse.Namespace) -> list[int | str]:
    """What runs at this ep: chunk counts of the pairs dispatch, and "nodes{R}x{K}" (two hops, R ep
    ranks to a node, the others on other nodes as far as the dispatch knows; the hop across nodes
    in K chunks, where there are several nodes)."""
    if ep == 1:
        return [1]
    nodes = [r for r in args.nodes if ep % r == 0]
    two_hops = [f"nodes{r}x{k}" for r in nodes for k in (1, *args.overlap) if k == 1 or r < ep]
    microbatches = [f"{how}{m}" for m in args.lanes for how in ("mb", "lanes")]
    return [1, *args.overlap, *two_hops, *microbatches]


def _microbatches(variant: int | str) -> tuple[int, bool] | None:
    """ "mb{M}" -> (M, False), "lanes{M}" -> (M, True); None for the other variants."""
    if isinstance(variant, str) and not variant.startswith("nodes"):
        laned = variant.startswith("lanes")
        return int(variant.removeprefix("lanes" if laned else "mb")), laned
    return None


def _two_hops(variant: str) -> tuple[int, int]:
    """ "nodes{R}x{K}" -> (R ep ranks to a node, K chunks)."""
    r, k = variant.removeprefix("nodes").split("x")
    return int(r), int(k)


def measure_layer(
    rank: int,
    ep: int,
    state: ParallelState,
    variant: int | str,
    args: argparse.Namespace,
    local: bool = False,
) -> dict[str, Any]:
    """The layer's forward + backward (median step over the ranks' barriers). local: the compute
    alone, every rank at once (the same contention): a layer of E/ep experts with no exchange, whose
    GEMMs have the shapes an ep rank's experts get (tokens·k rows over E/ep experts)."""
    torch.manual_seed(args.seed)
    if local:
        layer: Any = MoELayer(layer_config(args, args.experts // ep))
    else:
        layer = MoELayer(layer_config(args))  # the full layer on every rank, as build_model does
        parallelize_experts(layer, state)
        if isinstance(variant, str) and variant.startswith("nodes"):
            dedup_experts(layer, state, *_two_hops(variant))
        elif isinstance(variant, int):
            overlap_experts(layer, variant)
    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    x = torch.randn(1, args.tokens, args.hidden, generator=g, requires_grad=True)
    upstream = torch.randn(x.shape, generator=g)

    def run(t: torch.Tensor) -> torch.Tensor:
        return checkpoint(layer, t, use_reentrant=False) if args.recompute else layer(t)

    split = _microbatches(variant)
    m, laned = split or (1, False)
    pieces = list(zip(x.chunk(m, dim=1), upstream.chunk(m, dim=1), strict=True))

    def forward(piece: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return (run(piece[0]) * piece[1]).sum()  # its backward is y.backward(upstream)

    def step_once() -> None:
        if laned:
            lanes.overlapped(pieces, forward, lambda loss, last: loss.backward(), [0.0, 0.0])
        else:
            for piece in pieces:
                forward(piece).backward()

    times, sent, off_node = [], [], []
    for step in range(args.warmup + args.steps):
        if ep > 1:
            dist.barrier()
        began = time.perf_counter()
        step_once()
        if ep > 1:
            dist.barrier()  # the step ends when the slowest rank is done
        elapsed = time.perf_counter() - began
        if step >= args.warmup:
            times.append(elapsed)
            d, row_bytes = layer.dispatcher, args.hidden * x.element_size()
            if isinstance(d, NodeDispatcher):  # combine sends back as many as dispatch sent, on average
                sent.append(4 * d.rows_sent * row_bytes)
                off_node.append(4 * d.rows_sent_off_node * row_bytes)
            else:
                rows = d.rows_sent + d.rows_received if isinstance(d, AllToAllDispatcher) else 0
                # dispatch sends rows_sent, combine sends back rows_received; backward the reverse
                # (the last micro-batch's, times m).
                sent.append(2 * rows * row_bytes * m)
        layer.zero_grad(set_to_none=True)
        x.grad = None
    with LiveTensorBytes(tensors_of(layer, x, upstream)) as live:
        y = run(x)
        time.sleep(0.05)  # gloo's worker thread lets go of an exchange's buffers a little after wait()
        held = live.current - y.untyped_storage().nbytes()
        y.backward(upstream)
    expert_bytes = sum(p.numel() * p.element_size() for p in layer.experts.parameters())
    return {
        "held": held,
        "time_s": statistics.median(times),
        "sent": statistics.mean(sent),
        "off_node": statistics.mean(off_node) if off_node else None,
        "expert_bytes": expert_bytes,
    }


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
    parser.add_argument(
        "--overlap", type=int, nargs="*", default=[], help="moe_overlap_chunks to run beside 1 (ep > 1)"
    )
    parser.add_argument(
        "--nodes", type=int, nargs="*", default=[], help="moe_dispatch nodes with R ep ranks to a node"
    )
    parser.add_argument(
        "--lanes", type=int, nargs="*", default=[], help="micro-batches per step, in turn and in lanes"
    )
    parser.add_argument("--wire-gbs", type=float, default=0.0, help="emulated all-to-all bandwidth (GB/s)")
    parser.add_argument("--recompute", action="store_true", help="each layer inside a checkpoint")
    args = parser.parse_args()

    print(
        f"MoE layer: hidden {args.hidden}, {args.experts} experts of width {args.ffn} (SwiGLU), "
        f"top-{args.topk}, {args.tokens} tokens per rank; fp32, one thread per rank, "
        f"{os.cpu_count()} cores, torch {torch.__version__}{'; recomputed' if args.recompute else ''}"
        f"{f'; all-to-alls at {args.wire_gbs:g} GB/s at most (emulated wire)' if args.wire_gbs else ''}"
    )
    print(
        "| ep | experts per rank | dispatch | step (s) | all-to-all sent per rank per step (MiB) "
        "| of it across nodes (MiB) | uniform-routing figure, pairs (MiB) | expert weights per rank (MiB) "
        "| held for backward (MiB) |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    mib = 1 / 2**20
    overlap_rows = []
    for ep in args.ep:
        ranks = run_ep(ep, args)
        for variant in variants(ep, args):
            step = max(r[variant]["time_s"] for r in ranks)
            sent = statistics.mean(r[variant]["sent"] for r in ranks)
            analytic = 4 * args.tokens * args.topk * (ep - 1) / ep * args.hidden * 4
            held = f"{max(r[variant]['held'] for r in ranks) * mib:.2f}"
            split = _microbatches(variant)
            if split is not None:
                how = "in lanes" if split[1] else "one after the other"
                label, off, held = f"pairs, {split[0]} micro-batches {how}", "-", "-"
            elif isinstance(variant, str):
                per_node, chunks = _two_hops(variant)
                label = f"two hops, {per_node} ranks to a node" + (f", {chunks} chunks" if chunks > 1 else "")
                off = f"{statistics.mean(r[variant]['off_node'] for r in ranks) * mib:.2f}"
            else:
                label, off = (f"pairs, {variant} chunks" if variant > 1 else "pairs"), "-"
            print(
                f"| {ep} | {args.experts // ep} | {label} | {step:.3f} | {sent * mib:.2f} | {off} | "
                f"{analytic * mib:.2f} | {ranks[0][variant]['expert_bytes'] * mib:.2f} | {held} |"
            )
            if (ep > 1 and not isinstance(variant, str)) or (split is not None and split[1]):
                parts = (max(r["compute_s"] for r in ranks), max(r["exchange_s"] for r in ranks))
                overlap_rows.append((ep, variant, step, *parts))
    if not args.overlap and not args.lanes:
        return
    print(
        "\nThe step against its parts, each timed alone on the same ranks (compute: E/ep experts "
        "with no exchange; exchange: the four all-to-alls):\n"
    )
    print("| ep | overlap | step (s) | compute (s) | exchange (s) | compute + exchange | max of the two |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for ep, variant, step, compute, exchange in overlap_rows:
        split = _microbatches(variant)
        how = f"{split[0]} micro-batches in lanes" if split else f"{variant} chunks"
        print(
            f"| {ep} | {how} | {step:.3f} | {compute:.3f} | {exchange:.3f} | {compute + exchange:.3f} | "
            f"{max(compute, exchange):.3f} |"
        )


if __name__ == "__main__":
    main()
