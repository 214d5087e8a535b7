"""Engine MFU on one GPU: a ~1.1B-parameter Llama in bf16, ours against Hugging Face's LlamaForCausalLM.

Both models get identical shapes and weights (first losses checked equal), the same mean
cross-entropy (ours through GPTModel.loss, the LM head fused with the loss as the engine trains at
tp=1; Hugging Face's logits through megatrain's lm_loss) and the engine's own training machinery
around them:

- --precision bf16 (default, what the engine runs): bf16 parameters, gradients accumulated into the
  engine's fp32 DataParallel buffer (`param.main_grad`), MixedPrecisionOptimizer's fused AdamW on
  fp32 main parameters copied back to bf16 after the step: 2 + 4 + 12 bytes per parameter.
- --precision autocast: fp32 parameters under torch.autocast(bf16), plain fused AdamW.
- --fp8 tensorwise|rowwise (with bf16): also ours in precision fp8, the transformer linears' GEMMs in
  float8 (megatrain.engine.fp8; --fp8-backend torchao or te), as variant "ours+fp8". Its MFU is
  against the bf16 peak, as the engine reports it. Three models live at once: add --no-hf at 1B.

Steps run interleaved (A B A B …, order rotating per round), warm-up excluded, median of the rounds.
Throughput uses megatrain.engine.metrics for both models (Narayanan et al.'s FLOPs, no recompute
counted, the device's bf16 datasheet peak), so the MFU columns compare like with like. Peak memory
is torch.cuda.max_memory_allocated over one step, set against megatrain.plan.memory's estimate.

    python benchmarks/engine_gpu.py --json gpu.json            # on an H100: the table, ~3-5 min
    python benchmarks/engine_gpu.py --compile --json gpu.json  # + torch.compile'd model+loss, both
    python benchmarks/engine_gpu.py --tiny                     # CPU-sized smoke run of every code path
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _engine_common import Shape, build_pair, interleaved_medians  # noqa: E402

from megatrain.engine.fp8 import enable_fp8  # noqa: E402
from megatrain.engine.memtrack import LiveTensorBytes, tensors_of  # noqa: E402
from megatrain.engine.metrics import flops_per_iteration, peak_tflops  # noqa: E402
from megatrain.engine.models.gpt import lm_loss  # noqa: E402
from megatrain.engine.optimizer import MixedPrecisionOptimizer  # noqa: E402
from megatrain.engine.parallel.data import DataParallel  # noqa: E402
from megatrain.engine.parallel.state import ParallelState  # noqa: E402
from megatrain.plan.memory import estimate_memory  # noqa: E402

GiB = 1 << 30


class Trainer:
    """One model with its optimizer: `step()` runs forward + loss + backward + optimizer step."""

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
        precision: str,
        device: torch.device,
        x: torch.Tensor,
        y: torch.Tensor,
    ):
        self.precision, self.device, self.x, self.y = precision, device, x, y
        if precision == "bf16":
            self.model = model.to(device, torch.bfloat16)
            self.ddp: DataParallel | None = DataParallel(self.model, ParallelState.single(device))
            self.opt: Any = MixedPrecisionOptimizer(
                self.ddp, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), clip_grad=1.0
            )
        else:
            self.model = model.to(device)
            self.ddp = None
            decay = [p for p in self.model.parameters() if p.ndim >= 2]
            no_decay = [p for p in self.model.parameters() if p.ndim < 2]
            groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
            impl = {"fused": True} if device.type == "cuda" else {"foreach": True}
            self.opt = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), **impl)

        def forward_loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            ctx = (
                torch.autocast(device.type, dtype=torch.bfloat16)
                if precision == "autocast"
                else contextlib.nullcontext()
            )
            with ctx:  # DataParallel's forward is a pass-through: call the model itself
                return loss_fn(self.model, a, b)

        self.forward_loss = forward_loss

    def step(self) -> float:
        self.opt.zero_grad()
        loss = self.forward_loss(self.x, self.y)
        loss.backward()
        if self.ddp is not None:
            self.ddp.finish_grad_sync()
        else:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return float(loss.detach()) if self.device.type == "cpu" else 0.0

    def state_tensors(self) -> list[torch.Tensor]:
        """Parameters, gradient buffer, main parameters and Adam state: everything held across steps."""
        if self.ddp is not None:
            mains = [p for group in self.opt.adam.param_groups for p in group["params"]]
            return tensors_of(self.model, self.opt.adam, mains, self.ddp.grad_buffer)
        return tensors_of(self.model, self.opt)


def state_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def activation_peak(trainer: Trainer, sync: Callable[[], None]) -> int:
    """Bytes allocated during one step on top of what was allocated before it."""
    if trainer.device.type == "cuda":
        sync()
        before = torch.cuda.memory_allocated(trainer.device)
        torch.cuda.reset_peak_memory_stats(trainer.device)
        trainer.step()
        sync()
        return torch.cuda.max_memory_allocated(trainer.device) - before
    with LiveTensorBytes(trainer.state_tensors() + [trainer.x, trainer.y]) as live:
        trainer.step()
    return live.peak


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2, help="micro-batch size (both models live at once)")
    p.add_argument("--precision", choices=["bf16", "autocast"], default="bf16")
    p.add_argument("--fp8", choices=["tensorwise", "rowwise"], default=None, help="also ours in fp8")
    p.add_argument("--fp8-backend", choices=["torchao", "te"], default="torchao")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="also time torch.compile'd model+loss (both)")
    p.add_argument("--no-hf", action="store_true", help="ours only (when transformers is not installed)")
    p.add_argument("--tiny", action="store_true", help="tiny shape on whatever device there is (smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.hidden, args.heads, args.groups, args.ffn = 2, 64, 4, 2, 128
        args.vocab, args.seq, args.batch, args.rounds, args.warmup = 256, 32, 2, 2, 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        print("no CUDA device: run with --tiny for a CPU smoke run", file=sys.stderr)
        return 2
    shape = Shape(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        groups=args.groups,
        ffn=args.ffn,
        vocab=args.vocab,
        seq=args.seq,
        batch=args.batch,
    )
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    ours, hf = build_pair("llama", shape, seed=args.seed)
    cfg = ours.config
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g).to(device)
    y = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g).to(device)

    def ours_loss(m: torch.nn.Module, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return m.loss(t, labels)

    def hf_loss(m: torch.nn.Module, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return lm_loss(m(input_ids=t, use_cache=False).logits, labels)

    models: dict[str, tuple[torch.nn.Module, Callable]] = {"ours": (ours, ours_loss)}
    if not args.no_hf:
        models["hf"] = (hf, hf_loss)
    else:
        del hf
    trainers: dict[str, Trainer] = {}
    for name, (model, loss_fn) in models.items():
        trainers[name] = Trainer(model, loss_fn, args.precision, device, x, y)
    if args.fp8 and args.precision == "bf16":
        fp8_model, _ = build_pair("llama", shape, seed=args.seed)  # the same weights again
        trainers["ours+fp8"] = Trainer(fp8_model, ours_loss, "bf16", device, x, y)
        enable_fp8(trainers["ours+fp8"].model, args.fp8, args.fp8_backend)
    with torch.no_grad():  # same weights, same function: the first losses must agree (bf16 rounding)
        first = {n: float(t.forward_loss(x, y)) for n, t in trainers.items()}
    for other in ("hf", "ours+fp8"):  # float8 rounds more, but not 2% of the loss
        if other in first and abs(first["ours"] - first[other]) > 2e-2 * max(1.0, abs(first["ours"])):
            raise RuntimeError(f"first losses differ: {first}")
    if args.compile:
        for name in list(trainers):
            base = trainers[name]
            compiled = Trainer.__new__(Trainer)
            compiled.__dict__.update(base.__dict__)  # same model and optimizer, compiled forward+loss
            compiled.forward_loss = torch.compile(base.forward_loss, dynamic=False)
            trainers[f"{name}+compile"] = compiled

    timing = interleaved_medians({n: t.step for n, t in trainers.items()}, args.rounds, args.warmup, sync)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = peak_tflops(device_name, "bf16")
    iter_flops = flops_per_iteration(cfg, shape.batch)
    tokens = shape.batch * shape.seq
    est = estimate_memory(
        cfg, micro_batch_size=shape.batch, precision="bf16", device=device.type, fused_loss=True
    )
    rows: dict[str, dict[str, Any]] = {}
    for name, t in timing.items():
        tflops = iter_flops / t["median_s"] / 1e12
        rows[name] = {
            **t,
            "tokens_per_s": tokens / t["median_s"],
            "tflops": tflops,
            "mfu": tflops / peak if peak else None,
            "state_bytes": state_bytes(trainers[name].state_tensors()),
            "activation_peak_bytes": activation_peak(trainers[name], sync),
        }

    print(
        f"\n{device_name or 'CPU'} | torch {torch.__version__} | Llama {cfg.num_layers}L h{cfg.hidden_size} "
        f"{cfg.num_attention_heads}/{cfg.num_query_groups} heads ffn {cfg.ffn_hidden_size} V{cfg.vocab_size} "
        f"| seq {shape.seq} × micro-batch {shape.batch} | {ours.num_parameters() / 1e9:.3f}B params "
        f"| {args.precision}{f' (+fp8 {args.fp8}, {args.fp8_backend})' if args.fp8 else ''} "
        f"| peak {peak} TFLOP/s | median of {args.rounds} rounds"
    )
    print(f"\n{'variant':14s} {'ms/step':>8s} {'tokens/s':>9s} {'TFLOP/s':>8s} {'MFU':>6s} {'vs hf':>6s}")
    base = rows.get("hf", {}).get("median_s")
    for name, r in rows.items():
        mfu = f"{r['mfu']:6.1%}" if r["mfu"] is not None else f"{'n/a':>6s}"
        vs = f"{base / r['median_s']:5.2f}x" if base else f"{'-':>6s}"
        print(f"{name:14s} {r['median_s'] * 1e3:8.1f} {r['tokens_per_s']:9.0f} {r['tflops']:8.1f} {mfu} {vs}")
    est_state = est.params_bytes + est.grads_bytes + est.optimizer_bytes
    print(f"\n{'memory (GiB)':14s} {'state':>8s} {'act peak':>9s} {'total':>8s}")
    mem_rows = [("estimate", est_state, est.activations_bytes)]
    mem_rows += [(n, r["state_bytes"], r["activation_peak_bytes"]) for n, r in rows.items()]
    for name, state, act in mem_rows:
        print(f"{name:14s} {state / GiB:8.2f} {act / GiB:9.2f} {(state + act) / GiB:8.2f}")
    if args.json:
        out = {
            "device": device_name or "cpu",
            "torch": torch.__version__,
            "shape": shape.as_dict(),
            "num_params": ours.num_parameters(),
            "precision": args.precision,
            "fp8": {"recipe": args.fp8, "backend": args.fp8_backend} if args.fp8 else None,
            "peak_tflops": peak,
            "flops_per_iteration": iter_flops,
            "first_loss": first,
            "estimate": {
                "state_bytes": est_state,
                "activations_bytes": est.activations_bytes,
                "total_bytes": est.total_bytes,
            },
            "variants": rows,
        }
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
