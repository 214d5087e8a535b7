"""Context parallelism on gloo CPU ranks: ring attention's time and activation memory per rank
against one process holding the whole sequence, and the block work load balancing skips.

    python benchmarks/context_parallel.py                       # seq 1024 2048 4096, cp 2 and 4
    python benchmarks/context_parallel.py --seq 512 1024 --cp 2 --repeats 2
    torchrun --nproc-per-node 2 benchmarks/context_parallel.py --seq 8192 16384 \
        --heads 32 --groups 8 --head-dim 128 --dtype bf16     # cp = the ranks (NCCL on GPUs)

Attention table: per sequence length T, one process runs causal attention over (B, H, T, hd)
forward + backward with the registry's `attention` kernel (SDPA, on CPU torch's tiled flash kernel);
then cp ranks (one thread each) run ring attention over their T/cp tokens, whose blocks run the
`attention_block` kernel (on CPU the same flash kernel, returning the lse). Time: median over
repeats of the slowest rank. Peak bytes: LiveTensorBytes (every tensor ops return during forward +
backward, the inputs excluded), the largest over the ranks.

Model table: the peak activation bytes per rank of a whole Llama-flavour GPTModel step (forward,
loss, backward; parameters and gradients excluded) at cp = 1, 2, 4: the reason cp exists, target
~1/cp.

Skipped blocks: under load balancing each rank computes 3 chunk × chunk blocks at step 0 (two
causal diagonals, one full) and 2 at each later step, out of the 4·cp pairs it would compute passing
the whole K/V around; computed here from the ring's own plan and checked against the formula.

Ranks beyond the machine's cores time-share (cp=4 on 2 cores runs at half speed), so ring times read
high there; the table says how many cores there were.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain import kernels  # noqa: E402
from megatrain.engine.config import TransformerConfig  # noqa: E402
from megatrain.engine.memtrack import LiveTensorBytes, tensors_of  # noqa: E402
from megatrain.engine.microbatch import context_parallel_index  # noqa: E402
from megatrain.engine.models.gpt import GPTModel  # noqa: E402
from megatrain.engine.parallel.context import (  # noqa: E402
    Ring,
    _plan,
    parallelize_context,
    ring_attention,
    skipped_blocks,
)
from megatrain.engine.parallel.state import ParallelState  # noqa: E402
from megatrain.plan.layout import Layout  # noqa: E402


def _qkv(args: argparse.Namespace, t: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    b, h, grp, hd = args.batch, args.heads, args.groups, args.head_dim
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    return [torch.randn(b, n, t, hd, generator=g).to(device, dtype) for n in (h, grp, grp, h)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _measure(fn: Any, inputs: list[torch.Tensor], repeats: int, together: bool = False) -> tuple[float, int]:
    """(median seconds, peak bytes) of forward + backward of fn(q, k, v) with dout; `together`: the
    ranks start each repeat at a barrier."""
    device = str(inputs[0].device)
    times, peak = [], 0
    for _ in range(repeats + 1):  # the first is a warm-up
        q, k, v = (x.clone().requires_grad_() for x in inputs[:3])
        _sync(device)
        if together:
            dist.barrier()
        with LiveTensorBytes(ignore=[q, k, v, inputs[3]]) as mem:
            t0 = time.perf_counter()
            fn(q, k, v).backward(inputs[3])
            _sync(device)
            elapsed = time.perf_counter() - t0
        times.append(elapsed)
        peak = max(peak, mem.peak)
    return statistics.median(times[1:]), peak


def _model_config(args: argparse.Namespace, t: int) -> TransformerConfig:
    cfg = TransformerConfig.preset("tiny-llama")
    return replace(
        cfg, hidden_size=args.heads * args.head_dim, num_attention_heads=args.heads,
        num_query_groups=args.groups, ffn_hidden_size=4 * args.heads * args.head_dim, seq_length=t,
        num_layers=2, vocab_size=256,
    )  # fmt: skip


def _model_peak(args: argparse.Namespace, state: ParallelState, t: int) -> int:
    """Peak activation bytes of one forward + loss + backward at this rank's T/cp tokens."""
    torch.manual_seed(0)
    device = str(state.device)
    model = parallelize_context(GPTModel(_model_config(args, t)), state).to(device)
    idx = torch.as_tensor(context_parallel_index(t, state.cp_rank, state.cp_size))
    tokens = torch.randint(0, 256, (1, t + 1), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1][:, idx].to(device), tokens[:, 1:][:, idx].to(device)
    pos = idx.unsqueeze(0).to(device)
    with LiveTensorBytes(ignore=tensors_of(model, x, y, pos)) as mem:
        model.loss(x, y, position_ids=pos).backward()
    return mem.peak


def baseline(args: argparse.Namespace, device: str) -> dict[int, tuple[float, int, int]]:
    """One process over the whole sequence: {T: (attention seconds, attention peak, model peak)}."""
    out = {}
    for t in args.seq:
        inputs = _qkv(args, t, device)
        s, peak = _measure(
            lambda q, k, v: kernels.get("attention", q.device.type)(q, k, v), inputs, args.repeats
        )
        out[t] = (s, peak, _model_peak(args, ParallelState.single(device), t))
    return out


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Ring attention and the model's activations on this cp rank, at every T."""
    state = ParallelState.build(Layout(cp=world), args.device)
    ring = Ring.of(state)
    rows = []
    for t in args.seq:
        idx = torch.as_tensor(context_parallel_index(t, rank, world)).to(args.device)
        local = [x[:, :, idx].contiguous() for x in _qkv(args, t, args.device)]
        seconds, peak = _measure(functools.partial(ring_attention, ring=ring), local, args.repeats, True)
        rows.append({"kind": "attn", "t": t, "cp": world, "s": seconds, "peak": peak})
        rows.append({"kind": "model", "t": t, "cp": world, "peak": _model_peak(args, state, t)})
    return rows


def _plan_counts(cp: int) -> tuple[int, int]:
    """Chunk-pair blocks one rank computes per attention call, from the ring's plan (every rank)."""
    counts = set()
    for rank in range(cp):
        n = 0
        for step in range(cp):
            s = _plan(step, rank, cp, 1)
            rows = 2 if s.rows == slice(None) else 1
            cols = 2 if s.cols == slice(None) else 1
            n += rows * cols - (1 if s.causal else 0)  # a causal 2×2 block skips its upper pair
        counts.add(n)
    assert len(counts) == 1, f"ranks do unequal work: {counts}"
    computed = counts.pop()
    return computed, 4 * cp - computed


def print_tables(args: argparse.Namespace, base: dict[int, tuple[float, int, int]], rows: list[dict]) -> None:
    print("\n| T | cp | full attention (s) | ring, slowest rank (s) | time ratio |"
          " full peak (MiB) | ring peak per rank (MiB) | ratio |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    mib = 2**20
    for t in args.seq:
        s_full, p_full, _ = base[t]
        for cp in args.cp:
            mine = [r for r in rows if r["kind"] == "attn" and r["t"] == t and r["cp"] == cp]
            s, p = max(r["s"] for r in mine), max(r["peak"] for r in mine)
            print(f"| {t} | {cp} | {s_full:.3f} | {s:.3f} | {s / s_full:.2f} | "
                  f"{p_full / mib:.1f} | {p / mib:.1f} | {p / p_full:.2f} |")  # fmt: skip

    heads = " | ".join(f"cp={cp} per rank (MiB) | ratio" for cp in args.cp)
    print(f"\n| T | model activations cp=1 (MiB) | {heads} |")
    print("|---:|---:|" + "---:|---:|" * len(args.cp))
    for t in args.seq:
        one = base[t][2]
        cells = []
        for cp in args.cp:
            p = max(r["peak"] for r in rows if r["kind"] == "model" and r["t"] == t and r["cp"] == cp)
            cells.append(f"{p / mib:.1f} | {p / one:.2f}")
        print(f"| {t} | {one / mib:.1f} | {' | '.join(cells)} |")

    print("\n| cp | chunk-pair blocks computed per rank | skipped (fully masked) | of 4·cp |")
    print("|---:|---:|---:|---:|")
    for cp in sorted({1, *args.cp}):
        computed, skipped = _plan_counts(cp)
        assert (computed, skipped) == skipped_blocks(cp)
        print(f"| {cp} | {computed} | {skipped} | {4 * cp} |")


def _header(args: argparse.Namespace, where: str) -> None:
    print(f"# context parallelism ({where})")
    a = args
    print(
        f"# attention: B={a.batch} H={a.heads} G={a.groups} hd={a.head_dim}, {a.dtype}, fwd+bwd; model fp32"
    )


def torchrun_main(args: argparse.Namespace) -> None:
    """Under torchrun: cp = the world (NCCL on GPUs, one per rank; gloo on CPU); rank 0 also runs the
    one-process baseline on its device, then prints."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    args.device, args.cp = (f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"), [world]
    rows = worker(rank, world, args)
    base = baseline(args, args.device) if rank == 0 else {}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        device = torch.cuda.get_device_name() if cuda else "CPU"
        _header(args, f"torchrun, {world} ranks, {device}")
        print_tables(args, base, [r for rank_rows in gathered for r in rank_rows])
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument(
        "--cp", type=int, nargs="+", default=[2, 4], help="gloo runs (ignored under torchrun)"
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="of the attention inputs")
    args = parser.parse_args()
    args.device = "cpu"
    if "WORLD_SIZE" in os.environ:
        torchrun_main(args)
        return

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine" / "parallel"))
    from _launch import run_distributed

    torch.set_num_threads(1)
    _header(args, f"gloo CPU ranks, 1 thread each, {len(os.sched_getaffinity(0))} cores")
    base = baseline(args, "cpu")
    rows = [
        r
        for cp in args.cp
        for rank_rows in run_distributed(worker, cp, args, timeout=3600)
        for r in rank_rows
    ]
    print_tables(args, base, rows)


if __name__ == "__main__":
    main()
