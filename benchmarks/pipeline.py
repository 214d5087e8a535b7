"""Pipeline bubble and activation memory, measured on gloo CPU ranks next to the theory.

    python benchmarks/pipeline.py                       # pp 2 and 4, M 4/8/16: 1F1B, interleaved (V=2),
                                                        # zb-h1 and zbv
    python benchmarks/pipeline.py --pp 2 --microbatches 4 8 --steps 2 --schedules zbv

For each pp, one set of ranks (one thread each) runs a GPT model's stages with the engine's
PipelineSchedule and records, per stage, compute time and time spent waiting on its neighbours
(receives, and the barrier that ends each step so every stage shares one makespan). The measured
bubble is wait / (wait + compute) summed over stages, next to (p-1)/(m+p-1) for 1F1B,
((p-1)/V)/(m+(p-1)/V) interleaved, and the zero-bubble schedules' exact simulated figures with F = B = W
(schedules.theoretical_bubble). The stages train through DataParallel's gradient buffer, as the
engine does: the zero-bubble schedules' W passes are its fused weight-gradient GEMMs. Then the peak
bytes of activations each stage allocates during one step (LiveTensorBytes: every tensor an op
returns, parameters and gradients excluded) under 1F1B and under all-forward-all-backward, with the
micro-batches each holds at once.

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
from megatrain.engine.parallel.data import DataParallel  # noqa: E402
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


SCHEDULES = (("1f1b", 1), ("1f1b", 2), ("zb-h1", 1), ("zbv", 2))
"""(schedule, chunks per stage) measured; 1f1b with 2 is Megatron's interleaved schedule."""


def _run(
    chunks: list[nn.Module],
    ddp: DataParallel,
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
    ddp.zero_grad()

    def run() -> None:
        sched.forward_backward(
            batches,
            lambda out, mb: lm_loss(out, mb.labels) / m,
            before_backward=lambda last: setattr(ddp, "is_last_microbatch", last),
        )
        ddp.finish_grad_sync()

    if not track:
        run()
        return sched, 0
    with LiveTensorBytes(ignore=tensors_of(*chunks, ddp.grad_buffer)) as mem:
        run()
    return sched, mem.peak


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    cfg = model_config(args)
    rows = []
    for schedule, v in SCHEDULES:
        if schedule not in args.schedules:
            continue
        dims = Layout(pp=world, virtual_stages=v, pipeline_schedule=schedule)
        state = ParallelState.build(dims)
        torch.manual_seed(0)
        chunks = build_stage_modules(GPTModel(cfg), state)
        # As the engine: DataParallel's gradient buffer, the weight-gradient GEMMs fused into it
        # (what a zero-bubble schedule's W pass defers).
        ddp = DataParallel(nn.ModuleList(chunks), state)
        for m in args.microbatches:
            if schedule == "1f1b" and v > 1 and m % world:
                continue
            _run(chunks, ddp, state, cfg, schedule, m, args.micro_batch, 0)  # warm-up
            wait = compute = 0.0
            t0 = time.perf_counter()
            for step in range(args.steps):
                sched, _ = _run(chunks, ddp, state, cfg, schedule, m, args.micro_batch, step + 1)
                wait += sched.times.wait_s
                compute += sched.times.compute_s
            elapsed = (time.perf_counter() - t0) / args.steps
            rows.append(
                {
                    "kind": "bubble",
                    "pp": world,
                    "v": v,
                    "schedule": schedule,
                    "m": m,
                    "stage": state.pp_rank,
                    "wait": wait,
                    "compute": compute,
                    "step_s": elapsed,
                }
            )
        if (schedule, v) == ("1f1b", 1) and args.memory_microbatches:
            m = args.memory_microbatches
            for sched_name in ("1f1b", "all_forward_all_backward"):
                _, peak = _run(chunks, ddp, state, cfg, sched_name, m, args.micro_batch, 99, track=True)
                rows.append(
                    {
                        "kind": "memory",
                        "pp": world,
                        "m": m,
                        "stage": state.pp_rank,
                        "schedule": sched_name,
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
    parser.add_argument(
        "--schedules", nargs="+", default=["1f1b", "zb-h1", "zbv"], help="1f1b (and interleaved), zb-h1, zbv"
    )
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
    keys = sorted({(r["pp"], r["schedule"], r["v"], r["m"]) for r in bubble_rows})
    for pp, schedule, v, m in keys:
        rs = sorted(
            (r for r in bubble_rows if (r["pp"], r["schedule"], r["v"], r["m"]) == (pp, schedule, v, m)),
            key=lambda r: r["stage"],
        )
        wait, compute = sum(r["wait"] for r in rs), sum(r["compute"] for r in rs)
        per_stage = " ".join(f"{r['wait'] / (r['wait'] + r['compute']):.2f}" for r in rs)
        name = {"1f1b": "1F1B" if v == 1 else f"interleaved V={v}"}.get(schedule, schedule)
        theory = theoretical_bubble(pp, m, v, schedule)
        print(
            f"| {pp} | {name} | {m} | {wait / (wait + compute):.3f} | {theory:.3f} | "
            f"{per_stage} | {max(r['step_s'] for r in rs):.3f} |"
        )

    print(
        f"\n| pp | stage | peak activations 1F1B (MiB) | all-forward-all-backward (MiB) | ratio | "
        f"micro-batches held 1F1B / AFAB (M={args.memory_microbatches}) |"
    )
    print("|---:|---:|---:|---:|---:|---|")
    for pp in args.pp if memory_rows else ():
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
