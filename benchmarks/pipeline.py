"""Pipeline bubble and activation memory, measured on gloo CPU ranks next to the theory.

    python benchmarks/pipeline.py                       # pp 2 and 4, M 4/8/16, 1F1B and interleaved (V=2)
    python benchmarks/pipeline.py --pp 2 --microbatches 4 8 --steps 2

For each pp, one set of ranks (one thread each) runs a GPT model's stages with the engine's
PipelineSchedule and records, per stage, compute time and time spent waiting on its neighbours
(receives, and the barrier that ends each step so every stage shares one makespan). The measured
bubble is wait / (wait + compute) summed over stages, next to (p-1)/(m+p-1) for 1F1B and
((p-1)/V)/(m+(p-1)/V) interleaved. Then the peak bytes of activations each stage allocates during
one step (LiveTensorBytes: every tensor an op returns, parameters and gradients excluded) under 1F1B
and under all-forward-all-backward, with the micro-batches each holds at once.

Ranks beyond the machine's cores time-share: on a 2-core machine pp=4 runs four ranks on two cores,
so stages that should overlap run at half speed and the measured bubble reads low. The table says
how many cores there were.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain.engine.config import TransformerConfig  # noqa: E402
from megatrain.engine.memtrack import LiveTensorBytes, tensors_of  # noqa: E402
from megatrain.engine.models.gpt import GPTModel, lm_loss  # noqa: E402
from megatrain.engine.parallel.pipeline import build_stage_modules  # noqa: E402
from megatrain.engine.parallel.schedules import PipelineSchedule, theoretical_bubble  # noqa: E402
from megatrain.engine.parallel.state import ParallelState  # noqa: E402
from megatrain.plan.layout import Layout  # noqa: E402


def model_config(args: argparse.Namespace) -> TransformerConfig:
    return TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.hidden // 32,
        num_query_groups=args.hidden // 32,
        ffn_hidden_size=4 * args.hidden,
        seq_length=args.seq,
        vocab_size=args.vocab,
    )


def _batches(cfg: TransformerConfig, m: int, mb: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        t = torch.randint(0, cfg.vocab_size, (mb, cfg.seq_length + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _run(
    chunks: list[nn.Module],
    state: ParallelState,
    cfg: TransformerConfig,
    schedule: str,
    m: int,
    mb: int,
    step: int,
    track: bool = False,
) -> tuple[PipelineSchedule, int]:
    sched = PipelineSchedule(chunks, state, (mb, cfg.seq_length, cfg.hidden_size), torch.float32, schedule)
    batches = _batches(cfg, m, mb, step)
    for c in chunks:
        c.zero_grad(set_to_none=False)
    if not track:
        sched.forward_backward(batches, lambda out, mb: lm_loss(out, mb.labels) / m)
        return sched, 0
    with LiveTensorBytes(ignore=tensors_of(*chunks)) as mem:
        sched.forward_backward(batches, lambda out, mb: lm_loss(out, mb.labels) / m)
    return sched, mem.peak


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    cfg = model_config(args)
    rows = []
    for v in (1, 2):
        dims = Layout(pp=world, virtual_stages=v)
        state = ParallelState.build(dims)
        torch.manual_seed(0)
        chunks = build_stage_modules(GPTModel(cfg), state)
        for c in chunks:  # gradients allocated up front, as DataParallel's buffer would be
            for p in c.parameters():
                p.grad = torch.zeros_like(p)
        for m in args.microbatches:
            if v > 1 and m % world:
                continue
            _run(chunks, state, cfg, "1f1b", m, args.micro_batch, 0)  # warm-up
            wait = compute = 0.0
            t0 = time.perf_counter()
            for step in range(args.steps):
                sched, _ = _run(chunks, state, cfg, "1f1b", m, args.micro_batch, step + 1)
                wait += sched.times.wait_s
                compute += sched.times.compute_s
            elapsed = (time.perf_counter() - t0) / args.steps
            rows.append(
                {
                    "kind": "bubble",
                    "pp": world,
                    "v": v,
                    "m": m,
                    "stage": state.pp_rank,
                    "wait": wait,
                    "compute": compute,
                    "step_s": elapsed,
                }
            )
        if v == 1:
            m = args.memory_microbatches
            for schedule in ("1f1b", "all_forward_all_backward"):
                _, peak = _run(chunks, state, cfg, schedule, m, args.micro_batch, 99, track=True)
                rows.append(
                    {
                        "kind": "memory",
                        "pp": world,
                        "m": m,
                        "stage": state.pp_rank,
                        "schedule": schedule,
                        "peak": peak,
                    }
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--memory-microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine" / "parallel"))
    from _launch import run_distributed

    cores = len(os.sched_getaffinity(0))
    print(f"# pipeline bubble and activation memory (gloo CPU ranks, 1 thread each, {cores} cores)")
    print(
        f"# model: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
        f"micro-batch {args.micro_batch}; {args.steps} timed steps after one warm-up"
    )
    bubble_rows, memory_rows = [], []
    for pp in args.pp:
        for rank_rows in run_distributed(worker, pp, args, timeout=1800):
            for r in rank_rows:
                (bubble_rows if r["kind"] == "bubble" else memory_rows).append(r)

    print("\n| pp | schedule | micro-batches | measured bubble | theory | per-stage bubble | step (s) |")
    print("|---:|---|---:|---:|---:|---|---:|")
    keys = sorted({(r["pp"], r["v"], r["m"]) for r in bubble_rows})
    for pp, v, m in keys:
        rs = sorted(
            (r for r in bubble_rows if (r["pp"], r["v"], r["m"]) == (pp, v, m)), key=lambda r: r["stage"]
        )
        wait, compute = sum(r["wait"] for r in rs), sum(r["compute"] for r in rs)
        per_stage = " ".join(f"{r['wait'] / (r['wait'] + r['compute']):.2f}" for r in rs)
        name = "1F1B" if v == 1 else f"interleaved V={v}"
        print(
            f"| {pp} | {name} | {m} | {wait / (wait + compute):.3f} | {theoretical_bubble(pp, m, v):.3f} | "
            f"{per_stage} | {max(r['step_s'] for r in rs):.3f} |"
        )

    print(
        f"\n| pp | stage | peak activations 1F1B (MiB) | all-forward-all-backward (MiB) | ratio | "
        f"micro-batches held 1F1B / AFAB (M={args.memory_microbatches}) |"
    )
    print("|---:|---:|---:|---:|---:|---|")
    for pp in args.pp:
        for stage in range(pp):
            get = {r["schedule"]: r["peak"] for r in memory_rows if r["pp"] == pp and r["stage"] == stage}
            a, b = get["1f1b"], get["all_forward_all_backward"]
            held = min(pp - stage, args.memory_microbatches)
            print(
                f"| {pp} | {stage} | {a / 2**20:.1f} | {b / 2**20:.1f} | {b / a:.2f} | "
                f"{held} / {args.memory_microbatches} |"
            )


if __name__ == "__main__":
    main()
