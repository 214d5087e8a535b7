"""The `attention` kernel's backends (model.attention_backend) timed forward + backward, plain causal
and over packed documents, on the same inputs; each output first checked against SDPA's.

Backends: sdpa, flex (compiled on a GPU), flash and te where installed (CUDA), reference (the fp32
twin; left out at full size, where its (T, T) scores dominate). Steps run interleaved (A B A B …),
warm-up excluded, median of the rounds. TFLOP/s counts the causal half of the (T, T) work for plain
attention and each document's own causal half when packed (what a kernel that skips masked blocks
must do), forward 4·T²·hd·H/2 and backward 2.5× that.

    python benchmarks/attention.py --json attention.json   # on a GPU: bf16, B=2 T=4096 32/8 heads hd 128
    python benchmarks/attention.py --tiny                  # CPU-sized smoke run of every usable backend
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _engine_common import interleaved_medians  # noqa: E402

from megatrain import kernels  # noqa: E402
from megatrain.kernels.attention import Segments  # noqa: E402
from megatrain.spec_attention import missing_package  # noqa: E402


def documents(b: int, t: int, mean: int, seed: int) -> torch.Tensor:
    """(B, T) ids of contiguous documents, lengths drawn around `mean` tokens."""
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.rand(b, t, generator=gen) < 1.0 / mean
    cuts[:, 0] = False
    return torch.cumsum(cuts.long(), 1)


def useful_pairs(ids: torch.Tensor | None, b: int, t: int) -> float:
    """Query-key pairs a causal (per-document) kernel must compute."""
    if ids is None:
        return b * t * (t + 1) / 2
    # A document per (row, id) run: offset each row's ids so runs never join across rows.
    rows = torch.arange(b, device=ids.device).repeat_interleave(t) * (int(ids.max()) + 1)
    _, counts = torch.unique_consecutive(ids.flatten() + rows, return_counts=True)
    return float((counts * (counts + 1) / 2).sum())


def usable(device: str, tiny: bool) -> list[str]:
    names = ["sdpa", "flex"]
    if device == "cuda":
        names += [b for b in ("flash", "te") if missing_package(b) is None]
    return names + (["reference"] if tiny else [])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--doc-mean", type=int, default=512, help="mean packed document length (tokens)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="tiny shape on whatever device there is")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny:
        args.batch, args.seq, args.heads, args.groups, args.head_dim, args.doc_mean = 2, 64, 4, 2, 16, 16
        args.rounds, args.warmup = 2, 1
    elif device == "cpu":
        print("no CUDA device: run with --tiny for a CPU smoke run", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    b, t, h, g, hd = args.batch, args.seq, args.heads, args.groups, args.head_dim
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, t, hd, generator=gen).to(device, dtype).requires_grad_() for n in (h, g, g))
    dout = torch.randn(b, h, t, hd, generator=gen).to(device, dtype)
    ids = documents(b, t, args.doc_mean, seed=1).to(device)

    rows: dict[str, dict[str, Any]] = {}
    for packed in (False, True):
        # One Segments per forward, as the model builds it: what a backend derives is built per step.
        def segments() -> Segments | None:
            return Segments(ids) if packed else None  # noqa: B023

        want = kernels.get("attention", device, backend="sdpa")(q, k, v, segments())
        steps = {}
        for name in usable(device, args.tiny):
            fn = kernels.get("attention", device, backend=name)
            got = fn(q, k, v, segments())
            err = (got.float() - want.float()).abs().max().item()
            if err > (5e-2 if dtype == torch.bfloat16 else 1e-4):
                raise RuntimeError(f"{name} (packed={packed}) differs from sdpa by {err}")

            def step(fn: Any = fn) -> None:
                q.grad = k.grad = v.grad = None
                fn(q, k, v, segments()).backward(dout)

            steps[f"{name}{'+packed' if packed else ''}"] = step
        pairs = useful_pairs(ids if packed else None, b, t)
        flops = 3.5 * 4 * pairs * hd * h  # forward 4·pairs·hd per head, backward 2.5× that
        for name, timing in interleaved_medians(steps, args.rounds, args.warmup, sync).items():
            rows[name] = {**timing, "tflops": flops / timing["median_s"] / 1e12}

    name_dev = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"\n{name_dev} | torch {torch.__version__} | B={b} T={t} heads {h}/{g} hd {hd} | {dtype} | packed: "
          f"documents ~{args.doc_mean} tokens | forward+backward, median of {args.rounds}")  # fmt: skip
    print(f"\n{'backend':18s} {'ms':>8s} {'TFLOP/s':>8s}")
    for name, r in rows.items():
        print(f"{name:18s} {r['median_s'] * 1e3:8.2f} {r['tflops']:8.2f}")
    if args.json:
        shape = {"batch": b, "seq": t, "heads": h, "groups": g, "head_dim": hd, "doc_mean": args.doc_mean}
        out = {
            "device": name_dev,
            "torch": torch.__version__,
            "dtype": str(dtype),
            "shape": shape,
            "rows": rows,
        }
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
