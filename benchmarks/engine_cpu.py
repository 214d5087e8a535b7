"""Engine training throughput on CPU against Hugging Face transformers, one process, fp32.

For each flavour (GPT-2, Llama) our GPTModel and the matching Hugging Face model
(GPT2LMHeadModel / LlamaForCausalLM, attn_implementation="sdpa") get identical shapes and
identical weights (the first losses are checked equal), the same mean cross-entropy, the same AdamW
(grouping, hyper-parameters, fused implementation), gradient clipping at 1.0, and threads. Each
trains the way its own stack does by default:

- ours: the engine's step at one process (train.py): GPTModel.loss (the LM head fused with the
  cross-entropy), gradients accumulated into DataParallel's buffer (with gradient-accumulation
  fusion), MixedPrecisionOptimizer (global norm, clipping, fused AdamW on the buffer's views);
- hf: Hugging Face's logits through megatrain's lm_loss, clip_grad_norm_ and fused AdamW, as its
  Trainer does (max_grad_norm=1.0, adamw_torch_fused).

One timed step is zero_grad + forward + loss + backward + clipping + optimizer step. Variants run
interleaved (A B A B …, the order rotating per round), each timed step after one untimed step of the
same variant (--settle: so each is timed in its own heap steady state, not the one the variant
before it left), warm-up steps excluded, median of the rounds.
The table also gives each variant's minor page faults per step: fresh memory the kernel maps and
zeroes, which on a CPU is a large part of what large per-step temporaries cost.

    python benchmarks/engine_cpu.py                    # eager, both flavours (~1-2 min on 2 cores)
    python benchmarks/engine_cpu.py --compile          # + torch.compile'd model+loss, ours and HF's
    python benchmarks/engine_cpu.py --profile          # + top ops per variant (torch.profiler)
    python benchmarks/engine_cpu.py --ablate           # + ours without gradient-accumulation fusion
    python benchmarks/engine_cpu.py --tiny --json out.json   # seconds; the smoke test's setting

It also prints the analytical memory estimate (megatrain.plan.memory) next to the bytes measured
for our model's step (live tensor bytes, megatrain.engine.memtrack) at the benchmark's shape.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _engine_common import Shape, adamw, build_pair, hf_logits, interleaved_medians  # noqa: E402

from megatrain.engine.memtrack import LiveTensorBytes, tensors_of  # noqa: E402
from megatrain.engine.models.gpt import GPTModel, lm_loss  # noqa: E402
from megatrain.engine.optimizer import MixedPrecisionOptimizer  # noqa: E402
from megatrain.engine.parallel.data import DataParallel  # noqa: E402
from megatrain.engine.parallel.state import ParallelState  # noqa: E402
from megatrain.plan.memory import estimate_memory  # noqa: E402

MiB = 1 << 20


def default_shape(flavour: str, args: argparse.Namespace) -> Shape:
    if args.tiny:
        return Shape(layers=2, hidden=64, heads=4, groups=2, ffn=128, vocab=256, seq=32, batch=2)
    ffn = args.ffn or (4 * args.hidden if flavour == "gpt2" else ((8 * args.hidden // 3) + 63) // 64 * 64)
    return Shape(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        groups=args.groups,
        ffn=ffn,
        vocab=args.vocab,
        seq=args.seq,
        batch=args.batch,
    )


def engine_step(
    model: GPTModel,
    forward_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    fusion: bool = True,
) -> Callable[[], float]:
    """The engine's training step at one process, as train.py runs it."""
    ddp = DataParallel(model, ParallelState.single(), gradient_accumulation_fusion=fusion)
    opt = MixedPrecisionOptimizer(ddp, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), clip_grad=1.0)

    def step() -> float:
        opt.zero_grad()
        loss = forward_loss(x, y)
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        return float(loss.detach())

    return step


def hf_step(
    model: torch.nn.Module,
    forward_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    impl: str,
) -> Callable[[], float]:
    """Hugging Face Trainer's step: backward, clip_grad_norm_(1.0), AdamW, zero_grad."""
    opt = adamw(model, impl)
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> float:
        loss = forward_loss(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def measure_memory(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
) -> dict[str, int]:
    """Live bytes of one eager step of `model`, split as the estimate is (gradients zeroed in place)."""
    loss_fn(x, y).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    with LiveTensorBytes(tensors_of(model, opt, x, y)) as live:
        loss_fn(x, y).backward()
        activations = live.peak
        live.reset_peak()
        opt.step()
        workspace = live.peak - live.current
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    out = {
        "params": sum(storages.values()),
        "grads": sum(p.grad.untyped_storage().nbytes() for p in model.parameters()),
        "optimizer": sum(v.nbytes for s in opt.state.values() for v in s.values() if v.ndim),
        "activations": activations,
        "optimizer_workspace": workspace,
    }
    opt.zero_grad(set_to_none=True)
    return out


def profile_table(step: Callable[[], Any], steps: int = 3, rows: int = 12) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / steps / 1e3
    lines = [f"    {'op':56s} {'ms/step':>8s} {'share':>6s} {'calls':>6s}"]
    for e in events[:rows]:
        ms = e.self_cpu_time_total / steps / 1e3
        lines.append(f"    {e.key[:56]:56s} {ms:8.1f} {ms / total:6.1%} {e.count // steps:6d}")
    lines.append(f"    {'total (self CPU)':56s} {total:8.1f}")
    return "\n".join(lines)


def run_flavour(flavour: str, args: argparse.Namespace) -> dict[str, Any]:
    shape = default_shape(flavour, args)
    ours, hf = build_pair(flavour, shape, seed=args.seed)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g)
    y = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g)

    with torch.no_grad():  # identical function: the first losses must agree
        loss_ours, loss_hf = float(ours.loss(x, y)), float(lm_loss(hf_logits(hf)(x), y))
    if abs(loss_ours - loss_hf) > 1e-4 * max(1.0, abs(loss_ours)):
        raise RuntimeError(f"{flavour}: first losses differ (ours {loss_ours}, HF {loss_hf})")

    def hf_loss(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return lambda a, b: lm_loss(hf_logits(model)(a), b)

    # Every variant trains its own copy (DataParallel takes over its model's gradients), all made
    # before any is wrapped.
    names = ["ours", "hf"] + (["ours-nofusion"] if args.ablate else [])
    names += ["ours+compile", "hf+compile"] if args.compile else []
    models = {n: copy.deepcopy(ours if n.startswith("ours") else hf) for n in names}
    steps: dict[str, Callable[[], float]] = {}
    for name, model in models.items():
        # Compiled: model and loss in one graph; dynamic=False: the shapes never change here.
        wrap = (lambda f: torch.compile(f, dynamic=False)) if name.endswith("+compile") else (lambda f: f)
        if name.startswith("ours"):
            steps[name] = engine_step(model, wrap(model.loss), x, y, fusion=name != "ours-nofusion")
        else:
            steps[name] = hf_step(model, wrap(hf_loss(model)), x, y, args.optimizer)
    timing = interleaved_medians(steps, rounds=args.rounds, warmup=args.warmup, settle=args.settle)
    tokens = shape.batch * shape.seq
    result: dict[str, Any] = {
        "flavour": flavour,
        "shape": shape.as_dict(),
        "num_params": ours.num_parameters(),
        "first_loss": {"ours": loss_ours, "hf": loss_hf},
        "variants": {n: {**t, "tokens_per_s": tokens / t["median_s"]} for n, t in timing.items()},
    }
    if args.profile:
        result["profile"] = {name: profile_table(step) for name, step in steps.items()}

    # Memory: the estimate for this shape against our model's measured step (fresh optimizer).
    est = estimate_memory(
        ours.config,
        micro_batch_size=shape.batch,
        precision="fp32",
        fused_optimizer=args.optimizer == "fused",
        device="cpu",
        fused_loss=True,
    )
    # The unwrapped originals (plain .grad, as the estimate counts them).
    measured = measure_memory(ours.loss, ours, adamw(ours, args.optimizer), x, y)
    measured_hf = measure_memory(hf_loss(hf), hf, adamw(hf, args.optimizer), x, y)
    result["memory"] = {
        "estimate": {
            "params": est.params_bytes,
            "grads": est.grads_bytes,
            "optimizer": est.optimizer_bytes,
            "activations": est.activations_bytes,
            "optimizer_workspace": est.breakdown["optimizer_workspace"],
        },
        "measured": measured,
        "measured_hf": measured_hf,
    }
    return result


def print_report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\nCPU: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, fp32, AdamW {args.optimizer}, median of {args.rounds} "
        f"interleaved rounds ({args.settle} untimed step before each) after {args.warmup} warm-up steps"
    )
    print(
        f"\n{'flavour':8s} {'params':>8s} {'variant':14s} {'ms/step':>8s} {'tokens/s':>9s} {'vs hf':>6s} "
        f"{'faults/step':>11s}"
    )
    for r in results:
        base = r["variants"]["hf"]["median_s"]
        for name, v in r["variants"].items():
            print(
                f"{r['flavour']:8s} {r['num_params'] / 1e6:7.2f}M {name:14s} {v['median_s'] * 1e3:8.1f} "
                f"{v['tokens_per_s']:9.0f} {base / v['median_s']:5.2f}x {v['page_faults_per_step']:11.0f}"
            )
    print(f"\n{'flavour':8s} {'memory (MiB)':19s} {'estimate':>9s} {'ours':>9s} {'est/ours':>9s} {'hf':>9s}")
    for r in results:
        mem = r["memory"]
        for key in ("params", "grads", "optimizer", "activations", "optimizer_workspace"):
            e, m, h = mem["estimate"][key], mem["measured"][key], mem["measured_hf"][key]
            ratio = f"{e / m:9.3f}" if m else f"{'-':>9s}"
            print(f"{r['flavour']:8s} {key:19s} {e / MiB:9.2f} {m / MiB:9.2f} {ratio} {h / MiB:9.2f}")
    for r in results:
        for name, table in r.get("profile", {}).items():
            print(f"\nprofile {r['flavour']} {name}:\n{table}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavours", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--groups", type=int, default=2, help="Llama key/value groups (GPT-2 uses one per head)")
    p.add_argument("--ffn", type=int, default=None, help="default 4h (GPT-2), 8h/3 rounded to 64 (Llama)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--settle", type=int, default=1, help="untimed steps of a variant before each timed one")
    # fused: what the engine's MixedPrecisionOptimizer and Hugging Face's Trainer (adamw_torch_fused
    # with torch >= 2.8) both use; foreach applies to Hugging Face's step only.
    p.add_argument("--optimizer", choices=["foreach", "fused"], default="fused")
    p.add_argument("--compile", action="store_true", help="also time torch.compile'd model+loss (both)")
    p.add_argument(
        "--ablate", action="store_true", help="also time ours without gradient-accumulation fusion"
    )
    p.add_argument("--profile", action="store_true", help="print torch.profiler's top ops per variant")
    p.add_argument("--tiny", action="store_true", help="a seconds-long run on a tiny shape (smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tiny:
        args.rounds, args.warmup, args.settle = min(args.rounds, 2), 1, 0
    torch.set_num_threads(args.threads)  # the same for every variant
    results = [run_flavour(f, args) for f in args.flavours]
    print_report(results, args)
    if args.json:
        meta = {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "args": vars(args) | {"json": None},
        }
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
