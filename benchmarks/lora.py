"""Full fine-tuning against LoRA and QLoRA at the same shape: trainable parameters, peak memory, step time.

Each method runs in a fresh child process (one rank, CPU, the engine's own build_model,
make_trainable and training step: DataParallel, the mixed-precision optimizer): the model is built,
WARMUP steps run, then STEPS timed steps on fixed random tokens. The child reports its peak resident
set (getrusage: the kernel's high-water mark, model + gradients + optimizer state + activations) and
the median step time. The rows are ratios against `full` measured by the same script, the same
shape and the same tokens, one method after another (a shared, noisy host moves all of them alike).

    python benchmarks/lora.py                      # ~110M Llama, seq 256, batch 4, fp32 (~3 min)
    python benchmarks/lora.py --model tiny --steps 2   # seconds: a smoke run
    python benchmarks/lora.py --model moe          # a Mixtral-shaped MoE: full, LoRA on attention,
                                                   # and LoRA on attention and every routed expert

What it cannot show on a CPU: the GPU step time (a LoRA step skips the frozen weights' gradient
GEMMs, a third of a step's FLOPs; QLoRA adds a dequantisation per GEMM), and bf16 base weights (the
CPU runs fp32 here, so QLoRA's NF4 saves 4 → 0.53 bytes per base weight, not 2 → 0.53).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODELS: dict[str, dict[str, int]] = {
    # ~110M: 12 layers of 768, GQA 12/4 heads, SwiGLU 2048, a 32k vocabulary (untied).
    "110m": {"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "num_query_groups": 4,
             "ffn_hidden_size": 2048, "vocab_size": 32000},
    "tiny": {"num_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2,
             "ffn_hidden_size": 256, "vocab_size": 512},
    # Mixtral-shaped (every layer 8 experts, top-2, no dense MLP), ~150M parameters.
    "moe": {"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "num_query_groups": 4,
            "ffn_hidden_size": 1024, "vocab_size": 32000},
}  # fmt: skip
MOE = {"num_experts": 8, "router_topk": 2, "ffn_hidden_size": 1024}
METHODS = {"moe": ("full", "lora", "lora-experts")}
"""Per model; others: full, lora, qlora."""


def child(args: dict[str, Any]) -> dict[str, Any]:
    """One method: build, train, measure; runs in its own process."""
    import torch

    from megatrain.engine.build import build_model, lm_loss, make_trainable
    from megatrain.engine.config import LoRAConfig, MoEConfig, TrainConfig, TransformerConfig
    from megatrain.engine.lora import trainable_parameters
    from megatrain.engine.microbatch import MicroBatch
    from megatrain.engine.parallel.state import ParallelState
    from megatrain.plan.layout import Layout
    from megatrain.spec import ParallelismSpec

    torch.set_num_threads(args["threads"])
    seq, batch = args["seq"], args["batch"]
    moe = MoEConfig(**MOE) if args["model"] == "moe" else None
    mcfg = TransformerConfig.preset("tiny-llama", seq_length=seq, moe=moe, **MODELS[args["model"]])
    method = args["method"]
    targets = ("qkv", "proj", "experts") if method == "lora-experts" else LoRAConfig.targets
    nf4 = method == "qlora"
    lora = None if method == "full" else LoRAConfig(16, 32.0, targets=targets, quantize_base=nf4)
    cfg = TrainConfig(
        train_iters=100, global_batch_size=batch, micro_batch_size=batch, data_parallel_size=1,
        seq_length=seq, lr=1e-4, min_lr=0.0, lr_schedule="constant", warmup_iters=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0, precision="fp32",
        fp8_recipe="tensorwise", fp8_backend="torchao", recompute="none", recompute_every=1, compile=False,
        initial_loss_scale=65536.0, min_loss_scale=1.0, loss_scale_window=1000, hysteresis=2,
        checkpoint_interval=0, log_interval=1, eval_interval=0, eval_iters=1, seed=1, lora=lora,
    )  # fmt: skip
    state = ParallelState.build(Layout(), "cpu")
    train = make_trainable(
        build_model(mcfg, state, 1, "cpu", lora=lora), cfg, ParallelismSpec(), "fp32", mcfg
    )
    trainable, total = trainable_parameters(train.model.module)
    gen = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, mcfg.vocab_size, (batch, seq + 1), generator=gen)
    mb = MicroBatch(seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous(), None)
    times, losses = [], []
    for step in range(args["warmup"] + args["steps"]):
        began = time.perf_counter()
        train.optimizer.zero_grad()
        loss = lm_loss(train.ddp, mb, state)
        train.optimizer.scale_loss(loss).backward()
        train.ddp.finish_grad_sync()
        train.optimizer.step()
        if step >= args["warmup"]:
            times.append(time.perf_counter() - began)
        losses.append(float(loss))
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    weights = sum(_storage_bytes(p) for p in {id(p): p for p in train.model.module.parameters()}.values())
    return {"method": method, "trainable": trainable, "total": total, "step_s": statistics.median(times),
            "peak_mb": peak_kib / 1024, "weights_mb": weights / 2**20, "first_loss": losses[0],
            "last_loss": losses[-1]}  # fmt: skip


def _storage_bytes(p: Any) -> int:
    """Bytes a parameter holds: an NF4 tensor's inner tensors (4-bit codes, scales), else its own."""
    if hasattr(p, "__tensor_flatten__"):
        names, _ = p.__tensor_flatten__()
        return sum(_storage_bytes(getattr(p, n)) for n in names)
    return p.numel() * p.element_size()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="110m")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return 0
    rows = []
    for method in METHODS.get(a.model, ("full", "lora", "qlora")):
        args = {
            "method": method,
            **{k: getattr(a, k) for k in ("model", "seq", "batch", "steps", "warmup", "threads")},
        }
        out = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(args)],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[0]
    print(
        f"model {a.model}, seq {a.seq}, batch {a.batch}, fp32 on CPU, {a.steps} timed steps after {a.warmup}"
    )
    print(f"{'method':12} {'trainable':>12} {'total':>12} {'share':>7} {'weights MB':>10} {'peak MB':>9} "
          f"{'vs full':>8} {'step s':>8} {'vs full':>8} {'loss 1st→last':>16}")  # fmt: skip
    for r in rows:
        share = 100 * r["trainable"] / r["total"]
        print(
            f"{r['method']:12} {r['trainable']:>12,} {r['total']:>12,} {share:>6.2f}% "
            f"{r['weights_mb']:>10.0f} {r['peak_mb']:>9.0f} "
            f"{r['peak_mb'] / base['peak_mb']:>7.2f}x {r['step_s']:>8.3f} "
            f"{r['step_s'] / base['step_s']:>7.2f}x {r['first_loss']:>7.3f}→{r['last_loss']:.3f}"
        )
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
