"""Gradient-accumulation fusion on and off: the engine's one-process training step, paired A/B.

Two copies of the same GPTModel, each under DataParallel (one with gradient_accumulation_fusion,
one without) and MixedPrecisionOptimizer, as train.py builds them; steps alternate A B B A …, and
the figure is the median of the per-pair differences, which cancels most of a shared machine's drift
(a step's time moves by ±15% on a 2-core VM; a pair's two steps move together).

    python benchmarks/grad_fusion.py                    # Llama, benchmarks/engine_cpu.py's shape
    python benchmarks/grad_fusion.py --flavour gpt2 --pairs 40
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _engine_common import build_pair  # noqa: E402
from engine_cpu import build_parser, default_shape, engine_step  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavour", choices=["gpt2", "llama"], default="llama")
    p.add_argument("--pairs", type=int, default=30)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--tiny", action="store_true", help="a seconds-long run on a tiny shape")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    # engine_cpu.py's shapes, default or tiny.
    shape = default_shape(args.flavour, build_parser().parse_args(["--tiny"] if args.tiny else []))
    if args.tiny:
        args.pairs, args.warmup = min(args.pairs, 3), 1
    ours, _ = build_pair(args.flavour, shape)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g)
    y = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g)
    models = {"fusion": copy.deepcopy(ours), "no fusion": copy.deepcopy(ours)}
    steps = {name: engine_step(m, m.loss, x, y, fusion=name == "fusion") for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(args.warmup + args.pairs):
        order = list(steps) if i % 2 == 0 else list(steps)[::-1]
        for name in order:
            t0 = time.perf_counter()
            steps[name]()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    diffs = [a - b for a, b in zip(times["fusion"], times["no fusion"], strict=True)]
    tokens = shape.batch * shape.seq
    print(f"\n{args.flavour}, {tokens} tokens per step, {args.pairs} pairs, {args.threads} threads")
    for name, v in times.items():
        print(f"{name:10s} median {statistics.median(v) * 1e3:8.1f} ms")
    base = statistics.median(times["no fusion"])
    d = statistics.median(diffs)
    print(f"{'paired':10s} median difference {d * 1e3:+8.1f} ms ({d / base:+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
