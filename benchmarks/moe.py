"""The MoE layer's forward + backward time: grouped (the grouped_mlp kernel of this device: on a CPU
one bmm over groups padded to the largest), the same experts run one at a time (the kernel's loop),
a naive per-token loop, and a dense MLP of the same active FLOPs (width k·F: each token does the
work of its k experts), with ratios to the dense MLP.

    python benchmarks/moe.py                       # CPU, Mixtral-like proportions at small size
    python benchmarks/moe.py --device cuda --dtype bf16 --tokens 16384 --hidden 2048 --ffn 1408
    python benchmarks/moe.py --tiny                # seconds: the smoke run the tests use

Each variant runs its steps interleaved with the others (A B C D, then D C B A, ...), and the figure
is the median step, so a shared machine's drift moves every variant alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatrain.engine.config import MoEConfig, TransformerConfig  # noqa: E402
from megatrain.engine.models.gpt import MLP  # noqa: E402
from megatrain.engine.models.moe import MoELayer  # noqa: E402
from megatrain.kernels.grouped_mlp import grouped_mlp_loop  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def per_token_loop(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Every token through each of its experts, one token at a time (no grouping at all)."""
    flat = x.reshape(-1, x.shape[-1])
    probs, routing_map = layer.router(flat)
    ex = layer.experts
    out = []
    for t in range(flat.shape[0]):
        y = torch.zeros_like(flat[t])
        for e in routing_map[t].nonzero().flatten().tolist():
            gate, up = F.linear(flat[t], ex.fc1_weight[e]).chunk(2)
            y = y + probs[t, e].to(y.dtype) * F.linear(F.silu(gate) * up, ex.fc2_weight[e])
        out.append(y)
    return torch.stack(out).view_as(x)


def fwd_bwd(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, sync: Callable[[], None]
) -> Callable[[], float]:
    def step() -> float:
        t0 = time.perf_counter()
        y = fn(x)
        y.float().square().mean().backward()
        sync()
        return time.perf_counter() - t0

    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512, help="each expert's width")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--naive-tokens", type=int, default=256, help="tokens for the per-token loop (slow)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--tiny", action="store_true", help="a seconds-long run on a tiny shape")
    args = p.parse_args(argv)
    if args.tiny:
        args.tokens, args.hidden, args.ffn, args.steps, args.naive_tokens = 128, 32, 64, 2, 32
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)

    moe = MoEConfig(num_experts=args.experts, router_topk=args.topk, ffn_hidden_size=args.ffn)
    cfg = TransformerConfig.preset(
        "tiny-llama", hidden_size=args.hidden, num_attention_heads=1, num_query_groups=1, moe=moe
    )
    torch.manual_seed(0)
    layer = MoELayer(cfg).to(device, dtype)
    dense = MLP(dataclasses.replace(cfg, ffn_hidden_size=args.topk * args.ffn, moe=None)).to(device, dtype)
    x = torch.randn(1, args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    x_naive = x.detach()[:, : args.naive_tokens].clone().requires_grad_()

    def with_kernel(fn: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(inp: torch.Tensor) -> torch.Tensor:
            flat = inp.reshape(-1, inp.shape[-1])
            probs, routing_map = layer.router(flat)
            ex_x, counts = layer.dispatcher.dispatch(flat, probs, routing_map)
            ex = layer.experts
            return layer.dispatcher.combine(fn(ex_x, counts, ex.fc1_weight, ex.fc2_weight)).view_as(inp)

        return run

    variants: dict[str, tuple[Callable[[], float], int]] = {
        "MoE layer, grouped_mlp kernel": (fwd_bwd(layer, x, sync), args.tokens),
        "MoE layer, loop over experts": (fwd_bwd(with_kernel(grouped_mlp_loop), x, sync), args.tokens),
        "MoE layer, per-token loop": (
            fwd_bwd(lambda t: per_token_loop(layer, t), x_naive, sync),
            args.naive_tokens,
        ),
        f"dense MLP, width k·F = {args.topk * args.ffn}": (fwd_bwd(dense, x, sync), args.tokens),
    }
    from megatrain import kernels

    backend = kernels.get("grouped_mlp", device.type)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(args.steps + 1):  # the first round warms up
        order = list(variants) if i % 2 == 0 else list(variants)[::-1]
        for name in order:
            dt = variants[name][0]()
            if i:
                times[name].append(dt)
    dense_name = list(variants)[-1]
    dense_rate = args.tokens / statistics.median(times[dense_name])
    print(
        f"\nMoE layer fwd+bwd: {args.tokens} tokens, hidden {args.hidden}, {args.experts} experts × "
        f"F={args.ffn}, top-{args.topk}, SwiGLU, {args.dtype} on {args.device} ({args.threads} threads), "
        f"grouped_mlp backend {backend.__module__}.{backend.__name__}; median of {args.steps}"
    )
    print(f"{'variant':40s} {'tokens':>7s} {'ms/step':>9s} {'tokens/s':>10s} {'vs dense':>9s}")
    for name, (_, tokens) in variants.items():
        med = statistics.median(times[name])
        rate = tokens / med
        print(f"{name:40s} {tokens:7d} {med * 1e3:9.2f} {rate:10.0f} {rate / dense_rate:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
